"""Child processes the harness starts, and what they cost: CPU seconds and memory.

CPU comes from `/proc/<pid>/stat` through psutil (a dependency of `pgserver`, so present
wherever the dev extra is): user + system time, at the kernel's clock-tick resolution
(10 ms). For PostgreSQL the group is the postmaster, its live children (one backend per
connection) and its reaped children (counted in its `children_*` times), so a backend that
comes and goes inside a measurement is not lost. Peak RSS is `VmHWM` from
`/proc/<pid>/status`: the high-water mark over the process's whole life.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import psutil  # type: ignore[import-untyped]  # no stubs installed

STOP_TIMEOUT_S = 30.0


def _own_cpu(proc: psutil.Process) -> float:
    times = proc.cpu_times()
    return float(times.user + times.system)


def cpu_seconds(pid: int, *, with_children: bool = False) -> float:
    """CPU seconds used so far by `pid` (and, if asked, by its live and reaped children)."""
    try:
        proc = psutil.Process(pid)
        total = _own_cpu(proc)
        if with_children:
            times = proc.cpu_times()
            total += float(times.children_user + times.children_system)
            for child in proc.children(recursive=True):
                with contextlib.suppress(psutil.NoSuchProcess):
                    total += _own_cpu(child)
    except psutil.NoSuchProcess:
        return 0.0
    return total


def machine_cpu_seconds() -> tuple[float, float]:
    """CPU seconds the whole machine has been busy (every process, kernel included), and
    seconds stolen by the hypervisor, since boot (`/proc/stat`)."""
    times = psutil.cpu_times()
    busy = times.user + times.nice + times.system + times.irq + times.softirq
    return float(busy), float(getattr(times, "steal", 0.0))


def rss_bytes(pid: int) -> int:
    """Resident set size now."""
    try:
        return int(psutil.Process(pid).memory_info().rss)
    except psutil.NoSuchProcess:
        return 0


def peak_rss_bytes(pid: int) -> int:
    """The process's peak resident set size (`VmHWM`), 0 if unknown."""
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


OTHER = "other processes"  # the machine's busy time that none of the groups account for
STEAL = "stolen (hypervisor)"


@dataclass
class CpuMeter:
    """CPU seconds of named groups of processes between `start()` and `stop()`.

    Also the machine's busy time that no group accounts for (`OTHER`: anything else running
    on the machine, e.g. another test run) and the time the hypervisor stole (`STEAL`): a
    sample taken while either is large measured a contended machine.
    """

    groups: dict[str, list[int]] = field(default_factory=dict)
    with_children: frozenset[str] = frozenset()
    _before: dict[str, float] = field(default_factory=dict)

    def _read(self) -> dict[str, float]:
        read = {
            name: sum(cpu_seconds(pid, with_children=name in self.with_children) for pid in pids)
            for name, pids in self.groups.items()
        }
        read[OTHER], read[STEAL] = machine_cpu_seconds()
        return read

    def start(self) -> None:
        self._before = self._read()

    def stop(self) -> dict[str, float]:
        """CPU seconds per group since `start()`, `OTHER` and `STEAL` included."""
        after = self._read()
        spent = {name: max(after[name] - self._before.get(name, 0.0), 0.0) for name in after}
        ours = sum(value for name, value in spent.items() if name not in (OTHER, STEAL))
        spent[OTHER] = max(spent[OTHER] - ours, 0.0)
        return spent


class Child:
    """A child process with its output in a log file, stopped with SIGTERM then SIGKILL.

    Started in its own session: a Ctrl-C at the terminal reaches the harness, which stops
    its children itself, in order.
    """

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        log_path: Path,
        *,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        self.env = dict(env) if env is not None else None
        self.cwd = cwd
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def pid(self) -> int:
        if self.proc is None:
            raise RuntimeError(f"{self.name} is not running")
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def start(self, *, stdout: int | None = None) -> None:
        self._log = self.log_path.open("ab")
        self.proc = subprocess.Popen(  # noqa: S603  # our own Python modules, no shell
            self.argv,
            env=self.env,
            cwd=self.cwd,
            stdin=subprocess.DEVNULL,
            stdout=stdout if stdout is not None else self._log,
            stderr=self._log,
            start_new_session=True,
        )

    def log_tail(self, lines: int = 20) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> int | None:
        """SIGTERM, wait up to `timeout_s`, then SIGKILL. Safe to call twice."""
        proc = self.proc
        if proc is None:
            return None
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
        if self._log is not None:
            self._log.close()
            self._log = None
        return proc.returncode


def python_argv(*args: str) -> list[str]:
    """This interpreter running `args` (e.g. `-m charge_worker sandbox gateway`)."""
    return [sys.executable, *args]


def wait_until(check: Callable[[], bool], *, timeout_s: float, poll_s: float = 0.05) -> bool:
    """Poll a zero-argument callable until it returns true, at most `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(poll_s)
    return False
