-- Payment providers beyond the contract (docs/adapters.md).
--
-- `processing`: a charge the provider accepted that the bank settles days later (Stripe's
-- PaymentIntent `processing`, a bank debit). The row stays open, neither unknown (nothing
-- is looked up or re-sent: its claim answers "already settled") nor final (`settled_at`
-- stays empty); the webhook of the settlement, or reconcile's lookup, records what became
-- of it. It names the provider's charge from the start.
-- Instant: the new list holds every status of the old one and no row is `processing` yet,
-- so both checks hold for the existing rows without scanning the ledger under an
-- exclusive lock (NOT VALID: enforced for every row written from now on).
ALTER TABLE charge_attempts DROP CONSTRAINT charge_attempts_status_check;
ALTER TABLE charge_attempts ADD CONSTRAINT charge_attempts_status_check CHECK (status IN
    ('scheduled', 'pending', 'processing', 'succeeded', 'declined', 'blocked', 'failed',
     'refunded')) NOT VALID;
ALTER TABLE charge_attempts ADD CONSTRAINT charge_attempts_processing_charge_check
    CHECK (status <> 'processing' OR gateway_charge_id IS NOT NULL) NOT VALID;

-- reconcile's sweep of the rows the bank has not settled yet
CREATE INDEX charge_attempts_processing_idx ON charge_attempts (updated_at)
    WHERE status = 'processing';

-- Why a `declined` row was declined, as the provider said: `authentication_required` (the
-- bank wants the customer present: billing e-mails them), `insufficient_funds`, … NULL for
-- rows declined before this column, and where nobody said.
ALTER TABLE charge_attempts ADD COLUMN decline_code text;
