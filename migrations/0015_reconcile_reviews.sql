-- A person's review of what reconcile left for a person (`charge-worker reconcile resolve
-- ORDER_ID PERIOD --note TEXT`, src/charge_worker/reconcile/reviews.py).
--
-- Reconcile reports a discrepancy (a `succeeded` row whose charge the gateway does not
-- have) and an unmatched charge (captured, not proven the key's own) on every run of its
-- window, and its alerts fire while the latest run counts one. A review covers exactly the
-- charges it names: later runs count those apart (`reviewed`), so the alert clears, and a
-- new charge for the same key is a new finding. A review never refunds or records anything.
-- One row per charge reviewed; the first review of a charge stays (a second is refused as
-- "already reviewed"). The story (`charge_events`) tells it too, as a `reviewed` event.
-- A new table: nothing existing is rewritten or locked.
CREATE TABLE reconcile_reviews (
    order_id       bigint      NOT NULL,
    billing_period date        NOT NULL,
    -- `discrepancy`: `charge_id` is the ledger's charge the gateway lacks; `unmatched`: a
    -- captured charge at the gateway not proven the key's own
    finding        text        NOT NULL CHECK (finding IN ('discrepancy', 'unmatched')),
    charge_id      text        NOT NULL,
    reviewed_by    text        NOT NULL,
    reviewed_at    timestamptz NOT NULL DEFAULT now(),
    note           text        NOT NULL,
    PRIMARY KEY (order_id, billing_period, finding, charge_id)
);
