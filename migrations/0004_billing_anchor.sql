-- Billing dates keep their anchor: a subscription billed on the 31st is billed on the 31st
-- of every month that has one, and on the month's last day otherwise, instead of drifting
-- to the 28th after February (`+ interval '1 month'` from the previous period drifts). The
-- periods are computed by the producer (src/charge_worker/producer/periods.py).
-- Additive: rows written by an older producer or a billing system that knows nothing of
-- these columns keep working; a NULL anchor is set from `next_billing_date` the first time
-- the producer advances the row.

ALTER TABLE subscriptions
    ADD COLUMN billing_anchor date,
    ADD COLUMN billing_interval text NOT NULL DEFAULT 'month'
        CHECK (billing_interval IN ('month', 'year')),
    ADD COLUMN billing_interval_count integer NOT NULL DEFAULT 1
        CHECK (billing_interval_count BETWEEN 1 AND 120);
