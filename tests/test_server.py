"""`kvgraft serve` end to end: a real uvicorn server on 127.0.0.1, driven by the official `openai` client.

Grafted replies are checked against the server's own bare reply of the same full text (token for token, through
the receipts), receipts are fetched and re-verified by `kvgraft verify --receipt`, and the demo model answers with
a retrieved graft.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI
from typer.testing import CliRunner

from kvgraft.cli import app as cli_app
from kvgraft.engine.engine import Engine
from kvgraft.engine.verify import verify_receipt
from kvgraft.flywheel.problems import prompt_of, training_problems
from kvgraft.format.receipt import parse_receipt
from kvgraft.server import ServerConfig, create_app
from kvgraft.server.background import serve_in_thread
from kvgraft.store import LocalStore

from conftest import TEST_CHUNK, TEXT, cached_model

MODEL = "random:llama"
KEY = "test-key"


@dataclass
class Served:
    url: str
    engine: Engine
    store: Path
    client: OpenAI
    http: httpx.Client
    """with the API key"""

    def graft(self, text: str, metadata: dict[str, Any] | None = None) -> dict[str, Any]:
        reply = self.http.post("/v1/grafts", json={"text": text, "metadata": metadata or {}})
        assert reply.status_code in (200, 201), reply.text
        return dict(reply.json())


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    store = tmp_path_factory.mktemp("serve") / "store"
    model, tokenizer = cached_model(MODEL)
    engine = Engine(model, tokenizer, MODEL, TEST_CHUNK, LocalStore(store))
    config = ServerConfig(api_key=KEY, max_tokens_limit=64, max_body_bytes=64 * 1024)
    with serve_in_thread(create_app(engine, config)) as server:
        client = OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=60)
        with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as http:
            yield Served(server.url, engine, store, client, http)


def bare(served: Served, prompt: str, max_tokens: int = 8, **kwargs: Any) -> Any:
    return served.client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=max_tokens,
        extra_body={"kvgraft": {"retrieve": False, "include_receipt": True}},
        **kwargs,
    )


def kv(reply: Any) -> dict[str, Any]:
    """The `kvgraft` object of a reply (an extra field, kept by the client's models)."""
    return dict(reply.model_extra["kvgraft"])


# --- models, completions, chat ------------------------------------------------------------------------------


def test_models_lists_the_served_model(served: Served) -> None:
    assert [m.id for m in served.client.models.list()] == [MODEL]
    assert served.client.models.retrieve(MODEL).owned_by == "kvgraft"


def test_bare_completion_is_the_engines_run_with_usage(served: Served) -> None:
    reply = bare(served, "Hello there", max_tokens=8)
    receipt = kv(reply)["receipt"]
    assert reply.object == "text_completion" and reply.model == MODEL
    assert reply.choices[0].finish_reason == "length"
    assert receipt["input_tokens"] == served.engine.encode_context("Hello there")
    assert len(receipt["output_tokens"]) == 8
    assert reply.choices[0].text == served.engine.tokenizer.decode(receipt["output_tokens"], skip_special_tokens=True)
    assert reply.usage is not None
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens, reply.usage.total_tokens) == (12, 8, 20)
    assert reply.usage.prompt_tokens_details is not None and reply.usage.prompt_tokens_details.cached_tokens == 0
    info = kv(reply)
    assert info["grafts"] == [] and info["retrieval"] == [] and info["exact"] is True and info["approximate"] is False


def test_grafted_reply_equals_the_bare_reply_of_the_full_text(served: Served) -> None:
    made = served.graft(TEXT, {"title": "graft for the exactness test"})
    prompt = " And so the reader"
    grafted = served.client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=12,
        extra_body={"kvgraft": {"grafts": [made["id"][:12]], "include_receipt": True}},
    )
    fresh = bare(served, TEXT + prompt, max_tokens=12)
    g, f = kv(grafted), kv(fresh)
    assert g["grafts"] == [
        {"id": made["id"], "source": "request", "tokens": made["tokens"], "restored_tokens": made["aligned_tokens"]}
    ]
    assert g["exact"] is True and g["receipt"]["graft_id"] == made["id"]
    assert g["receipt"]["input_tokens"] == f["receipt"]["input_tokens"]
    assert g["receipt"]["output_tokens"] == f["receipt"]["output_tokens"]
    assert g["receipt"]["logits_chain_sha256"] == f["receipt"]["logits_chain_sha256"]
    assert grafted.choices[0].text == fresh.choices[0].text
    assert grafted.usage is not None and fresh.usage is not None
    assert grafted.usage.prompt_tokens == fresh.usage.prompt_tokens == len(served.engine.encode_context(TEXT + prompt))
    assert grafted.usage.prompt_tokens_details is not None
    assert grafted.usage.prompt_tokens_details.cached_tokens == made["aligned_tokens"] > 0


def test_streamed_completion_is_the_non_streamed_one(served: Served) -> None:
    made = served.graft(TEXT + " Streamed.", {"title": "stream test"})
    extra = {"kvgraft": {"grafts": [made["id"]]}}
    whole = served.client.completions.create(model=MODEL, prompt=" then", max_tokens=16, extra_body=extra)
    chunks = list(
        served.client.completions.create(
            model=MODEL,
            prompt=" then",
            max_tokens=16,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=extra,
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason is not None]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == whole.choices[0].finish_reason
    assert kv(finals[0])["receipt_id"] == kv(whole)["receipt_id"]
    assert kv(finals[0])["grafts"][0]["id"] == made["id"]
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert len({c.id for c in chunks}) == 1


def test_chat_uses_the_plain_fallback_prompt_and_streams_the_same_text(served: Served) -> None:
    messages: Any = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi"}]
    extra = {"kvgraft": {"retrieve": False}}
    chat = served.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, extra_body=extra)
    plain = bare(served, "system: Be brief.\nuser: Say hi\nassistant:", max_tokens=10)
    assert chat.object == "chat.completion"
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == plain.choices[0].text
    assert kv(chat)["receipt_id"] == kv(plain)["receipt_id"]
    stream = served.client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=10, stream=True, extra_body=extra
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == chat.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == chat.choices[0].finish_reason
    assert chunks[-1].object == "chat.completion.chunk"


def test_stop_strings_cut_streamed_and_whole_text_alike(served: Served) -> None:
    prompt = "Counting: a a a a a"
    whole = bare(served, prompt, max_tokens=24)
    text = whole.choices[0].text
    stop = text[3:5] if len(text) >= 5 else "a"
    cut = bare(served, prompt, max_tokens=24, stop=[stop])
    streamed = served.client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=24, stop=[stop], stream=True, extra_body={"kvgraft": {"retrieve": False}}
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == cut.choices[0].text
    assert stop not in cut.choices[0].text


# --- grafting through extra_body --------------------------------------------------------------------------------


def test_default_retrieval_grafts_the_best_matching_graft(served: Served) -> None:
    made = served.graft(
        "Zebras graze the savanna at dawn, and the herd moves on at noon.",
        {"title": "zebra notes", "summary": "zebras savanna herd grazing"},
    )
    reply = served.client.completions.create(model=MODEL, prompt=" Where do zebras graze?", max_tokens=4)
    info = kv(reply)
    assert [(g["id"], g["source"]) for g in info["grafts"]] == [(made["id"], "retrieval")]
    top = info["retrieval"][0]
    assert top["graft_id"] == made["id"] and top["used"] is True and top["skipped"] is None and top["score"] > 0
    assert top["label"] == "summary" and 0 < top["match"] <= 1

    gated = served.client.completions.create(
        model=MODEL, prompt=" Where do zebras graze?", max_tokens=4, extra_body={"kvgraft": {"min_score": 1e6}}
    )
    assert kv(gated)["grafts"] == []
    assert kv(gated)["retrieval"][0]["skipped"] == "score below min_score 1000000.0"

    off = served.client.completions.create(
        model=MODEL, prompt=" Where do zebras graze?", max_tokens=4, extra_body={"kvgraft": {"retrieve": False}}
    )
    assert kv(off)["grafts"] == [] and kv(off)["retrieval"] == []


def test_several_grafts_compose_exactly_as_a_chain_and_approximately_on_request(served: Served) -> None:
    first = served.graft("Alice keeps the red key in the blue box. " * 2)
    reply = served.http.post("/v1/grafts", json={"text": " Bob keeps the green key.", "after": first["id"]})
    assert reply.status_code == 201, reply.text
    chained = reply.json()
    other = served.graft("Carol keeps the gold key under the mat. " * 2)

    chain = served.client.completions.create(
        model=MODEL, prompt=" Who?", max_tokens=4, extra_body={"kvgraft": {"grafts": [first["id"], chained["id"]]}}
    )
    info = kv(chain)
    assert (info["exact"], info["approximate"]) == (True, False)
    assert [g["id"] for g in info["grafts"]] == [first["id"], chained["id"]]
    receipt = served.http.get(info["receipt_url"]).json()
    assert receipt["composition"] == {"mode": "chain", "grafts": [first["id"], chained["id"]]}
    assert verify_receipt(served.engine, parse_receipt(json.dumps(receipt), "served")).exact

    with pytest.raises(openai.BadRequestError) as caught:
        served.client.completions.create(
            model=MODEL, prompt=" Who?", max_tokens=4, extra_body={"kvgraft": {"grafts": [first["id"], other["id"]]}}
        )
    assert caught.value.body["code"] == "composition_refused" and caught.value.body["param"] == "kvgraft.grafts"
    assert caught.value.body["message"] == (
        f"graft {other['id'][:12]} does not begin with the tokens of graft {first['id'][:12]} (position 1 in the "
        'list), so the grafts are not one chain; build them as one chain (POST /v1/grafts with "after"), or set '
        "kvgraft.approximate to true"
    )

    approx = served.client.completions.create(
        model=MODEL,
        prompt=" Who?",
        max_tokens=4,
        extra_body={"kvgraft": {"grafts": [first["id"], other["id"]], "approximate": True}},
    )
    info = kv(approx)
    assert (info["exact"], info["approximate"]) == (False, True)
    receipt = served.http.get(info["receipt_url"]).json()
    assert receipt["approximate"] is True and receipt["composition"]["mode"] == "approximate"


def test_an_unknown_graft_is_404(served: Served) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        served.client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=2,
            stream=True,
            extra_body={"kvgraft": {"grafts": ["ab" * 32]}},
        )
    assert caught.value.body == {
        "message": f"no graft {'ab' * 32} in store <store>",
        "type": "not_found_error",
        "param": "kvgraft.grafts",
        "code": "graft_not_found",
    }


# --- receipts ---------------------------------------------------------------------------------------------------


def test_a_fetched_receipt_verifies_with_kvgraft_verify(served: Served, tmp_path: Path) -> None:
    made = served.graft(TEXT + " Receipts.", {"title": "receipt test"})
    reply = served.client.completions.create(
        model=MODEL,
        prompt=" Check me",
        max_tokens=6,
        extra_body={"kvgraft": {"grafts": [made["id"]], "include_receipt": True}},
    )
    info = kv(reply)
    fetched = served.client.get(info["receipt_url"].removeprefix("/v1"), cast_to=object)
    assert fetched == info["receipt"]
    assert fetched["id"] == info["receipt_id"] and fetched["graft_id"] == made["id"]
    on_disk = served.store / "receipts" / f"{info['receipt_id']}.json"
    assert json.loads(on_disk.read_text()) == fetched

    path = tmp_path / "receipt.json"
    path.write_text(json.dumps(fetched))
    result = CliRunner().invoke(cli_app, ["verify", "--receipt", str(path), "--store", str(served.store), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["exact"] is True

    check = verify_receipt(served.engine, parse_receipt(path.read_text(), str(path)))
    assert check.exact and check.tokens_equal and check.logits_equal


# --- the graft library and auth -----------------------------------------------------------------------------------


def test_library_endpoints_and_write_auth(served: Served) -> None:
    anonymous = httpx.Client(base_url=served.url, timeout=30)
    body = {"text": "Library entries are built from text.", "metadata": {"title": "library test", "kind": "notes"}}
    for reply in (
        anonymous.post("/v1/grafts", json=body),
        anonymous.delete("/v1/grafts/abcd"),
    ):
        assert reply.status_code == 401
        assert reply.headers["www-authenticate"] == 'Bearer realm="kvgraft"'
        assert reply.json() == {
            "error": {
                "message": "missing API key: send 'Authorization: Bearer <key>'",
                "type": "authentication_error",
                "param": None,
                "code": "missing_api_key",
            }
        }
    wrong = anonymous.post("/v1/grafts", json=body, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"

    created = served.http.post("/v1/grafts", json=body)
    assert created.status_code == 201
    graft = created.json()
    assert graft["created"] is True and graft["title"] == "library test" and graft["model"] == MODEL
    again = served.http.post("/v1/grafts", json=body)
    assert again.status_code == 200 and again.json()["id"] == graft["id"] and again.json()["created"] is False

    listed = anonymous.get("/v1/grafts").json()  # reads are open on this server
    assert graft["id"] in [g["id"] for g in listed["data"]] and listed["object"] == "list"
    first = anonymous.get("/v1/grafts", params={"limit": 1}).json()
    assert len(first["data"]) == 1 and first["has_more"] is True
    detail = anonymous.get(f"/v1/grafts/{graft['id'][:10]}").json()
    assert detail["id"] == graft["id"] and detail["manifest"]["metadata"]["title"] == "library test"
    assert detail["tokens"] == len(detail["manifest"]["tokens"]) == len(body["text"]) + 1
    row = {k: v for k, v in graft.items() if k != "created"}  # the same row from the put, the index, the manifest
    assert row["kind"] == "notes" and row["object"] == "graft" and row["bytes"] > 0
    assert next(g for g in listed["data"] if g["id"] == graft["id"]) == row
    assert {k: v for k, v in detail.items() if k != "manifest"} == row

    deleted = served.http.delete(f"/v1/grafts/{graft['id']}")
    assert deleted.status_code == 200
    assert deleted.json() == {"id": graft["id"], "object": "graft.deleted", "deleted": True}
    gone = anonymous.get(f"/v1/grafts/{graft['id']}")
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "not_found"
    assert graft["id"] not in [g["id"] for g in anonymous.get("/v1/grafts").json()["data"]]


def test_health_and_metrics(served: Served) -> None:
    http = httpx.Client(base_url=served.url, timeout=30)
    health = http.get("/health")
    assert health.status_code == 200
    assert health.json() == {"status": "ok", "model": MODEL, "queue_depth": 0, "max_queue": 16}
    bare(served, "metrics", max_tokens=2)
    text = http.get("/metrics")
    assert text.headers["content-type"].startswith("text/plain")
    body = text.text
    assert 'kvgraft_http_requests_total{method="POST",route="/v1/completions",status="200"}' in body
    for name in (
        "kvgraft_http_request_duration_seconds_bucket",
        'kvgraft_tokens_total{kind="completion"}',
        'kvgraft_tokens_total{kind="restored"}',
        'kvgraft_generations_total{graft="none"}',
        "kvgraft_graft_restore_seconds_count",
        "kvgraft_time_to_first_token_seconds_count",
        "kvgraft_queue_depth 0.0",
    ):
        assert name in body, name


# --- the demo model -----------------------------------------------------------------------------------------------


# Two worked problems of the family the demo model was trained on, and a third to ask (hand-written problems in
# another style lead the model off its format: it learned programs as well as worked solutions).
DEMO_PROBLEMS = training_problems(7, 3)
DEMO_BLOCK = "".join(prompt_of(p.text) + p.solution + "\n" for p in DEMO_PROBLEMS[:2])


def test_demo_model_answers_with_a_retrieved_graft(tmp_path: Path) -> None:
    model, tokenizer = cached_model("demo")
    engine = Engine(model, tokenizer, "demo", TEST_CHUNK, LocalStore(tmp_path / "store"))
    with serve_in_thread(create_app(engine, ServerConfig(api_key=KEY))) as server:
        client = OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=60)
        http = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
        summary = " ".join(p.text for p in DEMO_PROBLEMS[:2])
        made = http.post("/v1/grafts", json={"text": DEMO_BLOCK, "metadata": {"summary": summary}}).json()
        question = prompt_of(DEMO_PROBLEMS[2].text)
        grafted = client.completions.create(
            model="demo", prompt=question, max_tokens=80, stop=["\n"], extra_body={"kvgraft": {"include_receipt": True}}
        )
        fresh = client.completions.create(
            model="demo",
            prompt=DEMO_BLOCK + question,
            max_tokens=80,
            stop=["\n"],
            extra_body={"kvgraft": {"retrieve": False, "include_receipt": True}},
        )
        g, f = kv(grafted), kv(fresh)
        assert [(x["id"], x["source"]) for x in g["grafts"]] == [(made["id"], "retrieval")]
        assert g["exact"] is True and grafted.choices[0].finish_reason == "stop"
        assert g["receipt"]["output_tokens"] == f["receipt"]["output_tokens"]
        assert grafted.choices[0].text == fresh.choices[0].text
        assert "Answer:" in grafted.choices[0].text  # the trained model keeps the worked format
        receipt = client.get(g["receipt_url"].removeprefix("/v1"), cast_to=object)
        path = tmp_path / "r.json"
        path.write_text(json.dumps(receipt))
        assert verify_receipt(engine, parse_receipt(path.read_text(), "r.json")).exact

        chat = client.chat.completions.create(
            model="demo", messages=[{"role": "user", "content": "Ada has cards"}], max_tokens=8, stream=True
        )
        chunks = list(chat)
        assert chunks[-1].choices[0].finish_reason in ("stop", "length")
        assert kv(chunks[-1])["grafts"][0]["id"] == made["id"]


def test_random_gemma4_grafted_chat_and_completion_are_exact(tmp_path: Path) -> None:
    """Sliding-window and KV-shared layers, through the wire: a graft longer than the window restores exactly."""
    model, tokenizer = cached_model("random:gemma4")
    engine = Engine(model, tokenizer, "random:gemma4", TEST_CHUNK, LocalStore(tmp_path / "store"))
    with serve_in_thread(create_app(engine, ServerConfig(api_key=KEY))) as server:
        client = OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=60)
        http = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
        made = http.post("/v1/grafts", json={"text": TEXT}).json()
        assert made["aligned_tokens"] > 32  # past random:gemma4's 32-token sliding window
        messages: Any = [{"role": "user", "content": "Go on"}]
        grafted = client.chat.completions.create(
            model="random:gemma4",
            messages=messages,
            max_tokens=10,
            extra_body={"kvgraft": {"grafts": [made["id"]], "include_receipt": True}},
        )
        fresh = client.completions.create(
            model="random:gemma4",
            prompt=TEXT + "user: Go on\nassistant:",
            max_tokens=10,
            extra_body={"kvgraft": {"retrieve": False, "include_receipt": True}},
        )
        g, f = kv(grafted), kv(fresh)
        assert g["grafts"][0]["id"] == made["id"] and g["exact"] is True
        assert g["receipt"]["output_tokens"] == f["receipt"]["output_tokens"]
        assert g["receipt"]["logits_chain_sha256"] == f["receipt"]["logits_chain_sha256"]
        assert grafted.choices[0].message.content == fresh.choices[0].text
