"""Retries of a declined renewal (docs/contracts/gateway.md, "Retrying a declined renewal";
docs/decisions/0007-retries.md): what follows a declined try (`schedule`), and starting the
next try of a period (`starts`)."""
