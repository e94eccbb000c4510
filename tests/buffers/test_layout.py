"""FlatLayout: aligned offsets, contiguous shards and each rank's part of every parameter."""

from __future__ import annotations

import itertools
import random

import pytest

from graph_fsdp.buffers import FlatLayout
from graph_fsdp.buffers.layout import ALIGN_ELEMENTS

WORLD_SIZES = [1, 2, 3, 4, 5]
ALIGNS = [1, 4, 64]


def _expected_local(layout: FlatLayout, index: int, rank: int) -> tuple[int, int] | None:
    """Brute-force intersection of parameter ``index`` with ``rank``'s shard (None if empty)."""
    begin = layout.offsets[index]
    end = begin + layout.numels[index]
    lo, hi = rank * layout.shard_numel, (rank + 1) * layout.shard_numel
    start, stop = max(begin, lo), min(end, hi)
    if start >= stop:
        return None
    return start - begin, stop - begin


def check_layout(layout: FlatLayout) -> None:
    numels, world, align = layout.numels, layout.world_size, layout.align
    offsets = layout.offsets
    assert len(offsets) == len(numels)

    # Offsets: aligned, in order, parameters never overlap, all inside the buffer.
    for i, (off, n) in enumerate(zip(offsets, numels, strict=True)):
        assert off % align == 0, (i, off, align)
        if i + 1 < len(numels):
            assert offsets[i + 1] >= off + n
            # Packed back to back: the next start is the first aligned position after us.
            assert offsets[i + 1] - (off + n) < align
    assert offsets[:1] in ((), (0,))
    assert layout.used == (offsets[-1] + numels[-1] if numels else 0)
    assert layout.used <= layout.total

    # Shards: equal, aligned, contiguous, covering exactly [0, total).
    shard = layout.shard_numel
    assert shard >= 1 and shard % align == 0
    assert layout.total == shard * world
    assert layout.total % world == 0
    # Padding is minimal: one alignment unit less per rank would not hold the parameters.
    assert (shard - align) * world < max(layout.used, 1)
    ranges = [layout.shard_range(r) for r in range(world)]
    assert ranges[0][0] == 0 and ranges[-1][1] == layout.total
    for (_, hi), (next_lo, _) in itertools.pairwise(ranges):
        assert hi == next_lo
    for lo, hi in ranges:
        assert hi - lo == shard

    # Local ranges: match brute force; in rank order they tile [0, numel) exactly.
    for i, n in enumerate(numels):
        pos = 0
        total_local = 0
        for rank in range(world):
            start, end = layout.local_range(i, rank)
            assert 0 <= start <= end <= n, (i, rank, start, end, n)
            expected = _expected_local(layout, i, rank)
            if expected is None:
                assert start == end, (i, rank, start, end)
                continue
            assert (start, end) == expected
            assert start == pos, f"param {i}: rank {rank} starts at {start}, expected {pos}"
            pos = end
            total_local += end - start
        assert pos == n
        assert total_local == n
        assert sum(e - s for s, e in (layout.local_range(i, r) for r in range(world))) == n


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("align", ALIGNS)
def test_random_layouts(world: int, align: int) -> None:
    rng = random.Random(1000 * world + align)
    for _ in range(150):
        count = rng.randint(0, 8)
        numels = tuple(
            rng.choice([0, 1, 2, 3, world - 1, world, world + 1, rng.randint(1, 5000)])
            for _ in range(count)
        )
        check_layout(FlatLayout(numels, world, align))


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_default_alignment(world: int) -> None:
    rng = random.Random(world)
    for _ in range(50):
        numels = tuple(rng.randint(0, 3000) for _ in range(rng.randint(1, 6)))
        layout = FlatLayout(numels, world)
        assert layout.align == ALIGN_ELEMENTS
        check_layout(layout)


def test_uneven_split_of_one_param() -> None:
    layout = FlatLayout((10,), world_size=3, align=1)
    assert layout.shard_numel == 4 and layout.total == 12
    assert [layout.local_range(0, r) for r in range(3)] == [(0, 4), (4, 8), (8, 10)]
    check_layout(layout)


def test_param_split_across_shard_boundary() -> None:
    layout = FlatLayout((100, 30), world_size=2)
    assert layout.offsets == (0, 128)
    assert layout.used == 158
    assert layout.shard_numel == 128 and layout.total == 256
    assert layout.local_range(0, 0) == (0, 100)
    s, e = layout.local_range(0, 1)
    assert s == e
    s, e = layout.local_range(1, 0)
    assert s == e
    assert layout.local_range(1, 1) == (0, 30)
    check_layout(layout)


def test_params_smaller_than_world_size() -> None:
    layout = FlatLayout((1, 2, 3), world_size=5, align=1)
    assert layout.offsets == (0, 1, 3)
    assert layout.shard_numel == 2 and layout.total == 10
    # Param 2 (3 elements at [3, 6)) straddles ranks 1 and 2; ranks 3 and 4 hold nothing.
    assert layout.local_range(2, 1) == (0, 1)
    assert layout.local_range(2, 2) == (1, 3)
    for rank in (3, 4):
        for index in range(3):
            s, e = layout.local_range(index, rank)
            assert s == e
    check_layout(layout)


def test_zero_numel_local_shards() -> None:
    layout = FlatLayout((10, 300, 10), world_size=4, align=1)
    assert layout.shard_numel == 80
    assert layout.local_range(0, 0) == (0, 10)
    for rank in (1, 2, 3):
        s, e = layout.local_range(0, rank)
        assert s == e, rank
    s, e = layout.local_range(2, 0)
    assert s == e
    assert layout.local_range(2, 3) == (0, 10)
    assert [layout.local_range(1, r) for r in range(4)] == [
        (0, 70),
        (70, 150),
        (150, 230),
        (230, 300),
    ]
    check_layout(layout)


def test_zero_numel_params_and_empty_layout() -> None:
    check_layout(FlatLayout((0, 0, 5, 0), world_size=3))
    empty = FlatLayout((), world_size=4)
    assert empty.used == 0 and empty.total % 4 == 0 and empty.total > 0
    check_layout(empty)


def test_invalid_arguments() -> None:
    with pytest.raises(ValueError):
        FlatLayout((1,), world_size=0)
    with pytest.raises(ValueError):
        FlatLayout((4, -1), world_size=2)
