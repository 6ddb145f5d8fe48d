-- Reconcile costs what happened since its last run (src/charge_worker/reconcile/).

-- How far the gateway's history has been reconciled: the next run pages from here, less
-- CHARGE_WORKER_RECONCILE_OVERLAP_S. Written only by a real run, after every read and
-- repair it vouches for, in the ledger's own database: a failover that loses a ledger
-- commit loses every checkpoint written after it too, so that history is read again.
CREATE TABLE reconcile_checkpoint (
    source           text        PRIMARY KEY,  -- whose history: 'gateway'
    reconciled_until timestamptz NOT NULL,
    updated_at       timestamptz NOT NULL DEFAULT now()
);

-- The charge the gateway's history (or a lookup) showed reconcile for a succeeded row.
-- A row whose recorded charge it has not shown yet is a possible discrepancy: only those
-- are indexed, so the discrepancy sweep reads them and not the whole ledger.
ALTER TABLE charge_attempts ADD COLUMN gateway_seen_charge_id text;
CREATE INDEX charge_attempts_unseen_idx
    ON charge_attempts ((coalesce(settled_at, updated_at)), order_id, billing_period)
    WHERE status = 'succeeded' AND gateway_seen_charge_id IS DISTINCT FROM gateway_charge_id;

-- The keys a run left unsettled (a failure, a row not final yet, charges for a person):
-- the next runs decide them again on a fresh lookup, whatever history they read.
CREATE TABLE reconcile_followups (
    order_id       bigint      NOT NULL,
    billing_period date        NOT NULL,
    reason         text        NOT NULL CHECK (reason IN ('failed', 'open', 'unmatched')),
    found_at       timestamptz NOT NULL DEFAULT now(),
    updated_at     timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (order_id, billing_period)
);
-- looked at least recently first: a run stopped by its deadline is taken on by the next
CREATE INDEX reconcile_followups_due_idx
    ON reconcile_followups (updated_at, order_id, billing_period);
