-- Retries of a declined renewal (docs/contracts/gateway.md, "Retrying a declined renewal";
-- docs/decisions/0007-retries.md).
--
-- The ledger keeps one row per period: its claim is still the one barrier, across every try.
-- The row holds the period's current try; a try that ended declined is copied to
-- `charge_tries` by the statement that starts the next one (retries/starts.py), so a period
-- charged on its first try writes nothing more than before.

-- The period's current try (1, 2, ...): its key is `idempotency_key`
-- (`<order_id>:<billing_period>` for try 1, `...:<n>` after). Instant (a constant default).
ALTER TABLE charge_attempts ADD COLUMN current_try integer NOT NULL DEFAULT 1;
ALTER TABLE charge_attempts ADD CONSTRAINT charge_attempts_current_try_check
    CHECK (current_try >= 1) NOT VALID;
-- When the current try was started; NULL for try 1 (started with the row, `created_at`).
ALTER TABLE charge_attempts ADD COLUMN try_started_at timestamptz;
-- When the next try is due: set exactly while the row is `retry_scheduled`.
ALTER TABLE charge_attempts ADD COLUMN retry_at timestamptz;

-- Two states a declined try leaves a period in, neither final: `retry_scheduled` (a soft
-- decline: the producer starts the next try at `retry_at`) and `action_required` (the
-- customer must act: the period waits for `charge-worker retry`). `declined` stays final.
-- Instant, as in 0010: NOT VALID checks, which no existing row can break.
ALTER TABLE charge_attempts DROP CONSTRAINT charge_attempts_status_check;
ALTER TABLE charge_attempts ADD CONSTRAINT charge_attempts_status_check CHECK (status IN
    ('scheduled', 'pending', 'processing', 'succeeded', 'declined', 'blocked', 'failed',
     'refunded', 'retry_scheduled', 'action_required')) NOT VALID;
ALTER TABLE charge_attempts ADD CONSTRAINT charge_attempts_retry_at_check
    CHECK ((status = 'retry_scheduled') = (retry_at IS NOT NULL)) NOT VALID;

-- the producer's step that starts due tries
CREATE INDEX charge_attempts_retry_idx ON charge_attempts (retry_at)
    WHERE status = 'retry_scheduled';

-- The period's earlier tries, each declined (a try that holds money, or whose outcome is
-- unknown, is never followed by another). Written only by the statement that starts the
-- next try, with the row's fields as that try left them.
CREATE TABLE charge_tries (
    order_id          bigint      NOT NULL,
    billing_period    date        NOT NULL,
    try_no            integer     NOT NULL CHECK (try_no >= 1),
    idempotency_key   text        NOT NULL UNIQUE,
    gateway_charge_id text,
    decline_code      text,
    decline_class     text        CHECK (decline_class IN ('soft', 'customer_action', 'hard')),
    last_error        text,
    started_at        timestamptz NOT NULL,
    ended_at          timestamptz NOT NULL,
    PRIMARY KEY (order_id, billing_period, try_no),
    FOREIGN KEY (order_id, billing_period) REFERENCES charge_attempts ON DELETE CASCADE
);

-- Outcome events name their try (`attempt`), and a scheduled retry its time (`retry_at`).
ALTER TABLE charge_outcomes ADD COLUMN attempt integer NOT NULL DEFAULT 1;
ALTER TABLE charge_outcomes ADD COLUMN retry_at timestamptz;

-- 0012's function, with the two new states as events (`charge.retry_scheduled`,
-- `charge.action_required`) and the try in every event.
CREATE OR REPLACE FUNCTION charge_outcome() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER
SET search_path FROM CURRENT AS $$
DECLARE
    kind text;
BEGIN
    IF TG_WHEN = 'BEFORE' THEN
        IF TG_OP = 'INSERT' OR NEW.status IS DISTINCT FROM OLD.status THEN
            IF NEW.status IN ('succeeded', 'declined', 'blocked', 'failed', 'refunded',
                              'retry_scheduled', 'action_required') THEN
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
                                 occurred_at, next_try_at, attempt, retry_at)
    VALUES (NEW.order_id, NEW.billing_period, NEW.outcome_seq, NEW.outcome_type,
            NEW.subscription_id, NEW.customer_id, NEW.amount_minor, NEW.currency,
            NEW.gateway_charge_id, NEW.decline_code, NEW.decline_class,
            NEW.outcome_type = 'charge.blocked' AND NEW.status <> 'blocked', NEW.traceparent,
            now(), now(), NEW.current_try, NEW.retry_at);
    RETURN CASE WHEN TG_WHEN = 'BEFORE' THEN NEW END;
END
$$;
