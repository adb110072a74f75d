"""The flywheel's first half: solve, verify, store.

`harvest` asks the model each problem up to k times (sampled) under a token budget, checks each final answer
against the gold one, and stores only a verified solution, as a replay graft: the exact prompt the model is asked
followed by its verified worked solution up to the answer mark. Asked the problem again, the model restores that
state and decodes only the answer. Every graft carries the upstream cost that produced it (attempts, tokens
generated, wall time). `import_solutions` stores given worked solutions instead, each checked first.
`build_blocks` packs verified solutions into context blocks that fill the model's window.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from kvgraft.core.errors import BadInputError
from kvgraft.core.hashing import sha256_token_ids
from kvgraft.core.sampling import SamplingParams
from kvgraft.engine.engine import Engine
from kvgraft.flywheel.answers import answers_match, extract_answer
from kvgraft.flywheel.datasets import Item
from kvgraft.flywheel.problems import ANSWER_MARK, prompt_of
from kvgraft.models.loading import max_positions

STOP = ("\n",)
ItemCallback = Callable[[int, int], None]


@dataclass(frozen=True)
class HarvestRecord:
    problem_id: str
    problem_sha256: str
    verified: bool
    attempts: int
    tokens_generated: int
    wall_s: float
    build_s: float
    graft_id: str | None
    solution: str | None
    source: str
    error: str | None = None
    """why the problem could not be tried or stored (e.g. longer than the model's positions)"""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def replay_text(item: Item, solution: str) -> str:
    """Prompt plus verified solution, cut right after the last answer mark (added when the solution has none)."""
    at = solution.rfind(ANSWER_MARK)
    reasoning = solution[: at + len(ANSWER_MARK)] if at >= 0 else f"{solution.rstrip()}\n{ANSWER_MARK}"
    return prompt_of(item.problem) + reasoning


def _store_replay(
    engine: Engine, item: Item, solution: str, cost: dict[str, Any], source: str, check: bool
) -> tuple[str, float]:
    started = time.perf_counter()
    metadata = {
        "kind": "replay",
        "problem_id": item.id,
        "problem_sha256": item.text_sha256,
        "prompt_tokens_sha256": sha256_token_ids(engine.encode_context(prompt_of(item.problem))),
        "answer": item.answer,
        "solution": solution,
        "source": source,
        "cost": cost,
    }
    put = engine.put(replay_text(item, solution), metadata=metadata, check=check)
    return put.id, time.perf_counter() - started


def harvest(
    engine: Engine,
    items: list[Item],
    attempts: int = 4,
    budget: int = 160,
    temperature: float = 0.7,
    seed: int = 0,
    on_item: ItemCallback | None = None,
    check: bool = True,
) -> list[HarvestRecord]:
    """Solve each item with up to `attempts` sampled tries of at most `budget` new tokens; store verified ones.

    A problem that cannot be tried (longer than the model's positions) is recorded with its error, not raised.
    `check` computes each stored graft's new blocks twice and refuses to store them unless the two agree in every
    bit (`Engine.put(check=True)`): a verified solution is only worth keeping if its state is exact."""
    records = []
    for index, item in enumerate(items):
        started = time.perf_counter()
        try:
            records.append(_solve(engine, item, attempts, budget, temperature, seed + 7919 * index, check))
        except BadInputError as exc:
            wall = time.perf_counter() - started
            records.append(
                HarvestRecord(item.id, item.text_sha256, False, 0, 0, wall, 0.0, None, None, "model", str(exc))
            )
        if on_item is not None:
            on_item(index + 1, len(items))
    return records


def _solve(
    engine: Engine, item: Item, attempts: int, budget: int, temperature: float, seed: int, check: bool
) -> HarvestRecord:
    tokens, started, solution, tries = 0, time.perf_counter(), None, 0
    for attempt in range(attempts):
        tries = attempt + 1
        params = SamplingParams(budget, temperature, 1.0, seed + attempt, STOP)
        result = engine.generate(prompt_of(item.problem), params=params)
        tokens += len(result.output_tokens)
        if answers_match(item.answer, extract_answer(result.text)):
            solution = result.text
            break
    wall = time.perf_counter() - started
    graft_id, build_s = None, 0.0
    if solution is not None:
        cost = {"attempts": tries, "tokens_generated": tokens, "wall_s": round(wall, 4)}
        graft_id, build_s = _store_replay(engine, item, solution, cost, "model", check)
    verified = solution is not None
    return HarvestRecord(item.id, item.text_sha256, verified, tries, tokens, wall, build_s, graft_id, solution, "model")


def import_solutions(
    engine: Engine, items: list[Item], on_item: ItemCallback | None = None, check: bool = True
) -> list[HarvestRecord]:
    """Store the given worked solutions as replay grafts, each only if its final answer checks against the gold
    (and, with `check`, only if its state computes to the same bits twice, as in `harvest`)."""
    records = []
    for index, item in enumerate(items):
        solution = item.solution
        verified = bool(solution) and answers_match(item.answer, _final_answer(solution or ""))
        graft_id, build_s, error = None, 0.0, None
        if verified and solution:
            try:
                cost = {"attempts": 0, "tokens_generated": 0}
                graft_id, build_s = _store_replay(engine, item, solution, cost, "imported", check)
            except BadInputError as exc:
                verified, error = False, str(exc)
        records.append(
            HarvestRecord(
                item.id, item.text_sha256, verified, 0, 0, 0.0, build_s, graft_id, solution, "imported", error
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
    engine: Engine, records: list[HarvestRecord], items: list[Item], reserve: int = 256, check: bool = True
) -> list[str]:
    """Pack verified solutions into context blocks of at most (window - reserve) tokens; returns their ids.
    `check` as in `harvest`."""
    window = max_positions(engine.model) or 2048
    limit = window - reserve
    by_id = {item.id: item for item in items}
    blocks: list[list[tuple[Item, str]]] = [[]]
    used = 1  # BOS
    for record in records:
        if not record.verified or record.solution is None:
            continue
        item = by_id[record.problem_id]
        entry = prompt_of(item.problem) + record.solution + "\n"
        size = len(engine.encode_continuation(entry))
        if used + size > limit and blocks[-1]:
            blocks.append([])
            used = 1
        blocks[-1].append((item, record.solution))
        used += size
    ids = []
    for block in blocks:
        if not block:
            continue
        text = "".join(prompt_of(item.problem) + solution + "\n" for item, solution in block)
        problems = [{"id": item.id, "problem_sha256": item.text_sha256, "text": item.problem} for item, _ in block]
        ids.append(engine.put(text, metadata={"kind": "block", "problems": problems}, check=check).id)
    return ids
