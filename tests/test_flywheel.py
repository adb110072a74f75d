"""Harvest, library and ladder mechanics on a random model (fast); the demo model's figures are in test_demo."""

from __future__ import annotations

from kvgraft.engine.verify import verify_graft
from kvgraft.flywheel.bench import Gate, run_ladder, summarize
from kvgraft.flywheel.datasets import Item, load_dataset
from kvgraft.flywheel.harvest import build_blocks, import_solutions, replay_text
from kvgraft.flywheel.problems import prompt_of
from kvgraft.library.library import Library, jaccard

from conftest import EngineFactory


def _exam(n: int) -> list[Item]:
    return load_dataset("demo")[:n]


def test_import_stores_only_verified_solutions(make_engine: EngineFactory) -> None:
    engine = make_engine("random:gemma4")
    items = _exam(4)
    wrong = Item("bad", items[0].problem + " (variant)", str(int(items[0].answer) + 1), items[0].solution)
    records = import_solutions(engine, [*items, wrong])
    assert [r.verified for r in records] == [True, True, True, True, False]
    assert records[-1].graft_id is None
    stored = {engine.store.manifest(g).metadata["problem_id"] for g in engine.store.ids()}
    assert stored == {item.id for item in items}
    manifest = engine.store.manifest(records[0].graft_id or "")
    assert manifest.metadata["kind"] == "replay" and manifest.metadata["answer"] == items[0].answer
    assert engine.tokenizer.decode(manifest.tokens, skip_special_tokens=True) == replay_text(
        items[0], items[0].solution or ""
    )
    assert verify_graft(engine, manifest.id).exact


def test_library_finds_replays_by_prompt_hash_and_blocks_by_bm25(make_engine: EngineFactory) -> None:
    engine = make_engine("random:gemma4")
    items = _exam(8)
    records = import_solutions(engine, items[:5])
    blocks = build_blocks(engine, records, items)
    assert len(blocks) == 1
    library = Library.from_store(engine.store)
    for item, record in zip(items[:5], records, strict=True):
        assert library.find_replay(engine.encode_context(prompt_of(item.problem))) == record.graft_id
        assert library.holds(item.text_sha256)
        hit = library.search_blocks(item.problem, k=1)[0]
        assert (hit.graft_id, hit.problem_id, hit.match) == (blocks[0], item.id, 1.0)
    for item in items[5:]:
        assert library.find_replay(engine.encode_context(prompt_of(item.problem))) is None
        assert not library.holds(item.text_sha256)
        assert library.search_blocks(item.problem, k=1)[0].match < 0.9
    assert jaccard("Ada has 5 pens.", "ada has 5 pens") == 1.0


def test_ladder_tags_seen_and_unseen_and_verifies_receipts(make_engine: EngineFactory) -> None:
    engine = make_engine("random:gemma4")
    items = _exam(6)
    records = import_solutions(engine, items[:3])
    build_blocks(engine, records, items)
    results, facts = run_ladder(engine, items, Library.from_store(engine.store), budget=8)
    assert [r.seen for r in results] == [True, True, True, False, False, False]
    assert [r.grafted.path for r in results] == ["replay"] * 3 + ["block"] * 3
    assert all(r.grafted.decode_tokens <= 8 for r in results)
    assert facts["receipts"] == {"total": 6, "verified": 6}
    summary = summarize(results, 8, facts, Gate())
    assert summary["rungs"]["bare"]["seen"]["n"] == 3 and summary["rungs"]["bare"]["unseen"]["n"] == 3
    assert summary["rungs"]["gated"]["all"]["n"] == 6
    assert summary["upstream"]["grafts_used"] == 3
