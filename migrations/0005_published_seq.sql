-- The stream sequence of the newest message published for a row (by the producer, a
-- worker's requeue, or reconcile). With the consumer's ack floor it tells reconcile whether
-- a quiet row's message still waits in the stream (month start: a long queue, not a loss)
-- or is gone unsettled (a broker that lost it, a ledger that forgot it).
ALTER TABLE charge_attempts ADD COLUMN published_seq bigint;
