"""The domain's exceptions, grouped by the action they imply.

Adapters (`ledger`, `gateway`, `scoring`, `streams`) translate driver errors into these,
keeping the driver's exception as `__cause__`; nothing above them imports a driver's errors.

Our exception hierarchy::

    ChargeWorkerError
    ├── SettingsError ............ invalid configuration: fail at start, one line
    ├── MigrationError ........... a migration cannot be applied (edited, or failed)
    ├── ProvisioningError ........ streams or consumer cannot be created as configured
    ├── PermanentError ........... never retried: dead letter, then term
    │   ├── PoisonMessage ........ the message breaks contracts/charge-due.md
    │   ├── PayloadConflict ...... same (order_id, billing_period), other amount/currency/customer
    │   └── GatewayRejected ...... the gateway refused the request as invalid
    ├── TransientError ........... retry later with the same key (carries retry_after_s)
    │   ├── DependencyUnavailable  connection refused, breaker open, server restarting
    │   ├── OutcomeUnknown ....... the gateway may or may not have charged (5xx, timeout)
    │   ├── RequestInProgress .... the gateway is processing this key right now (409)
    │   ├── RateLimited .......... the gateway asked us to slow down (429)
    │   └── LeaseHeld ............ another live worker owns this charge right now
    └── AlreadySettled ........... the charge reached a final state before: ack the duplicate
"""

from __future__ import annotations


class ChargeWorkerError(Exception):
    """Base of every error charge-worker raises on purpose."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or (self.__doc__ or type(self).__name__).strip())


class SettingsError(ChargeWorkerError):
    """Invalid configuration."""


class MigrationError(ChargeWorkerError):
    """A migration cannot be applied."""


class ProvisioningError(ChargeWorkerError):
    """Streams or consumer cannot be provisioned as configured."""


class PermanentError(ChargeWorkerError):
    """Retrying cannot help; the message is dead-lettered with `reason`."""

    reason = "rejected"


class PoisonMessage(PermanentError):
    """The message breaks the charge.due/v1 contract."""

    reason = "poison"


class PayloadConflict(PermanentError):
    """The same charge key arrived with another amount, currency or customer."""

    reason = "conflict"


class GatewayRejected(PermanentError):
    """The gateway refused the request as invalid."""

    reason = "rejected"


class TransientError(ChargeWorkerError):
    """Retrying later with the same idempotency key is safe and may succeed."""

    def __init__(self, message: str | None = None, *, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class DependencyUnavailable(TransientError):
    """A dependency cannot be reached right now."""


class OutcomeUnknown(TransientError):
    """The gateway may or may not have charged; only a lookup can tell."""


class RequestInProgress(TransientError):
    """The gateway is processing a request with this idempotency key right now."""


class RateLimited(TransientError):
    """The gateway asked us to slow down."""


class LeaseHeld(TransientError):
    """Another live worker holds the lease on this charge."""


class AlreadySettled(ChargeWorkerError):
    """The charge reached a final state before; this delivery is a duplicate."""
