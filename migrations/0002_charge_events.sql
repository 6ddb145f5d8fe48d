-- The story of each charge, append-only: what `charge-worker explain` prints.
-- Written by the worker (deliveries, gateway calls), the producer (scheduled, published)
-- and reconcile (republished, resolved, refunds, discrepancies). Never updated or deleted
-- by the product; prune by age if it grows.
CREATE TABLE charge_events (
    id             bigserial   PRIMARY KEY,
    order_id       bigint      NOT NULL,
    billing_period date        NOT NULL,
    at             timestamptz NOT NULL DEFAULT clock_timestamp(),
    kind           text        NOT NULL CHECK (kind ~ '^[a-z_]+$'),
    actor          text        NOT NULL,
    detail         jsonb       NOT NULL DEFAULT '{}'::jsonb
);
CREATE INDEX charge_events_key_idx ON charge_events (order_id, billing_period, id);

-- The producer's outbox: scheduled rows not yet published, oldest first.
CREATE INDEX charge_attempts_unpublished_idx ON charge_attempts (created_at)
    WHERE status = 'scheduled' AND published_at IS NULL;
