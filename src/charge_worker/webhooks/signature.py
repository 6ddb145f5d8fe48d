"""Standard Webhooks signatures (contracts/gateway.md): verified on receipt, made by the simulator.

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

from standardwebhooks.webhooks import Webhook, WebhookVerificationError

from charge_worker.errors import MalformedDelivery, SettingsError, UnauthenticDelivery
from charge_worker.settings import WebhookSettings

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

    @classmethod
    def from_settings(cls, cfg: WebhookSettings) -> Verifier:
        """The verifier for the configured secrets and tolerance."""
        secrets = [secret.get_secret_value() for secret in cfg.webhook_secrets]
        return cls(secrets, tolerance_s=cfg.webhook_tolerance_s)

    def check_time(self, signed: SignedHeaders) -> None:
        """`UnauthenticDelivery` when the timestamp is further from now than the tolerance."""
        if abs(self.clock() - signed.timestamp) > self.tolerance_s:
            raise UnauthenticDelivery(
                f"webhook-timestamp is over {self.tolerance_s:g}s away from now"
            )

    def verify(self, body: bytes, signed: SignedHeaders) -> None:
        """Pass if one signature matches one secret; else `UnauthenticDelivery`."""
        self.check_time(signed)
        try:
            text = body.decode()
        except UnicodeDecodeError as error:
            raise MalformedDelivery("the body is not UTF-8") from error
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
