import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvgraft.core.errors import BadInputError
from kvgraft.core.schedule import ChunkSchedule


@given(start=st.integers(0, 500), length=st.integers(1, 500), chunk=st.integers(1, 80))
def test_spans_cover_the_range_and_end_on_absolute_multiples(start: int, length: int, chunk: int) -> None:
    spans = ChunkSchedule(chunk).spans(start, start + length)
    assert spans[0][0] == start and spans[-1][1] == start + length
    assert all(a < b for a, b in spans)
    assert all(spans[i][1] == spans[i + 1][0] for i in range(len(spans) - 1))
    # every span but the last ends on a multiple of C; none crosses one
    assert all(b % chunk == 0 for _, b in spans[:-1])
    assert all((b - 1) // chunk == a // chunk for a, b in spans)


@given(n=st.integers(1, 5000), chunk=st.integers(1, 200))
def test_aligned_length_is_the_largest_multiple_not_above(n: int, chunk: int) -> None:
    aligned = ChunkSchedule(chunk).aligned_length(n)
    assert aligned % chunk == 0 and aligned <= n < aligned + chunk


def test_spans_example() -> None:
    assert ChunkSchedule(16).spans(10, 40) == [(10, 16), (16, 32), (32, 40)]


def test_chunk_size_must_be_positive() -> None:
    with pytest.raises(BadInputError, match="chunk size must be a positive integer, got 0"):
        ChunkSchedule(0)
