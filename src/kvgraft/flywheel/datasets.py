"""Problem sets for harvest and bench: the demo exam, the bundled public benchmarks, or any JSONL file."""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from kvgraft.core.errors import BadInputError
from kvgraft.core.hashing import Sha256Hex, sha256_bytes
from kvgraft.flywheel.problems import exam_problems

BUNDLED = ("aime2025", "aime2024", "amc2023", "math500")
DEMO_EXAM = "demo"


@dataclass(frozen=True)
class Item:
    """One problem: `answer` is the gold answer as text ("70", "\\frac{3}{4}"); `solution` a worked one, if known."""

    id: str
    problem: str
    answer: str
    solution: str | None = None

    @property
    def text_sha256(self) -> Sha256Hex:
        """SHA-256 of the problem text's UTF-8 bytes (what marks a problem seen)."""
        return sha256_bytes(self.problem.encode())


def load_dataset(name: str) -> list[Item]:
    """Load a problem set.

    Args:
        name: `demo` (the 30-problem demo exam), a bundled set by name (aime2025, aime2024, amc2023, math500), or
            a path to a JSONL file with `problem` and `answer` fields (`id` and `solution` optional).

    Returns:
        The problems, in file order.

    Raises:
        BadInputError: an unknown name, a malformed line, or a file without problems.
    """
    if name == DEMO_EXAM:
        return [Item(p.id, p.text, str(p.answer), p.solution) for p in exam_problems()]
    if name in BUNDLED:
        text = resources.files("kvgraft").joinpath(f"data/benchmarks/{name}.jsonl").read_text(encoding="utf-8")
        return _parse_jsonl(text, name)
    path = Path(name)
    if not path.is_file():
        raise BadInputError(f"unknown dataset {name!r}: use demo, {', '.join(BUNDLED)}, or a JSONL file path")
    return _parse_jsonl(path.read_text(encoding="utf-8"), str(path))


def _parse_jsonl(text: str, where: str) -> list[Item]:
    items: list[Item] = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            problem, answer = row["problem"], row["answer"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise BadInputError(
                f'{where}:{number}: expected a JSON object with "problem" and "answer" ({exc})'
            ) from None
        solution = row.get("solution")
        items.append(
            Item(str(row.get("id", number - 1)), str(problem), str(answer), str(solution) if solution else None)
        )
    if not items:
        raise BadInputError(f"{where}: no problems in file")
    return items
