-- The trace that follows a due charge (W3C Trace Context): the producer opens it when it
-- schedules the charge with tracing on, and every copy of the charge's message carries
-- this `traceparent`, so the worker's deliveries continue it and `explain` and `reconcile`
-- can name it. NULL for a charge scheduled and published with tracing off.
-- Additive and instant: a nullable column, and a check that only rows written from now on
-- are held to (the existing rows are all NULL, and scanning the ledger under an exclusive
-- lock to prove it would stall every worker).
ALTER TABLE charge_attempts ADD COLUMN traceparent text;
ALTER TABLE charge_attempts ADD CONSTRAINT charge_attempts_traceparent_w3c
    CHECK (traceparent ~ '^00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$') NOT VALID;
