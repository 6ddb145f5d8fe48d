"""Outcome events: the outbox rows the ledger's triggers write with each change of a
period's state (migrations/0012_charge_outcomes.sql), and the relay that publishes them to
`CHARGE_OUTCOMES` (docs/contracts/charge-outcome.md)."""
