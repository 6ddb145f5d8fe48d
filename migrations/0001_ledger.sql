-- The ledger and the lock: one row per due charge, keyed by (order_id, billing_period).
-- Every transition is a single statement guarded by the current status and the fence
-- (lease_owner, attempt); see src/charge_worker/ledger.py.
CREATE TABLE charge_attempts (
    order_id          bigint      NOT NULL CHECK (order_id > 0),
    billing_period    date        NOT NULL,
    idempotency_key   text        NOT NULL UNIQUE,
    subscription_id   text        NOT NULL CHECK (length(subscription_id) BETWEEN 1 AND 64),
    customer_id       text        NOT NULL CHECK (length(customer_id) BETWEEN 1 AND 64),
    amount_minor      bigint      NOT NULL CHECK (amount_minor > 0),
    currency          text        NOT NULL CHECK (currency ~ '^[A-Z]{3}$'),
    -- what makes two messages for one key "the same charge"; a mismatch is a conflict
    fingerprint       text        GENERATED ALWAYS AS
                          (amount_minor::text || ' ' || currency || ' ' || customer_id) STORED,
    due_at            timestamptz,
    status            text        NOT NULL CHECK (status IN
                          ('scheduled', 'pending', 'succeeded', 'declined', 'blocked',
                           'failed', 'refunded')),
    scoring           text        CHECK (scoring IN ('approved', 'blocked', 'deferred')),
    review_reason     text,
    gateway_charge_id text,
    -- calls sent to the gateway; > 0 while pending means an outcome may be unknown
    gateway_calls     integer     NOT NULL DEFAULT 0 CHECK (gateway_calls >= 0),
    last_error        text,
    lease_owner       text,
    lease_until       timestamptz,
    -- the fence: bumped on every lease; a write names the attempt it belongs to
    attempt           integer     NOT NULL DEFAULT 0 CHECK (attempt >= 0),
    last_stream_seq   bigint,
    created_at        timestamptz NOT NULL DEFAULT now(),
    updated_at        timestamptz NOT NULL DEFAULT now(),
    published_at      timestamptz,
    settled_at        timestamptz,
    PRIMARY KEY (order_id, billing_period),
    CHECK (status NOT IN ('succeeded', 'refunded') OR gateway_charge_id IS NOT NULL),
    CHECK ((lease_owner IS NULL) = (lease_until IS NULL))
);

-- reconcile's sweeps look only at rows that are not final yet
CREATE INDEX charge_attempts_open_idx ON charge_attempts (updated_at)
    WHERE status IN ('scheduled', 'pending');
CREATE UNIQUE INDEX charge_attempts_gateway_charge_idx ON charge_attempts (gateway_charge_id)
    WHERE gateway_charge_id IS NOT NULL;

-- Charges made without a scoring verdict (scoring slow, failing or its breaker open);
-- written in the same transaction as the attempt's state, re-scored in the background.
CREATE TABLE deferred_scoring_checks (
    order_id        bigint      NOT NULL,
    billing_period  date        NOT NULL,
    status          text        NOT NULL DEFAULT 'pending'
                        CHECK (status IN ('pending', 'approved', 'blocked')),
    reason          text        NOT NULL,
    tries           integer     NOT NULL DEFAULT 0 CHECK (tries >= 0),
    next_try_at     timestamptz NOT NULL DEFAULT now(),
    last_error      text,
    created_at      timestamptz NOT NULL DEFAULT now(),
    resolved_at     timestamptz,
    PRIMARY KEY (order_id, billing_period),
    FOREIGN KEY (order_id, billing_period) REFERENCES charge_attempts ON DELETE CASCADE
);
CREATE INDEX deferred_scoring_checks_due_idx ON deferred_scoring_checks (next_try_at)
    WHERE status = 'pending';

-- The subscriptions the producer reads. In production this table belongs to the
-- subscriptions service and may hold rows we must refuse (a zero amount, a bad currency),
-- so it carries no CHECKs on money: the producer validates every row and reports bad ones.
CREATE TABLE subscriptions (
    subscription_id   text        PRIMARY KEY,
    order_id          bigint      NOT NULL UNIQUE,
    customer_id       text        NOT NULL,
    amount_minor      bigint      NOT NULL,
    currency          text        NOT NULL,
    next_billing_date date        NOT NULL,
    active            boolean     NOT NULL DEFAULT true,
    created_at        timestamptz NOT NULL DEFAULT now(),
    updated_at        timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX subscriptions_due_idx ON subscriptions (next_billing_date) WHERE active;
