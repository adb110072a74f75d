"""Reading the files commands are given, with one-line errors for unreadable or malformed ones."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvgraft.core.errors import BadInputError


def read_text_file(path: Path) -> str:
    """A UTF-8 text file's content.

    Args:
        path: the file.

    Returns:
        Its text.

    Raises:
        BadInputError: the file is missing, unreadable or not UTF-8.
    """
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise BadInputError(f"no such file: {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise BadInputError(f"cannot read {path}: {exc}") from None


def jsonl_items(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """The texts of a JSONL file: each line a JSON string, or an object with "text" (other fields: metadata).

    Args:
        path: the JSONL file; blank lines are skipped.

    Returns:
        `(text, metadata)` per line, in file order.

    Raises:
        BadInputError: a line is not JSON or has no text (named `path:line`), or the file has no texts.
    """
    items: list[tuple[str, dict[str, Any]]] = []
    for number, line in enumerate(read_text_file(path).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise BadInputError(f"{path}:{number}: not valid JSON ({exc.msg})") from None
        if isinstance(row, str):
            items.append((row, {}))
        elif isinstance(row, dict) and isinstance(row.get("text"), str):
            items.append((row["text"], {k: v for k, v in row.items() if k != "text"}))
        else:
            raise BadInputError(f'{path}:{number}: expected a JSON string or an object with a "text" field')
    if not items:
        raise BadInputError(f"{path}: no texts in file")
    return items
