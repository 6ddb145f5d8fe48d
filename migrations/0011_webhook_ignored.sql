-- `ignored`: a webhook about a charge that is not ours (a PaymentIntent another integration
-- made: Checkout, Billing, ... with no order_id/billing_period of ours). Journaled final at
-- once, answered 200, never retried or reviewed; purged like `applied` and `stale`.
-- Instant: the new list holds every status of the old one (NOT VALID: no scan under an
-- exclusive lock; enforced for every row written from now on).
ALTER TABLE webhook_inbox DROP CONSTRAINT webhook_inbox_status_check;
ALTER TABLE webhook_inbox ADD CONSTRAINT webhook_inbox_status_check CHECK (status IN
    ('received', 'processing', 'applied', 'stale', 'ignored', 'awaiting_dependency',
     'needs_review')) NOT VALID;

-- the gauges and the review queue: everything not final-and-fine
DROP INDEX webhook_inbox_open_idx;
CREATE INDEX webhook_inbox_open_idx ON webhook_inbox (status, received_at)
    WHERE status NOT IN ('applied', 'stale', 'ignored');
