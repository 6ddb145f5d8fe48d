"""charge-worker: a NATS JetStream billing consumer that charges each due subscription once."""
