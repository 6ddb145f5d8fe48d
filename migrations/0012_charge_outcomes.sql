-- Outcome events (docs/contracts/charge-outcome.md): the outbox, written by the ledger row's
-- own triggers, so that every statement that changes a period's state (the worker's settle
-- and give-up, a lookup's record, reconcile's repairs, a webhook, a late verdict, and any
-- path written later) commits its event with it, and no statement can forget to.
-- docs/decisions/0006-outbox.md says why a trigger and not a CTE per statement.

-- The period's last event number: `sequence` comes from the row, under the row's lock, so two
-- paths can never give one period the same number. Instant (a constant default).
ALTER TABLE charge_attempts ADD COLUMN outcome_seq integer NOT NULL DEFAULT 0;
-- ... and the type of that event (an inserted row's is written by the AFTER trigger from it).
ALTER TABLE charge_attempts ADD COLUMN outcome_type text;

-- The class of `decline_code` (src/charge_worker/declines.py), as it was when the row was
-- declined. NULL where no code was classed (rows declined before this column, or by a
-- webhook, which names none): a `generic_decline`, `soft`.
-- Instant: a nullable column, and a check only rows written from now on are held to.
ALTER TABLE charge_attempts ADD COLUMN decline_class text;
ALTER TABLE charge_attempts ADD CONSTRAINT charge_attempts_decline_class_check
    CHECK (decline_class IN ('soft', 'customer_action', 'hard')) NOT VALID;

-- One row per event: the row's fields as the change committed them, from which the relay
-- builds the message (outcomes/outbox.py, `Event.body`: the contract's rules on which field
-- an event type carries live there, once). `next_try_at` is the relay's backoff: a row is
-- taken when it has come, and pushed forward when its publish failed.
CREATE TABLE charge_outcomes (
    order_id          bigint      NOT NULL,
    billing_period    date        NOT NULL,
    sequence          integer     NOT NULL CHECK (sequence > 0),
    type              text        NOT NULL CHECK (type ~ '^charge\.[a-z][a-z_]*$'),
    subscription_id   text        NOT NULL,
    customer_id       text        NOT NULL,
    amount_minor      bigint      NOT NULL,
    currency          text        NOT NULL,
    gateway_charge_id text,
    decline_code      text,
    decline_class     text,
    review            boolean     NOT NULL,  -- a late verdict on a charged row
    traceparent       text,
    occurred_at       timestamptz NOT NULL,
    next_try_at       timestamptz NOT NULL,
    tries             integer     NOT NULL DEFAULT 0 CHECK (tries >= 0),
    last_error        text,
    sent_at           timestamptz,
    stream_seq        bigint,
    PRIMARY KEY (order_id, billing_period, sequence),
    CHECK ((sent_at IS NULL) = (stream_seq IS NULL))
);
-- the relay's queue and the age of its oldest row: unsent rows only, few at any time
CREATE INDEX charge_outcomes_unsent_idx ON charge_outcomes (occurred_at) WHERE sent_at IS NULL;
-- pruning sent rows past the retention
CREATE INDEX charge_outcomes_sent_idx ON charge_outcomes (sent_at) WHERE sent_at IS NOT NULL;

-- Which event a change of the row makes, if any: a new status the contract names; a dispute
-- opened; a review reason set on a charged row by a late scoring verdict (`blocked`, with
-- `review: true`). `processing`, `scheduled` and `pending` make none. On an UPDATE the
-- BEFORE trigger writes the event itself (one call a change); on an INSERT it only numbers
-- it, and the AFTER trigger writes it: a BEFORE INSERT trigger runs before ON CONFLICT DO
-- NOTHING (reconcile's adoption) has decided to insert nothing. The function runs as the
-- schema's owner: the roles that change the ledger need no privilege on the outbox.
CREATE FUNCTION charge_outcome() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER
SET search_path FROM CURRENT AS $$
DECLARE
    kind text;
BEGIN
    IF TG_WHEN = 'BEFORE' THEN
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
        IF kind IS NULL THEN
            RETURN NEW;
        END IF;
        NEW.outcome_seq := coalesce(OLD.outcome_seq, 0) + 1;
        NEW.outcome_type := kind;
        IF TG_OP = 'INSERT' THEN
            RETURN NEW;
        END IF;
    END IF;
    INSERT INTO charge_outcomes (order_id, billing_period, sequence, type, subscription_id,
                                 customer_id, amount_minor, currency, gateway_charge_id,
                                 decline_code, decline_class, review, traceparent,
                                 occurred_at, next_try_at)
    VALUES (NEW.order_id, NEW.billing_period, NEW.outcome_seq, NEW.outcome_type,
            NEW.subscription_id, NEW.customer_id, NEW.amount_minor, NEW.currency,
            NEW.gateway_charge_id, NEW.decline_code, NEW.decline_class,
            NEW.outcome_type = 'charge.blocked' AND NEW.status <> 'blocked', NEW.traceparent,
            now(), now());
    RETURN CASE WHEN TG_WHEN = 'BEFORE' THEN NEW END;
END
$$;

-- (an update of `outcome_seq` alone is the relay moving a period past a taken event id:
-- outcomes/outbox.py; the WHEN clause keeps it, and every other update, from the function)
CREATE TRIGGER charge_outcome BEFORE UPDATE ON charge_attempts FOR EACH ROW
    WHEN (OLD.status IS DISTINCT FROM NEW.status
          OR OLD.disputed_at IS DISTINCT FROM NEW.disputed_at
          OR OLD.review_reason IS DISTINCT FROM NEW.review_reason)
    EXECUTE FUNCTION charge_outcome();
CREATE TRIGGER charge_outcome_numbered BEFORE INSERT ON charge_attempts FOR EACH ROW
    WHEN (NEW.status NOT IN ('scheduled', 'pending'))
    EXECUTE FUNCTION charge_outcome();
CREATE TRIGGER charge_outcome_inserted AFTER INSERT ON charge_attempts FOR EACH ROW
    WHEN (NEW.outcome_seq > 0)
    EXECUTE FUNCTION charge_outcome();
