"""`charge-worker produce --processes N`: one run in N processes, its summaries added up.

One process keeps one core busy with its own Python, and PostgreSQL and nats-server another
only in part: a month start's million due charges wait on the producer's CPU. Runs at once
have always been safe (each locks the subscriptions it takes, `FOR UPDATE SKIP LOCKED`, and
publishes what it scheduled), so the N processes are N runs started together, each on its
own `Share` of the due subscriptions: a range of ids cut at quantiles of a sample, so the
shares are about equal, none reads what another refused, and none publishes as left over
what another has just scheduled. Their progress lines go to stderr as they come; their
summaries come back as JSON and are added up. The run is recorded once, by this process
(`job_runs`); the processes, each on a share, record nothing. Too few due subscriptions to
cut, and the run is one process's: this one's.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import signal
import sys

import click

from charge_worker import database
from charge_worker.database import translated
from charge_worker.errors import ChargeWorkerError
from charge_worker.producer.publish import WHOLE, Share
from charge_worker.producer.schedule import note_produced, produce_command
from charge_worker.producer.summary import Problem, Summary
from charge_worker.settings import Settings

SAMPLE_PERCENT = 2.0  # of the subscriptions read to cut the shares (a scan, ~0.2 s at 1M)
SIGNALS = (signal.SIGTERM, signal.SIGINT)  # passed on to the processes, which stop at once
NOT_STARTED = (
    "stopped by {} before every process started: the subscriptions of those not started stay"
    " due for the next run"
)

# The ids that cut the due subscriptions into equal shares, from a sample (NULL: too few).
_CUTS = """
SELECT percentile_disc($2::float8[]) WITHIN GROUP (ORDER BY subscription_id)
  FROM subscriptions TABLESAMPLE BERNOULLI ($3)
 WHERE active AND next_billing_date <= $1
"""


async def produce_in_processes(
    settings: Settings, day: dt.date, processes: int, *, as_json: bool
) -> int:
    """Run `produce` for `day` in `processes` child processes with this process's
    environment; print the summary of the whole run and return its exit status. A process
    that ends without a summary (its one-line error is above) is counted as a failure to
    publish: the subscriptions it took stay due for the next run. SIGTERM and SIGINT are
    passed on to the processes (a pod's stop and `kill` reach this one alone), which stop at
    once: their open batches roll back, as a crash's would."""
    children: list[asyncio.subprocess.Process] = []
    stopped: list[signal.Signals] = []

    def stop(sig: signal.Signals) -> None:
        stopped.append(sig)
        for child in children:
            if child.returncode is None:
                with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
                    child.send_signal(sig)

    started = dt.datetime.now(dt.UTC)
    try:
        shares = await _shares(settings, day, processes)
    except ChargeWorkerError as error:
        await note_produced(settings, day, started, error)
        raise
    if shares == [WHOLE]:  # one share, the whole run: a run of one process, recorded as one
        return await produce_command(settings, day, as_json=as_json)
    loop = asyncio.get_running_loop()
    for sig in SIGNALS:
        loop.add_signal_handler(sig, stop, sig)
    summary = Summary(day)
    try:
        for share in shares:
            if stopped:
                break
            children.append(await _start(day, share))
        if stopped and len(children) < len(shares):
            summary.failed.append(Problem(None, None, NOT_STARTED.format(stopped[0].name)))
        for number, child in enumerate(children, start=1):
            out, _ = await child.communicate()
            try:
                summary.add(Summary.from_json(out.decode()))
            except (ValueError, KeyError, TypeError):
                why = f"stopped by {stopped[0].name}" if stopped else "its error is above"
                reason = (
                    f"produce process {number} of {len(children)} ended with exit status "
                    f"{child.returncode} and no summary ({why}); the subscriptions it took "
                    "stay due for the next run"
                )
                summary.failed.append(Problem(None, None, reason))
    finally:
        for sig in SIGNALS:
            loop.remove_signal_handler(sig)
        for child in children:
            if child.returncode is None:  # this one was stopped: so are they
                with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
                    child.kill()
                await child.wait()
    click.echo(summary.as_json() if as_json else "\n".join(summary.lines()))
    await note_produced(settings, day, started, summary)
    return summary.exit_code


async def _shares(settings: Settings, day: dt.date, processes: int) -> list[Share]:
    """`processes` shares of the subscriptions due on `day`; one share, the whole run, when
    the sample is too small to cut."""
    quantiles = [n / processes for n in range(1, processes)]
    conn = await database.connect(settings.db, application_name="charge-worker produce")
    try:
        async with translated("produce"):
            cuts: list[str | None] = await conn.fetchval(_CUTS, day, quantiles, SAMPLE_PERCENT)
    finally:
        await database.close_quietly(conn)
    if not cuts or None in cuts:
        return [Share()]
    # in the database's order (its collation, not Python's), each once
    bounds = [cut for cut in dict.fromkeys(cuts) if cut is not None]
    return [
        Share(after, through) for after, through in zip(["", *bounds], [*bounds, None], strict=True)
    ]


async def _start(day: dt.date, share: Share) -> asyncio.subprocess.Process:
    argv = ["produce", "--date", day.isoformat(), "--json"]
    argv += ["--after", share.after]
    if share.through is not None:
        argv += ["--through", share.through]
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "charge_worker", *argv, stdout=asyncio.subprocess.PIPE
    )
