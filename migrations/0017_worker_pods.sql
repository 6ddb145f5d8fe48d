-- Each worker pod's own state, as it last wrote it (src/charge_worker/jobs/pods.py).
--
-- A circuit breaker lives in one worker process's memory, so only that process can tell
-- it. Every `charge-worker run` process upserts its own row (worker/presence.py): at its
-- start, every 30 s, and at once after one of its breakers changed state. `charge-worker
-- status` shows the rows seen in the last 2 minutes and counts the others (gone or
-- stuck); `maintain` deletes the rows not seen for a day. Each process is a row of its
-- own: a restarted container is a new worker name, and its old row ages out.
-- A new table: nothing existing is rewritten or locked.
CREATE TABLE worker_pods (
    -- the process's name as its logs and lease owner carry it (`worker=`): host, pid and
    -- a random suffix (event_loop.process_name)
    worker     text        PRIMARY KEY,
    -- the process's start, on its own clock
    started_at timestamptz NOT NULL,
    -- the database's now() at the process's latest write
    seen_at    timestamptz NOT NULL DEFAULT now(),
    -- by dependency: {"state": "closed" | "open" | "half-open", "since": ISO 8601 on the
    -- process's clock (its start, until the breaker first changes)}
    breakers   jsonb       NOT NULL DEFAULT '{}'::jsonb,
    -- messages being processed by the process when it wrote
    in_flight  bigint      NOT NULL DEFAULT 0,
    -- whether the process's latest read of the durable consumer found it paused
    paused     boolean     NOT NULL DEFAULT false
);
