"""A content-addressed store in an S3 bucket (or any S3-compatible service), through obstore.

Layout under s3://BUCKET/PREFIX/ is the local store's: grafts/<id>/manifest.json, grafts/<id>/tensors.safetensors
and blocks/<2 hex>/<block key>.safetensors, so a synced copy is a valid local store (docs/FORMAT.md).

Object stores have no rename and no lock, so the rules differ from the local store's (docs/FORMAT.md, "Remote
stores"):

- Commit point: a put uploads the blocks first, then the tensors file, then the manifest last with a conditional
  create (`If-None-Match: *`). A graft is visible exactly when its manifest is; a killed upload leaves at most
  unreferenced blocks (and a tensors file), which `gc` removes once older than its grace period.
- Integrity: every manifest, tensors file and block fetched is checked exactly as a local read (the same checking
  functions, over the fetched bytes); a mismatch raises and nothing is served.
- Concurrent writers of one block write identical bytes (a block's key commits to its content under kvgraft's
  exactness contract), so a plain overwrite is safe.
- gc takes no lock: it removes unreferenced blocks whose last_modified is older than the grace period. A put that
  reuses a stored block older than half the default grace period uploads it again, which renews its last_modified,
  so a put that commits within half that period never names a block gc may remove.
- Faults: connect and read timeouts and three retries with backoff bound how long a dead, silent or flaky endpoint
  takes to fail (well under a second when refused, about RETRY_TIMEOUT when silent). Every failure is one
  StoreError line: unreachable, connection dropped mid-request, credentials refused, bucket missing. Every object is
  one PUT (no multipart upload, which could leave hidden parts behind), and a put whose upload fails waits for its
  other uploads before raising, so nothing it started writes afterwards.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
import uuid
from collections.abc import Callable, Hashable, Iterable, Iterator
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn, TypeVar

import obstore
import torch
from obstore.exceptions import (
    AlreadyExistsError,
    BaseError,
    NotSupportedError,
    PermissionDeniedError,
    PreconditionError,
    UnauthenticatedError,
)
from obstore.store import S3Store as _ObjectStore

from kvgraft.core.errors import (
    FormatError,
    IntegrityError,
    MissingBlockError,
    NotFoundError,
    StoreError,
)
from kvgraft.core.hashing import BlockKey, GraftId, Sha256Hex
from kvgraft.format.blocks import BLOCK_SUFFIX, empty_assembly
from kvgraft.format.manifest import (
    MANIFEST_NAME,
    BlockRef,
    Manifest,
    expected_block_shapes,
    manifest_bytes,
    parse_manifest,
)
from kvgraft.format.tensor_files import (
    block_file_bytes,
    declared_block_digest_bytes,
    read_block_checked_bytes,
    read_tensors_checked_bytes,
    tensors_file_bytes,
)
from kvgraft.store.base import (
    GC_GRACE_S,
    GcReport,
    StoredGraft,
    check_sidecar_name,
    manifest_keys,
    resolve_id,
    stored_block_digest,
)

if TYPE_CHECKING:
    from obstore import ObjectMeta
    from obstore.store import BackoffConfig, ClientConfig, RetryConfig, S3Config

S3_SCHEME = "s3://"
ENDPOINT_ENVS = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")
"""Endpoint overrides, most specific first (the AWS SDKs' names), for S3-compatible services."""

# Bounded so that a dead endpoint fails in seconds: a few quick retries with backoff, then a clear error. The
# request timeout is generous because one block of a large model is tens of MB.
CONNECT_TIMEOUT = timedelta(seconds=3)
READ_TIMEOUT = timedelta(seconds=5)
"""Longest silence while reading an answer (GET, HEAD, LIST) before the attempt is retried: an endpoint that accepts
connections but never answers then fails within about RETRY_TIMEOUT, not REQUEST_TIMEOUT. Writes go without it:
reqwest's read timeout also runs while a request body is still being sent, so a large block on a slow link would
trip it (measured: a 3 MB PUT at 0.3 MB/s failed at a 2 s read timeout)."""
REQUEST_TIMEOUT = timedelta(seconds=120)
MAX_RETRIES = 3
RETRY_TIMEOUT = timedelta(seconds=10)
BACKOFF: BackoffConfig = {"init_backoff": timedelta(milliseconds=100), "max_backoff": timedelta(seconds=2), "base": 2}
GENERATION_NAME = "generation"
"""An object every committed put and every delete rewrites: its ETag is the store's change token."""
FETCH_WORKERS = 16
"""Blocks fetched at once by `get`: enough to fill a fast link, few enough not to trip a service's rate limit."""

T = TypeVar("T")
R = TypeVar("R")

_GRAFT_MANIFEST = re.compile(rf"grafts/([0-9a-f]{{64}})/{re.escape(MANIFEST_NAME)}")
_CREDENTIAL_CODES = ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "ExpiredToken", "InvalidToken")
# obstore's errors carry object_store's debug form: the HTTP failure's kind, the retries and the time they took.
_HTTP_KIND = re.compile(r"HttpError \{\s*kind: (\w+)")
_GAVE_UP = re.compile(r" in ([\d.]+)(ns|µs|us|ms|s), after (\d+) retries")
_STATUS = re.compile(r"status code: (\d{3})")
_SECONDS = {"ns": 1e-9, "µs": 1e-6, "us": 1e-6, "ms": 1e-3, "s": 1.0}


def parse_s3_url(url: str) -> tuple[str, str]:
    """The bucket and prefix (no leading or trailing slash, maybe empty) of an s3://BUCKET/PREFIX URL.

    Args:
        url: The store URL.

    Returns:
        (bucket, prefix). Raises StoreError when the URL names no bucket.
    """
    if not url.startswith(S3_SCHEME):
        raise StoreError(f"{url!r} is not an s3:// URL")
    bucket, _, prefix = url[len(S3_SCHEME) :].partition("/")
    if not bucket:
        raise StoreError(f"store URL {url!r} names no bucket (s3://BUCKET/PREFIX expected)")
    return bucket, prefix.strip("/")


def endpoint_from_env() -> str | None:
    """The S3 endpoint override from the environment (AWS_ENDPOINT_URL_S3, then AWS_ENDPOINT_URL), if any."""
    for name in ENDPOINT_ENVS:
        value = os.environ.get(name)
        if value:
            return value
    return None


class S3Store:
    """Implements `GraftStore` in an S3 bucket under a prefix (see the module docstring for the rules).

    Credentials come from the standard AWS chain (environment, profile files, instance metadata), as obstore reads
    them; the endpoint from `endpoint` or AWS_ENDPOINT_URL(_S3), for S3-compatible services.
    """

    def __init__(self, url: str, endpoint: str | None = None, fetch_workers: int = FETCH_WORKERS) -> None:
        self.bucket, self.prefix = parse_s3_url(url)
        self.endpoint = endpoint or endpoint_from_env()
        self._location = f"{S3_SCHEME}{self.bucket}" + (f"/{self.prefix}" if self.prefix else "")
        try:
            self._store = self._client(read_timeout=True)  # reads: a stalled answer fails in seconds
            self._writer = self._client(read_timeout=False)  # writes: bounded by REQUEST_TIMEOUT (see READ_TIMEOUT)
        except BaseError as exc:
            raise StoreError(f"cannot open store {self._location}: {_first_line(exc)}") from None
        self._fetch_workers = max(1, fetch_workers)
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()

    def _client(self, read_timeout: bool) -> _ObjectStore:
        """An obstore client of the bucket and prefix: bounded connect and request timeouts, a few retries with
        exponential backoff and jitter (connection errors, dropped connections, 5xx), and, when `read_timeout`, a
        bound on silence while an answer is read."""
        config: S3Config = {}
        if self.endpoint:
            config["endpoint"] = self.endpoint
        options: ClientConfig = {
            # A loopback or private endpoint (moto, MinIO) is often plain http.
            "allow_http": bool(self.endpoint and self.endpoint.startswith("http://")),
            "connect_timeout": CONNECT_TIMEOUT,
            "timeout": REQUEST_TIMEOUT,
        }
        if read_timeout:
            options["read_timeout"] = READ_TIMEOUT
        retry: RetryConfig = {"max_retries": MAX_RETRIES, "retry_timeout": RETRY_TIMEOUT, "backoff": BACKOFF}
        return _ObjectStore(
            self.bucket, prefix=self.prefix or None, config=config, client_options=options, retry_config=retry
        )

    @property
    def location(self) -> str:
        return self._location

    @property
    def directory(self) -> Path | None:
        return None

    def url(self, path: str) -> str:
        """The s3:// URL of an object of the store, for messages and `tensors_path`."""
        return f"{self._location}/{path}"

    # --- object access: every obstore error becomes a StoreError with one line ---

    @contextlib.contextmanager
    def _errors(self, doing: str) -> Iterator[None]:
        try:
            yield
        except BaseError as exc:
            self._raise_store_error(exc, doing)
        except OSError as exc:  # obstore raises FileNotFoundError for a missing object (callers handle it first)
            self._raise_store_error(exc, doing)

    def _raise_store_error(self, exc: Exception, doing: str) -> NoReturn:
        raise StoreError(self._error_message(exc, doing)) from None

    def _error_message(self, exc: Exception, doing: str) -> str:
        """One line for an obstore error: a missing bucket, refused credentials, an endpoint that cannot be reached
        or does not answer, a connection dropped mid-request, a server error; else obstore's own first line."""
        text = str(exc)
        if "NoSuchBucket" in text:
            return f"bucket {self.bucket} does not exist (store {self._location})"
        code = next((c for c in _CREDENTIAL_CODES if c in text), None)
        if code is None and isinstance(exc, PermissionDeniedError | UnauthenticatedError):
            code = "HTTP 403" if isinstance(exc, PermissionDeniedError) else "HTTP 401"  # a HEAD answers no body
        if code is not None:
            return f"access to store {self._location} denied ({code}): check the AWS credentials and their permissions"
        where = self.endpoint or "the AWS S3 endpoint"
        gave_up = _gave_up(text)
        after = f"; {gave_up}" if gave_up else ""
        kind = _HTTP_KIND.search(text)
        if kind is not None and kind.group(1) == "Connect":
            return f"cannot reach {where} for store {self._location} (connection failed{after})"
        if kind is not None and kind.group(1) == "Timeout":
            return f"cannot reach {where} for store {self._location} (no answer in time{after})"
        if kind is not None:  # Request, Interrupted, Decode: the connection broke mid-request
            dropped = f"connection to {where} dropped while trying to {doing} in store {self._location}"
            return f"{dropped} ({gave_up})" if gave_up else dropped
        status = _STATUS.search(text)
        if status is not None and status.group(1).startswith("5"):
            return f"{where} failed to {doing} in store {self._location} (HTTP {status.group(1)}{after})"
        return f"cannot {doing} in store {self._location}: {_first_line(exc)}"

    def _fetch(self, path: str) -> tuple[bytearray, datetime] | None:
        """An object's bytes (writable, so tensors can view them) and last_modified; None when there is none."""
        with self._errors(f"read {path}"):
            try:
                result = obstore.get(self._store, path)
                data = bytearray(result.bytes())
            except FileNotFoundError as exc:
                if "NoSuchBucket" in str(exc):
                    raise
                return None
            return data, result.meta["last_modified"]

    def _head(self, path: str) -> ObjectMeta | None:
        with self._errors(f"look up {path}"):
            try:
                return obstore.head(self._store, path)
            except FileNotFoundError as exc:
                if "NoSuchBucket" in str(exc):
                    raise
                return None

    def _write(self, path: str, data: bytes) -> None:
        # One PUT, never a multipart upload: it is atomic, and a failed one leaves no hidden parts in the bucket.
        with self._errors(f"write {path}"):
            obstore.put(self._writer, path, data, use_multipart=False)

    def _create(self, path: str, data: bytes) -> bool:
        """Write an object only if none is there (`If-None-Match: *`); False when one was."""
        with self._errors(f"write {path}"):
            try:
                obstore.put(self._writer, path, data, mode="create", use_multipart=False)
            except (AlreadyExistsError, PreconditionError):
                return False
            except NotSupportedError:
                # A service without conditional writes: the manifest's bytes are its id's, so a racing writer of
                # the same graft writes the same bytes; only the created flag may then be wrong.
                if self._head(path) is not None:
                    return False
                obstore.put(self._writer, path, data, use_multipart=False)
            return True

    def _remove(self, path: str) -> None:
        with self._errors(f"delete {path}"):
            obstore.delete(self._store, path)

    def _list(self, prefix: str) -> list[ObjectMeta]:
        with self._errors(f"list {prefix}"):
            return [meta for batch in obstore.list(self._store, prefix, chunk_size=1000) for meta in batch]

    def _list_one(self, prefix: str) -> None:
        """One listing request of at most one object (raises StoreError when the bucket is missing)."""
        with self._errors(f"list {prefix}"):
            next(iter(obstore.list(self._store, prefix, chunk_size=1)), None)

    def _workers(self) -> ThreadPoolExecutor:
        # obstore releases the GIL while it waits on the network and hashlib while it hashes, so threads overlap.
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._fetch_workers, thread_name_prefix="kvgraft-s3")
            return self._pool

    def _all(self, fn: Callable[[T], R], items: Iterable[T]) -> list[R]:
        """`fn` over `items` on the pool (see `_settle`).

        Args:
            fn: What to run on each item (a fetch, an upload).
            items: The items.

        Returns:
            fn's results, in the order of `items`.
        """
        return _settle([self._workers().submit(fn, item) for item in items])

    # --- the GraftStore interface ---

    def _graft_path(self, graft_id: str, name: str) -> str:
        return f"grafts/{graft_id}/{name}"

    def block_path(self, key: str) -> str:
        """The object path (under the prefix) of a block."""
        return f"blocks/{key[:2]}/{key}{BLOCK_SUFFIX}"

    def has_block(self, key: BlockKey) -> bool:
        return self._head(self.block_path(key)) is not None

    def read_block(
        self,
        key: BlockKey,
        block: BlockRef | None = None,
        shapes: dict[str, list[int]] | None = None,
        dtype: str | None = None,
    ) -> tuple[BlockRef, dict[str, torch.Tensor]]:
        """A block's tensors, fetched and checked against `block` or, when None, the digest the block declares."""
        path = self.block_path(key)
        fetched = self._fetch(path)
        if fetched is None:
            raise FormatError(f"{self.url(path)}: block {key[:12]} is missing")
        return read_block_checked_bytes(fetched[0], self.url(path), key, block, shapes, dtype)

    def put(
        self,
        manifest: Manifest,
        tensors: dict[str, torch.Tensor],
        blocks: dict[BlockKey, dict[str, torch.Tensor]] | None = None,
    ) -> tuple[GraftId, bool]:
        """Store a graft: the blocks given that the store lacks, the tensors file, then the manifest (the commit).

        Every block the manifest lists must be given or already stored; a stored block must declare the same digest.
        """
        graft_id = manifest.id
        manifest_path = self._graft_path(graft_id, MANIFEST_NAME)
        given = blocks or {}
        if self._head(manifest_path) is not None:
            self._repair(manifest, tensors, given)
            return graft_id, False
        # Blocks are independent objects: upload them concurrently, then commit only once all are in place. A failed
        # upload leaves at most unreferenced blocks, which gc removes.
        self._all(lambda ref: self._put_block(ref, given.get(ref.key)), manifest.blocks)
        self._write(self._graft_path(graft_id, manifest.tensors_file), tensors_file_bytes(tensors))
        data = manifest_bytes(manifest)
        created = self._create(manifest_path, data)
        if not created:
            # A commit retried after its answer was lost finds its own manifest there: the same bytes (created_at
            # included) mean this put committed it, so the change token must move all the same.
            existing = self._fetch(manifest_path)
            created = existing is not None and bytes(existing[0]) == data
        if created:
            self._bump()
        return graft_id, created

    def _repair(
        self, manifest: Manifest, tensors: dict[str, torch.Tensor], given: dict[BlockKey, dict[str, torch.Tensor]]
    ) -> None:
        """Replace the damaged parts of a stored graft by the writer's: the blocks it gave (each checked in full),
        then its tensors file and manifest when either fails its check."""
        self._all(lambda ref: self._put_block(ref, given[ref.key]), [r for r in manifest.blocks if r.key in given])
        try:
            self.own_tensors(self.manifest(manifest.id))
        except NotFoundError:
            return  # removed meanwhile
        except (FormatError, IntegrityError):
            self._write(self._graft_path(manifest.id, manifest.tensors_file), tensors_file_bytes(tensors))
            self._write(self._graft_path(manifest.id, MANIFEST_NAME), manifest_bytes(manifest))
            self._bump()

    def _put_block(self, ref: BlockRef, tensors: dict[str, torch.Tensor] | None) -> None:
        path = self.block_path(ref.key)
        fetched = self._fetch(path)
        if fetched is not None:
            data, modified = fetched
            where = self.url(path)
            stored = stored_block_digest(
                ref,
                tensors,
                lambda: declared_block_digest_bytes(data, where),
                lambda: read_block_checked_bytes(data, where, ref.key, None, None)[0].sha256,
            )
            if stored is not None:
                if _age_s(modified) >= GC_GRACE_S / 2:
                    # No utime on an object store: rewriting the same bytes renews last_modified, so gc's grace
                    # period covers this put until its manifest names the block.
                    self._write(path, bytes(data))
                return
        if tensors is None:
            raise MissingBlockError(
                f"block {ref.key[:12]} is neither stored nor given (removed while the graft was being built?); "
                "build the graft again"
            )
        # A concurrent writer of the same block writes the same bytes, so a plain overwrite is safe.
        self._write(path, block_file_bytes(tensors, ref.sha256))

    def ids(self) -> list[GraftId]:
        found = (_GRAFT_MANIFEST.fullmatch(meta["path"]) for meta in self._list("grafts"))
        return sorted(GraftId(Sha256Hex(match.group(1))) for match in found if match)

    def change_token(self) -> Hashable | None:
        """The ETag of the store's generation object (one HEAD), which every committed put and every delete
        rewrites, by any process: other replicas see a change at their next look, with no listing and no timer.

        A writer killed between its manifest's commit and the rewrite leaves its graft unseen by this token until
        the next put or delete anywhere in the store (the graft is whole and readable by id meanwhile).
        """
        meta = self._head(GENERATION_NAME)
        if meta is None:
            return ("empty",)
        return (meta.get("e_tag"), str(meta["last_modified"]))

    def _bump(self) -> None:
        self._write(GENERATION_NAME, uuid.uuid4().hex.encode())

    def prefetch(self, graft_id: str) -> bool:
        """No faster tier of its own (a RAM or Redis tier goes in front of it): nothing to start."""
        return False

    def read_sidecar(self, name: str) -> bytes | None:
        fetched = self._fetch(check_sidecar_name(name))
        return bytes(fetched[0]) if fetched is not None else None

    def write_sidecar(self, name: str, data: bytes) -> None:
        """Replace a sidecar object (an S3 put is atomic); a store we may not write to keeps none."""
        path = check_sidecar_name(name)
        with contextlib.suppress(StoreError):
            self._write(path, data)

    def resolve(self, id_or_prefix: str) -> GraftId:
        try:
            return resolve_id(
                id_or_prefix,
                self.location,
                lambda full: self._head(self._graft_path(full, MANIFEST_NAME)) is not None,
                self.ids,
            )
        except NotFoundError:
            # A HEAD answers a missing bucket with a bare 404, as it does a missing graft: one listing tells them
            # apart, so a store on a bucket that is not there says so (StoreError), not "no graft".
            self._list_one(GENERATION_NAME)
            raise

    def manifest(self, graft_id: str) -> Manifest:
        full = self.resolve(graft_id)
        path = self._graft_path(full, MANIFEST_NAME)
        fetched = self._fetch(path)
        if fetched is None:  # deleted between the lookup and the read
            raise NotFoundError(f"no graft {graft_id} in store {self._location}")
        manifest = parse_manifest(bytes(fetched[0]), self.url(path))
        if manifest.id != full:
            raise FormatError(f"graft directory {full} holds graft {manifest.id}")
        return manifest

    def get(self, graft_id: str) -> StoredGraft:
        """Read a graft: its blocks fetched concurrently (a bounded pool), each checked and then copied into its
        place in the per-layer tensors as it arrives, so assembly overlaps the network and a block's fetched bytes
        are freed at once. When anything fails, nothing is returned and no fetch is left running."""
        manifest = self.manifest(graft_id)
        shapes = expected_block_shapes(manifest)
        assembled = empty_assembly(shapes, len(manifest.blocks), manifest.dtype)

        def fetch_into(index: int) -> None:
            ref = manifest.blocks[index]
            _, part = self.read_block(ref.key, ref, shapes, manifest.dtype)
            for name, tensor in part.items():
                size = tensor.shape[-2]
                assembled[name][..., index * size : (index + 1) * size, :].copy_(tensor)

        pool = self._workers()
        pending = [pool.submit(fetch_into, index) for index in range(len(manifest.blocks))]
        try:  # the graft's own small tensors file, in this thread while the blocks arrive
            tensors = self.own_tensors(manifest)
        except BaseException:
            _stop(pending)
            raise
        _settle(pending)
        return StoredGraft(manifest, assembled | tensors)

    def delete(self, graft_id: str) -> None:
        """Remove a graft (its manifest first, so no reader sees half a graft), then its blocks no other names."""
        full = self.resolve(graft_id)
        blocks = self._named_blocks(full)
        self._remove(self._graft_path(full, MANIFEST_NAME))
        self._bump()
        for meta in self._list(f"grafts/{full}"):
            self._remove(meta["path"])
        for key in blocks - self.referenced_blocks() if blocks else ():
            self._remove(self.block_path(key))

    def _named_blocks(self, graft_id: str) -> set[str]:
        def raw() -> bytes | None:
            fetched = self._fetch(self._graft_path(graft_id, MANIFEST_NAME))
            return bytes(fetched[0]) if fetched is not None else None

        return manifest_keys(self, graft_id, raw)

    def referenced_blocks(self) -> set[str]:
        """Keys of every block some graft names (reads every manifest); a damaged manifest's are every key its bytes
        may name (`manifest_keys`)."""
        return {key for keys in self._all(self._named_blocks, self.ids()) for key in keys}

    def gc(self, grace_s: float = GC_GRACE_S) -> GcReport:
        """Remove blocks no graft names whose last_modified is older than `grace_s`, and litter of killed puts
        (graft objects without a manifest) as old. Takes no lock: see the module docstring for why a concurrent put
        is safe."""
        referenced = self.referenced_blocks()
        removed = freed = kept = 0
        for meta in self._list("blocks"):
            key = Path(meta["path"]).name.removesuffix(BLOCK_SUFFIX)
            if key in referenced:
                continue
            if _age_s(meta["last_modified"]) < grace_s:
                kept += 1
                continue
            self._remove(meta["path"])
            removed, freed = removed + 1, freed + meta["size"]
        committed = set(self.ids())
        for meta in self._list("grafts"):
            graft = meta["path"].split("/")[1]
            if graft not in committed and _age_s(meta["last_modified"]) >= grace_s:
                self._remove(meta["path"])
        return GcReport(removed, freed, kept)

    def tensors_path(self, graft_id: str) -> str:
        manifest = self.manifest(graft_id)
        return self.url(self._graft_path(manifest.id, manifest.tensors_file))

    def size_bytes(self, graft_id: str) -> int:
        """Bytes the graft takes on its own: its objects plus every block it names (shared or not)."""
        full = self.resolve(graft_id)
        own = sum(meta["size"] for meta in self._list(f"grafts/{full}"))
        sizes = self._all(lambda ref: self._head(self.block_path(ref.key)), self.manifest(full).blocks)
        return own + sum(meta["size"] for meta in sizes if meta is not None)

    def disk_bytes(self) -> int:
        """Bytes the store's objects take: every graft object and every block, each block counted once."""
        return sum(meta["size"] for meta in self._list("grafts")) + sum(meta["size"] for meta in self._list("blocks"))

    def own_tensors(self, manifest: Manifest) -> dict[str, torch.Tensor]:
        """The graft's tensors file, fetched and checked against `manifest`; its blocks are not fetched."""
        path = self._graft_path(manifest.id, manifest.tensors_file)
        fetched = self._fetch(path)
        if fetched is None:
            raise FormatError(f"{self.url(path)}: tensors file is missing")
        return read_tensors_checked_bytes(fetched[0], self.url(path), manifest)


def _settle(pending: list[Future[R]]) -> list[R]:
    """The results of tasks on a pool, in order. When one fails, those not started are cancelled and the running
    ones waited for before the first failure (in order) is raised: nothing a call started is still running, or
    writing, after it returns or raises.

    Args:
        pending: The tasks' futures.

    Returns:
        Their results, in order.
    """
    wait(pending, return_when=FIRST_EXCEPTION)
    failed = next((f.exception() for f in pending if f.done() and not f.cancelled() and f.exception()), None)
    if failed is not None:
        _stop(pending)
        raise failed
    return [future.result() for future in pending]


def _stop(pending: list[Future[R]]) -> None:
    """Cancel the tasks not started and wait for the running ones."""
    for future in pending:
        future.cancel()
    wait(pending)


def _age_s(modified: datetime) -> float:
    return (datetime.now(UTC) - modified).total_seconds()


def _gave_up(text: str) -> str:
    """The retries an obstore error reports, as "gave up after 3 retries in 8.5 s"; "" when there were none."""
    match = _GAVE_UP.search(text)
    if match is None:
        return ""
    seconds = float(match.group(1)) * _SECONDS[match.group(2)]
    retries = int(match.group(3))
    return f"gave up after {retries} {'retry' if retries == 1 else 'retries'} in {seconds:.1f} s"


def _first_line(exc: BaseException) -> str:
    line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return line if len(line) <= 300 else line[:297] + "..."
