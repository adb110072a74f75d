"""kvgraft.core.memory: the allocator's free pages go back to the OS."""

from __future__ import annotations

import platform

import pytest

from kvgraft.core.memory import release_free_memory


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_release_after_a_large_transient_structure() -> None:
    # 40 MB in 4 KiB objects: above pymalloc's small-object limit, below glibc's mmap threshold, so they live in
    # glibc's heap; freeing them leaves free pages there that only malloc_trim hands back.
    transient = [bytes(4096) for _ in range(10_000)]
    keep = [bytes(4096) for _ in range(16)]
    del transient
    assert release_free_memory() is True
    assert len(keep) == 16
