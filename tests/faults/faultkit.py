"""Shared helpers of the store's fault-injection suite (tests/faults/test_*.py, except the server's).

Not a conftest.py: a second `conftest` module (tests/ has no __init__.py, so both would be the module `conftest`)
replaces tests/conftest.py in sys.modules and breaks every later `from conftest import ...`.

What is here: the tiny store every fault test damages (a few grafts on random:llama with shared prefixes, a graft
built after another, the library index, a receipt, writers' signatures and the trust policy they are read under),
forking a child after the model is loaded, the real CLI in a
subprocess, and the summary table each test prints (and writes as JSON to $KVGRAFT_FAULTS_REPORT when set).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from kvgraft.core.sampling import SamplingParams
from kvgraft.engine.engine import Engine
from kvgraft.format import blocks as format_blocks
from kvgraft.format.signature import GraftSignature, SigningKey, sign
from kvgraft.library.index import load_index
from kvgraft.store import LocalStore
from kvgraft.store.trust import TrustPolicy, sign_graft, signature_name

from conftest import TEST_CHUNK, cached_model

MODEL = "random:llama"
REPORT_ENV = "KVGRAFT_FAULTS_REPORT"
PREFIX = (
    "Grafts keep the state of a model after it has read a text, so that the text need not be read again. "
    "Every byte of a stored graft is checked before it is used. "
)
"""~160 tokens: ten whole blocks that every graft built on it shares."""
SUFFIXES = (
    "The first ending tells of blocks shared between grafts",
    "A second ending speaks of manifests and their hashes, and of tensors files.",
    "Third: the index lists every graft, and receipts record what a generation did.",
    "Fourth and last, a crash never leaves half a graft behind in the store.",
)
OTHER_TEXT = "An unrelated text about rivers, bridges and the weather in the mountains, with no shared prefix at all."


def is_campaign(request: pytest.FixtureRequest) -> bool:
    """Whether pytest runs with --campaign (the long form of the suite)."""
    return bool(request.config.getoption("--campaign"))


def make_engine(store: LocalStore) -> Engine:
    """An engine on the tiny random Llama (built once per session) over `store`, chunks of TEST_CHUNK tokens."""
    model, tokenizer = cached_model(MODEL)
    return Engine(model, tokenizer, MODEL, TEST_CHUNK, store)


def aligned_text(engine: Engine, text: str) -> str:
    """`text` padded with dots until its token count is a multiple of the chunk size: such a graft keeps every
    token's KV and its next-token logits (a non-empty tensors file)."""
    while len(engine.encode_context(text)) % TEST_CHUNK:
        text += "."
    return text


def graft_texts(engine: Engine) -> list[str]:
    """Texts sharing PREFIX (so their leading blocks are shared); the first is aligned (it stores logits)."""
    texts = [PREFIX + suffix for suffix in SUFFIXES]
    texts[0] = aligned_text(engine, texts[0])
    return texts


def fixed_key(name: str) -> SigningKey:
    """A fixed ed25519 key per name (the SHA-256 of the name as its seed): the signature files, like every other
    file of the tiny store, are the same bytes on every run, so a trial's seed replays it exactly."""
    return SigningKey(Ed25519PrivateKey.from_private_bytes(hashlib.sha256(f"kvgraft faults {name}".encode()).digest()))


def write_public_key(directory: Path, name: str, key: SigningKey) -> None:
    """`directory/NAME.pub`, as `kvgraft keys new` writes it (PEM SubjectPublicKeyInfo)."""
    directory.mkdir(parents=True, exist_ok=True)
    pem = key.public.key.public_bytes(Encoding.PEM, PublicFormat.SubjectPublicKeyInfo)
    (directory / f"{name}.pub").write_bytes(pem)


@dataclass
class TinyStore:
    """The store the corruption trials damage, and what it holds."""

    root: Path
    store: LocalStore
    engine: Engine
    grafts: dict[str, str]
    """name -> graft id: "a".."d" share PREFIX, "after" continues "a" (build --after), "other" shares nothing"""
    receipt_name: str
    """the sidecar name of the receipt of a generation from graft "a": receipts/<receipt id>.json"""
    keys_dir: Path
    """the trusted keys' directory (alice.pub only), what `--trusted-keys` names"""
    policy: TrustPolicy
    """the policy of `keys_dir`: "a".."d" are trusted (alice signed them); "after" and "other" are refused"""
    signatures: dict[str, str]
    """sidecar name -> the name of the graft it is about (every signature file of the store)"""


def sign_tiny_store(store: LocalStore, grafts: dict[str, str]) -> dict[str, str]:
    """Sign the tiny store's grafts: alice (trusted) signs "a".."d"; mallory (not trusted) signs "a" under her own
    name, which no reader under the policy reads, and re-signs "after" in a file named for alice's key; "other" has
    a forgery in a file named for alice's key (alice's signature of "a", its graft_id field rewritten).

    A single-byte change cannot turn either refused file into a valid signature of its graft: the forged signature
    differs from alice's signature of "other" in most of its 64 bytes, and mallory's key differs from alice's in
    its public key and key id (the key id must be its public key's hash).

    Returns:
        Sidecar name -> the graft it is about, by name.
    """
    alice, mallory = fixed_key("alice"), fixed_key("mallory")
    names: dict[str, str] = {}
    for name in "abcd":
        names[signature_name(grafts[name], sign_graft(store, grafts[name], alice).key_id)] = name
    names[signature_name(grafts["a"], sign_graft(store, grafts["a"], mallory).key_id)] = "a"
    resigned = sign(grafts["after"], mallory)  # type: ignore[arg-type]
    names[signature_name(grafts["after"], alice.public.id)] = "after"
    store.write_sidecar(signature_name(grafts["after"], alice.public.id), resigned.to_bytes())
    copied = sign(grafts["a"], alice)  # type: ignore[arg-type]
    forged = GraftSignature(grafts["other"], copied.key_id, copied.public_key, copied.signature)  # type: ignore[arg-type]
    names[signature_name(grafts["other"], alice.public.id)] = "other"
    store.write_sidecar(signature_name(grafts["other"], alice.public.id), forged.to_bytes())
    return names


def build_tiny_store(root: Path) -> TinyStore:
    """Build the tiny store: six grafts with shared blocks, one after another, the index, one receipt, the
    signatures of `sign_tiny_store` and the trusted keys' directory (`root`'s sibling `trusted-keys/`).

    Args:
        root: the store's directory (created).

    Returns:
        The store, its engine, the graft ids by name, the receipt's sidecar name and the trust policy.
    """
    store = LocalStore(root)
    engine = make_engine(store)
    grafts: dict[str, str] = {}
    for name, text in zip("abcd", graft_texts(engine), strict=False):
        grafts[name] = engine.put(text, metadata={"title": f"graft {name}"}).id
    grafts["after"] = engine.put(" and the graft after it goes on a little.", after=grafts["a"]).id
    grafts["other"] = engine.put(aligned_text(engine, OTHER_TEXT), metadata={"title": "rivers"}).id
    result = engine.generate(" so", graft_id=grafts["a"], params=SamplingParams(max_new_tokens=4))
    receipt_name = f"receipts/{result.receipt.id}.json"
    store.write_sidecar(receipt_name, (json.dumps(result.receipt.to_json(), indent=1, sort_keys=True) + "\n").encode())
    signatures = sign_tiny_store(store, grafts)
    keys_dir = root.parent / "trusted-keys"
    write_public_key(keys_dir, "alice", fixed_key("alice"))
    load_index(store)  # writes index.json
    return TinyStore(root, store, engine, grafts, receipt_name, keys_dir, TrustPolicy.load(keys_dir), signatures)


def forked(work: Callable[[], None]) -> int:
    """Run `work` in a forked child (the model already loaded in this process); returns the child's pid.

    The child exits 0 when `work` returns, 3 after printing the traceback of an exception; never runs pytest's
    exit handlers.
    """
    pid = os.fork()
    if pid:
        return pid
    try:
        # The parent's block-assembly pool has no threads in the child: a fresh one (see format.blocks).
        format_blocks._assembly_pool.cache_clear()
        work()
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(3)
    os._exit(0)


def run_cli(*args: object, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """The real `kvgraft` command line in a subprocess (HF offline, the package from src/)."""
    env = os.environ | {"HF_HUB_OFFLINE": "1", "PYTHONPATH": str(Path(__file__).parents[2] / "src")}
    return subprocess.run(
        [sys.executable, "-m", "kvgraft.cli", *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        check=False,
    )


def one_error_line(proc: subprocess.CompletedProcess[str]) -> str:
    """The CLI's one `error:` line on stderr (exit code 1, no traceback); asserts that is what happened."""
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    assert proc.returncode == 1, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    return lines[0]


@dataclass
class Summary:
    """Counts of one fault campaign, printed as a table and written to $KVGRAFT_FAULTS_REPORT."""

    name: str
    seed: int
    counts: Counter[str] = field(default_factory=Counter)
    reasons: Counter[str] = field(default_factory=Counter)
    """harmless acceptances by reason (which bytes, why they cannot change a result)"""
    errors: Counter[str] = field(default_factory=Counter)
    """detections by error class"""
    failures: list[str] = field(default_factory=list)
    """one line per failed trial (silent acceptance, traceback, lost graft), with its seed"""
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "counts": dict(self.counts),
            "accepted_harmless_by_reason": dict(self.reasons.most_common()),
            "detected_by_error": dict(self.errors.most_common()),
            "failures": self.failures[:200],
            **self.extra,
        }

    def report(self) -> None:
        """Print the table (seen with pytest -s) and merge the JSON into $KVGRAFT_FAULTS_REPORT when set."""
        lines = [f"== {self.name} (seed {self.seed}) =="]
        lines += [f"  {key:<28} {value}" for key, value in sorted(self.counts.items())]
        lines += [f"  detected by {key:<20} {value}" for key, value in self.errors.most_common()]
        lines += [f"  harmless: {key} -> {value}" for key, value in self.reasons.most_common()]
        lines += [f"  {key}: {value}" for key, value in self.extra.items()]
        lines += [f"  FAILED {line}" for line in self.failures[:30]]
        print("\n" + "\n".join(lines))
        path = os.environ.get(REPORT_ENV)
        if path:
            target = Path(path)
            data = json.loads(target.read_text()) if target.is_file() else {}
            data[self.name] = self.to_json()
            target.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
