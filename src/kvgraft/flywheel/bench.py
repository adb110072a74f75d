"""The evaluation ladder: bare, code, grafted and gated answers, each problem tagged seen or unseen.

- bare: the model alone, greedy (or sampled, with `samples` > 1), under the token budget.
- code: the model asked for a Python program that prints the answer; the program runs in the sandbox
  (`kvgraft.flywheel.sandbox`) and its last printed line is the answer. No program, an error, no output or a timeout
  is no answer, counted by outcome. The generation has a receipt; the program's run is recorded beside it.
- grafted: the problem's replay graft when the query's prompt tokens equal a graft's prompt (found by hash; only
  the answer is decoded: this is replay, and is called so), else the best retrieved context block restored at
  position 0 before the problem, else bare.
- gated: the grafted answer only when its retrieval score and the model's own answer confidence pass
  thresholds, else the bare answer.
A problem is seen when a verified solution of it is in the library. Every grafted answer has a receipt, and
bench reruns each one fresh to verify it. A diagnostic run (`block_own`) asks each seen problem with the context
block that holds its own solution: it measures the model's skill at reading a worked solution in its context.

Prompts, stop rules and answers come from a prompt format (`kvgraft.flywheel.prompting`: the demo's plain one, or
an instruct model's chat template with `\\boxed{}` answers). With `samples` = k > 1 every rung answers each
problem k times (seeds 0..k-1); a cell then reports mean accuracy over all answers, a 95% interval over problems,
and pass@k (the share of problems answered right at least once), the MathArena protocol.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, replace
from enum import StrEnum
from typing import Any

from kvgraft.core.decode import TokenCallback
from kvgraft.core.errors import BadInputError
from kvgraft.engine.engine import Engine, GenerationResult
from kvgraft.engine.verify import verify_receipt
from kvgraft.flywheel.answers import answers_match
from kvgraft.flywheel.datasets import Item
from kvgraft.flywheel.energy import EnergyMeter, EnergyReading
from kvgraft.flywheel.harvest import HarvestSummary, budget_for
from kvgraft.flywheel.problems import ANSWER_MARK
from kvgraft.flywheel.prompting import Prompter, PromptSpec
from kvgraft.flywheel.sandbox import SandboxLimits, run_program
from kvgraft.flywheel.stats import mean_interval, wilson_interval
from kvgraft.format.metadata import GraftKind, GraftMetadata, HarvestCost
from kvgraft.format.receipt import Receipt
from kvgraft.library.library import Library


class Rung(StrEnum):
    """A rung of the ladder: how a problem is answered."""

    BARE = "bare"
    CODE = "code"
    GRAFTED = "grafted"
    GATED = "gated"


class Split(StrEnum):
    """A subset of the problems: those with a verified solution in the library, those without, or all."""

    SEEN = "seen"
    UNSEEN = "unseen"
    ALL = "all"


class AnswerPath(StrEnum):
    """The route an answer took: the model alone, a program it wrote, a replay graft, or a context block."""

    BARE = "bare"
    CODE = "code"
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
        if answer.path in (AnswerPath.BARE, AnswerPath.CODE) or (answer.score or 0.0) < self.min_match:
            return False
        return answer.confidence >= self.min_confidence


STDOUT_KEPT = 2000
"""characters of a program's output a report keeps"""


@dataclass(frozen=True, kw_only=True)
class ProgramRun:
    """What the code rung's program did: recorded beside the receipt of the generation that wrote it."""

    program: str | None
    """the program the model wrote; None when its output held none"""
    outcome: str
    """"no_program", or the sandbox's outcome ("ok", "no_output", "error", "timeout", "memory",
    "output_too_large", "killed")"""
    stdout: str = ""
    """the first STDOUT_KEPT characters it printed"""
    wall_s: float = 0.0
    isolation: str | None = None
    """the sandbox's isolation level ("root", "user", "none"); None when nothing ran"""
    network_isolated: bool | None = None

    def to_json(self) -> dict[str, Any]:
        """Returns: every field by name."""
        return asdict(self)


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
    program: ProgramRun | None = None
    """the code rung's program and how it ran; None on other rungs"""

    def to_json(self) -> dict[str, Any]:
        """Returns: every field by name (`path` as its string; "program" only on the code rung)."""
        data = asdict(self) | {"path": self.path.value}
        if self.program is None:
            del data["program"]
        return data


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
    code: Answer | None = None
    """the code rung's answer; None when the ladder ran without it"""
    sample: int = 0
    """which of a problem's samples this is (0 unless the ladder ran with `samples` > 1)"""

    @property
    def gated(self) -> Answer:
        """The gated rung's answer."""
        return self.grafted if self.gate_passed else self.bare

    def rung(self, rung: Rung) -> Answer:
        """The answer on one rung.

        Raises:
            BadInputError: the code rung of a result that has none.
        """
        if rung is Rung.CODE:
            if self.code is None:
                raise BadInputError(f"problem {self.id} was asked without the code rung")
            return self.code
        return {Rung.BARE: self.bare, Rung.GRAFTED: self.grafted, Rung.GATED: self.gated}[rung]

    def to_json(self) -> dict[str, Any]:
        """Returns: the problem's entry in a report's "problems" ("code" and "sample" only when the ladder had
        them)."""
        data: dict[str, Any] = {"id": self.id}
        if self.sample:
            data["sample"] = self.sample
        data |= {"seen": self.seen, "gold": self.gold, "bare": self.bare.to_json()}
        if self.code is not None:
            data["code"] = self.code.to_json()
        return data | {
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
    samples: int = 1
    """answers per problem: the answers come problem by problem, `samples` in a row"""
    per_problem_correct: tuple[int, ...] = ()
    """correct answers per problem (filled when `samples` > 1)"""

    @classmethod
    def of(cls, answers: list[Answer], samples: int = 1) -> Tally:
        """Count answers.

        Args:
            answers: the answers to count, problem by problem, `samples` consecutive answers per problem.
            samples: answers per problem.

        Returns:
            Their tally.
        """
        per_problem = (
            tuple(sum(a.correct for a in answers[i : i + samples]) for i in range(0, len(answers), samples))
            if samples > 1
            else ()
        )
        return cls(
            n=len(answers),
            correct=sum(a.correct for a in answers),
            decode_tokens_total=sum(a.decode_tokens for a in answers),
            ttft_s_total=sum(a.ttft_s for a in answers),
            wall_s=sum(a.wall_s for a in answers),
            samples=samples,
            per_problem_correct=per_problem,
        )

    @property
    def accuracy(self) -> float | None:
        """Correct answers over answers: with samples, the mean accuracy over all of them."""
        return self.correct / self.n if self.n else None

    @property
    def ci95(self) -> tuple[float, float]:
        """The 95% interval of the accuracy ((0, 1) when there are no answers): Wilson's over answers with one
        sample per problem; with several, over problems (`stats.mean_interval` of the per-problem accuracies:
        a problem's samples are not independent of each other)."""
        if self.samples > 1:
            return mean_interval([c / self.samples for c in self.per_problem_correct])
        return wilson_interval(self.correct, self.n)

    @property
    def pass_at_k(self) -> float | None:
        """The share of problems answered right at least once in their `samples` answers (None with one)."""
        if self.samples < 2 or not self.per_problem_correct:
            return None
        return sum(c > 0 for c in self.per_problem_correct) / len(self.per_problem_correct)

    @property
    def decode_tokens_mean(self) -> float | None:
        return self.decode_tokens_total / self.n if self.n else None

    @property
    def ttft_s_mean(self) -> float | None:
        return self.ttft_s_total / self.n if self.n else None

    def to_json(self) -> dict[str, Any]:
        """Returns: a ladder cell as reports hold it (the `block_own_solution` figures are its first five keys;
        "samples", "problems" and "pass_at_k" only with samples)."""
        data: dict[str, Any] = {
            "n": self.n,
            "correct": self.correct,
            "accuracy": self.accuracy,
            "ci95": list(self.ci95),
            "decode_tokens_mean": self.decode_tokens_mean,
            "decode_tokens_total": self.decode_tokens_total,
            "ttft_s_mean": self.ttft_s_mean,
            "wall_s": self.wall_s,
        }
        if self.samples > 1:
            data |= {"samples": self.samples, "problems": len(self.per_problem_correct), "pass_at_k": self.pass_at_k}
        return data


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
    samples: int = 1
    """answers per problem on every rung"""
    temperature: float = 0.0
    code_outcomes: Mapping[str, int] | None = None
    """the code rung's answers by how their program ended ("ok", "no_program", "error", ...); None without it"""
    prompt: PromptSpec | None = None
    """the prompt format asked in (None: plain, the demo's)"""
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
    def rung_order(self) -> list[Rung]:
        """The rungs this run has, in ladder order."""
        return [rung for rung in Rung if rung in self.rungs]

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
            "rungs": {
                rung.value: {split.value: self.cell(rung, split).to_json() for split in Split}
                for rung in self.rung_order
            },
            "bare_over_rung_decode_tokens": {
                split.value: {
                    rung.value: self.token_ratio(split, rung) for rung in self.rung_order if rung is not Rung.BARE
                }
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
        if self.samples > 1:
            data |= {"samples": self.samples, "temperature": self.temperature}
        if self.code_outcomes is not None:
            data["code_outcomes"] = dict(self.code_outcomes)
        if self.prompt is not None:
            data["prompt"] = self.prompt.to_json()
        labels = {"model": self.model, "dataset": self.dataset, "retriever": self.retriever}
        data |= {key: value for key, value in labels.items() if value is not None}
        if self.harvest is not None:
            data["harvest"] = self.harvest.to_json()
        if self.report is not None:
            data["report"] = self.report
        return data


def answer_confidence(engine: Engine, result: GenerationResult, answer_only: bool, mark: str = ANSWER_MARK) -> float:
    """How sure the model was of its answer.

    Args:
        engine: the engine that generated `result` (its tokenizer spells the tokens).
        result: a generation with per-token log-probabilities.
        answer_only: True when every output token spells the answer (a replay decodes only the answer);
            otherwise the answer starts after the answer mark.
        mark: the prompt format's answer mark (`Answer:`, or `\\boxed{` in the chat format).

    Returns:
        exp(mean log-probability) of the tokens that spell the answer (stop and blank tokens excluded); 0.0 when
        there are none.
    """
    tokens, logprobs = result.output_tokens, result.generation.token_logprobs
    start = 0
    if not answer_only:
        start = next(
            (i for i in range(1, len(tokens) + 1) if mark in str(engine.tokenizer.decode(tokens[:i]))),
            len(tokens),
        )
    picked = [
        lp
        for token, lp in zip(tokens[start:], logprobs[start:], strict=True)
        if str(engine.tokenizer.decode([token], skip_special_tokens=True)).strip()
    ]
    return math.exp(sum(picked) / len(picked)) if picked else 0.0


@dataclass(frozen=True, kw_only=True)
class AskSettings:
    """How every answer of a ladder is asked."""

    prompter: Prompter
    budget: int
    temperature: float = 0.0
    on_token: TokenCallback | None = None
    """called with each generated token (a progress bar's token count)"""


def _failed(path: AnswerPath, graft_id: str | None, score: float | None, wall: float, error: str) -> Answer:
    """A wrong answer that could not be produced, with its error."""
    return Answer(
        path=path,
        answer=None,
        correct=False,
        decode_tokens=0,
        ttft_s=0.0,
        wall_s=wall,
        confidence=0.0,
        graft_id=graft_id,
        score=score,
        error=error,
    )


def _generate(
    engine: Engine, ask: AskSettings, prompt: str, graft_id: str | None, seed: int, code: bool = False
) -> GenerationResult:
    """One generation under the ladder's settings, its budget cut to what fits in the model's positions."""
    graft_tokens = len(engine.store.manifest(graft_id).tokens) if graft_id else 0
    prompt_tokens = len(engine.encode_context(prompt)) if prompt else 0
    budget = budget_for(engine, graft_tokens + prompt_tokens, ask.budget)
    params = ask.prompter.stop.sampling(budget, ask.temperature, seed)
    return engine.generate(prompt, graft_id=graft_id, params=params, on_token=ask.on_token)


def _ask(
    engine: Engine,
    item: Item,
    ask: AskSettings,
    path: AnswerPath,
    graft_id: str | None,
    score: float | None,
    seed: int = 0,
) -> tuple[Answer, GenerationResult | None]:
    """Ask one problem one way; a prompt that cannot be run gives a wrong answer with its error (and no result)."""
    prompter = ask.prompter
    started = time.perf_counter()
    try:
        if path is AnswerPath.REPLAY:
            # The graft ends at the answer mark: the model continues with the answer alone.
            result = _generate(engine, ask, "", graft_id, seed)
            text = prompter.answer_mark + result.text
        else:
            result = _generate(engine, ask, prompter.prompt(item.problem), graft_id, seed)
            text = result.text
    except BadInputError as exc:
        return _failed(path, graft_id, score, time.perf_counter() - started, str(exc)), None
    predicted = prompter.answer(text)
    answer = Answer(
        path=path,
        answer=predicted,
        correct=answers_match(item.answer, predicted),
        decode_tokens=len(result.output_tokens),
        ttft_s=result.timings["ttft_s"],
        wall_s=time.perf_counter() - started,
        confidence=answer_confidence(engine, result, path is AnswerPath.REPLAY, prompter.answer_mark),
        graft_id=graft_id,
        score=score,
        receipt_id=result.receipt.id if graft_id else None,
    )
    return answer, result


def _ask_code(
    engine: Engine, item: Item, ask: AskSettings, limits: SandboxLimits, seed: int = 0
) -> tuple[Answer, GenerationResult | None]:
    """The code rung: ask for a program, run it in the sandbox, and read its last printed line as the answer."""
    started = time.perf_counter()
    try:
        result = _generate(engine, ask, ask.prompter.code_prompt(item.problem), None, seed)
    except BadInputError as exc:
        return _failed(AnswerPath.CODE, None, None, time.perf_counter() - started, str(exc)), None
    program = ask.prompter.program(result.text)
    if program is None:
        run = ProgramRun(program=None, outcome="no_program")
        predicted = None
    else:
        ran = run_program(program, limits)
        run = ProgramRun(
            program=program,
            outcome=ran.outcome,
            stdout=ran.stdout[:STDOUT_KEPT],
            wall_s=ran.wall_s,
            isolation=ran.isolation,
            network_isolated=ran.network_isolated,
        )
        predicted = ran.answer
    answer = Answer(
        path=AnswerPath.CODE,
        answer=predicted,
        correct=answers_match(item.answer, predicted),
        decode_tokens=len(result.output_tokens),
        ttft_s=result.timings["ttft_s"],
        wall_s=time.perf_counter() - started,
        confidence=0.0,  # a program's output has no probability; the gate never takes this rung's answers
        receipt_id=result.receipt.id,
        program=run,
    )
    return answer, result


ProblemCallback = Callable[[int, int], None]
"""called after each problem with (problems done, problems in all)"""


@dataclass(frozen=True, kw_only=True)
class _Asked:
    """One problem (one sample) on every rung, with the receipts to rerun."""

    result: ProblemResult
    grafted: Receipt | None
    code: Receipt | None


def _find_replay(library: Library, engine: Engine, item: Item, prompter: Prompter) -> str | None:
    """The problem's replay graft: by its prompt's tokens, else by its text's hash in this prompt format."""
    by_tokens = library.find_replay(engine.encode_context(prompter.prompt(item.problem)))
    return by_tokens or library.find_replay_by_problem(item.text_sha256, prompter.format.value)


def _ask_problem(
    engine: Engine,
    item: Item,
    library: Library,
    ask: AskSettings,
    gate: Gate,
    block_owner: dict[str, str],
    code_limits: SandboxLimits | None,
    sample: int = 0,
) -> _Asked:
    """One problem on every rung (one sample: its seed is the sample's index)."""
    bare, _ = _ask(engine, item, ask, AnswerPath.BARE, None, None, sample)
    code, code_result = (None, None)
    if code_limits is not None:
        code, code_result = _ask_code(engine, item, ask, code_limits, sample)
    replay = _find_replay(library, engine, item, ask.prompter)
    hits = [] if replay else library.search_blocks(item.problem, k=1)
    grafted, receipt = bare, None
    if replay or hits:
        path, graft_id, score = (
            (AnswerPath.REPLAY, replay, 1.0) if replay else (AnswerPath.BLOCK, hits[0].graft_id, hits[0].match)
        )
        grafted, result = _ask(engine, item, ask, path, graft_id, score, sample)
        receipt = result.receipt if result is not None else None
    seen = library.holds(item.text_sha256)
    block_own = None
    if seen and item.id in block_owner and sample == 0:
        block_own, _ = _ask(engine, item, ask, AnswerPath.BLOCK, block_owner[item.id], 1.0)
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
        code=code,
        sample=sample,
    )
    return _Asked(result=problem, grafted=receipt, code=code_result.receipt if code_result is not None else None)


@dataclass(frozen=True, kw_only=True)
class LadderOptions:
    """What a ladder run asks besides the problems and the library."""

    budget: int = 160
    """the most new tokens per answer (cut to the model's positions when longer)"""
    gate: Gate = field(default_factory=Gate)
    verify_receipts: bool = True
    """rerun every answer that has a receipt fresh, and record whether it is equal"""
    prompt: PromptSpec = field(default_factory=PromptSpec)
    code: SandboxLimits | None = None
    """the code rung's sandbox limits; None: no code rung"""
    samples: int = 1
    """answers per problem on every rung (seeds 0..samples-1); above 1 needs a temperature above 0"""
    temperature: float = 0.0


def run_ladder(
    engine: Engine,
    items: list[Item],
    library: Library,
    budget: int = 160,
    gate: Gate | None = None,
    verify_receipts: bool = True,
    on_problem: ProblemCallback | None = None,
    options: LadderOptions | None = None,
    on_token: TokenCallback | None = None,
) -> tuple[list[ProblemResult], LadderFacts]:
    """Ask every problem on every rung, then rerun every answer's receipt fresh.

    Args:
        engine: the model (its store holds the library's grafts).
        items: the problems, with gold answers.
        library: the grafts to answer with.
        budget: the most new tokens per answer (ignored when `options` is given: its own).
        gate: the gated rung's thresholds (default `Gate()`; ignored when `options` is given).
        verify_receipts: rerun each grafted and code answer fresh and record whether it is equal (ignored when
            `options` is given).
        on_problem: progress callback.
        options: everything the run asks (prompt format, code rung, samples); default: built from the arguments
            above, plain format, no code rung, one greedy sample.
        on_token: called with each generated token.

    Returns:
        One result per item and sample, problem by problem, and the run's facts (receipts, energy, wall time).

    Raises:
        BadInputError: samples below 1, several samples at temperature 0, or the chat format for a model without
            a chat template.
    """
    options = options or LadderOptions(budget=budget, gate=gate or Gate(), verify_receipts=verify_receipts)
    if options.samples < 1:
        raise BadInputError("samples must be at least 1")
    if options.samples > 1 and options.temperature <= 0:
        raise BadInputError("more than one sample needs a temperature above 0 (greedy answers would all agree)")
    prompter = options.prompt.bind(engine.tokenizer, engine.model_name)
    ask = AskSettings(prompter=prompter, budget=options.budget, temperature=options.temperature, on_token=on_token)
    meter = EnergyMeter(str(engine.model.device))
    meter.start()
    started = time.perf_counter()
    block_owner = {problem_id: graft_id for graft_id, problem_id, _ in library.block_entries}
    asked: list[_Asked] = []
    for index, item in enumerate(items):
        for sample in range(options.samples):
            asked.append(_ask_problem(engine, item, library, ask, options.gate, block_owner, options.code, sample))
        if on_problem is not None:
            on_problem(index + 1, len(items))
    bench_wall = time.perf_counter() - started
    energy = meter.stop()
    results = [a.result for a in asked]
    verified = None
    if options.verify_receipts:
        results = [_receipts_checked(engine, a) for a in asked]
        verified = sum(
            bool(answer.receipt_verified)
            for result in results
            for answer in (result.grafted, result.code)
            if answer is not None and answer.receipt_id is not None
        )
    kept = tuple(r for a in asked for r in (a.code, a.grafted) if r is not None)
    tally = ReceiptTally(total=len(kept), verified=verified, kept=kept)
    return results, LadderFacts(wall_s=bench_wall, energy=energy, receipts=tally)


def _receipts_checked(engine: Engine, asked: _Asked) -> ProblemResult:
    result = asked.result
    if asked.grafted is not None:
        exact = verify_receipt(engine, asked.grafted).exact
        result = replace(result, grafted=replace(result.grafted, receipt_verified=exact))
    if asked.code is not None and result.code is not None:
        exact = verify_receipt(engine, asked.code).exact
        result = replace(result, code=replace(result.code, receipt_verified=exact))
    return result


def summarize(
    results: list[ProblemResult],
    budget: int,
    facts: LadderFacts,
    gate: Gate,
    solve_wall_s: Mapping[str, float] | None = None,
    options: LadderOptions | None = None,
) -> BenchSummary:
    """Count a ladder run.

    Args:
        results: `run_ladder`'s results.
        budget: the most new tokens per answer the run used.
        facts: `run_ladder`'s facts.
        gate: the gate the run used.
        solve_wall_s: seconds the harvest spent on each problem, by problem id, when it ran in the same process
            (a graft does not record its wall time: its id must not depend on it).
        options: the run's options, when it was given some (samples, temperature, prompt format).

    Returns:
        The summary, unlabelled (set model, dataset and the rest with `dataclasses.replace`).
    """
    samples = options.samples if options else 1
    rungs_run = [rung for rung in Rung if rung is not Rung.CODE or any(r.code is not None for r in results)]
    rungs = {
        rung: {
            split: Tally.of(
                [r.rung(rung) for r in results if split is Split.ALL or r.seen == (split is Split.SEEN)], samples
            )
            for split in Split
        }
        for rung in rungs_run
    }
    used = [(r.id, r.upstream) for r in results if r.seen and r.upstream is not None and r.sample == 0]
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
        uses_per_graft=samples,
    )
    outcomes: dict[str, int] | None = None
    if Rung.CODE in rungs:
        outcomes = {}
        for r in results:
            program = r.code.program if r.code is not None else None
            outcome = program.outcome if program is not None else "not_run"
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
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
        samples=samples,
        temperature=options.temperature if options else 0.0,
        code_outcomes=outcomes,
        prompt=options.prompt if options and options.prompt.format.value != "plain" else None,
    )
