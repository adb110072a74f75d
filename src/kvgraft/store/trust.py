"""Trust for shared libraries: writers' signatures kept beside the grafts, and a tier that hides unsigned grafts.

A signature is the sidecar `signatures/<graft id>.<key id>.json` of any store (local or S3), so a reader under a
policy finds the signature a trusted key would have made by its name alone, with no listing. `TrustedStore` puts a
policy in front of a store: a graft no trusted key has signed is left out of `ids()` (so the library, retrieval and
the server never pick it) and refused by every read that names it (`UntrustedGraftError`, one line that says why).
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from kvgraft.core.errors import FormatError, StoreError, UntrustedGraftError
from kvgraft.core.hashing import GraftId
from kvgraft.format.manifest import Manifest
from kvgraft.format.signature import (
    GraftSignature,
    KeyId,
    PublicKey,
    SigningKey,
    check_signature,
    parse_signature,
    read_trusted_keys,
    sign,
)
from kvgraft.store.base import RECEIPTS_DIR, SIGNATURES_DIR, GraftStore, StoredGraft, StoreTier

SIGNATURES_GENERATION = f"{SIGNATURES_DIR}/generation"
"""A sidecar rewritten (random bytes) after every signature is written: part of a `TrustedStore`'s change token,
so that a server under a policy sees a graft signed after it listed the store."""


def signature_name(graft_id: str, key_id: str) -> str:
    """The sidecar name of a key's signature of a graft: `signatures/<graft id>.<key id>.json`."""
    return f"{SIGNATURES_DIR}/{graft_id}.{key_id}.json"


@dataclass(frozen=True)
class TrustPolicy:
    """The keys whose signatures make a graft usable."""

    keys: Mapping[KeyId, PublicKey]
    where: str
    """where the keys came from (their directory), for messages"""

    @classmethod
    def load(cls, directory: Path) -> TrustPolicy:
        """Every `*.pub` in `directory`; BadInputError when there is none or the directory is missing."""
        return cls(read_trusted_keys(directory), str(directory))


@dataclass(frozen=True)
class Verdict:
    """Whether a graft is signed by a trusted key."""

    signer: KeyId | None
    """the trusted key whose signature verifies; None when none does"""
    reason: str
    """why not ("unsigned", a bad or untrusted signature); empty when trusted"""

    @property
    def trusted(self) -> bool:
        return self.signer is not None


def judge(store: GraftStore, graft_id: str, policy: TrustPolicy) -> Verdict:
    """Read the signatures the policy's keys would have made of a graft, and check them.

    Args:
        store: the store the graft is in.
        graft_id: the graft's full id.
        policy: the trusted keys.

    Returns:
        The first trusted key whose signature verifies; otherwise the first reason found ("unsigned" when no
        trusted key's signature file exists).
    """
    reasons: list[str] = []
    for key_id in sorted(policy.keys):
        name = signature_name(graft_id, key_id)
        raw = store.read_sidecar(name)
        if raw is None:
            continue
        try:
            reason = check_signature(parse_signature(raw, name), graft_id, policy.keys)
        except FormatError as exc:
            reason = str(exc)
        if reason is None:
            return Verdict(key_id, "")
        reasons.append(reason)
    return Verdict(None, reasons[0] if reasons else "unsigned")


def sign_graft(store: GraftStore, graft_id: str, key: SigningKey) -> GraftSignature:
    """Sign a stored graft and keep the signature beside it.

    Args:
        store: the store (a plain one: a graft is signed before any policy trusts it).
        graft_id: the graft's id or a unique prefix.
        key: the writer's key.

    Returns:
        The signature written.

    Raises:
        NotFoundError: no such graft.
        StoreError: the store did not keep the signature (read-only).
    """
    full = store.resolve(graft_id)
    signature = sign(full, key)
    name = signature_name(full, signature.key_id)
    data = signature.to_bytes()
    store.write_sidecar(name, data)
    if store.read_sidecar(name) != data:  # write_sidecar keeps nothing, silently, in a store it cannot write
        raise StoreError(f"store {store.location} did not keep the signature {name} (is it read-only?)")
    store.write_sidecar(SIGNATURES_GENERATION, secrets.token_hex(16).encode())
    return signature


class TrustedStore(StoreTier):
    """A store seen through a trust policy: only grafts signed by a trusted key are there for use.

    `ids()` lists only trusted grafts; `resolve`, `manifest`, `get` and `own_tensors` of any other raise
    `UntrustedGraftError`. A graft found trusted stays so for the tier's life (an id never changes content, and the
    keys are fixed); an untrusted one is judged again each time, so a signature added later is seen. Writes pass
    through, except the derived sidecars (the index): written from this filtered view, they would drop the grafts
    this policy hides from every other reader of the store.
    """

    def __init__(self, inner: GraftStore, policy: TrustPolicy) -> None:
        super().__init__(inner)
        self.policy = policy
        self._trusted: dict[str, KeyId] = {}
        self._lock = threading.Lock()

    def verdict(self, graft_id: str) -> Verdict:
        """The verdict on a graft (by full id), from the cache when it was found trusted before."""
        with self._lock:
            signer = self._trusted.get(graft_id)
        if signer is not None:
            return Verdict(signer, "")
        verdict = judge(self.inner, graft_id, self.policy)
        if verdict.signer is not None:
            with self._lock:
                self._trusted[graft_id] = verdict.signer
        return verdict

    def require(self, graft_id: str) -> None:
        """Raise UntrustedGraftError unless a trusted key signed the graft (by full id)."""
        verdict = self.verdict(graft_id)
        if not verdict.trusted:
            raise UntrustedGraftError(
                f"graft {graft_id[:12]} is not signed by a trusted key ({self.policy.where}): {verdict.reason}"
            )

    def ids(self) -> list[GraftId]:
        return [graft_id for graft_id in self.inner.ids() if self.verdict(graft_id).trusted]

    def resolve(self, id_or_prefix: str) -> GraftId:
        full = self.inner.resolve(id_or_prefix)
        self.require(full)
        return full

    def manifest(self, graft_id: str) -> Manifest:
        return self.inner.manifest(self.resolve(graft_id))

    def get(self, graft_id: str) -> StoredGraft:
        return self.inner.get(self.resolve(graft_id))

    def own_tensors(self, manifest: Manifest) -> dict[str, torch.Tensor]:
        self.require(manifest.id)
        return self.inner.own_tensors(manifest)

    def prefetch(self, graft_id: str) -> bool:
        full = self.inner.resolve(graft_id)
        return self.verdict(full).trusted and self.inner.prefetch(full)

    def change_token(self) -> Hashable | None:
        """The store's token and the signatures' generation: a new signature changes it as a new graft does."""
        token = self.inner.change_token()
        return None if token is None else (token, self.inner.read_sidecar(SIGNATURES_GENERATION))

    def write_sidecar(self, name: str, data: bytes) -> None:
        if name.startswith((f"{RECEIPTS_DIR}/", f"{SIGNATURES_DIR}/")):
            self.inner.write_sidecar(name, data)
