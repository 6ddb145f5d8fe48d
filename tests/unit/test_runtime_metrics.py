"""The registries the worker and the webhook receiver serve carry the process and runtime
collectors the prometheus-client default registry would have: `process_*` (CPU, memory,
file descriptors, start time), `python_gc_*` and `python_info`."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from charge_worker.webhooks.metrics import WebhookMetrics
from charge_worker.worker.metrics import Metrics

RUNTIME_SERIES = (
    "process_cpu_seconds_total",
    "process_resident_memory_bytes",
    "process_start_time_seconds",
    "process_open_fds",
    "python_gc_objects_collected_total",
    "python_gc_collections_total",
    "python_info",
)


def _exported(registry: CollectorRegistry) -> set[str]:
    text = generate_latest(registry).decode()
    return {line.split("{")[0].split()[0] for line in text.splitlines() if not line.startswith("#")}


def test_the_worker_registry_exports_process_and_runtime_series() -> None:
    registry = CollectorRegistry()
    Metrics(registry)
    missing = [name for name in RUNTIME_SERIES if name not in _exported(registry)]
    assert not missing, f"the worker's /metrics lacks {missing}"


def test_the_webhook_registry_exports_process_and_runtime_series() -> None:
    registry = CollectorRegistry()
    WebhookMetrics(registry, source="gateway")
    missing = [name for name in RUNTIME_SERIES if name not in _exported(registry)]
    assert not missing, f"the receiver's /metrics lacks {missing}"
