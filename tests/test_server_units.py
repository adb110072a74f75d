"""Server parts that need no server: chat prompts, streamed text, the worker queue, receipts on disk."""

from __future__ import annotations

import asyncio
import copy
import json
import threading
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvgraft.core.errors import BadInputError, EnvironmentMismatchError, NotAChainError, NotFoundError
from kvgraft.core.sampling import SamplingParams
from kvgraft.engine.engine import Engine
from kvgraft.format.receipt import parse_receipt
from kvgraft.models.byte_tokenizer import BOS_ID, EOS_ID, build_byte_tokenizer
from kvgraft.server.errors import from_kvgraft
from kvgraft.server.grafting import LibraryView
from kvgraft.server.prompts import TextStream, chat_prompt
from kvgraft.server.receipts import DirectoryShelf, ReceiptBook
from kvgraft.server.worker import ModelWorker, QueueFullError, WorkerUnavailableError
from kvgraft.store import LocalStore

from conftest import TEST_CHUNK, cached_model

TOKENIZER = build_byte_tokenizer()


def tokens_of(data: bytes) -> list[int]:
    return [3 + b for b in data]


def test_chat_without_a_template_uses_the_plain_fallback() -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert chat_prompt(TOKENIZER, messages) == "system: Be brief.\nuser: Hi\nassistant:"


def test_chat_with_a_template_renders_it_with_one_bos() -> None:
    tokenizer = copy.deepcopy(TOKENIZER)
    tokenizer.chat_template = (
        "{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    text = chat_prompt(tokenizer, [{"role": "user", "content": "Hi"}])
    assert text == "<user>Hi<assistant>"
    assert tokenizer(text)["input_ids"][0] == BOS_ID and tokenizer(text)["input_ids"].count(BOS_ID) == 1


def test_stream_holds_back_unfinished_characters() -> None:
    stream = TextStream(TOKENIZER, ())
    euro = "€".encode()
    assert [stream.push(t) for t in tokens_of(b"a" + euro)] == ["a", "", "", "€"]
    assert stream.finish("a€") == ""


def test_stream_never_sends_a_stop_string_or_what_follows() -> None:
    stream = TextStream(TOKENIZER, ("STOP",))
    sent = "".join(stream.push(t) for t in tokens_of(b"abcST"))
    assert sent == "ab"  # "cST" could still begin "STOP"
    sent += "".join(stream.push(t) for t in tokens_of(b"OP"))
    assert sent + stream.finish("abc") == "abc"


@settings(max_examples=200, deadline=None)
@given(
    data=st.lists(
        st.sampled_from([*b"ab \n", 0xE2, 0x82, 0xAC, 0xF0, 0x9F, 0x98, 0x80, 0xFF]),
        max_size=24,
    ),
    stops=st.lists(st.sampled_from(["a", "b\n", "ab", "\u20ac", "zz"]), max_size=3),
    eos=st.booleans(),
)
def test_streamed_deltas_always_add_up_to_the_final_text(data: list[int], stops: list[str], eos: bool) -> None:
    """Whatever bytes come (broken UTF-8 included), the deltas are a prefix of the final text and, with `finish`,
    exactly it; the final text is what decoding cuts at the first stop, as kvgraft.core.decode does."""
    tokens = tokens_of(bytes(data)) + ([EOS_ID] if eos else [])
    stream = TextStream(TOKENIZER, tuple(stops))
    sent = ""
    produced: list[int] = []
    for token in tokens:
        produced.append(token)
        sent += stream.push(token)
        text = TOKENIZER.decode(produced, skip_special_tokens=True)
        if any(s in text for s in stops):
            break  # decoding stops at the first token that completes a stop string
    final = TOKENIZER.decode(produced, skip_special_tokens=True)
    cuts = [final.find(s) for s in stops if s in final]
    final = final[: min(cuts)] if cuts else final
    assert final.startswith(sent)
    assert sent + stream.finish(final) == final


def test_the_worker_runs_jobs_in_order_and_refuses_when_full() -> None:
    model, tokenizer = cached_model("random:llama")
    engine = Engine(model, tokenizer, "random:llama", TEST_CHUNK)
    worker = ModelWorker(engine, max_queue=2)
    hold = threading.Event()
    order: list[int] = []

    async def scenario() -> None:
        worker.start()
        blocked = worker.submit(lambda _: hold.wait(10))
        while worker.depth:  # the worker took the blocking job
            await asyncio.sleep(0.005)
        first = worker.submit(lambda _: order.append(1))
        second = worker.submit(lambda _: order.append(2))
        with pytest.raises(QueueFullError):
            worker.submit(lambda _: order.append(3))
        cancelled = second
        cancelled.cancel()  # cancelled while waiting: never runs
        hold.set()
        await blocked.future
        await first.future
        assert order == [1]
        failing = worker.submit(lambda _: 1 // 0)
        with pytest.raises(ZeroDivisionError):
            await failing.future
        assert await worker.run(lambda e: e.model_name) == "random:llama"  # it outlived the failure
        worker.close()
        with pytest.raises(WorkerUnavailableError):
            worker.submit(lambda _: None)

    asyncio.run(scenario())
    assert order == [1]


def test_receipts_are_kept_in_memory_and_on_disk(tmp_path: Path) -> None:
    model, tokenizer = cached_model("random:llama")
    engine = Engine(model, tokenizer, "random:llama", TEST_CHUNK)
    receipts = [engine.generate(f"text {i}", params=SamplingParams(max_new_tokens=2)).receipt for i in range(3)]
    book = ReceiptBook(DirectoryShelf(tmp_path / "receipts"), capacity=2)
    ids = [book.add(r) for r in receipts]
    assert ids == [r.id for r in receipts]
    assert book.get(ids[0]) == receipts[0].to_json()  # evicted from memory, read back from disk
    for receipt_id in ids:
        path = tmp_path / "receipts" / f"{receipt_id}.json"
        assert parse_receipt(path.read_text(), str(path)).id == receipt_id
    (tmp_path / "receipts" / f"{ids[0]}.json").write_text(json.dumps(receipts[0].to_json() | {"model_name": "edited"}))
    memory_only = ReceiptBook(DirectoryShelf(tmp_path / "receipts"), capacity=2)
    with pytest.raises(NotFoundError, match="unreadable"):
        memory_only.get(ids[0])  # an edited file is never served
    with pytest.raises(BadInputError):
        book.get("../../etc/passwd")


def test_the_library_view_rebuilds_only_when_the_store_changed(tmp_path: Path) -> None:
    model, tokenizer = cached_model("random:llama")
    engine = Engine(model, tokenizer, "random:llama", TEST_CHUNK, LocalStore(tmp_path / "store"))
    view = LibraryView(engine.store, refresh_s=3600)
    assert view.get().library.search("zebras", 3) == []
    first = view.get()
    assert view.get() is first  # nothing changed: the same index, not rebuilt
    made = engine.put("Zebras graze at dawn.")  # as another process would: the view is not told
    assert [h.graft_id for h in view.get().library.search("zebras", 3)] == [made.id]
    engine.store.delete(made.id)
    assert view.get().library.search("zebras", 3) == []


def test_the_server_adds_its_own_hint_to_core_errors() -> None:
    """Core errors name no remedy; the server appends the one a client has, keeping code and status."""
    mismatch = from_kvgraft(EnvironmentMismatchError("numeric environment differs (graft vs this run: threads)"))
    assert (mismatch.status, mismatch.code) == (400, "environment_mismatch")
    assert mismatch.message == (
        "numeric environment differs (graft vs this run: threads); the server does not allow environment mismatches "
        "(started without --allow-env-mismatch)"
    )
    refused = from_kvgraft(NotAChainError("the grafts are not one chain"), "kvgraft.grafts")
    assert (refused.status, refused.code, refused.param) == (400, "bad_input", "kvgraft.grafts")
    assert refused.message == (
        'the grafts are not one chain; build them as one chain (POST /v1/grafts with "after"), or set '
        "kvgraft.approximate to true"
    )
    plain = from_kvgraft(BadInputError("prompt is empty"))
    assert plain.message == "prompt is empty"  # no hint where the server has none
