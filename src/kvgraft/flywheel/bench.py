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
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, replace
from enum import StrEnum
from typing import Any

from kvgraft.core.errors import BadInputError
from kvgraft.core.sampling import SamplingParams
from kvgraft.engine.engine import Engine, GenerationResult
from kvgraft.engine.verify import verify_receipt
from kvgraft.flywheel.answers import answers_match, extract_answer
from kvgraft.flywheel.datasets import Item
from kvgraft.flywheel.energy import EnergyMeter, EnergyReading
from kvgraft.flywheel.harvest import HarvestSummary
from kvgraft.flywheel.problems import ANSWER_MARK, STOP, prompt_of
from kvgraft.flywheel.stats import wilson_interval
from kvgraft.format.metadata import GraftKind, GraftMetadata, HarvestCost
from kvgraft.format.receipt import Receipt
from kvgraft.library.library import Library


class Rung(StrEnum):
    """A rung of the ladder: how a problem is answered."""

    BARE = "bare"
    GRAFTED = "grafted"
    GATED = "gated"


class Split(StrEnum):
    """A subset of the problems: those with a verified solution in the library, those without, or all."""

    SEEN = "seen"
    UNSEEN = "unseen"
    ALL = "all"


class AnswerPath(StrEnum):
    """The route an answer took: the model alone, a replay graft, or a context block."""

    BARE = "bare"
    REPLAY = GraftKind.REPLAY.value
    BLOCK = GraftKind.BLOCK.value


@dataclass(frozen=True, kw_only=True)
class Gate:
    """When the gated rung takes the grafted answer rather than the bare one."""

    min_match: float = 0.9
    """retrieval: 1.0 for a replay found by prompt hash; for a block, the word overlap with its best problem"""
    min_confidence: float = 0.5
    """the model's answer confidence: geometric-mean probability of the answer's tokens"""

    def admits(self, answer: Answer) -> bool:
        """Whether a grafted answer passes the gate.

        Args:
            answer: the grafted rung's answer.

        Returns:
            True when it came from a graft and both its retrieval score and its confidence reach the thresholds.
        """
        if answer.path is AnswerPath.BARE or (answer.score or 0.0) < self.min_match:
            return False
        return answer.confidence >= self.min_confidence


@dataclass(frozen=True, kw_only=True)
class Answer:
    """One answer to one problem, as one rung gave it."""

    path: AnswerPath
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

    def to_json(self) -> dict[str, Any]:
        """Returns: every field by name (`path` as its string)."""
        return asdict(self) | {"path": self.path.value}


@dataclass(frozen=True, kw_only=True)
class Upstream:
    """The replay graft a seen problem was answered with, and what producing its solution cost."""

    graft_id: str
    cost: HarvestCost | None
    """None when the graft's metadata records no cost"""

    def to_json(self) -> dict[str, Any]:
        """Returns: {"graft_id", **cost} (the cost's keys as the graft's metadata holds them)."""
        return {"graft_id": self.graft_id, **(self.cost.to_json() if self.cost else {})}


@dataclass(frozen=True, kw_only=True)
class ProblemResult:
    """One problem on every rung."""

    id: str
    seen: bool
    gold: str
    bare: Answer
    grafted: Answer
    gate_passed: bool
    """whether the gate admitted the grafted answer (the gated rung's answer is then the grafted one)"""
    block_own: Answer | None = None
    upstream: Upstream | None = None

    @property
    def gated(self) -> Answer:
        """The gated rung's answer."""
        return self.grafted if self.gate_passed else self.bare

    def rung(self, rung: Rung) -> Answer:
        """The answer on one rung."""
        return {Rung.BARE: self.bare, Rung.GRAFTED: self.grafted, Rung.GATED: self.gated}[rung]

    def to_json(self) -> dict[str, Any]:
        """Returns: the problem's entry in a report's "problems"."""
        return {
            "id": self.id,
            "seen": self.seen,
            "gold": self.gold,
            "bare": self.bare.to_json(),
            "grafted": self.grafted.to_json(),
            "gated": self.gated.to_json(),
            "block_own": self.block_own.to_json() if self.block_own else None,
            "upstream": self.upstream.to_json() if self.upstream else {},
        }


@dataclass(frozen=True, kw_only=True)
class ReceiptTally:
    """The grafted answers' receipts, and how many a fresh rerun verified."""

    total: int
    verified: int | None
    """None when the receipts were not rerun"""
    kept: tuple[Receipt, ...] = field(default=(), compare=False)
    """the receipts themselves, in problem order (a report writes each to receipts/<id>.json)"""

    @property
    def all_verified(self) -> bool:
        """Whether every receipt was rerun and verified."""
        return self.verified == self.total

    def to_json(self) -> dict[str, Any]:
        """Returns: {"total", "verified"}."""
        return {"total": self.total, "verified": self.verified}


@dataclass(frozen=True, kw_only=True)
class LadderFacts:
    """What a ladder run measured besides the answers."""

    wall_s: float
    """the ladder's wall time (receipt verification excluded)"""
    energy: EnergyReading
    receipts: ReceiptTally


@dataclass(frozen=True, kw_only=True)
class Tally:
    """Answers counted: on one rung and split, or the diagnostic `block_own` answers."""

    n: int
    correct: int
    decode_tokens_total: int
    ttft_s_total: float
    wall_s: float

    @classmethod
    def of(cls, answers: list[Answer]) -> Tally:
        """Count answers.

        Args:
            answers: the answers to count.

        Returns:
            Their tally.
        """
        return cls(
            n=len(answers),
            correct=sum(a.correct for a in answers),
            decode_tokens_total=sum(a.decode_tokens for a in answers),
            ttft_s_total=sum(a.ttft_s for a in answers),
            wall_s=sum(a.wall_s for a in answers),
        )

    @property
    def accuracy(self) -> float | None:
        return self.correct / self.n if self.n else None

    @property
    def ci95(self) -> tuple[float, float]:
        """The 95% Wilson interval of the accuracy ((0, 1) when there are no answers)."""
        return wilson_interval(self.correct, self.n)

    @property
    def decode_tokens_mean(self) -> float | None:
        return self.decode_tokens_total / self.n if self.n else None

    @property
    def ttft_s_mean(self) -> float | None:
        return self.ttft_s_total / self.n if self.n else None

    def to_json(self) -> dict[str, Any]:
        """Returns: a ladder cell as reports hold it (the `block_own_solution` figures are its first five keys)."""
        return {
            "n": self.n,
            "correct": self.correct,
            "accuracy": self.accuracy,
            "ci95": list(self.ci95),
            "decode_tokens_mean": self.decode_tokens_mean,
            "decode_tokens_total": self.decode_tokens_total,
            "ttft_s_mean": self.ttft_s_mean,
            "wall_s": self.wall_s,
        }


_BLOCK_OWN_KEYS = ("n", "correct", "accuracy", "ci95", "decode_tokens_mean")


@dataclass(frozen=True, kw_only=True)
class UpstreamFigures:
    """The harvest cost behind the replay grafts a bench used, against the decode tokens they saved."""

    grafts_used: int
    harvest_tokens: int
    """tokens generated to find the used grafts' solutions, failed attempts included"""
    harvest_wall_s: float | None
    """seconds spent solving the used grafts' problems, when this run harvested them (or older grafts recorded
    it); None when unknown"""
    seen_grafted_tokens: int
    """decode tokens of the grafted rung on seen problems"""
    seen_bare_tokens: int
    """decode tokens of the bare rung on seen problems"""
    uses_per_graft: int = 1
    """a bench asks each problem once"""

    @property
    def amortized_tokens_per_use(self) -> float | None:
        return self.harvest_tokens / self.grafts_used if self.grafts_used else None

    @property
    def seen_grafted_tokens_including_upstream(self) -> int:
        return self.seen_grafted_tokens + self.harvest_tokens

    def to_json(self) -> dict[str, Any]:
        """Returns: a report's "upstream" (without "harvest_all", which the summary adds)."""
        return {
            "grafts_used": self.grafts_used,
            "harvest_tokens": self.harvest_tokens,
            "harvest_wall_s": self.harvest_wall_s,
            "uses_per_graft": self.uses_per_graft,
            "amortized_tokens_per_use": self.amortized_tokens_per_use,
            "seen_grafted_tokens_including_upstream": self.seen_grafted_tokens_including_upstream,
            "seen_bare_tokens": self.seen_bare_tokens,
        }


@dataclass(frozen=True, kw_only=True)
class BenchSummary:
    """A bench run's results: rungs x splits, token ratios, upstream cost, receipts, energy, every problem.

    `summarize` fills the figures; the labels below it (model, dataset, retriever, harvest, report) are set by
    whoever ran the bench (`dataclasses.replace`) and appear in the JSON only when set.
    """

    budget: int
    """the most new tokens per answer"""
    gate: Gate
    rungs: Mapping[Rung, Mapping[Split, Tally]]
    block_own: Tally
    upstream: UpstreamFigures
    energy: EnergyReading
    wall_s: float
    receipts: ReceiptTally
    problems: tuple[ProblemResult, ...]
    model: str | None = None
    dataset: str | None = None
    retriever: str | None = None
    harvest: HarvestSummary | None = None
    """the whole harvest behind the library, failures included (a flywheel run knows it)"""
    report: str | None = None
    """the markdown report's absolute path, once written"""

    @property
    def token_budget_total(self) -> int:
        return self.budget * len(self.problems)

    @property
    def errors(self) -> int:
        """Bare and grafted answers that could not be produced."""
        return sum(a.error is not None for r in self.problems for a in (r.bare, r.grafted))

    def cell(self, rung: Rung, split: Split) -> Tally:
        """The tally of one rung on one split."""
        return self.rungs[rung][split]

    def token_ratio(self, split: Split, rung: Rung) -> float | None:
        """Bare decode tokens over this rung's on one split (None when the rung decoded none)."""
        total = self.cell(rung, split).decode_tokens_total
        return self.cell(Rung.BARE, split).decode_tokens_total / total if total else None

    def to_json(self) -> dict[str, Any]:
        """Returns: the results object of `kvgraft bench --json`, `kvgraft demo --json` and results.json."""
        upstream = self.upstream.to_json()
        if self.harvest is not None:
            upstream["harvest_all"] = self.harvest.totals_json()
        data: dict[str, Any] = {
            "budget": self.budget,
            "token_budget_total": self.token_budget_total,
            "gate": asdict(self.gate),
            "rungs": {rung.value: {split.value: self.cell(rung, split).to_json() for split in Split} for rung in Rung},
            "bare_over_rung_decode_tokens": {
                split.value: {rung.value: self.token_ratio(split, rung) for rung in (Rung.GRAFTED, Rung.GATED)}
                for split in Split
            },
            "block_own_solution": {key: self.block_own.to_json()[key] for key in _BLOCK_OWN_KEYS},
            "upstream": upstream,
            "energy": self.energy.to_json(),
            "wall_s": self.wall_s,
            "receipts": self.receipts.to_json(),
            "errors": self.errors,
            "problems": [problem.to_json() for problem in self.problems],
        }
        labels = {"model": self.model, "dataset": self.dataset, "retriever": self.retriever}
        data |= {key: value for key, value in labels.items() if value is not None}
        if self.harvest is not None:
            data["harvest"] = self.harvest.to_json()
        if self.report is not None:
            data["report"] = self.report
        return data


def answer_confidence(engine: Engine, result: GenerationResult, answer_only: bool) -> float:
    """How sure the model was of its answer.

    Args:
        engine: the engine that generated `result` (its tokenizer spells the tokens).
        result: a generation with per-token log-probabilities.
        answer_only: True when every output token spells the answer (a replay decodes only the answer);
            otherwise the answer starts after the answer mark.

    Returns:
        exp(mean log-probability) of the tokens that spell the answer (stop and blank tokens excluded); 0.0 when
        there are none.
    """
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
    engine: Engine, item: Item, budget: int, path: AnswerPath, graft_id: str | None, score: float | None
) -> tuple[Answer, GenerationResult | None]:
    """Ask one problem one way; a prompt that cannot be run gives a wrong answer with its error (and no result)."""
    params = SamplingParams(max_new_tokens=budget, stop=STOP)
    started = time.perf_counter()
    try:
        if path is AnswerPath.REPLAY:
            # The graft ends at the answer mark: the model continues with the answer alone.
            result = engine.generate("", graft_id=graft_id, params=params)
            text = ANSWER_MARK + result.text
        else:
            result = engine.generate(prompt_of(item.problem), graft_id=graft_id, params=params)
            text = result.text
    except BadInputError as exc:
        wall = time.perf_counter() - started
        failed = Answer(
            path=path,
            answer=None,
            correct=False,
            decode_tokens=0,
            ttft_s=0.0,
            wall_s=wall,
            confidence=0.0,
            graft_id=graft_id,
            score=score,
            error=str(exc),
        )
        return failed, None
    predicted = extract_answer(text)
    answer = Answer(
        path=path,
        answer=predicted,
        correct=answers_match(item.answer, predicted),
        decode_tokens=len(result.output_tokens),
        ttft_s=result.timings["ttft_s"],
        wall_s=time.perf_counter() - started,
        confidence=answer_confidence(engine, result, answer_only=path is AnswerPath.REPLAY),
        graft_id=graft_id,
        score=score,
        receipt_id=result.receipt.id if graft_id else None,
    )
    return answer, result


ProblemCallback = Callable[[int, int], None]
"""called after each problem with (problems done, problems in all)"""


def _ask_problem(
    engine: Engine, item: Item, library: Library, budget: int, gate: Gate, block_owner: dict[str, str]
) -> tuple[ProblemResult, Receipt | None]:
    """One problem on every rung; returns its result and the grafted answer's receipt (None when bare)."""
    bare, _ = _ask(engine, item, budget, AnswerPath.BARE, None, None)
    replay = library.find_replay(engine.encode_context(prompt_of(item.problem)))
    hits = [] if replay else library.search_blocks(item.problem, k=1)
    grafted, receipt = bare, None
    if replay or hits:
        path, graft_id, score = (
            (AnswerPath.REPLAY, replay, 1.0) if replay else (AnswerPath.BLOCK, hits[0].graft_id, hits[0].match)
        )
        grafted, result = _ask(engine, item, budget, path, graft_id, score)
        receipt = result.receipt if result is not None else None
    seen = library.holds(item.text_sha256)
    block_own = None
    if seen and item.id in block_owner:
        block_own, _ = _ask(engine, item, budget, AnswerPath.BLOCK, block_owner[item.id], 1.0)
    upstream = None
    if replay:
        upstream = Upstream(graft_id=replay, cost=GraftMetadata.read(engine.store.manifest(replay).metadata).cost)
    problem = ProblemResult(
        id=item.id,
        seen=seen,
        gold=item.answer,
        bare=bare,
        grafted=grafted,
        gate_passed=gate.admits(grafted),
        block_own=block_own,
        upstream=upstream,
    )
    return problem, receipt


def run_ladder(
    engine: Engine,
    items: list[Item],
    library: Library,
    budget: int = 160,
    gate: Gate | None = None,
    verify_receipts: bool = True,
    on_problem: ProblemCallback | None = None,
) -> tuple[list[ProblemResult], LadderFacts]:
    """Ask every problem on every rung, then rerun every grafted answer's receipt fresh.

    Args:
        engine: the model (its store holds the library's grafts).
        items: the problems, with gold answers.
        library: the grafts to answer with.
        budget: the most new tokens per answer.
        gate: the gated rung's thresholds (default `Gate()`).
        verify_receipts: rerun each grafted answer fresh and record whether it is equal.
        on_problem: progress callback.

    Returns:
        One result per item, in order, and the run's facts (receipts, energy, wall time).
    """
    gate = gate or Gate()
    meter = EnergyMeter(engine.model.device.type)
    meter.start()
    started = time.perf_counter()
    block_owner = {problem_id: graft_id for graft_id, problem_id, _ in library.block_entries}
    asked = []
    for index, item in enumerate(items):
        asked.append(_ask_problem(engine, item, library, budget, gate, block_owner))
        if on_problem is not None:
            on_problem(index + 1, len(items))
    bench_wall = time.perf_counter() - started
    energy = meter.stop()
    results = [result for result, _ in asked]
    verified = None
    if verify_receipts:
        results = [
            result if receipt is None else _receipt_checked(result, verify_receipt(engine, receipt).exact)
            for result, receipt in asked
        ]
        verified = sum(bool(result.grafted.receipt_verified) for result in results)
    kept = tuple(receipt for _, receipt in asked if receipt is not None)
    tally = ReceiptTally(total=len(kept), verified=verified, kept=kept)
    return results, LadderFacts(wall_s=bench_wall, energy=energy, receipts=tally)


def _receipt_checked(result: ProblemResult, exact: bool) -> ProblemResult:
    return replace(result, grafted=replace(result.grafted, receipt_verified=exact))


def summarize(
    results: list[ProblemResult],
    budget: int,
    facts: LadderFacts,
    gate: Gate,
    solve_wall_s: Mapping[str, float] | None = None,
) -> BenchSummary:
    """Count a ladder run.

    Args:
        results: `run_ladder`'s results.
        budget: the most new tokens per answer the run used.
        facts: `run_ladder`'s facts.
        gate: the gate the run used.
        solve_wall_s: seconds the harvest spent on each problem, by problem id, when it ran in the same process
            (a graft does not record its wall time: its id must not depend on it).

    Returns:
        The summary, unlabelled (set model, dataset and the rest with `dataclasses.replace`).
    """
    rungs = {
        rung: {
            split: Tally.of([r.rung(rung) for r in results if split is Split.ALL or r.seen == (split is Split.SEEN)])
            for split in Split
        }
        for rung in Rung
    }
    used = [(r.id, r.upstream) for r in results if r.seen and r.upstream is not None]
    walls = [
        u.cost.wall_s if u.cost and u.cost.wall_s is not None else (solve_wall_s or {}).get(problem_id)
        for problem_id, u in used
    ]
    upstream = UpstreamFigures(
        grafts_used=len(used),
        harvest_tokens=sum(u.cost.tokens_generated if u.cost else 0 for _, u in used),
        harvest_wall_s=sum(w for w in walls if w is not None) if walls and None not in walls else None,
        seen_grafted_tokens=rungs[Rung.GRAFTED][Split.SEEN].decode_tokens_total,
        seen_bare_tokens=rungs[Rung.BARE][Split.SEEN].decode_tokens_total,
    )
    return BenchSummary(
        budget=budget,
        gate=gate,
        rungs=rungs,
        block_own=Tally.of([r.block_own for r in results if r.block_own is not None]),
        upstream=upstream,
        energy=facts.energy,
        wall_s=facts.wall_s,
        receipts=facts.receipts,
        problems=tuple(results),
    )
