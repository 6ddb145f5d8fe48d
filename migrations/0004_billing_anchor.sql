-- Billing dates keep their anchor: a subscription billed on the 31st is billed on the 31st
-- of every month that has one, and on the month's last day otherwise, instead of drifting
-- to the 28th after February (`+ interval '1 month'` from the previous period drifts).
-- Additive: rows written by an older producer or a billing system that knows nothing of
-- these columns keep working; a NULL anchor is set from `next_billing_date` the first time
-- the producer advances the row.

ALTER TABLE subscriptions
    ADD COLUMN billing_anchor date,
    ADD COLUMN billing_interval text NOT NULL DEFAULT 'month'
        CHECK (billing_interval IN ('month', 'year')),
    ADD COLUMN billing_interval_count integer NOT NULL DEFAULT 1
        CHECK (billing_interval_count BETWEEN 1 AND 120);

-- The first period after `current` in the schedule anchored at `anchor`, every `count`
-- `unit`s: the anchor's day of the month, clamped to the month's last day. `current` is
-- itself a period of that schedule (its month decides which one), so no counter is kept.
CREATE FUNCTION next_billing_period(anchor date, current date, unit text, count integer)
RETURNS date
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
AS $$
    SELECT (month_start
            + (least(extract(day FROM anchor)::integer,
                     extract(day FROM month_start + interval '1 month - 1 day')::integer) - 1)
           )::date
      FROM (SELECT (date_trunc('month', anchor)
                    + make_interval(months => (elapsed / step + 1) * step))::date AS month_start
              FROM (SELECT count * CASE unit WHEN 'year' THEN 12 ELSE 1 END AS step,
                           (extract(year FROM current)::integer
                              - extract(year FROM anchor)::integer) * 12
                           + extract(month FROM current)::integer
                           - extract(month FROM anchor)::integer AS elapsed) AS schedule
           ) AS next_month
$$;
