-- Outcome events (docs/contracts/charge-outcome.md): the outbox, written by the ledger row's
-- own triggers, so that every statement that changes a period's state (the worker's settle
-- and give-up, a lookup's record, reconcile's repairs, a webhook, a late verdict, and any
-- path written later) commits its event with it, and no statement can forget to.
-- docs/decisions/0006-outbox.md says why a trigger and not a CTE per statement.

-- The period's last event number: `sequence` comes from the row, under the row's lock, so two
-- paths can never give one period the same number. Instant (a constant default).
ALTER TABLE charge_attempts ADD COLUMN outcome_seq integer NOT NULL DEFAULT 0;
-- ... and the type of that event, which the BEFORE trigger decides and the AFTER one writes.
ALTER TABLE charge_attempts ADD COLUMN outcome_type text;

-- The class of `decline_code` (src/charge_worker/declines.py), as it was when the row was
-- declined. NULL where no code was classed (rows declined before this column, or by a
-- webhook, which names none): a `generic_decline`, `soft`.
-- Instant: a nullable column, and a check only rows written from now on are held to.
ALTER TABLE charge_attempts ADD COLUMN decline_class text;
ALTER TABLE charge_attempts ADD CONSTRAINT charge_attempts_decline_class_check
    CHECK (decline_class IN ('soft', 'customer_action', 'hard')) NOT VALID;

-- One row per event. The body is the message, built when the change commits (a snapshot of
-- the row then); the relay publishes it as it is. `next_try_at` is the relay's lease and its
-- backoff: a row is taken when it has come, and pushed forward when taken or failed.
CREATE TABLE charge_outcomes (
    order_id       bigint      NOT NULL,
    billing_period date        NOT NULL,
    sequence       integer     NOT NULL CHECK (sequence > 0),
    type           text        NOT NULL CHECK (type ~ '^charge\.[a-z][a-z_]*$'),
    body           jsonb       NOT NULL,
    traceparent    text,
    occurred_at    timestamptz NOT NULL,
    next_try_at    timestamptz NOT NULL,
    tries          integer     NOT NULL DEFAULT 0 CHECK (tries >= 0),
    last_error     text,
    sent_at        timestamptz,
    stream_seq     bigint,
    PRIMARY KEY (order_id, billing_period, sequence)
);
-- the relay's queue and the age of its oldest row: unsent rows only, few at any time
CREATE INDEX charge_outcomes_unsent_idx ON charge_outcomes (occurred_at) WHERE sent_at IS NULL;
-- pruning sent rows past the retention
CREATE INDEX charge_outcomes_sent_idx ON charge_outcomes (sent_at) WHERE sent_at IS NOT NULL;

-- Which event a change of the row makes, if any: a new status the contract names; a dispute
-- opened; a review reason set on a charged row by a late scoring verdict (`blocked`, with
-- `review: true` in the body). `processing`, `scheduled` and `pending` make none.
CREATE FUNCTION charge_outcome_decide() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    kind text;
BEGIN
    IF TG_OP = 'INSERT' OR NEW.status IS DISTINCT FROM OLD.status THEN
        IF NEW.status IN ('succeeded', 'declined', 'blocked', 'failed', 'refunded') THEN
            kind := 'charge.' || NEW.status;
        END IF;
    ELSIF NEW.disputed_at IS NOT NULL AND OLD.disputed_at IS NULL THEN
        kind := 'charge.disputed';
    ELSIF NEW.review_reason IS DISTINCT FROM OLD.review_reason
          AND NEW.review_reason IS NOT NULL THEN
        kind := 'charge.blocked';
    END IF;
    IF kind IS NOT NULL THEN
        NEW.outcome_seq := coalesce(OLD.outcome_seq, 0) + 1;
        NEW.outcome_type := kind;
    END IF;
    RETURN NEW;
END
$$;

-- Writes the event the BEFORE trigger decided. An AFTER trigger, because a BEFORE INSERT
-- trigger runs before ON CONFLICT DO NOTHING has decided to insert nothing. It runs as the
-- schema's owner: the roles that change the ledger need no privilege on the outbox.
CREATE FUNCTION charge_outcome_write() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER
SET search_path FROM CURRENT AS $$
DECLARE
    at timestamptz := now();
BEGIN
    INSERT INTO charge_outcomes (order_id, billing_period, sequence, type, body, traceparent,
                                 occurred_at, next_try_at)
    VALUES (NEW.order_id, NEW.billing_period, NEW.outcome_seq, NEW.outcome_type,
            jsonb_build_object(
                'schema', 'charge.outcome/v1',
                'event_id', concat_ws(':', NEW.order_id, to_char(NEW.billing_period, 'YYYY-MM-DD'),
                                    NEW.outcome_seq),
                'type', NEW.outcome_type,
                'sequence', NEW.outcome_seq,
                'order_id', NEW.order_id,
                'billing_period', NEW.billing_period,
                'subscription_id', NEW.subscription_id,
                'customer_id', NEW.customer_id,
                'amount_minor', NEW.amount_minor,
                'currency', NEW.currency,
                'attempt', 1,
                'gateway_charge_id', CASE WHEN NEW.outcome_type IN
                    ('charge.succeeded', 'charge.refunded', 'charge.disputed')
                    THEN NEW.gateway_charge_id END,
                'decline_code', CASE WHEN NEW.outcome_type = 'charge.declined'
                    THEN coalesce(NEW.decline_code, 'generic_decline') END,
                'decline_class', CASE WHEN NEW.outcome_type = 'charge.declined'
                    THEN coalesce(NEW.decline_class, 'soft') END,
                'occurred_at', to_char(at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.MS"Z"'))
            -- a late verdict on a charged row: the charge stands, a person reviews it
            || CASE WHEN NEW.outcome_type = 'charge.blocked' AND NEW.status <> 'blocked'
                    THEN '{"review": true}'::jsonb ELSE '{}'::jsonb END,
            NEW.traceparent, at, at);
    RETURN NULL;
END
$$;

CREATE TRIGGER charge_outcome_decide BEFORE UPDATE ON charge_attempts FOR EACH ROW
    WHEN (OLD.status IS DISTINCT FROM NEW.status
          OR OLD.disputed_at IS DISTINCT FROM NEW.disputed_at
          OR OLD.review_reason IS DISTINCT FROM NEW.review_reason)
    EXECUTE FUNCTION charge_outcome_decide();
CREATE TRIGGER charge_outcome_decide_new BEFORE INSERT ON charge_attempts FOR EACH ROW
    WHEN (NEW.status NOT IN ('scheduled', 'pending'))
    EXECUTE FUNCTION charge_outcome_decide();
-- (an update of `outcome_seq` alone is the relay moving a period past a taken event id:
-- outcomes/outbox.py; it writes nothing)
CREATE TRIGGER charge_outcome_write AFTER UPDATE ON charge_attempts FOR EACH ROW
    WHEN (NEW.outcome_seq <> OLD.outcome_seq
          AND (OLD.status IS DISTINCT FROM NEW.status
               OR OLD.disputed_at IS DISTINCT FROM NEW.disputed_at
               OR OLD.review_reason IS DISTINCT FROM NEW.review_reason))
    EXECUTE FUNCTION charge_outcome_write();
CREATE TRIGGER charge_outcome_write_new AFTER INSERT ON charge_attempts FOR EACH ROW
    WHEN (NEW.outcome_seq > 0)
    EXECUTE FUNCTION charge_outcome_write();
