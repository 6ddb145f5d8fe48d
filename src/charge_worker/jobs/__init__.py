"""Every money-moving job watched: `produce`, `reconcile` and `maintain` record each real
run in `job_runs` (`runs.py`), and every worker pod exports the latest ones, with the
oldest due charge not yet settled (`backlog.py`), as gauges (`exporter.py`). Each worker
pod writes its own state, which only its memory holds (its breakers), to `worker_pods`
(`pods.py`), for `status`."""

from charge_worker.jobs.exporter import JobGauges, export_job_runs
from charge_worker.jobs.figures import RECONCILE_GAUGES, RECONCILE_PREFIX
from charge_worker.jobs.runs import Job, note_run

__all__ = [
    "RECONCILE_GAUGES",
    "RECONCILE_PREFIX",
    "Job",
    "JobGauges",
    "export_job_runs",
    "note_run",
]
