-- When each money-moving job last ran, and what it came to (src/charge_worker/jobs/).
--
-- `produce`, `reconcile` and `maintain` each add one row at the end of a real run (a
-- `--dry-run` promises no write, and writes none; `produce --processes N` one row for the
-- whole run). Every worker pod reads the latest rows into its gauges: reconcile's findings
-- (`charge_worker_reconcile_*`, as its `--metrics-file` writes them) and each job's last
-- success and failure reach Prometheus without a host path. `maintain` prunes the rows
-- past their retention, keeping the ones the gauges read.
-- A new table and its index: nothing existing is rewritten or locked.
CREATE TABLE job_runs (
    id          bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    job         text        NOT NULL CHECK (job IN ('produce', 'reconcile', 'maintain')),
    started_at  timestamptz NOT NULL,
    finished_at timestamptz NOT NULL DEFAULT now(),
    -- produce: its exit status was 0; reconcile: it finished and handled every key it found;
    -- maintain: it finished
    ok          boolean     NOT NULL,
    -- the run's counts, by name: produce's summary; reconcile's report (the names of its
    -- `charge_worker_reconcile_*` gauges, present only when the run finished) and `full`;
    -- maintain's partitions made and dropped, and the runs it pruned. A run that ended
    -- early on an error names it (`error`).
    summary     jsonb       NOT NULL DEFAULT '{}'::jsonb
);
-- the latest success and the latest failure of each job: what the gauges read, and what
-- pruning keeps
CREATE INDEX job_runs_latest_idx ON job_runs (job, ok, finished_at);
