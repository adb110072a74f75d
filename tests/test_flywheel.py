"""Harvest, library and ladder mechanics on a random model (fast); the demo model's figures are in test_demo."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvgraft.core.errors import BadInputError
from kvgraft.core.hashing import sha256_token_ids
from kvgraft.engine.verify import verify_graft
from kvgraft.flywheel.bench import (
    Answer,
    AnswerPath,
    Gate,
    LadderFacts,
    LadderOptions,
    ProblemResult,
    ReceiptTally,
    Rung,
    Split,
    Tally,
    Upstream,
    run_ladder,
    summarize,
)
from kvgraft.flywheel.datasets import Item, load_dataset
from kvgraft.flywheel.energy import EnergyReading
from kvgraft.flywheel.harvest import HarvestRecord, HarvestSummary, build_blocks, import_solutions, replay_text
from kvgraft.flywheel.problems import prompt_of
from kvgraft.flywheel.prompting import PlainPrompter
from kvgraft.flywheel.sandbox import SandboxLimits
from kvgraft.flywheel.stats import mean_interval, wilson_interval
from kvgraft.format.metadata import GraftKind, GraftMetadata, HarvestCost, SolutionSource
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
    # The metadata a replay graft's id hashes: exactly these keys and values (graft ids must never change).
    assert manifest.metadata == {
        "kind": "replay",
        "problem_id": items[0].id,
        "problem_sha256": items[0].text_sha256,
        "prompt_tokens_sha256": sha256_token_ids(engine.encode_context(prompt_of(items[0].problem))),
        "answer": items[0].answer,
        "solution": items[0].solution,
        "source": "imported",
        "cost": {"attempts": 0, "tokens_generated": 0},
        "summary": replay_text(items[0], items[0].solution or ""),
    }
    read = GraftMetadata.read(manifest.metadata)
    assert read.kind is GraftKind.REPLAY and read.cost == HarvestCost(attempts=0, tokens_generated=0)
    assert [(p.id, p.problem_sha256, p.text) for p in read.problems] == [(items[0].id, items[0].text_sha256, None)]
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
    problems = [{"id": i.id, "problem_sha256": i.text_sha256, "text": i.problem} for i in items[:5]]
    block_text = "".join(prompt_of(i.problem) + (i.solution or "") + "\n" for i in items[:5])
    assert engine.store.manifest(blocks[0]).metadata == {"kind": "block", "problems": problems, "summary": block_text}
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
    assert [r.grafted.path for r in results] == [AnswerPath.REPLAY] * 3 + [AnswerPath.BLOCK] * 3
    assert all(r.grafted.decode_tokens <= 8 for r in results)
    assert all(r.grafted.receipt_verified is True for r in results)
    used = [r.upstream.graft_id if r.upstream else None for r in results]
    assert used == [record.graft_id for record in records] + [None, None, None]
    assert facts.receipts == ReceiptTally(total=6, verified=6)
    summary = summarize(results, 8, facts, Gate())
    assert summary.cell(Rung.BARE, Split.SEEN).n == 3 and summary.cell(Rung.BARE, Split.UNSEEN).n == 3
    assert summary.cell(Rung.GATED, Split.ALL).n == 6
    assert summary.upstream.grafts_used == 3 and summary.upstream.harvest_tokens == 0  # imported: no cost
    data = summary.to_json()
    assert data["receipts"] == {"total": 6, "verified": 6} and data["token_budget_total"] == 48
    assert [p["grafted"]["path"] for p in data["problems"]] == ["replay"] * 3 + ["block"] * 3


def _answer(path: AnswerPath, correct: bool, tokens: int, error: str | None = None, **kw: object) -> Answer:
    return Answer(
        path=path,
        answer="1" if correct else "2",
        correct=correct,
        decode_tokens=tokens,
        ttft_s=0.5,
        wall_s=1.0,
        confidence=0.75,
        error=error,
        **kw,  # type: ignore[arg-type]
    )


def test_summary_json_has_the_documented_shape_and_figures() -> None:
    bare = AnswerPath.BARE
    seen = ProblemResult(
        id="a",
        seen=True,
        gold="1",
        bare=_answer(bare, False, 40),
        grafted=_answer(AnswerPath.REPLAY, True, 2, graft_id="g", score=1.0, receipt_id="r", receipt_verified=True),
        gate_passed=True,
        block_own=_answer(AnswerPath.BLOCK, True, 10, graft_id="b", score=1.0),
        upstream=Upstream(graft_id="g", cost=HarvestCost(attempts=3, tokens_generated=90, wall_s=1.25)),
    )
    unseen = ProblemResult(
        id="b", seen=False, gold="1", bare=_answer(bare, True, 20), grafted=_answer(bare, True, 20), gate_passed=False
    )
    failed = ProblemResult(
        id="c",
        seen=False,
        gold="1",
        bare=_answer(bare, False, 0, "too long"),
        grafted=_answer(bare, False, 0, "too long"),
        gate_passed=False,
    )
    facts = LadderFacts(
        wall_s=3.0, energy=EnergyReading(joules=None, source="off"), receipts=ReceiptTally(total=1, verified=1)
    )
    harvest = HarvestSummary.of(
        [
            HarvestRecord(
                problem_id="a",
                problem_sha256="s",
                verified=True,
                attempts=3,
                tokens_generated=90,
                wall_s=1.25,
                build_s=0.5,
                graft_id="g",
                solution="x",
                source=SolutionSource.MODEL,
            )
        ],
        ["b"],
        2.0,
    )
    summary = summarize([seen, unseen, failed], 40, facts, Gate(min_match=0.5))
    data = summary.to_json()
    assert list(data) == [
        "budget", "token_budget_total", "gate", "rungs", "bare_over_rung_decode_tokens", "block_own_solution",
        "upstream", "energy", "wall_s", "receipts", "errors", "problems",
    ]  # fmt: skip
    assert data["gate"] == {"min_match": 0.5, "min_confidence": 0.5} and data["token_budget_total"] == 120
    assert data["rungs"]["grafted"]["seen"] == {
        "n": 1, "correct": 1, "accuracy": 1.0, "ci95": list(wilson_interval(1, 1)),
        "decode_tokens_mean": 2.0, "decode_tokens_total": 2, "ttft_s_mean": 0.5, "wall_s": 1.0,
    }  # fmt: skip
    assert data["rungs"]["bare"]["all"]["correct"] == 1 and data["rungs"]["bare"]["all"]["decode_tokens_total"] == 60
    assert data["rungs"]["gated"]["all"]["correct"] == 2 and data["rungs"]["gated"]["unseen"]["n"] == 2
    assert data["bare_over_rung_decode_tokens"]["seen"] == {"grafted": 20.0, "gated": 20.0}
    assert data["bare_over_rung_decode_tokens"]["all"]["grafted"] == pytest.approx(60 / 22)
    assert data["block_own_solution"] == {
        "n": 1, "correct": 1, "accuracy": 1.0, "ci95": list(wilson_interval(1, 1)), "decode_tokens_mean": 10.0,
    }  # fmt: skip
    assert data["upstream"] == {
        "grafts_used": 1, "harvest_tokens": 90, "harvest_wall_s": 1.25, "uses_per_graft": 1,
        "amortized_tokens_per_use": 90.0, "seen_grafted_tokens_including_upstream": 92, "seen_bare_tokens": 40,
    }  # fmt: skip
    assert data["errors"] == 2 and data["receipts"] == {"total": 1, "verified": 1}
    assert data["problems"][0]["gated"] == data["problems"][0]["grafted"]
    assert data["problems"][0]["upstream"] == {"graft_id": "g", "attempts": 3, "tokens_generated": 90, "wall_s": 1.25}
    assert data["problems"][1]["upstream"] == {} and data["problems"][1]["block_own"] is None
    labelled = replace(summary, model="m", dataset="d", harvest=harvest, report="/r.md").to_json()
    assert list(labelled)[-4:] == ["model", "dataset", "harvest", "report"]
    assert labelled["upstream"]["harvest_all"] == {
        "problems_tried": 1, "verified": 1, "attempts": 3, "tokens_generated": 90, "wall_s": 2.0,
    }  # fmt: skip
    assert labelled["harvest"]["replay_grafts"] == ["g"] and labelled["harvest"]["blocks"] == ["b"]


def test_code_rung_runs_each_program_in_the_sandbox_and_counts_outcomes(make_engine: EngineFactory) -> None:
    engine = make_engine("random:gemma4")
    items = _exam(3)
    records = import_solutions(engine, items[:2])
    build_blocks(engine, records, items)
    options = LadderOptions(budget=6, code=SandboxLimits(wall_s=5.0))
    results, facts = run_ladder(engine, items, Library.from_store(engine.store), options=options)
    codes = [r.code for r in results]
    assert all(c is not None and c.path is AnswerPath.CODE and c.program is not None for c in codes)
    # A random model writes no program worth the name: each is "no answer", counted by how it ended, never raised.
    outcomes = [c.program.outcome for c in codes if c is not None and c.program is not None]
    assert set(outcomes) <= {"no_program", "error", "no_output", "ok"}
    assert all(c is not None and c.receipt_id is not None and c.receipt_verified for c in codes)
    assert facts.receipts.total == facts.receipts.verified == 3 + 3  # the code and grafted answers' receipts
    summary = summarize(results, 6, facts, Gate(), options=options)
    assert summary.rung_order == [Rung.BARE, Rung.CODE, Rung.GRAFTED, Rung.GATED]
    assert sum((summary.code_outcomes or {}).values()) == 3
    assert summary.cell(Rung.CODE, Split.ALL).n == 3
    data = summary.to_json()
    assert list(data["rungs"]) == ["bare", "code", "grafted", "gated"]
    assert data["problems"][0]["code"]["program"]["outcome"] == outcomes[0]
    assert "program" not in data["problems"][0]["bare"]


def test_plain_programs_are_read_from_the_line_the_model_writes() -> None:
    prompter = PlainPrompter()
    assert prompter.code_prompt("Ada has 3 pens. How many pens now?") == "Q:Ada has 3 pens. How many pens now?\nCode:"
    assert prompter.program("print(34+3*5-2)") == "print(34+3*5-2)"
    assert prompter.program("  \n") is None
    assert prompter.program("```python\nx = 2\nprint(x)\n```") == "x = 2\nprint(x)\n"


def test_samples_give_mean_accuracy_an_interval_over_problems_and_pass_at_k(make_engine: EngineFactory) -> None:
    engine = make_engine("random:gemma4")
    items = _exam(3)
    options = LadderOptions(budget=4, samples=2, temperature=0.8)
    results, facts = run_ladder(engine, items, Library.from_store(engine.store), options=options)
    assert [(r.id, r.sample) for r in results] == [(i.id, s) for i in items for s in (0, 1)]
    assert results[0].bare.receipt_id is None and results[0].grafted.path is AnswerPath.BARE
    summary = summarize(results, 4, facts, Gate(), options=options)
    cell = summary.cell(Rung.BARE, Split.ALL)
    assert cell.n == 6 and cell.samples == 2 and len(cell.per_problem_correct) == 3
    assert cell.to_json()["samples"] == 2 and cell.to_json()["problems"] == 3
    with pytest.raises(BadInputError, match="more than one sample needs a temperature above 0"):
        run_ladder(engine, items, Library.from_store(engine.store), options=LadderOptions(samples=2))


def test_tally_with_samples_counts_pass_at_k_and_a_problem_level_interval() -> None:
    def answers(*correct: bool) -> list[Answer]:
        return [_answer(AnswerPath.BARE, c, 1) for c in correct]

    # Three problems, two samples each: right twice, once, never.
    tally = Tally.of(answers(True, True, True, False, False, False), samples=2)
    assert (tally.correct, tally.n, tally.per_problem_correct) == (3, 6, (2, 1, 0))
    assert tally.accuracy == 0.5 and tally.pass_at_k == 2 / 3
    assert tally.ci95 == mean_interval([1.0, 0.5, 0.0])
    assert tally.ci95 == (0.0, 1.0)  # 0.5 +- 1.96 * 0.5 / sqrt(3), clipped to [0, 1]
    low, high = mean_interval([1.0, 0.5, 0.5])
    half = 1.959964 * (1 / 12) ** 0.5 / 3**0.5  # the per-problem values' sample variance is 1/12
    assert (low, high) == (pytest.approx(2 / 3 - half), pytest.approx(2 / 3 + half))
    one = Tally.of(answers(True, False))
    assert one.pass_at_k is None and one.ci95 == wilson_interval(1, 2) and "pass_at_k" not in one.to_json()
    # Every problem at the same accuracy: no spread to measure, so Wilson's interval over problems.
    assert mean_interval([1.0, 1.0, 1.0]) == wilson_interval(3, 3)
    assert mean_interval([]) == (0.0, 1.0)


def test_wilson_interval_holds_the_proportion_at_every_count() -> None:
    # At 4/4, 10/10, 14/14, ... the formula's upper end rounded to 1 - 1e-16, below the accuracy itself: the
    # report's error bars then had a negative length and matplotlib refused to draw the ladder.
    for n in range(1, 301):
        for correct in range(n + 1):
            low, high = wilson_interval(correct, n)
            assert 0.0 <= low <= correct / n <= high <= 1.0
    assert wilson_interval(4, 4)[1] == 1.0 and wilson_interval(0, 4)[0] == 0.0
