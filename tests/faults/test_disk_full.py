"""A store on a small filesystem (a 2 MiB tmpfs, mounted when the test runs as root) that fills mid-build.

The failed build ends in one clear kvgraft error and leaves the store consistent with nothing half-written; on the
full disk `store stats` (which rewrites the index) and `generate --receipt` end cleanly, the latter leaving no
partial receipt; once space is freed, `gc` clears the litter and the same build succeeds with the same graft id.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from faultkit import Summary, make_engine, one_error_line, run_cli
from typer.testing import CliRunner

from kvgraft.cli import app
from kvgraft.core.errors import KvgraftError
from kvgraft.library.index import INDEX_NAME, store_stats
from kvgraft.store import LocalStore

from conftest import TEXT

pytestmark = pytest.mark.faults

SHORT = "A short text that fits on the small disk, three blocks or so of it."
LONG = TEXT  # about 200 tokens: 12 blocks of 66 KB, more than the room left for it (ROOM_KB)
ROOM_KB = 400


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 2 MiB tmpfs, unmounted afterwards; skipped where mounting is not allowed."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a size-limited tmpfs needs root")
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], capture_output=True, check=False
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def fill(directory: Path, name: str, leave_kb: int = 0) -> Path:
    """Write a filler file until `leave_kb` KiB are left free (0: until the filesystem is full); returns it."""
    filler = directory / name
    info = os.statvfs(directory)
    budget = info.f_bavail * info.f_frsize - leave_kb * 1024 if leave_kb else None
    with contextlib.suppress(OSError), filler.open("wb") as handle:
        while budget is None or budget > 0:
            handle.write(b"\0" * 4096)
            handle.flush()
            budget = None if budget is None else budget - 4096
    return filler


def half_written(store: LocalStore) -> list[str]:
    """Files a failed write left: anything in tmp/, a block that does not read back whole, a partial graft."""
    found = [f"tmp/{p.name}" for p in (store.root / "tmp").iterdir()] if (store.root / "tmp").is_dir() else []
    for path in store.block_files():
        try:
            store.read_block(path.name.removesuffix(".safetensors"))  # checked against its declared digest
        except KvgraftError as exc:
            found.append(f"block {path.name[:12]}: {exc}")
    found += [
        f"partial graft {d.name}" for d in (store.root / "grafts").iterdir() if not (d / "manifest.json").is_file()
    ]
    return found


def test_a_full_disk_fails_cleanly_and_recovers(small_disk: Path) -> None:
    store = LocalStore(small_disk / "store")
    engine = make_engine(store)
    summary = Summary("disk_full", 0)
    small = engine.put(SHORT)
    expected_long = engine.build(LONG).manifest.id
    fillers = [fill(small_disk, "filler-1", leave_kb=ROOM_KB)]

    with pytest.raises(KvgraftError) as failed:  # the disk fills mid-build
        engine.put(LONG)
    summary.extra["build_error"] = f"{type(failed.value).__name__}: {failed.value}"
    assert store.ids() == [small.id]
    store.get(small.id)
    leftovers = half_written(store)

    fillers.append(fill(small_disk, "filler-2"))  # now nothing more fits
    (store.root / INDEX_NAME).unlink(missing_ok=True)  # so stats must write the index
    try:
        api_stats = store_stats(store).to_json()
        summary.extra["stats_on_full_disk"] = f"ok ({api_stats['grafts']} grafts)"
    except KvgraftError as exc:
        summary.extra["stats_on_full_disk"] = f"{type(exc).__name__}: {exc}"
    proc = run_cli("store", "stats", "--store", store.root)
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    if proc.returncode != 0:
        one_error_line(proc)
    receipt = small_disk / "receipt.json"
    result = CliRunner().invoke(
        app, ["generate", "-g", small.id, "-p", " so", "-n", "2", "--receipt", str(receipt), "--store", str(store.root)]
    )
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert result.exit_code == 1 and result.stderr.strip().startswith("error: "), result.output
    assert "receipt" in result.stderr, result.stderr
    assert not [p.name for p in small_disk.iterdir() if "receipt" in p.name]  # no partial receipt, no temp file
    leftovers += [f"after stats on a full disk: {p}" for p in half_written(store) if p not in leftovers]

    for filler in fillers:
        filler.unlink(missing_ok=True)
    store.gc(0.0)
    assert not list((store.root / "tmp").iterdir())
    on_disk = {p.name.removesuffix(".safetensors") for p in store.block_files()}
    assert on_disk == store.referenced_blocks()
    rebuilt = engine.put(LONG)
    assert rebuilt.id == expected_long
    store.get(rebuilt.id)
    summary.extra["half_written_after_failure"] = leftovers
    summary.report()
    assert not leftovers, leftovers
