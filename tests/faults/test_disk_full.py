"""A store on a small filesystem that fills mid-build: a 2 MiB tmpfs where one can be mounted (root), else
RLIMIT_FSIZE in a forked child (the largest file a process may write: below one block, then 0 for "nothing fits").

The failed build ends in one clear kvgraft error and leaves the store consistent with nothing half-written; on the
full disk `store stats` (which rewrites the index) and `generate --receipt` end cleanly, the latter leaving no
partial receipt; once space is freed, `gc` clears the litter and the same build succeeds with the same graft id.
The scenario runs twice: `filesystem` (the tmpfs, or the RLIMIT_FSIZE fallback where mounting is not allowed or
KVGRAFT_FAULTS_DISK=rlimit) and `rlimit` (the fallback, always, so that it is tested where root mounts the tmpfs).
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvgraft.cli import app
from kvgraft.core.errors import KvgraftError
from kvgraft.library.index import INDEX_NAME, store_stats
from kvgraft.store import LocalStore

from conftest import TEXT
from faultkit import Summary, forked, make_engine, one_error_line, run_cli

pytestmark = pytest.mark.faults

SHORT = "A short text that fits on the small disk, three blocks or so of it."
LONG = TEXT  # about 200 tokens: 12 blocks of 66 KB, more than the room left for it (ROOM_KB)
ROOM_KB = 400
FSIZE_KB = 48
"""The RLIMIT_FSIZE fallback's limit while building: below one block file (66 KB), above a manifest or the index"""
FORCE_ENV = "KVGRAFT_FAULTS_DISK"


@dataclass
class SmallDisk:
    """Where the store lives and how it is made to fill: `tmpfs` (fill it with filler files) or `rlimit` (lower
    RLIMIT_FSIZE; only ever in the forked child that runs the scenario, never in pytest's process)."""

    root: Path
    how: str
    """"tmpfs" or "rlimit" """
    why: str
    """how it was chosen (the reason for a fallback)"""
    fillers: list[Path] = field(default_factory=list)

    def leave_room(self) -> None:
        """Room for a small file but not for the long build's blocks."""
        if self.how == "tmpfs":
            self.fillers.append(fill(self.root, "filler-1", leave_kb=ROOM_KB))
        else:
            set_fsize(FSIZE_KB * 1024)

    def fill_up(self) -> None:
        """Nothing more fits."""
        if self.how == "tmpfs":
            self.fillers.append(fill(self.root, "filler-2"))
        else:
            set_fsize(0)

    def free(self) -> None:
        """Space again."""
        for filler in self.fillers:
            filler.unlink(missing_ok=True)
        if self.how == "rlimit":
            set_fsize(resource.RLIM_INFINITY)


def set_fsize(limit: int) -> None:
    """Set the soft RLIMIT_FSIZE (the hard one stays, so it can be raised again); SIGXFSZ ignored, so a write past
    it fails with EFBIG (OSError) as one on a full disk does, instead of killing the process."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
    soft = limit if hard == resource.RLIM_INFINITY else min(limit, hard)
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


@pytest.fixture(params=["filesystem", "rlimit"])
def small_disk(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[SmallDisk]:
    """A 2 MiB tmpfs (unmounted afterwards) where it can be mounted, else a plain directory under RLIMIT_FSIZE."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if request.param == "rlimit" or os.environ.get(FORCE_ENV) == "rlimit":
        yield SmallDisk(mount, "rlimit", f"forced ({request.param} test, {FORCE_ENV}={os.environ.get(FORCE_ENV)})")
        return
    if os.geteuid() != 0:
        yield SmallDisk(mount, "rlimit", "fallback: mounting a size-limited tmpfs needs root")
        return
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], capture_output=True, check=False
    )
    if done.returncode != 0:
        yield SmallDisk(mount, "rlimit", f"fallback: cannot mount a tmpfs here: {done.stderr.decode().strip()}")
        return
    try:
        yield SmallDisk(mount, "tmpfs", "a 2 MiB tmpfs")
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


def test_a_full_disk_fails_cleanly_and_recovers(small_disk: SmallDisk, tmp_path: Path) -> None:
    """The scenario in a forked child (the model loaded here; a lowered RLIMIT_FSIZE must not outlive it), its
    figures written to a file for the report made here."""
    result = tmp_path / "result.json"
    pid = forked(lambda: full_disk_scenario(small_disk, result))
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    assert code == 0, f"the scenario failed in the child (exit {code}): its traceback is on stderr above"
    name = "disk_full" if small_disk.how == "tmpfs" else f"disk_full_{small_disk.how}"
    summary = Summary(name, 0, extra={"disk": f"{small_disk.how}: {small_disk.why}", **json.loads(result.read_text())})
    summary.report()
    assert not summary.extra["half_written_after_failure"], summary.extra


def full_disk_scenario(small_disk: SmallDisk, result: Path) -> None:
    """Fill the disk mid-build, check the failure and the store, fill it up, run stats and generate --receipt,
    free it, gc, rebuild; writes the figures to `result` (JSON) once the disk is free again."""
    try:
        run_scenario(small_disk, result)
    finally:
        small_disk.free()  # a traceback printed after a failure must not meet a lowered RLIMIT_FSIZE


def run_scenario(small_disk: SmallDisk, result: Path) -> None:
    store = LocalStore(small_disk.root / "store")
    engine = make_engine(store)
    extra: dict[str, object] = {}
    small = engine.put(SHORT)
    expected_long = engine.build(LONG).manifest.id
    small_disk.leave_room()

    with pytest.raises(KvgraftError) as failed:  # the disk fills mid-build
        engine.put(LONG)
    extra["build_error"] = f"{type(failed.value).__name__}: {failed.value}"
    assert store.ids() == [small.id]
    store.get(small.id)
    leftovers = half_written(store)

    small_disk.fill_up()  # now nothing more fits
    (store.root / INDEX_NAME).unlink(missing_ok=True)  # so stats must write the index
    try:
        api_stats = store_stats(store).to_json()
        extra["stats_on_full_disk"] = f"ok ({api_stats['grafts']} grafts)"
    except KvgraftError as exc:
        extra["stats_on_full_disk"] = f"{type(exc).__name__}: {exc}"
    proc = run_cli("store", "stats", "--store", store.root)
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    if proc.returncode != 0:
        one_error_line(proc)
    receipt = small_disk.root / "receipt.json"
    generated = CliRunner().invoke(
        app, ["generate", "-g", small.id, "-p", " so", "-n", "2", "--receipt", str(receipt), "--store", str(store.root)]
    )
    assert generated.exception is None or isinstance(generated.exception, SystemExit), repr(generated.exception)
    assert generated.exit_code == 1 and generated.stderr.strip().startswith("error: "), generated.output
    assert "receipt" in generated.stderr, generated.stderr
    assert not [p.name for p in small_disk.root.iterdir() if "receipt" in p.name]  # no partial receipt, no temp file
    leftovers += [f"after stats on a full disk: {p}" for p in half_written(store) if p not in leftovers]

    small_disk.free()
    store.gc(0.0)
    assert not list((store.root / "tmp").iterdir())
    on_disk = {p.name.removesuffix(".safetensors") for p in store.block_files()}
    assert on_disk == store.referenced_blocks()
    rebuilt = engine.put(LONG)
    assert rebuilt.id == expected_long
    store.get(rebuilt.id)
    extra["half_written_after_failure"] = leftovers
    result.write_text(json.dumps(extra))
