"""The domain's exceptions, grouped by the action they imply.

Adapters (`database`, `ledger`, `gateway`, `scoring`, `streams`, `dlq`) translate driver
errors into these, keeping the driver's exception as `__cause__`; nothing above them imports
a driver's errors. An error met while processing a delivery names its `outcome` (a value of
`worker.decisions.Outcome`, and the metrics' label): decisions read it from here.

Our exception hierarchy::

    ChargeWorkerError
    ├── SettingsError ............ invalid configuration: fail at start, one line
    ├── MigrationError ........... a migration cannot be applied (edited, or failed)
    │   └── MigrationLockTimeout . every try waited out its lock_timeout: run it again later
    ├── ProvisioningError ........ streams or consumer cannot be created as configured
    ├── PermanentError ........... never retried: dead letter (reason = outcome), then term
    │   ├── PoisonMessage ........ the message breaks docs/contracts/charge-due.md
    │   ├── PayloadConflict ...... same (order_id, billing_period), other amount/currency/customer
    │   ├── Unverified ........... no subscription says so (CHARGE_WORKER_VERIFY_SUBSCRIPTION)
    │   ├── GatewayRejected ...... the gateway refused the request as invalid
    │   └── UnstorableValue ...... PostgreSQL cannot store a value (a NUL, out of range): poison
    ├── TransientError ........... retry later with the same key (carries retry_after_s)
    │   ├── DependencyUnavailable  connection refused, breaker open, server restarting
    │   ├── NoVerdict ............ scoring gave no verdict and the policy is `hold`
    │   ├── OutcomeUnknown ....... the gateway may or may not have charged (5xx, timeout)
    │   │   └── ReplayedFailure .. that 5xx replayed for a retried key: no new failure
    │   ├── RequestInProgress .... the gateway is processing this key right now (409)
    │   ├── RateLimited .......... the gateway asked us to slow down (429)
    │   └── LeaseHeld ............ another live worker owns this charge right now
    ├── AlreadySettled ........... the charge reached a final state before: ack the duplicate
    ├── GuardRefused ............. a guarded ledger write matched no row the rules allowed (a bug)
    ├── RetryRefused ............. `charge-worker retry` refused: one line, nothing changed
    └── DeliveryRejected ......... a webhook delivery refused before anything was recorded
        ├── MalformedDelivery .... missing or malformed headers or body: 400
        ├── UnauthenticDelivery .. no valid signature, or a stale timestamp: 401
        │   └── ForeignSource .... an unsigned delivery from outside the provider's networks: 403
        ├── DeliveryTooLarge ..... the body is over the limit: 413
        └── DeliveryTooSlow ...... the body did not arrive in time: 408
"""

from __future__ import annotations

from typing import ClassVar


class ChargeWorkerError(Exception):
    """Base of every error charge-worker raises on purpose."""

    outcome: ClassVar[str] = "unavailable"  # what a delivery that met it came to

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or (self.__doc__ or type(self).__name__).strip())


class SettingsError(ChargeWorkerError):
    """Invalid configuration."""


class MigrationError(ChargeWorkerError):
    """A migration cannot be applied."""


class MigrationLockTimeout(MigrationError):
    """Every try of a migration timed out waiting for a lock another session held; nothing
    of it was applied, and a later run may succeed once that session lets go."""


class ProvisioningError(ChargeWorkerError):
    """Streams or consumer cannot be provisioned as configured."""


class PermanentError(ChargeWorkerError):
    """Retrying cannot help; the message is dead-lettered with its outcome as the reason."""

    outcome = "rejected"


class PoisonMessage(PermanentError):
    """The message breaks the charge.due/v1 contract."""

    outcome = "poison"


class PayloadConflict(PermanentError):
    """The same charge key arrived with another amount, currency or customer."""

    outcome = "conflict"


class Unverified(PermanentError):
    """The message disagrees with its subscription (amount, currency, customer, or a period
    off its schedule), or has none: `CHARGE_WORKER_VERIFY_SUBSCRIPTION=match` charges only
    what a subscription says is due."""

    outcome = "unverified"


class GatewayRejected(PermanentError):
    """The gateway refused the request as invalid."""


class TransientError(ChargeWorkerError):
    """Retrying later with the same idempotency key is safe and may succeed."""

    def __init__(self, message: str | None = None, *, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class DependencyUnavailable(TransientError):
    """A dependency cannot be reached right now."""


class NoVerdict(TransientError):
    """Scoring gave no verdict and the policy is `hold`: wait for one."""


class OutcomeUnknown(TransientError):
    """The gateway may or may not have charged; only a lookup can tell."""

    outcome = "outcome_unknown"


class ReplayedFailure(OutcomeUnknown):
    """The provider replayed its first answer to this idempotency key, and that was a 5xx
    (`Idempotent-Replayed: true`): the outcome is as unknown as it was, but this is no new
    failure of the provider, so a breaker neither counts it nor ends a run of failures."""


class RequestInProgress(TransientError):
    """The gateway is processing a request with this idempotency key right now."""

    outcome = "in_progress"


class RateLimited(TransientError):
    """The gateway asked us to slow down."""

    outcome = "rate_limited"


class LeaseHeld(TransientError):
    """Another live worker holds the lease on this charge."""

    outcome = "lease_held"


class AlreadySettled(ChargeWorkerError):
    """The charge reached a final state before; this delivery is a duplicate."""

    outcome = "duplicate"


class GuardRefused(ChargeWorkerError):
    """The guarded ledger write matched no row although the rules allowed it (a bug)."""


class RetryRefused(ChargeWorkerError):
    """No next try may be started for this period now."""


class DeliveryRejected(ChargeWorkerError):
    """A webhook delivery refused before anything was recorded; `status_code` is the answer."""

    status_code: ClassVar[int] = 400
    result: ClassVar[str] = "malformed"  # the metrics' label


class MalformedDelivery(DeliveryRejected):
    """Missing or malformed headers or body."""


class UnauthenticDelivery(DeliveryRejected):
    """No valid signature, or a timestamp too far from now."""

    status_code = 401
    result = "unauthorized"


class ForeignSource(UnauthenticDelivery):
    """A delivery from outside the provider's networks (counted as `unauthorized`)."""

    status_code = 403

    def __init__(self, address: str) -> None:
        super().__init__(f"{address} is outside CHARGE_WORKER_WEBHOOK_SOURCE_NETWORKS")
        self.address = address  # as it was seen (bounded)


class DeliveryTooLarge(DeliveryRejected):
    """The body is over the configured limit."""

    status_code = 413
    result = "too_large"


class UnstorableValue(PermanentError):
    """PostgreSQL cannot store a value of the message, however often it is retried."""

    outcome = "poison"


class DeliveryTooSlow(DeliveryRejected):
    """The body did not arrive within the configured deadline."""

    status_code = 408
    result = "too_slow"
