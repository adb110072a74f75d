"""The flywheel's first half: solve, verify, store.

`harvest` asks the model each problem up to k times (sampled) under a token budget, checks each final answer
against the gold one, and stores only a verified solution, as a replay graft: the exact prompt the model is asked
(in a prompt format: `kvgraft.flywheel.prompting`) followed by its verified worked solution up to the answer
mark. Asked the problem again, the model restores that state and decodes only the answer. Every graft carries the
upstream cost that produced it (attempts, tokens generated, wall time). `import_solutions` stores given worked
solutions instead, each checked first. `build_blocks` packs verified solutions into context blocks that fill the
model's window.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from kvgraft.core.decode import TokenCallback
from kvgraft.core.errors import BadInputError
from kvgraft.core.hashing import GraftId, sha256_token_ids
from kvgraft.engine.engine import Engine
from kvgraft.flywheel.answers import answers_match, extract_answer
from kvgraft.flywheel.datasets import Item
from kvgraft.flywheel.prompting import PlainPrompter, Prompter, PromptSpec
from kvgraft.format.metadata import BlockMetadata, HarvestCost, ProblemRef, ReplayMetadata, SolutionSource
from kvgraft.models.loading import max_positions

ItemCallback = Callable[[int, int], None]
"""called after each item with (items done, items in all)"""


@dataclass(frozen=True, kw_only=True)
class HarvestRecord:
    """What harvest did with one problem."""

    problem_id: str
    problem_sha256: str
    verified: bool
    attempts: int
    tokens_generated: int
    wall_s: float
    build_s: float
    graft_id: GraftId | None
    solution: str | None
    source: SolutionSource
    error: str | None = None
    """why the problem could not be tried or stored (e.g. longer than the model's positions)"""

    def to_json(self) -> dict[str, Any]:
        """Returns: every field by name (`source` as its string)."""
        return asdict(self) | {"source": self.source.value}


@dataclass(frozen=True, kw_only=True)
class HarvestSummary:
    """A harvest in figures (the JSON of `kvgraft harvest`, and a flywheel report's "harvest")."""

    problems: int
    verified: int
    errors: int
    replay_grafts: tuple[str, ...]
    blocks: tuple[str, ...]
    attempts: int
    tokens_generated: int
    wall_s: float

    @classmethod
    def of(cls, records: Sequence[HarvestRecord], blocks: Sequence[str], wall_s: float) -> HarvestSummary:
        """Sum up a harvest.

        Args:
            records: one per problem, from `harvest` or `import_solutions`.
            blocks: the ids `build_blocks` returned.
            wall_s: the harvest's wall time, graft building included.

        Returns:
            The summary.
        """
        return cls(
            problems=len(records),
            verified=sum(r.verified for r in records),
            errors=sum(r.error is not None for r in records),
            replay_grafts=tuple(r.graft_id for r in records if r.graft_id),
            blocks=tuple(blocks),
            attempts=sum(r.attempts for r in records),
            tokens_generated=sum(r.tokens_generated for r in records),
            wall_s=wall_s,
        )

    def to_json(self) -> dict[str, Any]:
        """Returns: every field by name (the id tuples as lists)."""
        return asdict(self) | {"replay_grafts": list(self.replay_grafts), "blocks": list(self.blocks)}

    def totals_json(self) -> dict[str, Any]:
        """Returns: the whole harvest's cost, as a report's "upstream" → "harvest_all" holds it."""
        return {
            "problems_tried": self.problems,
            "verified": self.verified,
            "attempts": self.attempts,
            "tokens_generated": self.tokens_generated,
            "wall_s": self.wall_s,
        }


def replay_text(item: Item, solution: str, prompter: Prompter | None = None) -> str:
    """The text of a replay graft.

    Args:
        item: the problem.
        solution: its verified worked solution.
        prompter: the prompt format (default: plain).

    Returns:
        The prompt plus the solution, cut right after its last answer mark (added when the solution has none).
    """
    return (prompter or PlainPrompter()).replay_text(item.problem, solution)


def budget_for(engine: Engine, input_tokens: int, budget: int) -> int:
    """The most new tokens an answer may take: the budget, cut to what fits in the model's positions.

    A long budget (32768) on a model with a shorter window answers as far as the window goes rather than refusing.

    Args:
        engine: the model.
        input_tokens: the tokens before the answer (graft and prompt).
        budget: the budget asked.

    Returns:
        min(budget, positions - input_tokens); the budget itself when nothing fits (the engine then refuses the
        input with its own error) or the model states no limit.
    """
    limit = max_positions(engine.model)
    if limit is None or limit - input_tokens < 1:
        return budget
    return min(budget, limit - input_tokens)


def _store_replay(
    engine: Engine,
    item: Item,
    solution: str,
    cost: HarvestCost,
    source: SolutionSource,
    check: bool,
    prompter: Prompter,
) -> tuple[GraftId, float]:
    """Store a verified solution as a replay graft; returns its id and the seconds the put took."""
    started = time.perf_counter()
    metadata = ReplayMetadata(
        problem_id=item.id,
        problem_sha256=item.text_sha256,
        prompt_tokens_sha256=sha256_token_ids(engine.encode_context(prompter.prompt(item.problem))),
        answer=item.answer,
        solution=solution,
        source=source,
        cost=cost,
        prompt_format=prompter.format.value,
    )
    put = engine.put(prompter.replay_text(item.problem, solution), metadata=metadata.to_json(), check=check)
    return put.id, time.perf_counter() - started


def problem_seed(seed: int, index: int) -> int:
    """The first sampling seed of problem `index` of a harvest started with `seed` (its tries count up from it)."""
    return seed + 7919 * index


def harvest(
    engine: Engine,
    items: list[Item],
    attempts: int = 4,
    budget: int = 160,
    temperature: float = 0.7,
    seed: int = 0,
    on_item: ItemCallback | None = None,
    check: bool = True,
    prompt: PromptSpec | None = None,
    on_token: TokenCallback | None = None,
) -> list[HarvestRecord]:
    """Solve each item with sampled tries and store each verified solution as a replay graft.

    A problem that cannot be tried (longer than the model's positions) is recorded with its error, not raised.

    Args:
        engine: the model and the store the grafts go to.
        items: the problems, with gold answers.
        attempts: the most tries per problem.
        budget: the most new tokens per try.
        temperature: sampling temperature.
        seed: the first try's seed (each problem and try gets its own, derived from it).
        on_item: progress callback.
        check: compute each stored graft's new blocks twice and refuse to store them unless the two agree in
            every bit (`Engine.put(check=True)`): a verified solution is only worth keeping if its state is exact.
        prompt: the prompt format (default: plain, the demo's).
        on_token: called with each generated token (a progress bar's token count).

    Returns:
        One record per item, in order.

    Raises:
        BadInputError: the chat format for a model without a chat template.
    """
    prompter = (prompt or PromptSpec()).bind(engine.tokenizer, engine.model_name)
    records = []
    for index, item in enumerate(items):
        started = time.perf_counter()
        try:
            seed_i = problem_seed(seed, index)
            tries = _Tries(attempts, budget, temperature, seed_i, on_token)
            records.append(_solve(engine, item, tries, check, prompter))
        except BadInputError as exc:
            wall = time.perf_counter() - started
            records.append(_unsolved(item, SolutionSource.MODEL, wall_s=wall, error=str(exc)))
        if on_item is not None:
            on_item(index + 1, len(items))
    return records


@dataclass(frozen=True)
class _Tries:
    """How one problem is tried: at most `attempts` samples from `seed` on, each under `budget` new tokens."""

    attempts: int
    budget: int
    temperature: float
    seed: int
    on_token: TokenCallback | None = None


def _solve(engine: Engine, item: Item, plan: _Tries, check: bool, prompter: Prompter) -> HarvestRecord:
    tokens, started, solution, tries = 0, time.perf_counter(), None, 0
    prompt = prompter.prompt(item.problem)
    room = budget_for(engine, len(engine.encode_context(prompt)), plan.budget)
    for attempt in range(plan.attempts):
        tries = attempt + 1
        params = prompter.stop.sampling(room, plan.temperature, plan.seed + attempt)
        result = engine.generate(prompt, params=params, on_token=plan.on_token)
        tokens += len(result.output_tokens)
        if answers_match(item.answer, prompter.answer(result.text)):
            solution = result.text
            break
    wall = time.perf_counter() - started
    graft_id: GraftId | None = None
    build_s = 0.0
    if solution is not None:
        # No wall time in the graft: its id hashes its metadata, and the same seeds must give the same id on any
        # run, machine or Ray worker. The record keeps the time (HarvestRecord.wall_s).
        cost = HarvestCost(attempts=tries, tokens_generated=tokens)
        graft_id, build_s = _store_replay(engine, item, solution, cost, SolutionSource.MODEL, check, prompter)
    return HarvestRecord(
        problem_id=item.id,
        problem_sha256=item.text_sha256,
        verified=solution is not None,
        attempts=tries,
        tokens_generated=tokens,
        wall_s=wall,
        build_s=build_s,
        graft_id=graft_id,
        solution=solution,
        source=SolutionSource.MODEL,
    )


def _unsolved(item: Item, source: SolutionSource, wall_s: float, error: str) -> HarvestRecord:
    return HarvestRecord(
        problem_id=item.id,
        problem_sha256=item.text_sha256,
        verified=False,
        attempts=0,
        tokens_generated=0,
        wall_s=wall_s,
        build_s=0.0,
        graft_id=None,
        solution=None,
        source=source,
        error=error,
    )


def import_solutions(
    engine: Engine,
    items: list[Item],
    on_item: ItemCallback | None = None,
    check: bool = True,
    prompt: PromptSpec | None = None,
) -> list[HarvestRecord]:
    """Store the items' own worked solutions as replay grafts, each only if its final answer checks against the gold.

    Args:
        engine: the model and the store the grafts go to.
        items: the problems, with gold answers and worked solutions (an item without one is not verified).
        on_item: progress callback.
        check: as in `harvest`: store a graft only if its state computes to the same bits twice.
        prompt: the prompt format the grafts' prompts are written in (default: plain).

    Returns:
        One record per item, in order (a solution that cannot be stored is not verified, with its error).
    """
    prompter = (prompt or PromptSpec()).bind(engine.tokenizer, engine.model_name)
    records = []
    for index, item in enumerate(items):
        solution = item.solution
        verified = bool(solution) and answers_match(item.answer, _final_answer(solution or ""))
        graft_id: GraftId | None = None
        build_s, error = 0.0, None
        if verified and solution:
            try:
                cost = HarvestCost(attempts=0, tokens_generated=0)
                source = SolutionSource.IMPORTED
                graft_id, build_s = _store_replay(engine, item, solution, cost, source, check, prompter)
            except BadInputError as exc:
                verified, error = False, str(exc)
        records.append(
            HarvestRecord(
                problem_id=item.id,
                problem_sha256=item.text_sha256,
                verified=verified,
                attempts=0,
                tokens_generated=0,
                wall_s=0.0,
                build_s=build_s,
                graft_id=graft_id,
                solution=solution,
                source=SolutionSource.IMPORTED,
                error=error,
            )
        )
        if on_item is not None:
            on_item(index + 1, len(items))
    return records


def _final_answer(solution: str) -> str | None:
    """The answer a worked solution states: after its last answer mark, else its last \\boxed{...}."""
    marked = extract_answer(solution)
    if marked is not None:
        return marked
    at = solution.rfind("\\boxed{")
    if at < 0:
        return None
    depth, start = 0, at + len("\\boxed{")
    for position in range(start, len(solution)):
        if solution[position] == "{":
            depth += 1
        elif solution[position] == "}":
            if depth == 0:
                return solution[start:position]
            depth -= 1
    return None


def build_blocks(
    engine: Engine,
    records: list[HarvestRecord],
    items: list[Item],
    reserve: int = 256,
    check: bool = True,
    prompt: PromptSpec | None = None,
) -> list[GraftId]:
    """Pack verified solutions into context blocks that fit the model's window, and store them.

    Args:
        engine: the model and the store the blocks go to.
        records: harvest records; the verified ones are packed, in order.
        items: the problems the records name.
        reserve: tokens each block leaves free for a query and its answer.
        check: as in `harvest`.
        prompt: the prompt format each problem is written in (default: plain).

    Returns:
        The blocks' graft ids.
    """
    prompter = (prompt or PromptSpec()).bind(engine.tokenizer, engine.model_name)
    window = max_positions(engine.model) or 2048
    limit = window - reserve
    by_id = {item.id: item for item in items}
    blocks: list[list[tuple[Item, str]]] = [[]]
    used = 1  # BOS
    for record in records:
        if not record.verified or record.solution is None:
            continue
        item = by_id[record.problem_id]
        entry = prompter.prompt(item.problem) + record.solution + "\n"
        size = len(engine.encode_continuation(entry))
        if used + size > limit and blocks[-1]:
            blocks.append([])
            used = 1
        blocks[-1].append((item, record.solution))
        used += size
    ids: list[GraftId] = []
    for block in blocks:
        if not block:
            continue
        text = "".join(prompter.prompt(item.problem) + solution + "\n" for item, solution in block)
        metadata = BlockMetadata(
            problems=tuple(
                ProblemRef(id=item.id, problem_sha256=item.text_sha256, text=item.problem) for item, _ in block
            )
        )
        ids.append(engine.put(text, metadata=metadata.to_json(), check=check).id)
    return ids
