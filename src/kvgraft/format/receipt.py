"""Receipts: a JSON record of one generation that anyone can re-check by rerunning it fresh.

A receipt commits to the fingerprint of the run, the graft used, every input token id, every output token id
and, through a chained SHA-256, the bytes of every step's logits. With several grafts it records their
`Composition`: `{"mode": "chain", "grafts": [ids]}`, or `{"mode": "approximate", "grafts": [ids], "offsets": [the
position each graft starts at]}`.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from kvgraft.core.errors import FormatError
from kvgraft.core.fingerprint import Fingerprint
from kvgraft.core.hashing import GraftId, Sha256Hex, sha256_json, sha256_token_ids
from kvgraft.core.sampling import SamplingParams

RECEIPT_VERSION = 2
_ID_EXCLUDED = ("id", "created_at", "timings")


class CompositionMode(StrEnum):
    """CHAIN: the grafts form one chain, so the last one's state is theirs, bit for bit (exact).
    APPROXIMATE: grafts built separately, re-positioned one after another (never exact)."""

    CHAIN = "chain"
    APPROXIMATE = "approximate"


@dataclass(frozen=True, kw_only=True)
class Composition:
    """Several grafts in one context, in order."""

    mode: CompositionMode
    grafts: tuple[str, ...]
    """The graft ids, in context order."""
    offsets: tuple[int, ...] | None = None
    """The position at which each graft starts (approximate compositions)."""

    @property
    def approximate(self) -> bool:
        return self.mode is CompositionMode.APPROXIMATE

    def to_json(self) -> dict[str, Any]:
        """The JSON object receipts and generation results carry; `offsets` only when there are some."""
        data: dict[str, Any] = {"mode": self.mode.value, "grafts": list(self.grafts)}
        if self.offsets is not None:
            data["offsets"] = list(self.offsets)
        return data

    @classmethod
    def from_json(cls, value: Any) -> Composition | None:
        """Read `to_json`'s object, or null.

        Args:
            value: the decoded JSON value.

        Returns:
            The composition, or None for null.

        Raises:
            ValueError: not null nor an object with a known mode and at least two grafts.
        """
        if value is None:
            return None
        if not isinstance(value, dict) or value.get("mode") not in [mode.value for mode in CompositionMode]:
            raise ValueError("composition must be null or an object with mode 'chain' or 'approximate'")
        if not isinstance(value.get("grafts"), list) or len(value["grafts"]) < 2:
            raise ValueError("composition.grafts must list at least two grafts")
        offsets = value.get("offsets")
        return cls(
            mode=CompositionMode(value["mode"]),
            grafts=tuple(str(graft) for graft in value["grafts"]),
            offsets=None if offsets is None else tuple(int(offset) for offset in offsets),
        )


@dataclass(frozen=True, kw_only=True)
class Receipt:
    """One generation, committed to: what ran (fingerprint, graft, sampling), on what input, with what output."""

    fingerprint: Fingerprint
    model_name: str
    graft_id: GraftId | None
    graft_aligned_tokens: int
    input_tokens: list[int]
    output_tokens: list[int]
    logits_chain_sha256: Sha256Hex
    sampling: SamplingParams
    exact: bool
    environment_differences: list[str]
    created_at: str
    timings: dict[str, float]
    composition: Composition | None = None
    """Several grafts in one context (a chain, or an approximate composition); None for one graft or none."""

    @property
    def approximate(self) -> bool:
        """Whether the run was an approximate composition, which is never exact."""
        return self.composition is not None and self.composition.approximate

    def to_json(self) -> dict[str, Any]:
        """The receipt's JSON object, with its `id` first."""
        body = {
            "receipt_version": RECEIPT_VERSION,
            "fingerprint": self.fingerprint.to_json(),
            "model_name": self.model_name,
            "graft_id": self.graft_id,
            "graft_aligned_tokens": self.graft_aligned_tokens,
            "input_tokens": list(self.input_tokens),
            "input_sha256": sha256_token_ids(self.input_tokens),
            "output_tokens": list(self.output_tokens),
            "output_sha256": sha256_token_ids(self.output_tokens),
            "logits_chain_sha256": self.logits_chain_sha256,
            "steps": len(self.output_tokens),
            "sampling": self.sampling.to_json(),
            "exact": self.exact,
            "environment_differences": list(self.environment_differences),
            "composition": self.composition.to_json() if self.composition is not None else None,
            "approximate": self.approximate,
            "created_at": self.created_at,
            "timings": dict(self.timings),
        }
        return {"id": receipt_id(body), **body}

    @property
    def id(self) -> Sha256Hex:
        return Sha256Hex(self.to_json()["id"])

    def write(self, path: Path) -> None:
        """Write the JSON, indented, keys sorted, with a final newline: whole or not at all (a temporary file beside
        it, renamed over it; on a full disk nothing is left, not an empty receipt)."""
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                handle.write(json.dumps(self.to_json(), indent=1, sort_keys=True) + "\n")
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


def receipt_id(body: dict[str, Any]) -> Sha256Hex:
    """SHA-256 of the canonical receipt without `id`, `created_at` and `timings` (which vary run to run).

    Args:
        body: the receipt's JSON object (with or without `id`).

    Returns:
        The receipt's id.
    """
    return sha256_json({k: v for k, v in body.items() if k not in _ID_EXCLUDED})


def parse_receipt(raw: str, where: str) -> Receipt:
    """Read and check a receipt's JSON.

    Args:
        raw: the JSON text.
        where: names the receipt in error messages (a path, "request").

    Returns:
        The receipt.

    Raises:
        FormatError: not valid JSON, an unknown version, a malformed field, or hashes or id that do not match.
    """
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise FormatError(f"{where}: receipt is not valid JSON ({exc.msg})") from None
    if not isinstance(data, dict) or data.get("receipt_version") != RECEIPT_VERSION:
        version = data.get("receipt_version") if isinstance(data, dict) else None
        raise FormatError(f"{where}: unknown receipt_version {version!r}; this kvgraft reads version {RECEIPT_VERSION}")
    try:
        receipt = Receipt(
            fingerprint=Fingerprint.from_json(data["fingerprint"]),
            model_name=str(data["model_name"]),
            graft_id=data["graft_id"],
            graft_aligned_tokens=int(data["graft_aligned_tokens"]),
            input_tokens=[int(t) for t in data["input_tokens"]],
            output_tokens=[int(t) for t in data["output_tokens"]],
            logits_chain_sha256=Sha256Hex(str(data["logits_chain_sha256"])),
            sampling=SamplingParams.from_json(data["sampling"]),
            exact=bool(data["exact"]),
            environment_differences=[str(d) for d in data["environment_differences"]],
            created_at=str(data["created_at"]),
            timings={str(k): float(v) for k, v in data["timings"].items()},
            composition=Composition.from_json(data["composition"]),
        )
        if data["approximate"] is not receipt.approximate:
            raise ValueError("approximate must be true exactly for an approximate composition")
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise FormatError(f"{where}: malformed receipt ({type(exc).__name__}: {exc})") from None
    if data.get("input_sha256") != sha256_token_ids(receipt.input_tokens):
        raise FormatError(f"{where}: input_sha256 does not match input_tokens")
    if data.get("output_sha256") != sha256_token_ids(receipt.output_tokens):
        raise FormatError(f"{where}: output_sha256 does not match output_tokens")
    if data.get("id") != receipt.id:
        raise FormatError(f"{where}: receipt id does not match its content (the receipt was edited)")
    return receipt
