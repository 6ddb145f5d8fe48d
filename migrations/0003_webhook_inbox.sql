-- Gateway webhooks (contracts/gateway.md): the inbox journal, and what the ledger keeps of
-- them. See src/charge_worker/webhook_inbox.py for every statement on these.

-- The revision of the gateway charge object (gateway_charge_id) whose snapshot was applied
-- last: a webhook applies only if its revision is newer (never rolls the ledger back).
ALTER TABLE charge_attempts
    ADD COLUMN gateway_revision bigint CHECK (gateway_revision > 0),
    ADD COLUMN disputed_at      timestamptz;

-- Every verified webhook, journaled before the 2xx: the receiver inserts (ON CONFLICT DO
-- NOTHING, so a redelivery is a no-op), a processor leases rows and applies them.
-- received -> processing -> applied | stale | awaiting_dependency | needs_review;
-- a processing row whose lease (next_attempt_at) expired is taken again: a crash loses nothing.
CREATE TABLE webhook_inbox (
    id              bigserial   PRIMARY KEY,
    source          text        NOT NULL,
    event_id        text        NOT NULL CHECK (length(event_id) BETWEEN 1 AND 255),
    message_id      text        NOT NULL,  -- the webhook-id header of the first delivery
    event_type      text        NOT NULL,
    object_id       text        NOT NULL,  -- the gateway charge id
    revision        bigint      NOT NULL CHECK (revision > 0),
    order_id        bigint,                -- from the charge's metadata, when it has them
    billing_period  date,
    payload         jsonb       NOT NULL,
    status          text        NOT NULL DEFAULT 'received' CHECK (status IN
                        ('received', 'processing', 'applied', 'stale',
                         'awaiting_dependency', 'needs_review')),
    attempts        integer     NOT NULL DEFAULT 0 CHECK (attempts >= 0),
    last_error      text,
    outcome         text,                  -- what processing concluded, in words
    lease_owner     text,
    -- when the row may be taken: the retry time, or for `processing` the lease's end
    next_attempt_at timestamptz NOT NULL DEFAULT now(),
    received_at     timestamptz NOT NULL DEFAULT now(),
    updated_at      timestamptz NOT NULL DEFAULT now(),
    finished_at     timestamptz,
    UNIQUE (source, event_id),
    CHECK ((status = 'processing') = (lease_owner IS NOT NULL))
);

-- the processor's work: rows due now
CREATE INDEX webhook_inbox_due_idx ON webhook_inbox (next_attempt_at, id)
    WHERE status IN ('received', 'processing', 'awaiting_dependency');
-- the gauges and the review queue: everything not final-and-fine
CREATE INDEX webhook_inbox_open_idx ON webhook_inbox (status, received_at)
    WHERE status NOT IN ('applied', 'stale');
-- revisions already applied per charge object; the retention purge
CREATE INDEX webhook_inbox_object_idx ON webhook_inbox (source, object_id, revision);
CREATE INDEX webhook_inbox_received_idx ON webhook_inbox (received_at);
