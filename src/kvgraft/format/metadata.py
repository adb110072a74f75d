"""The manifest metadata kvgraft itself writes and reads (docs/FORMAT.md, section 8.1).

`metadata` is free JSON and part of a graft's id. Two shapes have a meaning, written by the flywheel's harvest
and read by the library, its index and the bench:
- replay: {"kind": "replay", "problem_id", "problem_sha256", "prompt_tokens_sha256", "answer", "solution",
  "source", "cost": {"attempts", "tokens_generated"[, "wall_s"]}}
- block:  {"kind": "block", "problems": [{"id", "problem_sha256", "text"}, ...]}
and any graft may carry "summary" or "title", what retrieval finds a graft by when it is not a block.

The writers (`ReplayMetadata`, `BlockMetadata`) produce exactly those dicts, so graft ids stay what they were;
the reader (`GraftMetadata.read`) accepts any metadata and keeps what it can use.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

SUMMARY_CHARS = 2000
"""the most characters of a graft's text `Engine.put` keeps as its default summary, and the index keeps of any"""


class GraftKind(StrEnum):
    """The flywheel's kinds of graft (metadata "kind")."""

    REPLAY = "replay"
    """a problem's prompt and its verified solution up to the answer mark: asked again, only the answer decodes"""
    BLOCK = "block"
    """verified solutions packed into one context block, found by retrieval over their problems"""


class SolutionSource(StrEnum):
    """Where a replay graft's verified solution came from (metadata "source")."""

    MODEL = "model"
    IMPORTED = "imported"


@dataclass(frozen=True, kw_only=True)
class HarvestCost:
    """The upstream cost of a verified solution, failed attempts included (a replay graft's "cost")."""

    attempts: int
    tokens_generated: int
    wall_s: float | None = None
    """seconds spent solving, as grafts harvested before ids were made reproducible recorded it; None in new grafts
    (an id must not depend on timing) and for imported solutions"""

    def to_json(self) -> dict[str, Any]:
        """Returns: {"attempts", "tokens_generated"[, "wall_s"]}, as stored in the metadata."""
        cost: dict[str, Any] = {"attempts": self.attempts, "tokens_generated": self.tokens_generated}
        if self.wall_s is not None:
            cost["wall_s"] = self.wall_s
        return cost

    @classmethod
    def read(cls, raw: object) -> HarvestCost | None:
        """A cost from stored metadata, leniently.

        Args:
            raw: the metadata's "cost" value (any JSON value).

        Returns:
            The cost (a missing count reads as 0), or None when `raw` is not an object.
        """
        if not isinstance(raw, Mapping):
            return None
        wall = raw.get("wall_s")
        return cls(
            attempts=int(raw.get("attempts", 0)),
            tokens_generated=int(raw.get("tokens_generated", 0)),
            wall_s=float(wall) if wall is not None else None,
        )


@dataclass(frozen=True, kw_only=True)
class ProblemRef:
    """A problem whose verified solution a graft holds."""

    id: str
    problem_sha256: str
    """SHA-256 of the problem text's UTF-8 bytes"""
    text: str | None = None
    """the problem text (a block's problems carry it: retrieval matches them; a replay is found by hash)"""

    def to_json(self) -> dict[str, str]:
        """Returns: {"id", "problem_sha256"[, "text"]}."""
        ref = {"id": self.id, "problem_sha256": self.problem_sha256}
        if self.text is not None:
            ref["text"] = self.text
        return ref

    @classmethod
    def read(cls, raw: object) -> ProblemRef | None:
        """A problem from stored metadata (or an index row), leniently.

        Args:
            raw: one entry of a "problems" list (any JSON value).

        Returns:
            The problem, or None when `raw` is not an object with an "id" and a "problem_sha256".
        """
        if not isinstance(raw, Mapping) or "id" not in raw or "problem_sha256" not in raw:
            return None
        text = raw.get("text")
        return cls(
            id=str(raw["id"]), problem_sha256=str(raw["problem_sha256"]), text=None if text is None else str(text)
        )


@dataclass(frozen=True, kw_only=True)
class ReplayMetadata:
    """What harvest stores with a replay graft."""

    problem_id: str
    problem_sha256: str
    prompt_tokens_sha256: str
    """`sha256_token_ids` of the prompt `Q:<problem>\\nA:` encoded as a context: the key a query is matched by"""
    answer: str
    """the gold answer"""
    solution: str
    """the verified worked solution"""
    source: SolutionSource
    cost: HarvestCost
    prompt_format: str = "plain"
    """the prompt format the graft's prompt was written in (`kvgraft.flywheel.prompting.PromptFormat`)"""

    def to_json(self) -> dict[str, Any]:
        """Returns: the metadata dict to store (graft ids hash it: its keys and values never change, and
        "prompt_format" is written only when it is not "plain", so plain grafts keep the ids they always had)."""
        data: dict[str, Any] = {
            "kind": GraftKind.REPLAY.value,
            "problem_id": self.problem_id,
            "problem_sha256": self.problem_sha256,
            "prompt_tokens_sha256": self.prompt_tokens_sha256,
            "answer": self.answer,
            "solution": self.solution,
            "source": self.source.value,
            "cost": self.cost.to_json(),
        }
        if self.prompt_format != "plain":
            data["prompt_format"] = self.prompt_format
        return data


@dataclass(frozen=True, kw_only=True)
class BlockMetadata:
    """What harvest stores with a context block: the problems whose verified solutions it packs."""

    problems: tuple[ProblemRef, ...]

    def to_json(self) -> dict[str, Any]:
        """Returns: the metadata dict to store (graft ids hash it: its keys and values never change)."""
        return {"kind": GraftKind.BLOCK.value, "problems": [problem.to_json() for problem in self.problems]}


@dataclass(frozen=True, kw_only=True)
class GraftMetadata:
    """What the library, its index and the bench read from any graft's metadata (absent keys read as None/())."""

    kind: GraftKind | str | None = None
    """a GraftKind when the metadata names one, else the metadata's own string (kept, never interpreted)"""
    title: Any = None
    """the metadata's "title", as stored"""
    summary: str | None = None
    """the first SUMMARY_CHARS characters of the metadata's "summary" (None when absent or empty)"""
    prompt_tokens_sha256: str | None = None
    problems: tuple[ProblemRef, ...] = ()
    """a replay's one problem (without text), else the metadata's "problems" (well-formed entries only)"""
    cost: HarvestCost | None = None
    """a replay's upstream cost"""
    prompt_format: str | None = None
    """a replay's prompt format ("plain" when its metadata names none); None for other grafts"""

    @classmethod
    def read(cls, metadata: Mapping[str, Any]) -> GraftMetadata:
        """Read a manifest's metadata leniently: malformed parts are dropped, never raised.

        Args:
            metadata: a manifest's `metadata` object.

        Returns:
            What kvgraft uses of it.
        """
        kind = _kind(metadata.get("kind"))
        raw_problems = metadata.get("problems")
        listed = raw_problems if isinstance(raw_problems, list) else []
        problems = tuple(ref for ref in map(ProblemRef.read, listed) if ref is not None)
        if kind is GraftKind.REPLAY:
            problems = _replay_problem(metadata)
        summary = metadata.get("summary")
        prompt_sha = metadata.get("prompt_tokens_sha256")
        return cls(
            kind=kind,
            title=metadata.get("title"),
            summary=str(summary)[:SUMMARY_CHARS] if summary else None,
            prompt_tokens_sha256=prompt_sha if isinstance(prompt_sha, str) else None,
            problems=problems,
            cost=HarvestCost.read(metadata.get("cost")) if kind is GraftKind.REPLAY else None,
            prompt_format=str(metadata.get("prompt_format") or "plain") if kind is GraftKind.REPLAY else None,
        )


def with_default_summary(metadata: Mapping[str, Any], text: str) -> dict[str, Any]:
    """A copy of `metadata` with a "summary" (the text's first SUMMARY_CHARS characters) unless it has one.

    Args:
        metadata: the caller's metadata for a new graft.
        text: the graft's text.

    Returns:
        The metadata to store: retrieval finds a graft by its summary (see kvgraft.library.retrieval).
    """
    return {**metadata, "summary": metadata.get("summary", text[:SUMMARY_CHARS])}


def _replay_problem(metadata: Mapping[str, Any]) -> tuple[ProblemRef, ...]:
    if "problem_id" not in metadata or "problem_sha256" not in metadata:
        return ()
    return (ProblemRef(id=str(metadata["problem_id"]), problem_sha256=str(metadata["problem_sha256"])),)


def _kind(raw: object) -> GraftKind | str | None:
    if not isinstance(raw, str):
        return None
    try:
        return GraftKind(raw)
    except ValueError:
        return raw
