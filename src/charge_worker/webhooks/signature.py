"""Webhook signatures, one scheme per source: verified on receipt, made by the simulator.

| scheme     | headers                                            | key                 |
|------------|----------------------------------------------------|---------------------|
| `standard` | `webhook-id`, `webhook-timestamp`,                 | `whsec_<base64>`,   |
|            | `webhook-signature: v1,<base64 HMAC of id.t.body>` | the decoded bytes   |
| `stripe`   | `Stripe-Signature: t=<unix>,v1=<hex HMAC of t.body>` | `whsec_…` as is   |
| `yookassa` | none: not signed (its source address is checked, `sources.py`) | none      |

Standard Webhooks (docs/contracts/gateway.md):

`standardwebhooks` (the scheme's reference implementation) computes and compares them:
HMAC-SHA256 over `<id>.<timestamp>.<body>`, any of several space-separated `v1,<base64>`
signatures, `hmac.compare_digest`. Version 1.1 needs a thin wrapper, which is this module:

- its timestamp tolerance is fixed at 5 minutes: ours (`CHARGE_WORKER_WEBHOOK_TOLERANCE_S`) is
  checked first, and a wider one is refused at start, since the library would still reject;
- a signature without a comma, bad base64 or a body that is not UTF-8 raise ValueError or
  UnicodeDecodeError rather than its own error, and a missing header looks like a wrong
  signature: headers are parsed here, so malformed is 400 and unauthentic 401;
- it decodes whatever it can of any secret: secrets are checked at start.

Neither a secret nor a signature ever appears in an exception message (they reach logs).
"""

from __future__ import annotations

import base64
import binascii
import datetime as dt
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import stripe
from standardwebhooks.webhooks import Webhook, WebhookVerificationError

from charge_worker.errors import MalformedDelivery, SettingsError, UnauthenticDelivery
from charge_worker.settings import GatewayKind, WebhookSettings

LIBRARY_TOLERANCE_S = 300.0  # standardwebhooks 1.1 checks this itself
MAX_SIGNATURES = 16
_ID = re.compile(r"[\x21-\x7e]{1,255}")
_TIMESTAMP = re.compile(r"[0-9]{1,12}")
_SIGNATURE = re.compile(r"v[0-9]+[a-z]?,[A-Za-z0-9+/]+={0,2}")
_SECRETS_ENV = "CHARGE_WORKER_WEBHOOK_SECRETS"


@dataclass(frozen=True)
class SignedHeaders:
    """The three Standard Webhooks headers of one delivery, well-formed."""

    message_id: str
    timestamp: int
    signatures: tuple[str, ...]

    def as_headers(self) -> dict[str, str]:
        """Back to headers, for the library's `verify`."""
        return {
            "webhook-id": self.message_id,
            "webhook-timestamp": str(self.timestamp),
            "webhook-signature": " ".join(self.signatures),
        }


def read_headers(headers: Mapping[str, str]) -> SignedHeaders:
    """The signature headers, or `MalformedDelivery` naming the one that is wrong."""
    message_id = headers.get("webhook-id", "")
    timestamp = headers.get("webhook-timestamp", "")
    signature = headers.get("webhook-signature", "")
    for name, value in (
        ("webhook-id", message_id),
        ("webhook-timestamp", timestamp),
        ("webhook-signature", signature),
    ):
        if not value:
            raise MalformedDelivery(f"the {name} header is missing")
    if not _ID.fullmatch(message_id):
        raise MalformedDelivery("webhook-id is not 1-255 printable characters")
    if not _TIMESTAMP.fullmatch(timestamp):
        raise MalformedDelivery("webhook-timestamp is not unix seconds")
    tokens = tuple(signature.split())
    if len(tokens) > MAX_SIGNATURES:
        raise MalformedDelivery(f"webhook-signature has over {MAX_SIGNATURES} signatures")
    for token in tokens:
        if not _SIGNATURE.fullmatch(token) or not _is_base64(token.partition(",")[2]):
            raise MalformedDelivery("webhook-signature is not space-separated v<n>,<base64>")
    return SignedHeaders(message_id, int(timestamp), tokens)


def _is_base64(text: str) -> bool:
    try:
        base64.b64decode(text, validate=True)
    except binascii.Error:
        return False
    return True


def check_secret(secret: str) -> str:
    """A `whsec_<base64>` secret as the library takes it; `SettingsError` otherwise."""
    if not secret.startswith("whsec_"):
        raise SettingsError(f"{_SECRETS_ENV}: a secret does not start with whsec_")
    try:
        key = base64.b64decode(secret.removeprefix("whsec_"), validate=True)
    except binascii.Error as error:
        raise SettingsError(f"{_SECRETS_ENV}: a secret is not whsec_<base64>") from error
    if len(key) < 16:
        raise SettingsError(f"{_SECRETS_ENV}: a secret decodes to under 16 bytes")
    return secret


class Verifier:
    """Checks deliveries against every configured secret (several during a rotation)."""

    def __init__(
        self,
        secrets: Sequence[str],
        *,
        tolerance_s: float = LIBRARY_TOLERANCE_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not secrets:
            raise SettingsError(f"{_SECRETS_ENV} is not set; `webhooks` needs a whsec_ secret")
        if tolerance_s > LIBRARY_TOLERANCE_S:
            raise SettingsError(
                f"CHARGE_WORKER_WEBHOOK_TOLERANCE_S is {tolerance_s:g}s but standardwebhooks "
                f"rejects timestamps over {LIBRARY_TOLERANCE_S:g}s away itself"
            )
        self._hooks = [Webhook(check_secret(secret)) for secret in secrets]
        self.tolerance_s = tolerance_s
        self.clock = clock

    def read_headers(self, headers: Mapping[str, str]) -> SignedHeaders:
        """The signature headers, well-formed, or `MalformedDelivery`."""
        return read_headers(headers)

    @classmethod
    def from_settings(cls, cfg: WebhookSettings) -> Verifier:
        """The verifier for the configured secrets and tolerance."""
        secrets = [secret.get_secret_value() for secret in cfg.webhook_secrets]
        return cls(secrets, tolerance_s=cfg.webhook_tolerance_s)

    def check_time(self, signed: Signed) -> None:
        """`UnauthenticDelivery` when the timestamp is further from now than the tolerance."""
        if abs(self.clock() - signed.timestamp) > self.tolerance_s:
            raise UnauthenticDelivery(
                f"webhook-timestamp is over {self.tolerance_s:g}s away from now"
            )

    def verify(self, body: bytes, signed: Signed) -> None:
        """Pass if one signature matches one secret; else `UnauthenticDelivery`."""
        assert isinstance(signed, SignedHeaders)
        self.check_time(signed)
        text = _utf8(body)
        headers = signed.as_headers()
        for hook in self._hooks:
            try:
                hook.verify(text, headers, json_parse=False)
            except WebhookVerificationError:
                continue
            return
        raise UnauthenticDelivery("no valid signature")


def sign(secret: str, message_id: str, timestamp: int, body: bytes) -> str:
    """The `v1,<base64>` signature of a delivery (for the simulator and tests)."""
    when = dt.datetime.fromtimestamp(timestamp, dt.UTC)
    return Webhook(secret).sign(message_id, when, body.decode())


def signed_headers(
    secret: str, message_id: str, body: bytes, *, timestamp: int | None = None
) -> dict[str, str]:
    """The three headers that make `body` a signed delivery."""
    at = int(time.time()) if timestamp is None else timestamp
    return {
        "webhook-id": message_id,
        "webhook-timestamp": str(at),
        "webhook-signature": sign(secret, message_id, at, body),
    }


# Stripe: https://docs.stripe.com/webhooks#verify-manually. stripe-python's `WebhookSignature`
# (the reference) computes and compares; its tolerance only refuses old timestamps, so the
# time is checked here, both ways, as for the standard scheme.
STRIPE_HEADER = "stripe-signature"
_STRIPE_PART = re.compile(r"([a-z0-9]+)=([^,=]*)")
_HEX_SIGNATURE = re.compile(r"[0-9a-f]{64}")
Scheme = Literal["standard", "stripe", "yookassa"]
# the adapter's provider delivers its way: Standard Webhooks, Stripe-Signature, or unsigned
SCHEME_OF: dict[GatewayKind, Scheme] = {
    "contract": "standard",
    "stripe": "stripe",
    "yookassa": "yookassa",
}


class Signed(Protocol):
    """A delivery's signature headers, well-formed: when it was signed, and its id when
    the scheme has one in a header."""

    @property
    def timestamp(self) -> int: ...
    @property
    def message_id(self) -> str: ...


@dataclass(frozen=True)
class StripeSigned:
    """`Stripe-Signature`, well-formed: its timestamp and the header as sent (verified by
    stripe-python as a whole); the event id is in the body."""

    timestamp: int
    header: str
    message_id: str = ""


def read_stripe_header(headers: Mapping[str, str]) -> StripeSigned:
    """`Stripe-Signature`, or `MalformedDelivery` saying what is wrong with it."""
    header = headers.get(STRIPE_HEADER, "")
    if not header:
        raise MalformedDelivery("the Stripe-Signature header is missing")
    parts = header.split(",")
    if len(parts) > MAX_SIGNATURES + 2 or not all(_STRIPE_PART.fullmatch(p) for p in parts):
        raise MalformedDelivery("Stripe-Signature is not comma-separated name=value pairs")
    pairs = [p.split("=", 1) for p in parts]
    stamps = [value for name, value in pairs if name == "t"]
    signatures = [value for name, value in pairs if name == "v1"]
    if len(stamps) != 1 or not _TIMESTAMP.fullmatch(stamps[0]):
        raise MalformedDelivery("Stripe-Signature has no t=<unix seconds>")
    if not signatures or not all(_HEX_SIGNATURE.fullmatch(s) for s in signatures):
        raise MalformedDelivery("Stripe-Signature has no v1=<hex HMAC-SHA256>")
    return StripeSigned(int(stamps[0]), header)


def check_stripe_secret(secret: str) -> str:
    """A Stripe endpoint secret (`whsec_…`, used as is); `SettingsError` otherwise."""
    if not secret.startswith("whsec_") or len(secret) < len("whsec_") + 8:
        raise SettingsError(f"{_SECRETS_ENV}: a Stripe secret is whsec_ and 8 characters or more")
    return secret


class StripeVerifier:
    """Checks `Stripe-Signature` against every configured secret (several during a rotation)."""

    def __init__(
        self,
        secrets: Sequence[str],
        *,
        tolerance_s: float = LIBRARY_TOLERANCE_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not secrets:
            raise SettingsError(f"{_SECRETS_ENV} is not set; `webhooks` needs a whsec_ secret")
        self._secrets = [check_stripe_secret(secret) for secret in secrets]
        self.tolerance_s = tolerance_s
        self.clock = clock

    def read_headers(self, headers: Mapping[str, str]) -> StripeSigned:
        """The signature header, well-formed, or `MalformedDelivery`."""
        return read_stripe_header(headers)

    def check_time(self, signed: Signed) -> None:
        """`UnauthenticDelivery` when `t` is further from now than the tolerance."""
        if abs(self.clock() - signed.timestamp) > self.tolerance_s:
            raise UnauthenticDelivery(
                f"the Stripe-Signature timestamp is over {self.tolerance_s:g}s away from now"
            )

    def verify(self, body: bytes, signed: Signed) -> None:
        """Pass if one `v1` signature matches one secret; else `UnauthenticDelivery`."""
        assert isinstance(signed, StripeSigned)
        self.check_time(signed)
        text = _utf8(body)
        for secret in self._secrets:
            try:
                stripe.WebhookSignature.verify_header(text, signed.header, secret, tolerance=None)
            except stripe.SignatureVerificationError:
                continue
            return
        raise UnauthenticDelivery("no valid signature")


def stripe_signature(secret: str, body: bytes, *, timestamp: int | None = None) -> str:
    """The `Stripe-Signature` header of a delivery (for the simulator and tests)."""
    at = int(time.time()) if timestamp is None else timestamp
    header: str = stripe.WebhookSignature.generate_signature_header(
        body.decode(), secret, timestamp=at
    )
    return header


def verifier_for(scheme: Scheme, cfg: WebhookSettings) -> Verifier | StripeVerifier | None:
    """The verifier of `scheme` for the configured secrets and tolerance; None for a scheme
    that does not sign (`yookassa`: no secret needed)."""
    if scheme == "yookassa":
        return None
    if scheme == "stripe":
        secrets = [secret.get_secret_value() for secret in cfg.webhook_secrets]
        return StripeVerifier(secrets, tolerance_s=cfg.webhook_tolerance_s)
    return Verifier.from_settings(cfg)


def _utf8(body: bytes) -> str:
    """The body as text (both schemes sign text), or `MalformedDelivery`."""
    try:
        return body.decode()
    except UnicodeDecodeError as error:
        raise MalformedDelivery("the body is not UTF-8") from error
