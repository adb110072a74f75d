"""`/openapi.json` is served and true: schemathesis, driven by it against a real server on loopback, finds nothing.

Every check schemathesis has runs (no 5xx, documented status codes, content types and headers, response schemas,
schema-valid requests accepted, schema-invalid ones refused, auth enforced), through every phase (examples,
coverage, fuzzing, stateful). CI runs a few examples per operation with a fixed seed; `--campaign` runs many,
with a fresh seed that the failure message names.
"""

from __future__ import annotations

import collections
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from schemathesis.config import SchemathesisConfig
from schemathesis.engine import events, from_schema

from kvgraft.engine.engine import Engine
from kvgraft.server import ServerConfig, create_app
from kvgraft.server.background import serve_in_thread
from kvgraft.store import LocalStore

from conftest import TEST_CHUNK, cached_model

MODEL = "random:llama"
KEY = "openapi-key"
CI_EXAMPLES = 8
CAMPAIGN_EXAMPLES = 300
CI_SEED = 12


@dataclass
class Findings:
    """What one schemathesis run did: cases, statuses seen, and its failures (unique by operation and kind)."""

    cases: int = 0
    statuses: collections.Counter[int] = field(default_factory=collections.Counter)
    failures: dict[tuple[str, str], str] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)

    def report(self) -> str:
        lines = [f"{len(self.failures)} unique failures in {self.cases} cases; statuses {dict(self.statuses)}"]
        lines += [f"{op}: {title}: {detail}" for (op, title), detail in sorted(self.failures.items())]
        lines += [f"error: {e}" for e in self.errors]
        return "\n".join(lines)


def run_schemathesis(url: str, headers: dict[str, str], examples: int, seed: int) -> Findings:
    """Run every schemathesis phase and check against a server, as `st run --checks all` would.

    Args:
        url: the server's base URL (its document at `/openapi.json`).
        headers: sent with every request (the API key).
        examples: most generated examples per operation and phase.
        seed: the generation seed.

    Returns:
        What the run found.
    """
    config = SchemathesisConfig.from_dict(
        {
            "headers": headers,
            "workers": 1,
            "seed": seed,
            "checks": {"enabled": True},
            "generation": {"max-examples": examples},
            "request-timeout": 60,
        }
    )
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json", config=config)
    found = Findings()
    for event in from_schema(schema).execute():
        if isinstance(event, events.ScenarioFinished | events.FuzzScenarioFinished):
            _record(found, event.recorder)
        elif isinstance(event, events.NonFatalError):
            found.errors.append(f"{event.label}: {event.value!r}")
        elif isinstance(event, events.FatalError):
            found.errors.append(f"fatal: {event.exception!r}")
    return found


def _record(found: Findings, recorder: Any) -> None:
    found.cases += len(recorder.cases)
    for interaction in recorder.interactions.values():
        if interaction.response is not None:
            found.statuses[interaction.response.status_code] += 1
    for case_id, nodes in recorder.checks.items():
        for node in nodes:
            if node.failure_info is None:
                continue
            failure = node.failure_info.failure
            interaction = recorder.interactions.get(case_id)
            detail = str(getattr(failure, "message", "")).replace("\n", " | ")[:300]
            if interaction is not None and interaction.response is not None:
                body = interaction.request.body
                detail += f" | request {body[:300]!r} -> {interaction.response.status_code}"
                detail += f" {(interaction.response.content or b'')[:200]!r}"
            found.failures.setdefault((recorder.label, failure.title), detail)


@dataclass
class Served:
    url: str
    store: Path


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """A server with the key on reads and writes, small limits, and an empty store."""
    store = tmp_path_factory.mktemp("openapi") / "store"
    model, tokenizer = cached_model(MODEL)
    engine = Engine(model, tokenizer, MODEL, TEST_CHUNK, LocalStore(store))
    config = ServerConfig(
        api_key=KEY, protect_reads=True, max_tokens_limit=8, default_completion_tokens=4, max_body_bytes=64 * 1024
    )
    with serve_in_thread(create_app(engine, config)) as server:
        yield Served(server.url, store)


def test_schemathesis_finds_nothing(served: Served, request: pytest.FixtureRequest) -> None:
    campaign = bool(request.config.getoption("--campaign"))
    seed = random.SystemRandom().randrange(2**64) if campaign else CI_SEED
    examples = CAMPAIGN_EXAMPLES if campaign else CI_EXAMPLES
    found = run_schemathesis(served.url, {"Authorization": f"Bearer {KEY}"}, examples, seed)
    print(f"schemathesis (seed {seed}, {examples} examples per operation): {found.report()}")
    assert not found.failures and not found.errors, f"seed {seed}\n{found.report()}"
    assert found.cases >= 300  # every phase ran, not a vacuous pass
    assert found.statuses[200] > 0 and found.statuses[201] > 0  # valid requests reached the model and the store
    assert 500 not in found.statuses
    assert httpx.get(f"{served.url}/health").status_code == 200


def test_the_document_is_served_without_the_docs_ui(served: Served) -> None:
    document = httpx.get(f"{served.url}/openapi.json").json()
    assert document["openapi"].startswith("3.")
    assert httpx.get(f"{served.url}/docs").status_code == 404
    assert httpx.get(f"{served.url}/redoc").status_code == 404
    operations = {(m.upper(), p) for p, item in document["paths"].items() for m in item}
    assert operations == {
        ("GET", "/health"),
        ("GET", "/metrics"),
        ("GET", "/v1/models"),
        ("GET", "/v1/models/{model_id}"),
        ("POST", "/v1/completions"),
        ("POST", "/v1/chat/completions"),
        ("GET", "/v1/receipts/{receipt_id}"),
        ("GET", "/v1/grafts"),
        ("POST", "/v1/grafts"),
        ("GET", "/v1/grafts/{graft_id}"),
        ("DELETE", "/v1/grafts/{graft_id}"),
    }
    # Reads are protected on this server: every /v1 operation needs the key (and answers 401 without it).
    for path, item in document["paths"].items():
        for operation in item.values():
            secured = path.startswith("/v1/")
            assert (operation.get("security") == [{"bearer": []}]) == secured, path
            assert ("401" in operation["responses"]) == secured, path
    completions = document["paths"]["/v1/completions"]["post"]
    assert sorted(completions["responses"]) == ["200", "400", "401", "404", "413", "429", "500", "503"]
    assert sorted(completions["responses"]["200"]["content"]) == ["application/json", "text/event-stream"]
    assert completions["responses"]["429"]["headers"]["Retry-After"]["required"] is True
    assert completions["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/CompletionRequest"
    }
    schemas = document["components"]["schemas"]
    request_schema = schemas["CompletionRequest"]["properties"]
    assert request_schema["model"]["enum"] == [MODEL]
    assert request_schema["max_tokens"]["anyOf"][0] == {"type": "integer", "minimum": 1, "maximum": 8}
    assert "422" not in str(document) and "HTTPValidationError" not in schemas
    assert sorted(document["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == ["text/plain"]


def test_without_a_key_writes_are_documented_as_403_and_reads_as_open(tmp_path: Path) -> None:
    model, tokenizer = cached_model(MODEL)
    engine = Engine(model, tokenizer, MODEL, TEST_CHUNK, LocalStore(tmp_path / "store"))
    document = create_app(engine, ServerConfig()).openapi()
    create = document["paths"]["/v1/grafts"]["post"]
    assert "403" in create["responses"] and "401" not in create["responses"] and "security" not in create
    listing = document["paths"]["/v1/grafts"]["get"]
    assert "401" not in listing["responses"] and "security" not in listing
    assert "securitySchemes" not in document["components"]


def test_an_integral_float_is_an_integer_and_a_fraction_is_not(served: Served) -> None:
    headers = {"Authorization": f"Bearer {KEY}"}
    body: dict[str, Any] = {"model": MODEL, "prompt": "Hi", "max_tokens": 2.0, "kvgraft": {"retrieve": False}}
    reply = httpx.post(f"{served.url}/v1/completions", json=body, headers=headers, timeout=60)
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] <= 2
    reply = httpx.post(f"{served.url}/v1/completions", json=body | {"max_tokens": 2.5}, headers=headers, timeout=60)
    assert reply.status_code == 400
    assert reply.json()["error"]["message"] == "max_tokens: Input should be a valid integer"
