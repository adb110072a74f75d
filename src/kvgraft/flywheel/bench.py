"""The evaluation ladder: bare, grafted and gated answers, each problem tagged seen or unseen.

- bare: the model alone, greedy, under the token budget.
- grafted: the problem's replay graft when the query's prompt tokens equal a graft's prompt (found by hash; only
  the answer is decoded: this is replay, and is called so), else the best retrieved context block restored at
  position 0 before the problem, else bare.
- gated: the grafted answer only when its retrieval score and the model's own answer confidence pass
  thresholds, else the bare answer.
A problem is seen when a verified solution of it is in the library. Every grafted answer has a receipt, and
bench reruns each one fresh to verify it. A diagnostic run (`block_own`) asks each seen problem with the context
block that holds its own solution: it measures the model's skill at reading a worked solution in its context.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from kvgraft.core.errors import BadInputError
from kvgraft.core.sampling import SamplingParams
from kvgraft.engine.engine import Engine, GenerationResult
from kvgraft.engine.verify import verify_receipt
from kvgraft.flywheel.answers import answers_match, extract_answer
from kvgraft.flywheel.datasets import Item
from kvgraft.flywheel.energy import EnergyMeter
from kvgraft.flywheel.problems import ANSWER_MARK, prompt_of
from kvgraft.flywheel.stats import wilson_interval
from kvgraft.library.library import Library

RUNGS = ("bare", "grafted", "gated")
SPLITS = ("seen", "unseen", "all")
STOP = ("\n",)


@dataclass(frozen=True)
class Gate:
    min_match: float = 0.9
    """retrieval: 1.0 for a replay found by prompt hash; for a block, the word overlap with its best problem"""
    min_confidence: float = 0.5
    """the model's answer confidence: geometric-mean probability of the answer's tokens"""


@dataclass
class Answer:
    path: str
    """bare, replay or block"""
    answer: str | None
    correct: bool
    decode_tokens: int
    ttft_s: float
    wall_s: float
    confidence: float
    graft_id: str | None = None
    score: float | None = None
    receipt_id: str | None = None
    receipt_verified: bool | None = None
    error: str | None = None
    """why no answer was produced (e.g. the prompt does not fit the model's positions); counted as wrong"""


@dataclass
class ProblemResult:
    id: str
    seen: bool
    gold: str
    bare: Answer
    grafted: Answer
    gated: Answer
    block_own: Answer | None = None
    upstream: dict[str, Any] = field(default_factory=dict)

    def rung(self, name: str) -> Answer:
        return {"bare": self.bare, "grafted": self.grafted, "gated": self.gated}[name]


def answer_confidence(engine: Engine, result: GenerationResult, answer_only: bool) -> float:
    """exp(mean log-probability) of the tokens that spell the answer (after the answer mark; stop token excluded)."""
    tokens, logprobs = result.output_tokens, result.generation.token_logprobs
    start = 0
    if not answer_only:
        start = next(
            (i for i in range(1, len(tokens) + 1) if ANSWER_MARK in str(engine.tokenizer.decode(tokens[:i]))),
            len(tokens),
        )
    picked = [
        lp
        for token, lp in zip(tokens[start:], logprobs[start:], strict=True)
        if str(engine.tokenizer.decode([token])).strip()
    ]
    return math.exp(sum(picked) / len(picked)) if picked else 0.0


def _ask(
    engine: Engine, item: Item, budget: int, path: str, graft_id: str | None, score: float | None
) -> tuple[Answer, GenerationResult | None]:
    params = SamplingParams(max_new_tokens=budget, stop=STOP)
    started = time.perf_counter()
    try:
        if path == "replay":
            result = engine.generate("", graft_id=graft_id, params=params)
            text = ANSWER_MARK + result.text
        else:
            result = engine.generate(prompt_of(item.problem), graft_id=graft_id, params=params)
            text = result.text
    except BadInputError as exc:
        wall = time.perf_counter() - started
        return Answer(path, None, False, 0, 0.0, wall, 0.0, graft_id, score, error=str(exc)), None
    predicted = extract_answer(text)
    answer = Answer(
        path=path,
        answer=predicted,
        correct=answers_match(item.answer, predicted),
        decode_tokens=len(result.output_tokens),
        ttft_s=result.timings["ttft_s"],
        wall_s=time.perf_counter() - started,
        confidence=answer_confidence(engine, result, answer_only=path == "replay"),
        graft_id=graft_id,
        score=score,
        receipt_id=result.receipt.id if graft_id else None,
    )
    return answer, result


ProblemCallback = Callable[[int, int], None]


def run_ladder(
    engine: Engine,
    items: list[Item],
    library: Library,
    budget: int = 160,
    gate: Gate | None = None,
    verify_receipts: bool = True,
    on_problem: ProblemCallback | None = None,
) -> tuple[list[ProblemResult], dict[str, Any]]:
    """Ask every problem on every rung; returns per-problem results and run facts (receipts, energy, wall time)."""
    gate = gate or Gate()
    meter = EnergyMeter(engine.model.device.type)
    meter.start()
    started = time.perf_counter()
    results, receipts = [], []
    block_owner = {problem_id: graft_id for graft_id, problem_id, _ in library.block_entries}
    for index, item in enumerate(items):
        bare, _ = _ask(engine, item, budget, "bare", None, None)
        replay = library.find_replay(engine.encode_context(prompt_of(item.problem)))
        hits = [] if replay else library.search_blocks(item.problem, k=1)
        if replay or hits:
            path, graft_id, score = ("replay", replay, 1.0) if replay else ("block", hits[0].graft_id, hits[0].match)
            grafted, result = _ask(engine, item, budget, path, graft_id, score)
            if result is not None:
                receipts.append((grafted, result))
        else:
            grafted = bare
        passes = grafted.path != "bare" and (grafted.score or 0.0) >= gate.min_match
        gated = grafted if passes and grafted.confidence >= gate.min_confidence else bare
        seen = library.holds(item.text_sha256)
        block_own = None
        if seen and item.id in block_owner:
            block_own, _ = _ask(engine, item, budget, "block", block_owner[item.id], 1.0)
        upstream = {}
        if replay:
            cost = engine.store.manifest(replay).metadata.get("cost", {})
            upstream = {"graft_id": replay, **cost}
        results.append(ProblemResult(item.id, seen, item.answer, bare, grafted, gated, block_own, upstream))
        if on_problem is not None:
            on_problem(index + 1, len(items))
    bench_wall = time.perf_counter() - started
    energy = meter.stop()
    verified = 0
    if verify_receipts:
        for answer, result in receipts:
            answer.receipt_verified = verify_receipt(engine, result.receipt).exact
            verified += bool(answer.receipt_verified)
    facts = {
        "wall_s": bench_wall,
        "energy": energy.to_json(),
        "receipts": {"total": len(receipts), "verified": verified if verify_receipts else None},
        "receipt_objects": [result.receipt.to_json() for _, result in receipts],
    }
    return results, facts


def summarize(results: list[ProblemResult], budget: int, facts: dict[str, Any], gate: Gate) -> dict[str, Any]:
    """The results object: rungs x splits, token ratios, upstream cost amortized, receipts, energy."""
    rungs: dict[str, Any] = {}
    for rung in RUNGS:
        rungs[rung] = {}
        for split in SPLITS:
            chosen = [r for r in results if split == "all" or r.seen == (split == "seen")]
            answers = [r.rung(rung) for r in chosen]
            correct = sum(a.correct for a in answers)
            n = len(answers)
            total = sum(a.decode_tokens for a in answers)
            rungs[rung][split] = {
                "n": n,
                "correct": correct,
                "accuracy": correct / n if n else None,
                "ci95": list(wilson_interval(correct, n)),
                "decode_tokens_mean": total / n if n else None,
                "decode_tokens_total": total,
                "ttft_s_mean": sum(a.ttft_s for a in answers) / n if n else None,
                "wall_s": sum(a.wall_s for a in answers),
            }
    ratios = {}
    for split in SPLITS:
        bare_total = rungs["bare"][split]["decode_tokens_total"]
        ratios[split] = {
            rung: (bare_total / rungs[rung][split]["decode_tokens_total"])
            if rungs[rung][split]["decode_tokens_total"]
            else None
            for rung in ("grafted", "gated")
        }
    own = [r.block_own for r in results if r.block_own is not None]
    seen = [r for r in results if r.seen and r.upstream]
    upstream_tokens = sum(int(r.upstream.get("tokens_generated", 0)) for r in seen)
    upstream_wall = sum(float(r.upstream.get("wall_s", 0.0)) for r in seen)
    return {
        "budget": budget,
        "token_budget_total": budget * len(results),
        "gate": asdict(gate),
        "rungs": rungs,
        "bare_over_rung_decode_tokens": ratios,
        "block_own_solution": {
            "n": len(own),
            "correct": sum(a.correct for a in own),
            "accuracy": sum(a.correct for a in own) / len(own) if own else None,
            "ci95": list(wilson_interval(sum(a.correct for a in own), len(own))),
            "decode_tokens_mean": sum(a.decode_tokens for a in own) / len(own) if own else None,
        },
        "upstream": {
            "grafts_used": len(seen),
            "harvest_tokens": upstream_tokens,
            "harvest_wall_s": upstream_wall,
            "uses_per_graft": 1,
            "amortized_tokens_per_use": upstream_tokens / len(seen) if seen else None,
            "seen_grafted_tokens_including_upstream": rungs["grafted"]["seen"]["decode_tokens_total"] + upstream_tokens,
            "seen_bare_tokens": rungs["bare"]["seen"]["decode_tokens_total"],
        },
        "energy": facts["energy"],
        "wall_s": facts["wall_s"],
        "receipts": facts["receipts"],
        "errors": sum(a.error is not None for r in results for a in (r.bare, r.grafted)),
        "problems": [asdict(r) for r in results],
    }
