"""Receipts of served generations: the recent ones in memory, every one on disk as `<id>.json`.

The file is exactly what `Receipt.write` produces, so `kvgraft verify --receipt FILE` accepts it, and so does a
reply of `GET /v1/receipts/{id}` saved to a file.
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
from typing import Any

from kvgraft.core.errors import BadInputError, KvgraftError, NotFoundError
from kvgraft.format.receipt import Receipt, parse_receipt

_RECEIPT_ID = re.compile(r"^[0-9a-f]{64}$")
log = logging.getLogger("uvicorn.error")


class ReceiptBook:
    """The server's receipts, by id: the last `capacity` in memory, every one in `directory` when it has one."""

    def __init__(self, directory: Path | None, capacity: int = 1000) -> None:
        self.directory = directory
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
        if self.directory is not None:
            try:
                self._write(data)
            except OSError as exc:
                # The reply still carries the receipt (and memory keeps it); a full or read-only disk must not
                # fail a generation that already happened.
                log.warning("cannot persist receipt %s in %s: %s", data["id"], self.directory, exc)
        return str(data["id"])

    def get(self, receipt_id: str) -> dict[str, Any]:
        """A kept receipt's JSON, from memory or else from its file (checked before it is served).

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
        path = self.directory / f"{receipt_id}.json" if self.directory is not None else None
        if path is None or not path.is_file():
            raise NotFoundError(f"no receipt {receipt_id} on this server")
        try:
            raw = path.read_text(encoding="utf-8")
            parse_receipt(raw, str(path))  # a damaged or edited file is never served as a receipt
            data: dict[str, Any] = json.loads(raw)
            return data
        except (OSError, UnicodeDecodeError, KvgraftError) as exc:
            log.warning("unreadable receipt %s: %s", path, exc)
            raise NotFoundError(f"receipt {receipt_id} is stored but unreadable on this server") from None

    def _write(self, data: dict[str, Any]) -> None:
        assert self.directory is not None
        self.directory.mkdir(parents=True, exist_ok=True)
        final = self.directory / f"{data['id']}.json"
        fd, tmp = tempfile.mkstemp(prefix=".receipt-", suffix=".json", dir=self.directory)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                handle.write(json.dumps(data, indent=1, sort_keys=True) + "\n")
            os.replace(tmp, final)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
