"""Random single-byte flips, truncations and appends of every kind of file a store holds.

Each trial damages one file of the tiny store (faultkit.build_tiny_store), then observes everything a user can get
from the store through the Python API: every graft read back with every hash checked (manifest and tensor
hashes), each block as a build reusing it reads it, the library index, `store stats`, `ls`, retrieval rankings, the
receipt with its verification, and which grafts a `TrustedStore` under the tiny store's policy lists and lets
through (a signature file damaged must refuse its graft with one UntrustedGraftError line, and never let a refused
graft through). The trial is then

- detected: every observation that differs from the undamaged baseline is a kvgraft error (what the CLI prints
  as one `error:` line);
- accepted, harmless: every observation equals the baseline; the trial records which bytes were changed (file
  kind, region, JSON field) as its reason;
- a silent acceptance (fails): some observation differs and is not an error;
- a traceback (fails): some observation raised something other than a kvgraft error;
- and a graft is lost (fails) when a graft that does not depend on the damaged file cannot be read.

A sample of trials is replayed through the CLI (in process, and two through the real `kvgraft` in a subprocess).
CI runs 200 trials, `--campaign` 5,000 (KVGRAFT_FAULTS_TRIALS sets another count); KVGRAFT_FAULTS_SEED picks
another seed.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import struct
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from kvgraft.cli import app
from kvgraft.cli.grafts import graft_row
from kvgraft.cli.inputs import read_text_file
from kvgraft.core.errors import KvgraftError, UntrustedGraftError
from kvgraft.core.hashing import sha256_tensor
from kvgraft.engine.verify import verify_receipt
from kvgraft.format.receipt import parse_receipt
from kvgraft.library.index import INDEX_NAME, load_index, store_stats
from kvgraft.library.library import Library
from kvgraft.store.trust import SIGNATURES_GENERATION, TrustedStore

from faultkit import Summary, TinyStore, build_tiny_store, is_campaign, one_error_line, run_cli

pytestmark = pytest.mark.faults

QUERIES = ("blocks shared between grafts", "rivers and bridges", "receipts record a generation", "crash")
JSON_KINDS = {"manifest", "index", "receipt", "signature"}
Outcome = tuple[Any, ...]
"""("ok", value), ("error", class name, message) or ("traceback", text)"""


@dataclass(frozen=True)
class Damage:
    """One trial's damage: which file, how, where."""

    seed: int
    kind: str
    path: Path
    mutation: str
    """"flip", "truncate" or "append" """
    offset: int
    """the flipped byte, the new length, or the old length (where the append starts)"""
    data: bytes
    """the XOR mask (one byte) or the appended bytes"""

    def apply(self, original: bytes) -> bytes:
        if self.mutation == "flip":
            return original[: self.offset] + bytes([original[self.offset] ^ self.data[0]]) + original[self.offset + 1 :]
        if self.mutation == "truncate":
            return original[: self.offset]
        return original + self.data

    def describe(self, root: Path) -> str:
        return (
            f"seed {self.seed}: {self.mutation} {self.path.relative_to(root)} ({self.kind}) at {self.offset}"
            f" data {self.data.hex()}"
        )


def file_kind(root: Path, path: Path) -> str | None:
    """The kind of a store file, None for files that are no part of the store's content (lock, tmp/)."""
    rel = path.relative_to(root).parts
    if rel[0] == "blocks":
        return "block"
    if rel[0] == "grafts":
        return "manifest" if rel[-1] == "manifest.json" else "tensors"
    if rel == (INDEX_NAME,):
        return "index"
    if rel[0] in ("receipts", "signatures"):
        return rel[0][:-1]
    return None


def store_files(root: Path) -> dict[str, list[Path]]:
    """Every content file of the store, by kind."""
    files: dict[str, list[Path]] = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        kind = file_kind(root, path)
        if kind is not None:
            files.setdefault(kind, []).append(path)
    return files


def header_end(data: bytes) -> int:
    """Where a safetensors file's header ends (8 + its declared length), clamped to the file."""
    return min(len(data), 8 + struct.unpack("<Q", data[:8])[0]) if len(data) >= 8 else len(data)


def draw_damage(seed: int, files: dict[str, list[Path]], originals: dict[Path, bytes]) -> Damage:
    """One random damage: a kind (uniformly, so small files are hit as often as blocks), a file, a mutation."""
    rng = random.Random(seed)
    kind = rng.choice(sorted(files))
    path = rng.choice(files[kind])
    data = originals[path]
    mutation = rng.choices(["flip", "truncate", "append"], weights=[6, 2, 2])[0]
    if mutation == "flip":
        # Half the flips of a safetensors file hit its header: the tensor bytes are most of it, and all alike.
        in_header = kind not in JSON_KINDS and rng.random() < 0.5
        offset = rng.randrange(header_end(data) if in_header else len(data))
        return Damage(seed, kind, path, mutation, offset, bytes([rng.randrange(1, 256)]))
    if mutation == "truncate":
        return Damage(seed, kind, path, mutation, rng.randrange(len(data)), b"")
    count = rng.randint(1, 16)
    alphabet = b" \n\t\r" if rng.random() < 0.5 else bytes(range(256))
    return Damage(seed, kind, path, mutation, len(data), bytes(rng.choice(alphabet) for _ in range(count)))


def attempt(func: Callable[[], Any]) -> Outcome:
    try:
        return ("ok", func())
    except KvgraftError as exc:
        return ("error", type(exc).__name__, str(exc))
    except Exception:
        return ("traceback", traceback.format_exc())


class Observer:
    """Everything the store gives back, through the API; the receipt's rerun is memoized by its parsed content
    (a verification reads nothing but the receipt and the model, so equal receipts verify alike)."""

    def __init__(self, tiny: TinyStore, everything: bool) -> None:
        self.tiny = tiny
        self.everything = everything
        """read every graft and block in every trial (campaign); else those that read the damaged file, and one
        other graft (LocalStore.get reads only its graft's manifest, tensors file and blocks)"""
        self.block_keys = sorted(p.name.removesuffix(".safetensors") for p in tiny.store.block_files())
        self._verified: dict[str, Any] = {}

    def graft(self, graft_id: str) -> dict[str, Any]:
        stored = self.tiny.store.get(graft_id)
        manifest = {k: v for k, v in stored.manifest.to_json().items() if k != "created_at"}
        return {"manifest": manifest, "tensors": {n: sha256_tensor(t) for n, t in sorted(stored.tensors.items())}}

    def ls(self) -> list[dict[str, Any]]:
        store = self.tiny.store
        rows = [graft_row(graft_id, store.manifest(graft_id)) for graft_id in store.ids()]
        return [{k: v for k, v in row.items() if k != "created_at"} for row in rows]

    def receipt(self) -> dict[str, Any]:
        receipt = parse_receipt(read_text_file(self.tiny.root / self.tiny.receipt_name), self.tiny.receipt_name)
        body = {k: v for k, v in receipt.to_json().items() if k not in ("created_at", "timings")}
        canonical = json.dumps(body, sort_keys=True)
        if canonical not in self._verified:
            check = verify_receipt(self.tiny.engine, receipt)
            self._verified[canonical] = [check.tokens_equal, check.logits_equal, check.first_divergence]
        return {"receipt": body, "verification": self._verified[canonical]}

    def search(self) -> list[list[Any]]:
        library = Library.from_store(self.tiny.store)
        return [[(h.graft_id, round(h.score, 9), h.label) for h in library.search(q, k=10)] for q in QUERIES]

    def trust(self) -> dict[str, Outcome]:
        """Each graft as a fresh `TrustedStore` under the tiny store's policy sees it: ("ok", its id) when trusted,
        the refusal otherwise. A refusal that is not one UntrustedGraftError line, or `ids()` disagreeing with what
        `resolve` lets through, is recorded as an "ok" value that differs from the baseline (a failure)."""
        tier = TrustedStore(self.tiny.store, self.tiny.policy)
        listed = attempt(tier.ids)
        if listed[0] != "ok":
            return {"trust:ids": ("ok", f"ids() under the policy failed: {listed[1:]}")}
        seen: dict[str, Outcome] = {"trust:ids": ("ok", "listed")}
        for name, graft_id in self.tiny.grafts.items():
            outcome = attempt(lambda g=graft_id: tier.resolve(g))
            if outcome[0] == "error" and (outcome[1] != UntrustedGraftError.__name__ or "\n" in outcome[2]):
                outcome = ("ok", f"refused with {outcome[1]}, not one UntrustedGraftError line: {outcome[2]!r}")
            if outcome[0] != "traceback" and (outcome[0] == "ok") != (graft_id in listed[1]):
                outcome = ("ok", f"ids() lists it: {graft_id in listed[1]}, resolve gives {outcome[:2]}")
            seen[f"trust:{name}"] = outcome
        return seen

    def observe(self, grafts: set[str] | None = None, blocks: set[str] | None = None) -> dict[str, Outcome]:
        """Everything, or (`grafts`, `blocks` given, unless `everything`) only those grafts and blocks."""
        store = self.tiny.store
        seen: dict[str, Outcome] = {"ids": attempt(store.ids), "ls": attempt(self.ls)}
        for name, graft_id in self.tiny.grafts.items():
            if self.everything or grafts is None or name in grafts:
                seen[f"get:{name}"] = attempt(lambda g=graft_id: self.graft(g))
        for key in self.block_keys:  # as a build reusing the block reads it: checked against its declared digest
            if self.everything or blocks is None or key in blocks:
                seen[f"reuse:{key[:12]}"] = attempt(lambda k=key: str(store.read_block(k)[0].sha256))
        seen["index"] = attempt(lambda: {k: asdict(v) for k, v in sorted(load_index(store).items())})
        # disk_bytes (and the ratio over it) are the files' true sizes: a truncated or padded file changes them.
        seen["stats"] = attempt(
            lambda: {k: v for k, v in store_stats(store).to_json().items() if k not in ("disk_bytes", "dedup_ratio")}
        )
        seen["search"] = attempt(self.search)
        seen["receipt"] = attempt(self.receipt)
        seen |= self.trust()
        return seen


def json_paths(a: Any, b: Any, path: str = "") -> set[str]:
    """The paths at which two JSON values differ (list indices written [*])."""
    if isinstance(a, dict) and isinstance(b, dict):
        return set().union(*(json_paths(a.get(k), b.get(k), f"{path}.{k}".lstrip(".")) for k in set(a) | set(b)))
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return set().union(set(), *(json_paths(x, y, f"{path}[*]") for x, y in zip(a, b, strict=True)))
    return set() if a == b else {path or "<root>"}


def safetensors_header(data: bytes) -> Any:
    return json.loads(data[8 : header_end(data)])


def harmless_reason(damage: Damage, original: bytes, damaged: bytes, after: bytes | None) -> str:
    """Which bytes a harmless acceptance changed, and so why they cannot change a result.

    Args:
        damage: the trial's damage.
        original: the file before; damaged: after the damage; after: after the observation (None when gone).
    """
    if damage.kind == "index" and after != damaged:
        return "index: damaged copy not trusted, rebuilt from the grafts"
    parse = json.loads if damage.kind in JSON_KINDS else safetensors_header
    try:
        before_value, damaged_value = parse(original), parse(damaged)
    except ValueError:
        return f"{damage.kind}: unparseable, ignored"
    if before_value == damaged_value:
        if damage.kind in JSON_KINDS:
            return f"{damage.kind}: JSON whitespace (same parsed value)"
        if damage.mutation == "flip" and damage.offset < header_end(original):
            return f"{damage.kind}: header JSON whitespace/padding (same parsed header)"
        return f"{damage.kind}: {damage.mutation} outside the header"
    return f"{damage.kind}: field {', '.join(sorted(json_paths(before_value, damaged_value)))}"


def signature_reason(tiny: TinyStore, damage: Damage, baseline: dict[str, Outcome]) -> str | None:
    """Why a harmless change of a signature file is harmless, when that is not in its parsed fields alone.

    Only files named for a key of the policy are ever read under it (`signatures/<graft id>.<key id>.json`); the
    generation file is random bytes a `TrustedStore` only compares for change. A refused graft's file that still
    gives the same refusal changed nothing a reader sees.
    """
    name = damage.path.relative_to(tiny.root).as_posix()
    if name == SIGNATURES_GENERATION:
        return "signature: the generation file (random bytes, only compared for change)"
    if damage.path.name.split(".")[1] not in tiny.policy.keys:
        return "signature: file of a key the policy does not trust (never read under it)"
    if baseline[f"trust:{tiny.signatures[name]}"][0] != "ok":
        return "signature: of a refused graft, still refused for the same reason"
    return None


def signature_owner(tiny: TinyStore, path: Path) -> set[str]:
    """The graft a signature file named for a trusted key is about, by name (empty for any other file)."""
    name = path.relative_to(tiny.root).as_posix()
    trusted_key = len(path.name.split(".")) == 3 and path.name.split(".")[1] in tiny.policy.keys
    return {tiny.signatures[name]} if trusted_key and name in tiny.signatures else set()


@dataclass
class Trial:
    damage: Damage
    outcome: str
    """"detected", "accepted", "silent" or "traceback" """
    detail: str
    lost: list[str]


def dependents(tiny: TinyStore, path: Path) -> set[str]:
    """Names of the grafts that read `path` (their manifest, tensors file or one of their blocks)."""
    names = set()
    for name, graft_id in tiny.grafts.items():
        manifest = tiny.store.manifest(graft_id)
        own = {tiny.root / "grafts" / graft_id / f for f in ("manifest.json", manifest.tensors_file)}
        if path in own or path in {tiny.store.block_path(ref.key) for ref in manifest.blocks}:
            names.add(name)
    return names


def run_trial(
    tiny: TinyStore, observer: Observer, baseline: dict[str, Outcome], damage: Damage, originals: dict[Path, bytes]
) -> Trial:
    """Damage one file, observe, classify, and put every file back as it was."""
    original = originals[damage.path]
    damaged = damage.apply(original)
    needs = dependents(tiny, damage.path) if damage.kind in ("block", "manifest", "tensors") else set()
    needs |= signature_owner(tiny, damage.path) if damage.kind == "signature" else set()
    others = sorted(set(tiny.grafts) - needs)
    sampled = needs | {random.Random(damage.seed).choice(others)} if others else needs
    block = {damage.path.name.removesuffix(".safetensors")} if damage.kind == "block" else set()
    damage.path.write_bytes(damaged)
    try:
        seen = observer.observe(sampled, block)
        after = damage.path.read_bytes() if damage.path.exists() else None
    finally:
        restore(tiny.root, originals)
    lost = [n for n in tiny.grafts if seen.get(f"get:{n}", ("ok",))[0] != "ok" and n not in needs]
    # Under the policy too: a graft trusted before and refused now, though the damaged file is not its signature.
    lost += [
        f"{n} (under the policy)"
        for n in tiny.grafts
        if baseline[f"trust:{n}"][0] == "ok" and seen.get(f"trust:{n}", ("error",))[0] != "ok" and n not in needs
    ]
    differing = sorted(k for k in seen if seen[k] != baseline[k])
    tracebacks = [k for k, v in seen.items() if v[0] == "traceback"]
    if tracebacks:
        return Trial(damage, "traceback", f"{tracebacks[0]}: {seen[tracebacks[0]][1].splitlines()[-1]}", lost)
    if not differing:
        reason = signature_reason(tiny, damage, baseline) if damage.kind == "signature" else None
        return Trial(damage, "accepted", reason or harmless_reason(damage, original, damaged, after), lost)
    silent = [k for k in differing if seen[k][0] != "error"]
    if silent:
        shown = "; ".join(f"{k}: {str(seen[k][1])[:160]}" for k in silent[:3])
        return Trial(damage, "silent", f"accepted with other {shown}", lost)
    return Trial(damage, "detected", seen[differing[0]][1], lost)


def restore(root: Path, originals: dict[Path, bytes]) -> None:
    """Put every file back (the damaged one, and the index an observation may have rewritten); clear tmp/."""
    for path, data in originals.items():
        if not path.exists() or path.read_bytes() != data:
            path.write_bytes(data)
    extra = [p for p in root.rglob("*") if p.is_file() and p not in originals and p.name != "lock"]
    assert not [p for p in extra if "tmp" not in p.relative_to(root).parts], extra
    shutil.rmtree(root / "tmp", ignore_errors=True)


def tally(trials: list[Trial], seed: int, name: str, root: Path) -> Summary:
    summary = Summary(name, seed)
    for trial in trials:
        summary.counts["trials"] += 1
        summary.counts[
            {"silent": "silently_accepted", "accepted": "accepted_harmless"}.get(trial.outcome, trial.outcome)
        ] += 1
        summary.counts[f"trials_on_{trial.damage.kind}"] += 1
        summary.counts["grafts_lost"] += len(trial.lost)
        if trial.outcome == "accepted":
            summary.reasons[trial.detail] += 1
        elif trial.outcome == "detected":
            summary.errors[trial.detail] += 1
        if trial.outcome in ("silent", "traceback") or trial.lost:
            lost = f" (lost {trial.lost})" if trial.lost else ""
            summary.failures.append(f"{trial.damage.describe(root)}: {trial.outcome} {trial.detail}{lost}")
    for key in ("detected", "silently_accepted", "traceback", "grafts_lost", "accepted_harmless"):
        summary.counts.setdefault(key, 0)
    return summary


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> TinyStore:
    return build_tiny_store(tmp_path_factory.mktemp("corruption") / "store")


def test_random_damage_is_detected_or_harmless(tiny: TinyStore, request: pytest.FixtureRequest) -> None:
    """N seeded trials: zero silent acceptances, zero tracebacks, zero grafts lost; a CLI sample agrees."""
    trials_n = int(os.environ.get("KVGRAFT_FAULTS_TRIALS", 5000 if is_campaign(request) else 200))
    base_seed = int(os.environ.get("KVGRAFT_FAULTS_SEED", "1200"))
    files = store_files(tiny.root)
    assert {"block", "manifest", "tensors", "index", "receipt", "signature"} <= set(files), sorted(files)
    originals = {p: p.read_bytes() for paths in files.values() for p in paths}
    observer = Observer(tiny, everything=is_campaign(request))
    baseline = observer.observe()
    refused = {f"trust:{name}" for name in ("after", "other")}  # re-signed by mallory, forged (faultkit)
    assert all(v[0] == "ok" for k, v in baseline.items() if k not in refused), baseline
    assert [baseline[k][1] for k in sorted(refused)] == ["UntrustedGraftError"] * 2, baseline
    trials = [
        run_trial(tiny, observer, baseline, draw_damage(base_seed + i, files, originals), originals)
        for i in range(trials_n)
    ]
    summary = tally(trials, base_seed, "corruption", tiny.root)
    summary.extra["cli_checked"] = check_cli_sample(tiny, trials, originals, 4 if is_campaign(request) else 1)
    summary.report()
    assert not summary.failures, "\n".join(summary.failures[:20])
    assert summary.counts["detected"] > 0


def cli_command(tiny: TinyStore, trial: Trial) -> list[str]:
    """The command a user would run that reads what the trial damaged."""
    store = ["--store", str(tiny.root)]
    if trial.damage.kind == "signature":
        owner = signature_owner(tiny, trial.damage.path) or {"a"}
        graft = ["-g", tiny.grafts[owner.pop()], "-p", " so", "-n", "2"]
        return ["generate", *graft, "--trusted-keys", str(tiny.keys_dir), *store]
    if trial.damage.kind == "receipt":
        return ["verify", "--receipt", str(tiny.root / tiny.receipt_name), *store]
    if trial.damage.kind == "index":
        return ["store", "stats", "--json", *store]
    needs = sorted(dependents(tiny, trial.damage.path)) or ["a"]
    return ["generate", "-g", tiny.grafts[needs[0]], "-p", " so", "-n", "2", *store]


def readable_by_get(tiny: TinyStore, trial: Trial) -> bool:
    """Whether the damage is one `generate` meets (a block's declared digest is read only when a build reuses it)."""
    return trial.damage.kind in ("receipt", "index", "signature") or bool(dependents(tiny, trial.damage.path))


def check_cli_sample(tiny: TinyStore, trials: list[Trial], originals: dict[Path, bytes], subprocesses: int) -> int:
    """Replay the first detected and the first accepted trial of each kind through the CLI; the first
    `subprocesses` detected ones through the real `kvgraft` in a subprocess (one `error:` line, exit 1).

    Returns:
        How many trials the CLI replayed.
    """
    chosen: dict[tuple[str, str], Trial] = {}
    for trial in trials:
        if trial.outcome in ("detected", "accepted") and readable_by_get(tiny, trial):
            chosen.setdefault((trial.damage.kind, trial.outcome), trial)
    runner = CliRunner()
    baseline_stats = json.loads(runner.invoke(app, ["store", "stats", "--json", "--store", str(tiny.root)]).stdout)
    real = 0
    for (kind, outcome), trial in sorted(chosen.items()):
        command = cli_command(tiny, trial)
        # A signature's graft may be one the policy refuses already (exit 1 undamaged); every other command exits 0.
        undamaged_code = runner.invoke(app, command).exit_code if kind == "signature" else 0
        trial.damage.path.write_bytes(trial.damage.apply(originals[trial.damage.path]))
        try:
            result = runner.invoke(app, command)
            where = trial.damage.describe(tiny.root)
            assert result.exception is None or isinstance(result.exception, SystemExit), (where, result.exception)
            assert "Traceback" not in result.output, (where, result.output)
            if outcome == "detected" and kind != "index":
                assert result.exit_code == 1, (where, result.output)
                lines = result.stderr.strip().splitlines()
                assert len(lines) == 1 and lines[0].startswith("error: "), (where, result.stderr)
                if real < subprocesses and kind in ("block", "receipt", "manifest", "signature"):
                    one_error_line(run_cli(*command))
                    real += 1
            else:
                assert result.exit_code == undamaged_code, (where, result.output)
                if kind == "index":
                    assert json.loads(result.stdout) == baseline_stats, where
        finally:
            restore(tiny.root, originals)
    return len(chosen)


def test_no_bit_flip_or_truncation_of_a_signature_lets_a_refused_graft_through(
    tiny: TinyStore, request: pytest.FixtureRequest
) -> None:
    """Every truncation and every flip of bit 0 or 5 (a hex digit's case; every bit with --campaign) of each byte of
    the two refused grafts' signature files (mallory's signature of "after" and the forgery for "other", both named
    for the trusted key): the graft stays refused, with one UntrustedGraftError line. (No other graft's verdict
    reads these files: a verdict reads only the files named for its own graft id; the random trials check every
    graft's verdict.)"""
    refused = {name: graft for name, graft in tiny.signatures.items() if graft in ("after", "other")}
    assert sorted(refused.values()) == ["after", "other"], tiny.signatures
    bits = range(8) if is_campaign(request) else (0, 5)
    variants = 0
    for name, graft in refused.items():
        path = tiny.root / name
        original = path.read_bytes()
        damaged = [original[:length] for length in range(len(original))]
        damaged += [
            original[:i] + bytes([original[i] ^ (1 << bit)]) + original[i + 1 :]
            for i in range(len(original))
            for bit in bits
        ]
        try:
            for data in damaged:
                path.write_bytes(data)
                with pytest.raises(UntrustedGraftError) as refusal:
                    TrustedStore(tiny.store, tiny.policy).resolve(tiny.grafts[graft])
                assert "\n" not in str(refusal.value), str(refusal.value)
                variants += 1
        finally:
            path.write_bytes(original)
    assert variants > 2 * (1 + len(bits)) * 300
