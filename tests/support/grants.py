"""The three PostgreSQL roles of docs/deploying.md, set up from that page itself.

The SQL block of its "PostgreSQL roles" section is read and run as written, section by
section (`-- as a superuser:`, `-- as a superuser, in billing:`, `-- as charge_owner, in
billing, after ...`), so the page and the tests cannot drift. Only the names change: each
set-up gets roles and a database of its own (roles are global to the server), and the
placeholder passwords a real one.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import asyncpg

DEPLOYING = Path(__file__).parents[2] / "docs" / "deploying.md"
PASSWORD = "grants-test-password"


def documented_sql() -> str:
    """The SQL block of docs/deploying.md's "PostgreSQL roles" section."""
    text = DEPLOYING.read_text()
    after = text[text.index("## PostgreSQL roles") :]
    match = re.search(r"```sql\n(.*?)```", after, flags=re.DOTALL)
    assert match, "docs/deploying.md's PostgreSQL roles section has no ```sql block"
    return match.group(1)


def statements(sql: str) -> list[str]:
    """The statements of `sql`, one by one, without comments."""
    code = "\n".join(line.split("--", 1)[0] for line in sql.splitlines())
    return [part.strip() for part in code.split(";") if part.strip()]


def sections(sql: str) -> dict[str, list[str]]:
    """Statements by who runs them: `superuser`, `superuser in db`, `owner in db`."""
    found: dict[str, list[str]] = {}
    current: list[str] = []
    for line in sql.splitlines():
        heading = line.strip().lower()
        if heading.startswith("-- as a superuser, in billing"):
            current = found.setdefault("superuser in db", [])
        elif heading.startswith("-- as a superuser"):
            current = found.setdefault("superuser", [])
        elif heading.startswith("-- as charge_owner"):
            current = found.setdefault("owner in db", [])
        else:
            current.append(line)
    return {who: statements("\n".join(lines)) for who, lines in found.items()}


def with_user(url: str, user: str, database: str) -> str:
    """`url` as `user` (with the test password), on `database`."""
    parts = urlsplit(url)
    host = parts.hostname or "127.0.0.1"
    netloc = f"{user}:{PASSWORD}@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc, path=f"/{database}"))


@dataclass(frozen=True)
class Roles:
    """The documented set-up on one server: who is who, and where."""

    admin_url: str
    owner: str
    worker: str
    webhooks: str
    database: str

    @property
    def owner_url(self) -> str:
        return with_user(self.admin_url, self.owner, self.database)

    @property
    def worker_url(self) -> str:
        return with_user(self.admin_url, self.worker, self.database)

    @property
    def webhooks_url(self) -> str:
        """The webhook receiver's own role (`charge-worker webhooks`)."""
        return with_user(self.admin_url, self.webhooks, self.database)

    @property
    def superuser_url(self) -> str:
        """The admin, on the billing database."""
        parts = urlsplit(self.admin_url)
        return urlunsplit(parts._replace(path=f"/{self.database}"))

    def named(self, statement: str) -> str:
        """A documented statement with this set-up's names and password."""
        for generic, mine in (
            ("charge_owner", self.owner),
            ("charge_worker", self.worker),
            ("charge_webhooks", self.webhooks),
            ("billing", self.database),
        ):
            statement = re.sub(rf"\b{generic}\b", mine, statement)
        return statement.replace("'…'", f"'{PASSWORD}'")

    async def run(self, who: str, url: str) -> None:
        """Run one documented section as written (renamed), one statement at a time."""
        conn = await asyncpg.connect(url)
        try:
            for statement in sections(documented_sql())[who]:
                await conn.execute(self.named(statement))
        finally:
            await conn.close()

    async def as_owner(self, sql: str) -> None:
        """Run `sql` (documented names) as the schema owner, e.g. to revoke one grant."""
        conn = await asyncpg.connect(self.owner_url)
        try:
            await conn.execute(self.named(sql))
        finally:
            await conn.close()

    async def drop(self) -> None:
        conn = await asyncpg.connect(self.admin_url)
        try:
            await conn.execute(f"DROP DATABASE IF EXISTS {self.database} WITH (FORCE)")
            for role in (self.webhooks, self.worker, self.owner):
                await conn.execute(f"DROP ROLE IF EXISTS {role}")
        finally:
            await conn.close()


async def readme_roles(admin_url: str, migrate: Callable[[str], Awaitable[None]]) -> Roles:
    """The documented roles and database, set up as it says: the superuser's sections, then
    `migrate(owner_url)` (charge-worker migrate as the owner), then the owner's grants."""
    uid = uuid.uuid4().hex[:8]
    roles = Roles(
        admin_url,
        f"charge_owner_{uid}",
        f"charge_worker_{uid}",
        f"charge_webhooks_{uid}",
        f"billing_{uid}",
    )
    await roles.run("superuser", admin_url)
    await roles.run("superuser in db", roles.superuser_url)
    await migrate(roles.owner_url)
    await roles.run("owner in db", roles.owner_url)
    return roles
