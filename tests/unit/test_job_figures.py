"""Reconcile's figures are named once: every count of its report is a gauge, and every
gauge but the run's time a count (what `job_runs` keeps, and the worker pods export)."""

from __future__ import annotations

import dataclasses

from charge_worker.jobs.figures import LAST_RUN, RECONCILE_COUNTS, RECONCILE_GAUGES
from charge_worker.reconcile.report import Counts


def test_every_count_of_the_report_is_a_gauge_and_no_other() -> None:
    counts = [field.name for field in dataclasses.fields(Counts)]
    assert sorted(RECONCILE_COUNTS) == sorted(counts)
    assert set(RECONCILE_GAUGES) == {LAST_RUN, *counts}
