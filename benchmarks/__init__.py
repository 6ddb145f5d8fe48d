"""The benchmark harness behind `make bench`: the worker against the bare pipeline.

One run starts the stack (embedded nats-server and PostgreSQL unless NATS_URL /
DATABASE_URL are set; the gateway and scoring simulators as child processes) and measures,
each case several times (median, min, max):

1. the bare pipeline (`bare_pipeline.py`): the worker's I/O with none of its safety, an
   outcome event published per charge included;
2. the worker (`charge-worker run`) at zero latency: charges/s, CPU per charge,
   publish-to-ack latency at half load, peak RSS (`throughput.py`); 2b. the same with the
   subscription check on (`CHARGE_WORKER_VERIFY_SUBSCRIPTION=match`, every claim checked);
   2c. the same without its outbox (the outbox triggers disabled): case 2 minus case 2c is
   the outbox's cost per charge, a row of its own;
3. latency-bound, 4. incident shape, 5. scale-out to two processes (`latency_bound.py`);
6. RSS after 10,000 charges and after as many more as fit the budget (`memory.py`);

and, asked for by name, month start (`month_start.py`). It prints a table, the ratios
against the targets (MET / MISSED), and writes `benchmarks/results/latest.json`.
How one sample is measured: `drain.py`; statistics: `stats.py`. The worker's own CPU per
charge against the bare pipeline's, in one process, for A/B-ing a change: `overhead.py`.
Results and the reading of them: `docs/benchmarks.md`.
"""
