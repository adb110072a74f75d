"""Receipts of served generations: the recent ones in memory, every one on a shelf as `<id>.json`.

The shelf is the graft store itself by default (`receipts/<id>.json` beside the grafts, on local disk or S3), so
every server replica on a shared store answers `/v1/receipts/{id}` for a generation any of them served; or a
directory given by `ServerConfig.receipts_dir`. The file is exactly what `Receipt.write` produces, so
`kvgraft verify --receipt FILE` accepts it, and so does a reply of `GET /v1/receipts/{id}` saved to a file.
"""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any, Protocol

from kvgraft.core.errors import BadInputError, KvgraftError, NotFoundError
from kvgraft.format.receipt import Receipt, parse_receipt
from kvgraft.store.base import RECEIPTS_DIR, GraftStore

_RECEIPT_ID = re.compile(r"^[0-9a-f]{64}$")
log = logging.getLogger("uvicorn.error")


class ReceiptShelf(Protocol):
    """Where receipt files are kept, by file name (`<id>.json`)."""

    @property
    def where(self) -> str:
        """The shelf's location, for messages."""
        ...

    def read(self, name: str) -> bytes | None:
        """The file's bytes, or None when there is none."""
        ...

    def write(self, name: str, data: bytes) -> None:
        """Replace the file atomically (OSError or a KvgraftError when it cannot)."""
        ...


class StoreShelf:
    """Receipts as sidecars of a graft store: `receipts/<id>.json` beside the grafts, shared by every replica."""

    def __init__(self, store: GraftStore) -> None:
        self.store = store

    @property
    def where(self) -> str:
        return f"{self.store.location}/{RECEIPTS_DIR}"

    def read(self, name: str) -> bytes | None:
        return self.store.read_sidecar(f"{RECEIPTS_DIR}/{name}")

    def write(self, name: str, data: bytes) -> None:
        self.store.write_sidecar(f"{RECEIPTS_DIR}/{name}", data)


class DirectoryShelf:
    """Receipts as files of one local directory (created when the first is written)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    @property
    def where(self) -> str:
        return str(self.directory)

    def read(self, name: str) -> bytes | None:
        try:
            return (self.directory / name).read_bytes()
        except FileNotFoundError:
            return None

    def write(self, name: str, data: bytes) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".receipt-", suffix=".json", dir=self.directory)
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
            os.replace(tmp, self.directory / name)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


class ReceiptBook:
    """The server's receipts, by id: the last `capacity` in memory, every one on the shelf when there is one."""

    def __init__(self, shelf: ReceiptShelf | None, capacity: int = 1000) -> None:
        self.shelf = shelf
        self.capacity = capacity
        self._recent: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._lock = threading.Lock()

    def add(self, receipt: Receipt) -> str:
        """Keep a receipt (as its JSON: what `GET /v1/receipts/{id}` replies and the file holds).

        Args:
            receipt: the receipt of a served generation.

        Returns:
            Its id.
        """
        data = receipt.to_json()
        with self._lock:
            self._recent[data["id"]] = data
            self._recent.move_to_end(data["id"])
            while len(self._recent) > self.capacity:
                self._recent.popitem(last=False)
        if self.shelf is not None:
            try:
                self.shelf.write(f"{data['id']}.json", (json.dumps(data, indent=1, sort_keys=True) + "\n").encode())
            except (OSError, KvgraftError) as exc:
                # The reply still carries the receipt (and memory keeps it); a full disk or an unreachable store
                # must not fail a generation that already happened.
                log.warning("cannot persist receipt %s in %s: %s", data["id"], self.shelf.where, exc)
        return str(data["id"])

    def get(self, receipt_id: str) -> dict[str, Any]:
        """A kept receipt's JSON, from memory or else from the shelf (checked before it is served).

        Args:
            receipt_id: the receipt's id, 64 lowercase hex digits.

        Returns:
            The receipt's JSON object.

        Raises:
            BadInputError: a malformed id.
            NotFoundError: no such receipt here, or its file is damaged.
        """
        if not _RECEIPT_ID.match(receipt_id):
            raise BadInputError(f"malformed receipt id {receipt_id!r}: expected 64 lowercase hex digits")
        with self._lock:
            found = self._recent.get(receipt_id)
        if found is not None:
            return found
        name = f"{receipt_id}.json"
        try:
            raw_bytes = self.shelf.read(name) if self.shelf is not None else None
        except (OSError, KvgraftError) as exc:
            log.warning("cannot read receipt %s from %s: %s", receipt_id, self.shelf and self.shelf.where, exc)
            raise NotFoundError(f"receipt {receipt_id} is stored but unreadable on this server") from None
        if raw_bytes is None:
            raise NotFoundError(f"no receipt {receipt_id} on this server")
        assert self.shelf is not None
        try:
            raw = raw_bytes.decode("utf-8")
            parse_receipt(raw, f"{self.shelf.where}/{name}")  # a damaged or edited file is never served
            data: dict[str, Any] = json.loads(raw)
            return data
        except (UnicodeDecodeError, KvgraftError) as exc:
            log.warning("unreadable receipt %s in %s: %s", name, self.shelf.where, exc)
            raise NotFoundError(f"receipt {receipt_id} is stored but unreadable on this server") from None
