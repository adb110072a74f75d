"""Writers' signatures of grafts: ed25519 over the graft id, and the key files they are made with.

A graft id is the SHA-256 of its manifest, and the manifest names the hash of every tensor the graft holds, so a
signature over the id vouches for every byte of the graft. The bytes signed are `SIGNED_PREFIX` followed by the
64-hex-digit id (ASCII): the prefix keeps a signature from ever being taken for one over something else.

Key files are PEM: a private key as unencrypted PKCS8 (`NAME.key`, mode 0600), a public key as SubjectPublicKeyInfo
(`NAME.pub`). A key's id is the first 16 hex digits of the SHA-256 of its raw 32-byte public key. A signature is a
small JSON file (docs/FORMAT.md, "Signatures"); stores keep it as a sidecar beside the graft.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NewType

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from kvgraft.core.errors import BadInputError, FormatError
from kvgraft.core.hashing import GraftId, Sha256Hex, sha256_bytes

KeyId = NewType("KeyId", str)
"""A public key's id: the first 16 hex digits of the SHA-256 of its raw 32 bytes."""

SIGNATURE_FORMAT = "kvgraft-signature-1"
ALGORITHM = "ed25519"
SIGNED_PREFIX = b"kvgraft-graft-signature-v1:"
PRIVATE_SUFFIX = ".key"
PUBLIC_SUFFIX = ".pub"
_FIELDS = {"format", "graft_id", "key_id", "public_key", "algorithm", "signature"}
_KEY_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")  # used with fullmatch
_HEX_LENGTHS = {"graft_id": 64, "key_id": 16, "public_key": 64, "signature": 128}


def signed_message(graft_id: str) -> bytes:
    """The bytes a signature of a graft signs.

    Args:
        graft_id: the graft's full id (64 hex digits).

    Returns:
        `SIGNED_PREFIX` followed by the id, ASCII.
    """
    return SIGNED_PREFIX + graft_id.encode("ascii")


@dataclass(frozen=True)
class PublicKey:
    """An ed25519 public key and its id."""

    key: Ed25519PublicKey

    @property
    def raw(self) -> bytes:
        """The key's 32 raw bytes."""
        return self.key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)

    @property
    def id(self) -> KeyId:
        return KeyId(sha256_bytes(self.raw)[:16])

    def verifies(self, signature: bytes, graft_id: str) -> bool:
        """Whether `signature` is this key's signature of `graft_id`."""
        try:
            self.key.verify(signature, signed_message(graft_id))
        except InvalidSignature:
            return False
        return True


@dataclass(frozen=True)
class SigningKey:
    """An ed25519 private key, with its public half."""

    key: Ed25519PrivateKey

    @property
    def public(self) -> PublicKey:
        return PublicKey(self.key.public_key())


@dataclass(frozen=True)
class GraftSignature:
    """One writer's signature of one graft, as its JSON file holds it."""

    graft_id: GraftId
    key_id: KeyId
    public_key: str
    """the signer's raw public key, 64 hex digits"""
    signature: str
    """the ed25519 signature of `signed_message(graft_id)`, 128 hex digits"""

    def to_json(self) -> dict[str, Any]:
        return {
            "format": SIGNATURE_FORMAT,
            "graft_id": self.graft_id,
            "key_id": self.key_id,
            "public_key": self.public_key,
            "algorithm": ALGORITHM,
            "signature": self.signature,
        }

    def to_bytes(self) -> bytes:
        """The signature file's bytes (sorted keys, one field a line)."""
        return (json.dumps(self.to_json(), indent=1, sort_keys=True) + "\n").encode("ascii")


def sign(graft_id: GraftId, key: SigningKey) -> GraftSignature:
    """Sign a graft id.

    Args:
        graft_id: the graft's full id.
        key: the writer's key.

    Returns:
        The signature, ready to be kept beside the graft.
    """
    public = key.public
    return GraftSignature(graft_id, public.id, public.raw.hex(), key.key.sign(signed_message(graft_id)).hex())


def parse_signature(raw: bytes, where: str) -> GraftSignature:
    """Read a signature file, checking its form (not whether it verifies: see `check_signature`).

    Args:
        raw: the file's bytes.
        where: the file's name, for messages.

    Returns:
        The signature.

    Raises:
        FormatError: not JSON, other fields, another format or algorithm, a field that is not lowercase hex of its
            length, or a key id that is not its public key's.
    """
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise FormatError(f"signature file {where} is not JSON: {exc}") from None
    if not isinstance(data, dict) or set(data) != _FIELDS:
        raise FormatError(f"signature file {where} does not have exactly the fields {sorted(_FIELDS)}")
    if data["format"] != SIGNATURE_FORMAT or data["algorithm"] != ALGORITHM:
        raise FormatError(f"signature file {where} is not a {SIGNATURE_FORMAT} {ALGORITHM} signature")
    for field, length in _HEX_LENGTHS.items():
        value = data[field]
        if not isinstance(value, str) or not re.fullmatch(f"[0-9a-f]{{{length}}}", value):
            raise FormatError(f"signature file {where}: {field} is not {length} lowercase hex digits")
    if sha256_bytes(bytes.fromhex(data["public_key"]))[:16] != data["key_id"]:
        raise FormatError(f"signature file {where}: key_id is not the id of its public_key")
    return GraftSignature(
        GraftId(Sha256Hex(data["graft_id"])), KeyId(data["key_id"]), data["public_key"], data["signature"]
    )


def check_signature(signature: GraftSignature, graft_id: str, trusted: Mapping[KeyId, PublicKey]) -> str | None:
    """Whether a signature vouches for a graft under a set of trusted keys.

    The signature is checked with the trusted key of its key id, never with the public key the file carries (which
    anyone can write).

    Args:
        signature: a parsed signature file.
        graft_id: the full id of the graft it is meant for.
        trusted: the trusted public keys, by id.

    Returns:
        None when it does; otherwise why not, in a few words.
    """
    if signature.graft_id != graft_id:
        return f"the signature is for graft {signature.graft_id[:12]}, not this one"
    key = trusted.get(signature.key_id)
    if key is None or key.raw.hex() != signature.public_key:
        return f"signature by key {signature.key_id} is not trusted"
    if not key.verifies(bytes.fromhex(signature.signature), graft_id):
        return f"signature by key {signature.key_id} does not verify"
    return None


# --- key files --------------------------------------------------------------------------------------------------


def write_key_pair(directory: Path, name: str) -> tuple[Path, Path, SigningKey]:
    """Make a new key pair and write `directory/NAME.key` (private, mode 0600) and `directory/NAME.pub`.

    Args:
        directory: where the files go (created if missing).
        name: the files' name, without suffix.

    Returns:
        The private key file, the public key file and the key.

    Raises:
        BadInputError: a name that is not a plain file name, either file existing already (never overwritten), or
            a directory that cannot be written.
    """
    if not _KEY_NAME.fullmatch(name):
        raise BadInputError(f"key name {name!r} is not a plain file name (letters, digits, '.', '_', '-')")
    private_path, public_path = directory / f"{name}{PRIVATE_SUFFIX}", directory / f"{name}{PUBLIC_SUFFIX}"
    for path in (private_path, public_path):
        if path.exists():
            raise BadInputError(f"{path} exists already; a key file is never overwritten (choose another name)")
    key = SigningKey(Ed25519PrivateKey.generate())
    private_pem = key.key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    public_pem = key.public.key.public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    try:
        directory.mkdir(parents=True, exist_ok=True)
        _write_new(private_path, private_pem, 0o600)
        _write_new(public_path, public_pem, 0o644)
    except FileExistsError as exc:
        raise BadInputError(f"{exc.filename} exists already; a key file is never overwritten") from None
    except OSError as exc:
        raise BadInputError(f"cannot write key files in {directory}: {exc.strerror}") from None
    return private_path, public_path, key


def _write_new(path: Path, data: bytes, mode: int) -> None:
    """Create `path` with `mode` from the start (a private key is never readable by others, even briefly)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def _read_pem(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise BadInputError(f"cannot read key file {path}: {exc.strerror}") from None


def read_signing_key(path: Path) -> SigningKey:
    """A private key file (PEM PKCS8, unencrypted, ed25519).

    Raises:
        BadInputError: unreadable, or not an unencrypted ed25519 private key.
    """
    try:
        key = serialization.load_pem_private_key(_read_pem(path), password=None)
    except (ValueError, TypeError) as exc:
        raise BadInputError(f"{path} is not an unencrypted PEM private key: {exc}") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise BadInputError(f"{path} is not an ed25519 private key")
    return SigningKey(key)


def read_public_key(path: Path) -> PublicKey:
    """A public key file (PEM SubjectPublicKeyInfo, ed25519).

    Raises:
        BadInputError: unreadable, or not an ed25519 public key.
    """
    try:
        key = serialization.load_pem_public_key(_read_pem(path))
    except (ValueError, TypeError) as exc:
        raise BadInputError(f"{path} is not a PEM public key: {exc}") from None
    if not isinstance(key, Ed25519PublicKey):
        raise BadInputError(f"{path} is not an ed25519 public key")
    return PublicKey(key)


def read_trusted_keys(directory: Path) -> dict[KeyId, PublicKey]:
    """Every public key (`*.pub`) in a directory, by id.

    Args:
        directory: the trusted keys' directory.

    Returns:
        The keys, by id (at least one).

    Raises:
        BadInputError: no such directory, no `*.pub` in it, or a `*.pub` that is not an ed25519 public key.
    """
    if not directory.is_dir():
        raise BadInputError(f"trusted keys directory {directory} does not exist or is not a directory")
    keys = {key.id: key for key in map(read_public_key, sorted(directory.glob(f"*{PUBLIC_SUFFIX}")))}
    if not keys:
        raise BadInputError(f"trusted keys directory {directory} holds no public key (*{PUBLIC_SUFFIX})")
    return keys
