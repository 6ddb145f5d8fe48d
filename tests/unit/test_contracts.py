"""docs/contracts/ against the specifications and against the code that speaks them.

Every JSON Schema is valid draft 2020-12; `asyncapi.yaml` and `gateway.openapi.yaml` are valid
against their specifications' own schemas (vendored in `metaschemas/`: AsyncAPI 3.0.0 from
the `@asyncapi/specs` package, OpenAPI 3.1 from `openapi-spec-validator`'s resources, both
Apache-2.0). The charge-due schema and `charge_worker.messages` judge a table of bodies
alike; the dead letters `charge_worker.dlq` writes satisfy their schema; what the outcome
relay publishes (subject, headers, body) is what the AsyncAPI document and the outcome
schema say; the OpenAPI paths are exactly the gateway simulator's routes, and what the
`contract` adapter sends and the simulator answers (in process, no server) satisfies the
OpenAPI schemas.
"""

from __future__ import annotations

import calendar
import datetime as dt
import gzip
import json
import re
from collections.abc import Awaitable, Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
import referencing
import referencing.jsonschema
import yaml
from nats.js.api import PubAck
from prometheus_client import CollectorRegistry
from pydantic import SecretStr

from charge_worker import dlq, messages
from charge_worker.errors import PoisonMessage
from charge_worker.gateway import ContractGateway
from charge_worker.outcomes.outbox import Event, Published, Result
from charge_worker.outcomes.relay import OutboxMetrics, Relay
from charge_worker.sandbox.gateway.app import GatewayConfig, GatewaySimulator, build_gateway_app
from charge_worker.settings import GatewaySettings, NatsSettings, WorkerSettings

ROOT = Path(__file__).parents[2]
CONTRACTS = ROOT / "docs" / "contracts"
SCHEMAS = CONTRACTS / "schemas"
META = Path(__file__).parent / "metaschemas"
SCHEMA_FILES = sorted(SCHEMAS.glob("*.json"))


def load_json(path: Path) -> Any:
    return json.loads(path.read_text())


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


_RFC3339 = re.compile(
    r"(\d{4})-(\d{2})-(\d{2})[Tt ](\d{2}):(\d{2}):(\d{2})(?:\.\d+)?(?:[Zz]|[+-](\d{2}):(\d{2}))",
    re.ASCII,
)


def _date_time(value: object) -> bool:
    """RFC 3339 `date-time` (the `T` may be a space, per its note), no leap second: what
    `format: date-time` asserts for the worker. jsonschema checks it only with the
    `rfc3339-validator` package, which the project does not install."""
    if not isinstance(value, str):
        return True
    match = _RFC3339.fullmatch(value)
    if match is None:
        return False
    year, month, day, hour, minute, second = (int(part) for part in match.groups()[:6])
    off_hour, off_minute = (int(part or 0) for part in match.groups()[6:])
    return (
        year >= 1
        and 1 <= month <= 12
        and 1 <= day <= calendar.monthrange(year, month)[1]
        and hour < 24
        and minute < 60
        and second < 60
        and off_hour < 24
        and off_minute < 60
    )


FORMATS = jsonschema.FormatChecker()
FORMATS.checks("date-time")(_date_time)


def validator(path: Path) -> jsonschema.protocols.Validator:
    schema = load_json(path)
    return jsonschema.Draft202012Validator(schema, format_checker=FORMATS)


def errors_of(schema_validator: jsonschema.protocols.Validator, instance: Any) -> list[str]:
    return [error.message for error in schema_validator.iter_errors(instance)]


# --- the documents are valid ---------------------------------------------------------------


@pytest.mark.parametrize("path", SCHEMA_FILES, ids=lambda path: path.name)
def test_schema_is_valid_draft_2020_12(path: Path) -> None:
    schema = load_json(path)
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    jsonschema.Draft202012Validator.check_schema(schema)
    for example in schema.get("examples", []):
        assert errors_of(validator(path), example) == []


def test_the_schemas_are_the_ones_the_docs_name() -> None:
    assert [path.name for path in SCHEMA_FILES] == [
        "charge-dlq-headers.v1.json",
        "charge-due.v1.json",
        "charge-outcome.v1.json",
    ]


def _refs(node: object) -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str):
                yield value
            else:
                yield from _refs(value)
    elif isinstance(node, list):
        for item in node:
            yield from _refs(item)


def _resolves(document: Any, base: Path, ref: str) -> bool:
    """A `$ref` of a document: a JSON pointer into it, or a file beside it (and a pointer)."""
    target, _, pointer = ref.partition("#")
    node = load_json(base / target) if target else document
    for escaped in filter(None, pointer.split("/")):
        part = escaped.replace("~1", "/").replace("~0", "~")
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def _meta(name: str) -> Any:
    path = META / name
    return json.loads(
        gzip.decompress(path.read_bytes()) if name.endswith(".gz") else path.read_text()
    )


ASYNCAPI = load_yaml(CONTRACTS / "asyncapi.yaml")
OPENAPI = load_yaml(CONTRACTS / "gateway.openapi.yaml")


def test_asyncapi_document_is_valid_asyncapi_3() -> None:
    meta = _meta("asyncapi-3.0.0.json.gz")
    spec_validator = jsonschema.validators.validator_for(meta)(meta)
    assert [
        f"{list(e.absolute_path)}: {e.message}" for e in spec_validator.iter_errors(ASYNCAPI)
    ] == []
    broken = json.loads(json.dumps(ASYNCAPI))
    broken["operations"]["deadLetter"]["action"] = "publish"  # AsyncAPI 2's word
    assert list(spec_validator.iter_errors(broken)), "the meta-schema checks nothing"


def test_openapi_document_is_valid_openapi_3_1() -> None:
    meta = _meta("openapi-3.1.json")
    spec_validator = jsonschema.Draft202012Validator(meta)
    assert [
        f"{list(e.absolute_path)}: {e.message}" for e in spec_validator.iter_errors(OPENAPI)
    ] == []
    broken = json.loads(json.dumps(OPENAPI))
    broken["paths"]["/v1/charges"]["post"]["responses"]["200"].pop("description")
    assert list(spec_validator.iter_errors(broken)), "the meta-schema checks nothing"
    # OpenAPI's schema leaves Schema Objects to their dialect: each is a 2020-12 schema
    for name, schema in OPENAPI["components"]["schemas"].items():
        assert jsonschema.Draft202012Validator.check_schema(schema) is None, name


@pytest.mark.parametrize(
    ("name", "document"), [("asyncapi.yaml", ASYNCAPI), ("gateway.openapi.yaml", OPENAPI)]
)
def test_every_ref_resolves(name: str, document: Any) -> None:
    unresolved = [ref for ref in _refs(document) if not _resolves(document, CONTRACTS, ref)]
    assert unresolved == [], name


def test_asyncapi_names_the_subjects_of_the_contracts() -> None:
    addresses = {channel["address"] for channel in ASYNCAPI["channels"].values()}
    assert addresses == {"charges.due", "charges.dlq", "charges.outcome.{kind}"}
    outcome = (SCHEMAS / "charge-outcome.v1.json").read_text()
    assert "charges.outcome.<kind>" in outcome


# --- charge.due/v1: the schema and the model judge alike ------------------------------------

DUE = validator(SCHEMAS / "charge-due.v1.json")
EXAMPLE: dict[str, Any] = {
    "schema": "charge.due/v1",
    "order_id": 48291,
    "billing_period": "2026-09-01",
    "subscription_id": "sub_7Q2",
    "customer_id": "cus_42",
    "amount_minor": 99000,
    "currency": "RUB",
    "due_at": "2026-09-01T00:00:00Z",
}
MISSING = object()
MAX = 2**63 - 1


def body(**changes: object) -> dict[str, Any]:
    data = dict(EXAMPLE)
    for field, value in changes.items():
        if value is MISSING:
            data.pop(field)
        else:
            data[field] = value
    return data


VALID: dict[str, object] = {
    "the example": body(),
    "unknown fields, nested": body(note={"nested": [1, {"deep": None}]}, x=1.5),
    "attempt 1": body(attempt=1),
    "attempt 3": body(attempt=3),
    "smallest order id": body(order_id=1),
    "largest order id": body(order_id=MAX),
    "smallest amount": body(amount_minor=1),
    "largest amount": body(amount_minor=MAX),
    "a leap day": body(billing_period="2024-02-29"),
    "an offset": body(due_at="2026-09-01T03:00:00+03:00"),
    "a negative offset": body(due_at="2026-08-31T19:00:00-05:00"),
    "a fraction": body(due_at="2026-09-01T00:00:00.123456Z"),
    "lower-case t and z": body(due_at="2026-09-01t00:00:00z"),
    "a space for T": body(due_at="2026-09-01 00:00:00Z"),
    "64 characters": body(customer_id="c" * 64),
    "64 non-ASCII characters": body(subscription_id="é" * 64),
}
INVALID: dict[str, object] = {
    **{f"no {field}": body(**{field: MISSING}) for field in EXAMPLE},
    "a list": [EXAMPLE],
    "a string": "charge.due/v1",
    "schema v2": body(schema="charge.due/v2"),
    "schema null": body(schema=None),
    "order id 0": body(order_id=0),
    "order id negative": body(order_id=-1),
    "order id over 2^63-1": body(order_id=MAX + 1),
    "order id a string": body(order_id="48291"),
    "order id true": body(order_id=True),
    "order id null": body(order_id=None),
    "order id 1.5": body(order_id=1.5),
    "amount 0": body(amount_minor=0),
    "amount negative": body(amount_minor=-100),
    "amount over 2^63-1": body(amount_minor=MAX + 1),
    "amount a float": body(amount_minor=990.5),
    "amount a string": body(amount_minor="99000"),
    "currency lower case": body(currency="rub"),
    "currency 4 letters": body(currency="RUBL"),
    "currency 2 letters": body(currency="RU"),
    "currency with a newline": body(currency="RUB\n"),
    "currency a number": body(currency=643),
    "period unpadded": body(billing_period="2026-9-01"),
    "period basic format": body(billing_period="20260901"),
    "period 30 February": body(billing_period="2026-02-30"),
    "period month 13": body(billing_period="2026-13-01"),
    "period year 0": body(billing_period="0000-01-01"),
    "period a timestamp": body(billing_period="2026-09-01T00:00:00Z"),
    "period a number": body(billing_period=20260901),
    "due_at without a zone": body(due_at="2026-09-01T00:00:00"),
    "due_at a date": body(due_at="2026-09-01"),
    "due_at without seconds": body(due_at="2026-09-01T00:00Z"),
    "due_at an empty fraction": body(due_at="2026-09-01T00:00:00.Z"),
    "due_at unix seconds": body(due_at=1788000000),
    "due_at unix seconds in a string": body(due_at="1788000000"),
    "due_at month 13": body(due_at="2026-13-01T00:00:00Z"),
    "due_at 30 February": body(due_at="2026-02-30T00:00:00Z"),
    "due_at hour 24": body(due_at="2026-09-01T24:00:00Z"),
    "due_at a leap second": body(due_at="2026-09-01T00:00:60Z"),
    "due_at offset 24 hours": body(due_at="2026-09-01T00:00:00+24:00"),
    "empty subscription": body(subscription_id=""),
    "65 characters": body(subscription_id="s" * 65),
    "subscription a number": body(subscription_id=42),
    "customer null": body(customer_id=None),
    "a newline in an id": body(customer_id="cus\n42"),
    "DEL in an id": body(customer_id="cus\x7f42"),
    "a C1 control in an id": body(subscription_id="sub\x857Q2"),
    **{f"attempt {value!r}": body(attempt=value) for value in (0, -1, "2", 1.5, None)},
}
# Where the two disagree today, each for its reason; strict: the mark fails once they agree.
KNOWN: dict[str, tuple[object, str]] = {
    "attempt above the model's bound": (
        body(attempt=messages.MAX_TRIES + 1),
        "the schema sets no upper bound; the model refuses a try no schedule can reach",
    ),
    "order id 1.0": (
        body(order_id=1.0),
        "JSON Schema counts 1.0 as an integer; the model refuses a number with a fraction",
    ),
}


def model_accepts(data: object) -> bool:
    try:
        messages.parse(json.dumps(data).encode())
    except PoisonMessage:
        return False
    return True


def schema_accepts(data: Any) -> bool:
    return DUE.is_valid(data)


@pytest.mark.parametrize(("case", "data"), VALID.items(), ids=list(VALID))
def test_schema_and_model_accept(case: str, data: object) -> None:
    assert (schema_accepts(data), model_accepts(data)) == (True, True), case


@pytest.mark.parametrize(("case", "data"), INVALID.items(), ids=list(INVALID))
def test_schema_and_model_refuse(case: str, data: object) -> None:
    assert (schema_accepts(data), model_accepts(data)) == (False, False), case


@pytest.mark.parametrize(
    ("case", "data"),
    [
        pytest.param(case, data, marks=pytest.mark.xfail(strict=True, reason=reason))
        for case, (data, reason) in KNOWN.items()
    ],
    ids=list(KNOWN),
)
def test_known_disagreements(case: str, data: object) -> None:
    assert schema_accepts(data) == model_accepts(data), case


def test_schema_names_the_model_fields() -> None:
    schema = load_json(SCHEMAS / "charge-due.v1.json")
    fields = {info.alias or name: info for name, info in messages.ChargeDue.model_fields.items()}
    assert set(schema["properties"]) == set(fields)
    assert set(schema["required"]) == {name for name, info in fields.items() if info.is_required()}
    assert schema["properties"]["schema"]["const"] == messages.SCHEMA


def test_a_message_the_code_writes_satisfies_the_schema() -> None:
    charge = messages.parse(json.dumps(EXAMPLE).encode())
    assert errors_of(DUE, json.loads(charge.to_json())) == []


# --- dead letters ----------------------------------------------------------------------------

DLQ_HEADERS = validator(SCHEMAS / "charge-dlq-headers.v1.json")
REASONS: list[str] = load_json(SCHEMAS / "charge-dlq-headers.v1.json")["properties"]["Dlq-Reason"][
    "enum"
]


def test_the_reasons_are_the_contracts() -> None:
    prose = (CONTRACTS / "charge-due.md").read_text()
    assert REASONS == ["poison", "max_deliveries", "rejected", "conflict", "unverified"]
    assert all(f"`{reason}`" in prose for reason in REASONS)


@pytest.mark.parametrize("reason", REASONS)
def test_dead_letter_headers_satisfy_the_schema(reason: str) -> None:
    original: Mapping[str, object] = {
        "Nats-Msg-Id": "charge:48291:2026-09-01",
        "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
    }
    headers = dlq.envelope_headers(
        reason=reason, error="why", stream_seq=7, num_delivered=5, original=original
    )
    assert errors_of(DLQ_HEADERS, headers) == []
    assert headers["Nats-Msg-Id"] == "dlq:7"


def test_dead_letter_headers_of_hostile_input_satisfy_the_schema() -> None:
    headers = dlq.envelope_headers(
        reason="poison",
        error="näive\n\x1b[31mline two " + "x" * 1000,
        stream_seq=1,
        num_delivered=1,
        original={"Nats-Msg-Id": "charge:ü", "traceparent": "not a traceparent"},
        first_seen="2026-09-01T00:00:00Z",
    )
    assert errors_of(DLQ_HEADERS, headers) == []
    assert "traceparent" not in headers


def test_a_dead_letter_without_its_reason_is_refused() -> None:
    headers = dlq.envelope_headers(
        reason="poison", error="e", stream_seq=1, num_delivered=1, original=None
    )
    assert DLQ_HEADERS.is_valid(headers)
    assert not DLQ_HEADERS.is_valid({**headers, "Dlq-Reason": "tired"})
    assert not DLQ_HEADERS.is_valid({k: v for k, v in headers.items() if k != "Dlq-Reason"})


# --- outcome events ---------------------------------------------------------------------
# The bodies are the migration's triggers': tests/integration/test_outbox.py validates the
# body of every path that writes one against the schema, test_outcome_relay.py what reaches
# the stream. Here: the example, and what the relay makes of a body (subject, headers).

OUTCOME = validator(SCHEMAS / "charge-outcome.v1.json")


def _example_in(markdown: Path) -> Any:
    """The first ```json block of a contract file."""
    match = re.search(r"```json\n(.*?)```", markdown.read_text(), re.DOTALL)
    assert match is not None
    return json.loads(match.group(1).replace('"ch_..."', '"ch_3f9a"'))


def test_outcome_example_of_the_contract_satisfies_the_schema() -> None:
    assert errors_of(OUTCOME, _example_in(CONTRACTS / "charge-outcome.md")) == []


def test_charge_due_example_of_the_contract_satisfies_the_schema() -> None:
    example = _example_in(CONTRACTS / "charge-due.md")
    assert example == EXAMPLE
    assert errors_of(DUE, example) == []


@pytest.mark.parametrize(
    ("case", "changes"),
    [
        ("a decline without its class", {"type": "charge.declined", "decline_code": "x"}),
        ("a success without its charge", {"gateway_charge_id": None}),
        ("a retry without retry_at", {"type": "charge.retry_scheduled", "decline_code": "x"}),
        ("a success with a decline code", {"decline_code": "insufficient_funds"}),
        ("sequence 0", {"sequence": 0}),
        ("an event id of another shape", {"event_id": "48291-2026-09-01-3"}),
    ],
)
def test_outcome_schema_refuses(case: str, changes: dict[str, object]) -> None:
    event = _example_in(CONTRACTS / "charge-outcome.md") | changes
    assert not OUTCOME.is_valid(event), case


def test_outcome_schema_lets_a_new_type_through() -> None:
    event = _example_in(CONTRACTS / "charge-outcome.md") | {"type": "charge.partially_refunded"}
    assert OUTCOME.is_valid(event)


class RecordingStream:
    """JetStream's publish, recorded: what the relay sends, without a server."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes, dict[str, str]]] = []

    async def publish(
        self, subject: str, payload: bytes, *, headers: dict[str, str], **options: object
    ) -> PubAck:
        self.sent.append((subject, payload, headers))
        return PubAck(stream="CHARGE_OUTCOMES", seq=len(self.sent))


class OneBatch:
    """The outbox as the relay uses it, holding one batch of unsent events."""

    def __init__(self, events: list[Event]) -> None:
        self.events = events

    async def relay(
        self,
        limit: int,
        publish: Callable[[list[Event]], Awaitable[Published]],
        *,
        before_mark: Callable[[], None],
    ) -> list[tuple[Event, Result]]:
        return list(zip(self.events, await publish(self.events), strict=True))


def _event(body: dict[str, Any], traceparent: str | None) -> Event:
    """The outbox row the ledger's trigger writes for the change `body` tells."""
    return Event(
        body["order_id"],
        dt.date.fromisoformat(body["billing_period"]),
        body["sequence"],
        body["type"],
        body["subscription_id"],
        body["customer_id"],
        body["amount_minor"],
        body["currency"],
        body["gateway_charge_id"],
        body["decline_code"],
        body["decline_class"],
        body.get("review", False),
        traceparent,
        dt.datetime.fromisoformat(body["occurred_at"]),
    )


async def test_what_the_relay_publishes_is_what_the_asyncapi_document_says() -> None:
    example = _example_in(CONTRACTS / "charge-outcome.md")
    declined = example | {
        "event_id": "7:2026-09-01:1",
        "order_id": 7,
        "sequence": 1,
        "type": "charge.declined",
        "gateway_charge_id": None,
        "decline_code": "insufficient_funds",
        "decline_class": "soft",
    }
    traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    bodies = [example, declined]
    events = [_event(example, traceparent), _event(declined, None)]
    stream = RecordingStream()
    relay = Relay(
        OneBatch(events),
        stream,
        NatsSettings(),
        WorkerSettings(),
        OutboxMetrics(CollectorRegistry()),
    )
    assert await relay.relay_once() == 2

    channel = ASYNCAPI["channels"]["chargeOutcomes"]
    message = ASYNCAPI["components"]["messages"]["chargeOutcome"]
    headers_schema = jsonschema.Draft202012Validator(message["headers"])
    kinds = channel["parameters"]["kind"]["examples"]
    for (subject, payload, headers), event, expected in zip(
        stream.sent, events, bodies, strict=True
    ):
        body = json.loads(payload)
        assert body == expected  # the contract's own example, field for field
        assert payload == event.body()  # the same bytes each time: a re-publish is a duplicate
        assert errors_of(OUTCOME, body) == []
        kind = body["type"].removeprefix("charge.")
        assert kind in kinds
        assert subject == channel["address"].replace("{kind}", kind)
        assert errors_of(headers_schema, headers) == []
        assert headers["Nats-Msg-Id"] == f"outcome:{body['event_id']}"
    assert stream.sent[0][2]["traceparent"] == traceparent
    assert "traceparent" not in stream.sent[1][2]


# --- the gateway: OpenAPI against the simulator and the adapter ----------------------------


def test_openapi_paths_are_the_simulators_routes() -> None:
    served = {
        (route.path, method.lower())
        for route in GatewaySimulator(GatewayConfig()).routes()
        for method in route.methods or ()
        if method != "HEAD"  # Starlette's, with every GET
    }
    documented = {
        (path, method)
        for path, item in OPENAPI["paths"].items()
        for method in item
        if method in {"get", "put", "post", "delete", "patch", "options", "head", "trace"}
    }
    assert sorted(documented - served) == [], "documented, not served"
    assert sorted(served - documented) == [], "served, not documented"


def test_openapi_documents_the_webhook() -> None:
    webhook = OPENAPI["webhooks"]["chargeEvent"]["post"]
    assert {p["name"] for p in webhook["parameters"]} == {
        "webhook-id",
        "webhook-timestamp",
        "webhook-signature",
    }
    assert set(webhook["responses"]) >= {"200", "400", "401", "413"}


_OPENAPI_URI = "urn:charge-worker:gateway.openapi"
_REGISTRY: referencing.Registry[Any] = referencing.Registry().with_resource(
    _OPENAPI_URI,
    referencing.Resource.from_contents(
        OPENAPI, default_specification=referencing.jsonschema.DRAFT202012
    ),
)


def openapi_errors(pointer: str, instance: object) -> list[str]:
    """What `instance` breaks of the OpenAPI document's schema at `pointer`."""
    schema = {"$ref": f"{_OPENAPI_URI}#{pointer}"}
    checker = jsonschema.Draft202012Validator(schema, registry=_REGISTRY, format_checker=FORMATS)
    return [error.message for error in checker.iter_errors(instance)]


def _response_schema(path: str, method: str, status: int) -> str:
    responses = OPENAPI["paths"][path][method]["responses"]
    response = responses.get(str(status)) or responses[f"{str(status)[0]}XX"]
    if "$ref" in response:
        response = OPENAPI["components"]["responses"][response["$ref"].rsplit("/", 1)[1]]
    return str(response["content"]["application/json"]["schema"]["$ref"]).removeprefix("#")


class Recorded(httpx.AsyncBaseTransport):
    """The simulator in process; every exchange kept."""

    def __init__(self, app: Any) -> None:
        self.inner = httpx.ASGITransport(app=app)
        self.exchanges: list[tuple[httpx.Request, int, Any]] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self.inner.handle_async_request(request)
        content = await response.aread()
        self.exchanges.append((request, response.status_code, json.loads(content)))
        return httpx.Response(response.status_code, headers=response.headers, content=content)


async def test_what_the_adapter_sends_and_the_simulator_answers_is_documented() -> None:
    app = build_gateway_app(GatewayConfig(api_key="sk_test_contract", seed=1))
    transport = Recorded(app)
    settings = GatewaySettings(url="http://127.0.0.1", api_key=SecretStr("sk_test_contract"))
    gateway = ContractGateway(settings, transport=transport)
    # another key for the same refund: the gateway's verdict, not a replay of the first
    again = ContractGateway(
        settings.model_copy(update={"idempotency_key_prefix": "again:"}), transport=transport
    )
    try:
        charged = await gateway.charge(messages.parse(json.dumps(EXAMPLE).encode()))
        declined = await gateway.charge(
            messages.parse(json.dumps(body(order_id=2, customer_id="cus_decline_1")).encode())
        )
        await gateway.lookup(48291, messages.parse(json.dumps(EXAMPLE).encode()).billing_period)
        await gateway.history(created_gte=0, created_lt=2**40, limit=100)
        assert charged.charge_id is not None
        await gateway.refund(charged.charge_id)
        assert await again.refund(charged.charge_id) == "already"
    finally:
        await gateway.aclose()
        await again.aclose()
    assert (charged.status, declined.status) == ("succeeded", "declined")
    seen = set()
    for request, status, answer in transport.exchanges:
        path, method = request.url.path, request.method.lower()
        operation = OPENAPI["paths"][path][method]
        seen.add((path, method, status))
        if "requestBody" in operation:
            pointer = operation["requestBody"]["content"]["application/json"]["schema"]["$ref"]
            assert openapi_errors(pointer.removeprefix("#"), json.loads(request.content)) == []
        for given in operation.get("parameters", []):
            parameter = (
                OPENAPI["components"]["parameters"][given["$ref"].rsplit("/")[-1]]
                if "$ref" in given
                else given
            )
            if parameter.get("required") and parameter["in"] == "header":
                assert parameter["name"].lower() in request.headers
        assert openapi_errors(_response_schema(path, method, status), answer) == [], (
            path,
            status,
        )
    assert seen == {
        ("/v1/charges", "post", 200),
        ("/v1/charges", "post", 402),
        ("/v1/charges", "get", 200),
        ("/v1/refunds", "post", 200),
        ("/v1/refunds", "post", 400),
    }
