"""Flat layout of a unit's parameters: offsets, padding and each rank's contiguous shard.

Knows sizes, alignment and ranks only. Parameters are packed back to back (each start
aligned so views stay vectorisable) into one flat buffer whose padded length is a multiple
of the world size; rank r owns elements ``[r * shard, (r + 1) * shard)``. A parameter may be
split across ranks, smaller than the world size, or absent from a rank (zero-numel local
shard): ``local_range`` says which part of it a rank holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

ALIGN_ELEMENTS = 64
"""Parameter starts are multiples of this many elements (128 bytes in bf16)."""


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


@dataclass(frozen=True)
class FlatLayout:
    """Placement of ``numels`` in a flat buffer sharded over ``world_size`` ranks.

    Frozen, so the derived sizes are computed once (``cached_property``).
    """

    numels: tuple[int, ...]
    world_size: int
    align: int = ALIGN_ELEMENTS

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size={self.world_size} must be >= 1")
        if any(n < 0 for n in self.numels):
            raise ValueError(f"negative numel in {self.numels}")

    @cached_property
    def offsets(self) -> tuple[int, ...]:
        out, pos = [], 0
        for n in self.numels:
            out.append(pos)
            pos = _round_up(pos + n, self.align)
        return tuple(out)

    @cached_property
    def used(self) -> int:
        """Elements up to the end of the last parameter (before world-size padding)."""
        if not self.numels:
            return 0
        return self.offsets[-1] + self.numels[-1]

    @cached_property
    def shard_numel(self) -> int:
        """Elements each rank owns; a multiple of ``align`` so shards stay aligned."""
        return _round_up(max(-(-self.used // self.world_size), 1), self.align)

    @cached_property
    def total(self) -> int:
        return self.shard_numel * self.world_size

    def shard_range(self, rank: int) -> tuple[int, int]:
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def local_range(self, index: int, rank: int) -> tuple[int, int]:
        """Part ``[start, end)`` of parameter ``index`` (in its own flat numbering) that
        ``rank`` owns; ``start == end`` when the rank holds none of it."""
        lo, hi = self.shard_range(rank)
        begin = self.offsets[index]
        start = min(max(lo, begin), begin + self.numels[index])
        end = max(min(hi, begin + self.numels[index]), start)
        return start - begin, end - begin
