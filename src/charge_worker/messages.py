"""The `charge.due/v1` message (docs/contracts/charge-due.md): parsing, validation, identity."""

from __future__ import annotations

import datetime as dt
import json
import re
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    AwareDatetime,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictStr,
    ValidationError,
)

from charge_worker.errors import PoisonMessage
from charge_worker.settings import MAX_TRIES

SCHEMA = "charge.due/v1"
MAX_BODY_BYTES = 64 * 1024
MAX_ORDER_ID = 2**63 - 1
MAX_DEPTH = 100  # a charge is one flat object; unknown fields may nest, not without end

# C0, DEL and C1 controls, and lone surrogates: PostgreSQL's text refuses a NUL (and UTF-8 a
# surrogate), so a charge holding one could never be claimed; the rest are terminal escapes.
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\ud800-\udfff]")
_TRACEPARENT = re.compile(r"00-(?!0{32}-)[0-9a-f]{32}-(?!0{16}-)[0-9a-f]{16}-[0-9a-f]{2}")
_ISO_DATE = re.compile(r"\d{4}-\d{2}-\d{2}")
_RFC3339 = re.compile(r"\d{4}-\d{2}-\d{2}[Tt ]\d{2}:\d{2}:\d{2}(\.\d+)?([Zz]|[+-]\d{2}:\d{2})")


def _shaped(pattern: re.Pattern[str], shape: str, native: type) -> BeforeValidator:
    """A `native` object (the producer's row), or a string shaped like `shape`, checked
    before pydantic reads it: pydantic also takes a number, or a number in a string, as a
    Unix timestamp ("0" is 1970-01-01), and the billing period is half of the idempotency
    key. The field then parses in lax mode: strict mode refuses a string here once a
    validator stands in front of it."""

    def check(value: Any) -> Any:
        if isinstance(value, native) or (isinstance(value, str) and pattern.fullmatch(value)):
            return value
        raise ValueError(f"must be {shape}")

    return BeforeValidator(check)


def _no_control(value: str) -> str:
    if _CONTROL.search(value):
        raise ValueError("must hold no control characters")
    return value


def _storable(value: dt.datetime) -> dt.datetime:
    """Within the years 1-9999 once in UTC, as the ledger stores it: 0001-01-01T00:30+01:00
    is a valid RFC 3339 timestamp of the year 0. An offset is less than a day: only the
    first and the last year can leave the range."""
    if 1 < value.year < 9999:
        return value
    try:
        value.astimezone(dt.UTC)
    except OverflowError as error:
        raise ValueError("must lie within the years 0001-9999 in UTC") from error
    return value


_Id = Annotated[StrictStr, Field(min_length=1, max_length=64), AfterValidator(_no_control)]


class ChargeDue(BaseModel):
    """One subscription whose billing day has come. Unknown extra fields are ignored."""

    # cache_strings: the values (customers, timestamps) are new in nearly every message, so
    # pydantic-core's string cache would only fill up with them; the keys repeat.
    model_config = ConfigDict(strict=True, frozen=True, extra="ignore", cache_strings="keys")

    schema_: Literal["charge.due/v1"] = Field(alias="schema")
    order_id: int = Field(ge=1, le=MAX_ORDER_ID)
    billing_period: Annotated[
        dt.date, _shaped(_ISO_DATE, "an ISO date, YYYY-MM-DD", dt.date), Field(strict=False)
    ]
    subscription_id: _Id
    customer_id: _Id
    amount_minor: int = Field(gt=0, le=MAX_ORDER_ID)
    currency: Annotated[StrictStr, Field(pattern=r"^[A-Z]{3}$")]
    due_at: Annotated[
        AwareDatetime,
        _shaped(_RFC3339, "an RFC 3339 timestamp with a zone", dt.datetime),
        Field(strict=False),
        AfterValidator(_storable),
    ]
    # which try of the period this message asks for (gateway.md, "Retrying a declined
    # renewal"): 1 unless the period was declined and is tried again
    attempt: int = Field(1, ge=1, le=MAX_TRIES)

    @property
    def key(self) -> str:
        """The try's idempotency key, the gateway's `Idempotency-Key`: the period's
        `<order_id>:<billing_period>` for try 1, with `:<attempt>` after."""
        return idempotency_key(self.order_id, self.billing_period, self.attempt)

    @property
    def fingerprint(self) -> str:
        """Amount, currency and customer, as `charge_attempts.fingerprint` spells them (and
        `GatewayCharge.fingerprint`): what proves a charge is this period's."""
        return f"{self.amount_minor} {self.currency} {self.customer_id}"

    @property
    def msg_id(self) -> str:
        """The `Nats-Msg-Id` the producer publishes this try with."""
        return msg_id(self.order_id, self.billing_period, self.attempt)

    def to_json(self) -> bytes:
        """The message body; try 1's carries no `attempt`, as before retries existed."""
        exclude = {"attempt"} if self.attempt == 1 else None
        return self.model_dump_json(by_alias=True, exclude=exclude).encode()


def idempotency_key(order_id: int, billing_period: dt.date, attempt: int = 1) -> str:
    """Try `attempt`'s key; try 1's is the period's own (the request before retries existed)."""
    period = f"{order_id}:{billing_period.isoformat()}"
    return period if attempt == 1 else f"{period}:{attempt}"


def msg_id(order_id: int, billing_period: dt.date, attempt: int = 1) -> str:
    return f"charge:{idempotency_key(order_id, billing_period, attempt)}"


def parse(body: bytes) -> ChargeDue:
    """Parse and validate a message body; any breach of the contract is a `PoisonMessage`."""
    if len(body) > MAX_BODY_BYTES:
        raise PoisonMessage(f"body is {len(body)} bytes, over the {MAX_BODY_BYTES} byte limit")
    try:
        text = body.decode("utf-8")
        if text.count("[") + text.count("{") > MAX_DEPTH and _depth(text) > MAX_DEPTH:
            raise PoisonMessage(f"body nests arrays or objects deeper than {MAX_DEPTH} levels")
        # json first: pydantic would accept a top-level non-object only to fail less clearly,
        # and Python refuses integers of more than 4300 digits here with a ValueError.
        data = _DECODER.decode(text)
    except (UnicodeDecodeError, ValueError) as error:
        raise PoisonMessage(f"body is not UTF-8 JSON: {_first_line(error)}") from error
    if not isinstance(data, dict):
        raise PoisonMessage(f"body is a JSON {type(data).__name__}, not an object")
    if data.get("schema") != SCHEMA:
        raise PoisonMessage(f"schema is {data.get('schema')!r}, expected {SCHEMA!r}")
    try:
        return ChargeDue.model_validate_json(body)
    except ValidationError as error:
        raise PoisonMessage(_describe(error)) from error


def _depth(text: str) -> int:
    """The deepest nesting of arrays and objects, brackets inside strings not counted.

    Checked before `json.loads`, whose C scanner recurses per level: a RecursionError out of
    it leaves CPython 3.11's recursion accounting off (later `ast.parse` calls in the same
    process fail with "AST constructor recursion depth mismatch"), so deep input must never
    reach it."""
    depth = deepest = 0
    in_string = escaped = False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
    return deepest


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object; a key given twice is poison (parsers disagree on which one wins).

    Linear in the number of keys: a 64 KiB body holds thousands, and this runs on the loop."""
    data = dict(pairs)
    if len(data) < len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:  # the first key given twice
            if key in seen:
                raise PoisonMessage(f"field {key!r} appears more than once")
            seen.add(key)
    return data


# one decoder for every message: `json.loads` with a hook builds a new one per call
_DECODER = json.JSONDecoder(object_pairs_hook=_unique_keys)


def valid_traceparent(header: object) -> str | None:
    """The header if it is a valid W3C `traceparent` of version 00, else None.

    It comes from outside and is forwarded as an HTTP header and kept in dead letters: a
    non-ASCII one made every gateway call of its charge fail."""
    if isinstance(header, str) and _TRACEPARENT.fullmatch(header):
        return header
    return None


def _describe(error: ValidationError) -> str:
    first = error.errors()[0]
    where = ".".join(str(part) for part in first["loc"]) or "body"
    return f"{where}: {first['msg']}"


def _first_line(error: Exception) -> str:
    return str(error).splitlines()[0][:200]
