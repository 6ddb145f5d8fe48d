-- The fleet's request rate at the gateway (CHARGE_WORKER_GATEWAY_RATE_LIMIT): one token
-- bucket per name, refilled and taken from in one statement (src/charge_worker/ratelimit.py).
CREATE TABLE rate_buckets (
    name       text             PRIMARY KEY,
    tokens     double precision NOT NULL,
    granted    integer          NOT NULL DEFAULT 0,
    updated_at timestamptz      NOT NULL
);
