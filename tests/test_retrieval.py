"""Retrieval with scores: BM25 by default, a dense retriever from a local sentence-transformers model (built here,
in a temporary directory: nothing is downloaded), over blocks' problems and every other graft's summary or title."""

from __future__ import annotations

import json
import re
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvgraft.cli import app
from kvgraft.core.errors import BadInputError
from kvgraft.flywheel.datasets import Item, load_dataset
from kvgraft.format.metadata import SUMMARY_CHARS
from kvgraft.library.index import INDEX_NAME, INDEX_VERSION, load_index
from kvgraft.library.library import Library
from kvgraft.library.retrieval import BM25Retriever, DenseRetriever, make_retriever
from kvgraft.store import LocalStore

from conftest import EngineFactory

BLOCKS, PER_BLOCK = 4, 3
PLAIN = {
    "tide": "The tide tables for the harbour list high water twice a day, about twelve hours apart.",
    "bread": "Sourdough bread rises slowly because wild yeast ferments the flour over a whole night.",
    "comet": "A comet's tail always points away from the sun, pushed by the solar wind and light.",
}


def _problems() -> list[Item]:
    return load_dataset("demo")[: BLOCKS * PER_BLOCK]


def _put_blocks(make_engine: EngineFactory, items: list[Item]) -> list[str]:
    """Context blocks of PER_BLOCK problems each (the graft text is short: retrieval reads the metadata)."""
    engine = make_engine()
    ids = []
    for b in range(BLOCKS):
        chosen = items[b * PER_BLOCK : (b + 1) * PER_BLOCK]
        problems = [{"id": i.id, "problem_sha256": i.text_sha256, "text": i.problem} for i in chosen]
        ids.append(engine.put(f"block {b}", metadata={"kind": "block", "problems": problems}).id)
    return ids


def _put_plain(make_engine: EngineFactory) -> dict[str, str]:
    engine = make_engine()
    return {name: engine.put(text, metadata={"summary": text}).id for name, text in PLAIN.items()}


def test_bm25_ranks_a_problems_own_block_first_with_sorted_scores(
    make_engine: EngineFactory, store: LocalStore
) -> None:
    items = _problems()
    blocks = _put_blocks(make_engine, items)
    library = Library.from_store(store)
    assert library.retriever.name == "bm25"
    for n, item in enumerate(items):
        hits = library.search_blocks(item.problem, k=3)
        assert 1 <= len(hits) <= 3
        assert (hits[0].graft_id, hits[0].problem_id, hits[0].match) == (blocks[n // PER_BLOCK], item.id, 1.0)
        scores = [h.score for h in hits]
        assert scores == sorted(scores, reverse=True) and scores[0] > 0.0
        assert len({h.graft_id for h in hits}) == len(hits)  # one hit per block, its best problem


def test_bm25_retriever_scores_only_documents_sharing_a_term() -> None:
    retriever = BM25Retriever()
    assert retriever.search("anything", 3) == []
    retriever.index([("a", "Ada has 5 pens"), ("b", "Bob has 3 cats"), ("c", "zed eats")])
    hits = retriever.search("ada pens 5", 10)
    assert [key for key, _ in hits] == ["a"] and hits[0][1] > 0.0
    assert [key for key, _ in retriever.search("has", 10)] == ["a", "b"]  # equal scores: corpus order
    assert retriever.search("nothing shared", 10) == [] and retriever.search("", 10) == []


def test_index_entries_carry_summaries_and_search_finds_plain_text_grafts(
    make_engine: EngineFactory, store: LocalStore
) -> None:
    items = _problems()
    blocks = _put_blocks(make_engine, items)
    plain = _put_plain(make_engine)
    engine = make_engine()
    # Engine.build makes the text's start the summary unless the metadata sets one; an empty one opts out.
    titled = engine.put(
        "A note kept only by its title.", metadata={"title": "lighthouse keeper logbook", "summary": ""}
    ).id
    untitled = engine.put("Nothing to find this one by.", metadata={"summary": ""}).id
    default = engine.put("A plain note with no metadata at all.").id
    long_summary = engine.put("Long.", metadata={"summary": "x" * (SUMMARY_CHARS + 500)}).id

    entries = load_index(store)
    assert all(entries[gid].summary == PLAIN[name] for name, gid in plain.items())
    assert entries[titled].summary is None and entries[titled].retrieval_texts() == [
        ("title", "lighthouse keeper logbook")
    ]
    assert entries[untitled].retrieval_texts() == []
    assert entries[default].retrieval_texts() == [("summary", "A plain note with no metadata at all.")]
    assert len(entries[long_summary].summary or "") == SUMMARY_CHARS
    assert [label for label, _ in entries[blocks[0]].retrieval_texts()] == [i.id for i in items[:PER_BLOCK]]

    library = Library.from_store(store)
    for name, gid in plain.items():
        hits = library.search(PLAIN[name], k=3)
        assert (hits[0].graft_id, hits[0].label, hits[0].match) == (gid, "summary", 1.0)  # its own words, all
        assert [h.score for h in hits] == sorted((h.score for h in hits), reverse=True)
    assert library.search("harbour tide water", k=1)[0].graft_id == plain["tide"]
    # "lighthouse keeper logbook": 2 of the 3 words, and no other
    assert [(h.graft_id, h.label, h.match) for h in library.search("lighthouse logbook", k=2)] == [
        (titled, "title", 2 / 3)
    ]
    hit = library.search(items[4].problem, k=1)[0]
    assert (hit.graft_id, hit.label) == (blocks[1], items[4].id)
    # blocks alone are what search_blocks ranks: plain grafts never come back from it
    assert {h.graft_id for h in library.search_blocks(PLAIN["comet"], k=10)} <= set(blocks)
    assert all(h.graft_id != untitled for h in library.search("Nothing to find this one by", k=10))


def test_an_index_of_the_previous_version_is_rebuilt_with_summaries(
    make_engine: EngineFactory, store: LocalStore
) -> None:
    plain = _put_plain(make_engine)
    current = load_index(store)
    old = {
        "index_version": 1,
        "grafts": [{k: v for k, v in asdict(e).items() if k != "summary"} for e in current.values()],
    }
    (store.root / INDEX_NAME).write_text(json.dumps(old))
    assert load_index(store) == current
    assert json.loads((store.root / INDEX_NAME).read_text())["index_version"] == INDEX_VERSION == 3
    assert Library.from_store(store).search(PLAIN["bread"], k=1)[0].graft_id == plain["bread"]


# --- the dense retriever, on a tiny sentence-transformers model made here --------------------------------------


@pytest.fixture(scope="module")
def dense_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A randomly initialised 1-layer BERT with a WordPiece vocabulary of the test texts, saved locally; loaded by
    sentence-transformers from that directory (mean pooling)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("sentence_transformers")
    from transformers import BertConfig, BertModel, BertTokenizerFast

    path = tmp_path_factory.mktemp("dense-model")
    texts = [i.problem for i in _problems()] + list(PLAIN.values())
    vocab = sorted({t for text in texts for t in re.findall(r"\w+|[^\w\s]", text.lower())})
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *vocab]
    tokenizer = BertTokenizerFast(vocab={word: n for n, word in enumerate(words)})
    assert "[UNK]" not in tokenizer.tokenize(texts[0])
    tokenizer.save_pretrained(str(path))
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=len(words),
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=256,
    )
    BertModel(config).save_pretrained(str(path))
    return path


def test_dense_retriever_ranks_an_exact_duplicate_first_with_cosine_one(dense_model: Path) -> None:
    retriever = make_retriever(str(dense_model))
    assert isinstance(retriever, DenseRetriever) and retriever.name == f"dense:{dense_model}"
    docs = [(i.id, i.problem) for i in _problems()] + list(PLAIN.items())
    retriever.batch_size = 4  # the corpus is encoded in several batches
    retriever.index(docs)
    for key, text in docs:
        hits = retriever.search(text, k=5)
        assert len(hits) == 5 and hits[0][0] == key
        assert hits[0][1] == pytest.approx(1.0, abs=1e-5)
        scores = [s for _, s in hits]
        assert scores == sorted(scores, reverse=True) and all(-1.0 - 1e-5 <= s <= 1.0 + 1e-5 for s in scores)
    assert retriever.empty().search("anything", 3) == []


def test_library_with_the_dense_retriever(dense_model: Path, make_engine: EngineFactory, store: LocalStore) -> None:
    items = _problems()
    blocks = _put_blocks(make_engine, items)
    plain = _put_plain(make_engine)
    library = Library.from_store(store, retriever=str(dense_model))
    for n, item in enumerate(items):
        hit = library.search_blocks(item.problem, k=2)[0]
        assert (hit.graft_id, hit.problem_id) == (blocks[n // PER_BLOCK], item.id)
        assert hit.score == pytest.approx(1.0, abs=1e-5)
    for name, gid in plain.items():
        hit = library.search(PLAIN[name], k=2)[0]
        assert (hit.graft_id, hit.label) == (gid, "summary") and hit.score == pytest.approx(1.0, abs=1e-5)


def test_dense_retriever_refuses_what_is_not_a_local_directory(tmp_path: Path) -> None:
    with pytest.raises(BadInputError) as caught:
        DenseRetriever("/nonexistent/model")
    assert str(caught.value) == (
        "dense model /nonexistent/model: not a local directory "
        "(give a sentence-transformers model directory; kvgraft never downloads one)"
    )
    a_file = tmp_path / "model.bin"
    a_file.write_bytes(b"")
    with pytest.raises(BadInputError, match="not a local directory"):
        make_retriever(str(a_file))
    with pytest.raises(BadInputError, match="not a local directory"):
        Library.from_store(LocalStore(tmp_path / "store"), retriever="sentence-transformers/all-MiniLM-L6-v2")
    with pytest.raises(BadInputError, match=r"^dense model .*: cannot load it \(.+\)$"):
        DenseRetriever(tmp_path)  # a directory, but no model in it


def test_dense_retriever_without_sentence_transformers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "sentence_transformers", None)
    with pytest.raises(BadInputError) as caught:
        DenseRetriever(tmp_path)
    assert str(caught.value) == "the dense retriever needs sentence-transformers: pip install 'kvgraft[dense]'"


def test_cli_bench_refuses_a_dense_model_that_is_not_a_directory(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        app, ["bench", "--dense-model", "/nonexistent", "--store", str(tmp_path / "store"), "--json"]
    )
    assert result.exit_code == 1, result.output
    assert result.stdout == "" and "Traceback" not in result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: dense model /nonexistent: not a local directory"), lines


def test_a_library_reads_back_from_its_packed_form() -> None:
    # from_store repacks what it keeps (JSON of its own lookups and documents) once the index parse is freed.
    library = Library(
        replay_by_prompt={"p" * 64: "g1" * 32},
        replay_problems={"s" * 64: "g1" * 32},
        replay_by_format={("plain", "s" * 64): "g1" * 32, ("chat", "s" * 64): "g2" * 32},
        block_entries=[
            ("b1" * 32, "lib-1-0", "What is 2+2?"),
            ("b1" * 32, "lib-1-1", "Ünïcode ∑, 数学"),
            ("b2" * 32, "x", ""),
        ],
        other_entries=[("g3" * 32, "summary", "A note.")],
    )
    retriever = make_retriever()
    copy = Library._unpacked(library._packed(), retriever)
    assert copy.retriever is retriever
    for name in ("replay_by_prompt", "replay_problems", "replay_by_format", "block_entries", "other_entries"):
        assert getattr(copy, name) == getattr(library, name)
    assert copy.block_entries[0][0] is copy.block_entries[1][0]  # a block's graft id is held once
