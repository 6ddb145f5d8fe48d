-- charge_events, partitioned by the month of `at`, so that old stories are dropped a month at
-- a time (`charge-worker maintain`, run as the schema owner) instead of deleted row by row.
-- The rows written so far stay where they are: the old table becomes the partition of
-- everything before next month. Partitions for the next twelve months are made now, and
-- `maintain` keeps twelve ahead, so a write never finds its month missing. Ids keep coming
-- from the same sequence; the primary key includes `at`, as partitioning requires.
ALTER TABLE charge_events RENAME TO charge_events_before;
ALTER TABLE charge_events_before RENAME CONSTRAINT charge_events_pkey TO charge_events_before_pkey;
ALTER INDEX charge_events_key_idx RENAME TO charge_events_before_key_idx;

CREATE TABLE charge_events (
    id             bigint      NOT NULL DEFAULT nextval('charge_events_id_seq'),
    order_id       bigint      NOT NULL,
    billing_period date        NOT NULL,
    at             timestamptz NOT NULL DEFAULT clock_timestamp(),
    kind           text        NOT NULL
                   CONSTRAINT charge_events_kind_check CHECK (kind ~ '^[a-z_]+$'),
    actor          text        NOT NULL,
    detail         jsonb       NOT NULL DEFAULT '{}'::jsonb,
    PRIMARY KEY (id, at)
) PARTITION BY RANGE (at);
ALTER SEQUENCE charge_events_id_seq OWNED BY charge_events.id;
CREATE INDEX charge_events_key_idx ON charge_events (order_id, billing_period, id);

DO $$
DECLARE
    next_month timestamptz := date_trunc('month', now() AT TIME ZONE 'UTC') AT TIME ZONE 'UTC'
                              + interval '1 month';
    first timestamptz;
BEGIN
    -- attaching builds the (id, at) key on it, and takes its (order_id, billing_period, id)
    -- index for the parent's
    ALTER TABLE charge_events_before DROP CONSTRAINT charge_events_before_pkey;
    EXECUTE format('ALTER TABLE charge_events ATTACH PARTITION charge_events_before'
                   ' FOR VALUES FROM (MINVALUE) TO (%L)', next_month);
    FOR ahead IN 0..11 LOOP
        first := next_month + make_interval(months => ahead);
        EXECUTE format('CREATE TABLE %I PARTITION OF charge_events FOR VALUES FROM (%L) TO (%L)',
                       'charge_events_' || to_char(first AT TIME ZONE 'UTC', 'YYYY_MM'),
                       first, first + interval '1 month');
    END LOOP;
END
$$;
