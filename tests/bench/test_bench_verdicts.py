"""What a bench row may claim (graph_fsdp/bench/verdicts.py): its own peak memory, and that
its graphs replayed - the arithmetic and verdicts on their own, and a launch on gloo whose
graphed rows did not replay."""

from __future__ import annotations

from dataclasses import replace

import pytest
from graph_fsdp_testing import SMALLEST_GPT, spawn_cases

from graph_fsdp.bench import runner as bench_runner
from graph_fsdp.bench.peers import BenchSpec
from graph_fsdp.bench.verdicts import (
    COMM_INSIDE,
    RowMemory,
    comm_status,
    graph_label,
    graph_verdict,
    memory_fields,
)
from graph_fsdp.training.train import TrainConfig

MiB = 2**20


class FakeAllocator:
    """torch.cuda's counters over a toy caching allocator: blocks are allocated into 64 MiB
    segments, freed blocks stay reserved until ``empty_cache`` (a segment with a live block
    stays), peaks track the maxima since the last reset."""

    SEGMENT = 64 * MiB

    def __init__(self) -> None:
        self.segments: list[list[int]] = []  # the live block sizes of each segment
        self.free: list[int] = []  # free bytes per segment
        self.peak_allocated = self.peak_reserved = 0
        self.garbage: list[tuple[int, int]] = []  # blocks gc would free
        self.workspaces: dict[str, tuple[int, int]] = {}  # cuBLAS's, per stream
        self.log: list[str] = []

    def gemm(self, stream: str) -> None:
        """A GEMM on ``stream``: its 32 MiB workspace is made once and kept."""
        if stream not in self.workspaces:
            self.workspaces[stream] = self.malloc(32 * MiB)

    def malloc(self, size: int) -> tuple[int, int]:
        i = next((i for i, free in enumerate(self.free) if free >= size), None)
        if i is None:
            self.segments.append([])
            self.free.append(max(size, self.SEGMENT))
            i = len(self.free) - 1
        self.segments[i].append(size)
        self.free[i] -= size
        self._update()
        return i, size

    def release(self, block: tuple[int, int]) -> None:
        i, size = block
        self.segments[i].remove(size)
        self.free[i] += size

    def _update(self) -> None:
        self.peak_allocated = max(self.peak_allocated, self.memory_allocated())
        self.peak_reserved = max(self.peak_reserved, self.memory_reserved())

    def memory_allocated(self) -> int:
        return sum(sum(s) for s in self.segments)

    def memory_reserved(self) -> int:
        return sum(sum(s) + f for s, f in zip(self.segments, self.free))

    def max_memory_allocated(self) -> int:
        return self.peak_allocated

    def max_memory_reserved(self) -> int:
        return self.peak_reserved

    def reset_peak_memory_stats(self) -> None:
        self.peak_allocated, self.peak_reserved = self.memory_allocated(), self.memory_reserved()

    def clear_workspaces(self) -> None:
        self.log.append("clear_workspaces")
        for block in self.workspaces.values():
            self.release(block)
        self.workspaces = {}

    def empty_cache(self) -> None:
        self.log.append("empty_cache")
        for block in self.garbage:  # (gc ran first: RowMemory.start collects)
            self.release(block)
        self.garbage = []
        keep = [i for i, s in enumerate(self.segments) if s]
        self.segments = [self.segments[i] for i in keep]
        self.free = [self.free[i] for i in keep]


def _row(alloc: FakeAllocator, sizes: list[int]) -> list[tuple[int, int]]:
    """A row: allocates ``sizes`` in turn, frees all but the first at the end."""
    blocks = [alloc.malloc(s) for s in sizes]
    for b in blocks[1:]:
        alloc.release(b)
    return blocks[:1]


def test_own_peaks_subtract_what_the_row_started_with() -> None:
    alloc = FakeAllocator()
    first = RowMemory.start(alloc)
    kept = _row(alloc, [10 * MiB, 300 * MiB, 200 * MiB])  # keeps 10 MiB (a leftover)
    first = memory_fields(first.stop(alloc).values())
    assert first["own_peak_allocated_bytes"] == 510 * MiB
    assert first["start_allocated_bytes"] == first["start_reserved_bytes"] == 0
    # The second row does the same work after the first one's leftovers (10 MiB live, and
    # garbage the collection frees): its own peaks are the same as if it ran first.
    alloc.garbage = [alloc.malloc(100 * MiB)]
    second = RowMemory.start(alloc)
    _row(alloc, [10 * MiB, 300 * MiB, 200 * MiB])
    second = memory_fields(second.stop(alloc).values())
    assert second["own_peak_allocated_bytes"] == 510 * MiB
    assert second["start_allocated_bytes"] == 10 * MiB
    assert second["process_peak_allocated_bytes"] == 520 * MiB
    # The leftover's segment had 54 MiB free: this row put its 10 MiB block there instead of
    # reserving a new 64 MiB segment, so its own reserved peak is lower by that segment -
    # the slack it reports (plus the segment's rounding) bounds that.
    assert second["start_reserved_slack_bytes"] == 54 * MiB
    assert first["own_peak_reserved_bytes"] == 564 * MiB
    assert second["own_peak_reserved_bytes"] == 564 * MiB - FakeAllocator.SEGMENT
    assert kept  # the first row's leftover is still live


def test_every_row_pays_for_the_cublas_workspaces_it_makes() -> None:
    """An eager row makes its stream's workspace; a graphed row after it its eager steps' and
    its capture stream's: each counts its own, as if it ran alone in a process."""
    alloc = FakeAllocator()
    eager = RowMemory.start(alloc)
    alloc.gemm("default")
    eager = memory_fields(eager.stop(alloc).values())
    graphed = RowMemory.start(alloc)
    assert alloc.log == ["clear_workspaces", "empty_cache"] * 2  # cleared, then given back
    alloc.gemm("default")
    alloc.gemm("capture")
    graphed = memory_fields(graphed.stop(alloc).values())
    assert eager["own_peak_allocated_bytes"] == 32 * MiB
    assert graphed["own_peak_allocated_bytes"] == 64 * MiB
    assert graphed["start_allocated_bytes"] == 0  # the eager row's workspace went back


def test_graph_verdicts() -> None:
    ok = {"captures": 1, "replays": 40, "eager_fallbacks": 0, "scopes": [], "comm_graphs": None}
    fields, why = graph_verdict(ok, timed_steps=10, comm_requested=True)
    assert why is None and fields == {
        "graph_captures": 1,
        "graph_replays": 40,
        "graph_eager_fallbacks": 0,
        "comm_graphs": "not lent (one rank, or not NCCL)",
    }
    assert graph_label(fields) == "1/40/0, comm not lent (one rank, or not NCCL)"
    cases = [
        (None, "NOT GRAPHED: no graph report (it may have run eagerly)"),
        ({**ok, "replays": 0}, "NOT GRAPHED: 0 replays"),
        ({**ok, "eager_fallbacks": 2}, "FELL BACK: 2 calls of captured modules ran eagerly"),
        ({**ok, "replays": 9}, "NOT GRAPHED: 9 replays over 10 timed steps"),
        (
            {**ok, "comm_graphs": {"graphs": 0, "replays": 0, "eager_calls": 8, "failed": "X: y"}},
            "COMMUNICATION GRAPHS failed: X: y",
        ),
        (
            {**ok, "comm_graphs": {"graphs": 0, "replays": 0, "eager_calls": 8, "failed": None}},
            "COMMUNICATION GRAPHS none replayed (8 eager calls)",
        ),
    ]
    for report, expected in cases:
        _, why = graph_verdict(report, timed_steps=10)
        assert why is not None and why.startswith(expected), (report, why)
    # Communication graphs off (the "eager comm" rows), or inside a step graph: no failure.
    comm = {"graphs": 8, "replays": 0, "eager_calls": 8, "failed": None}
    assert graph_verdict({**ok, "comm_graphs": comm}, timed_steps=10, comm_requested=False)[1] is (
        None
    )
    assert comm_status({**ok, "scopes": ["full_iteration"]}, True) == (COMM_INSIDE, False)
    assert comm_status({**ok, "comm_graphs": {**comm, "replays": 16}}, True) == (
        "8 graphs, 16 replays, 8 eager calls",
        False,
    )


TINY = SMALLEST_GPT


def _fake_graphed(rank: int, world_size: int, spec: BenchSpec) -> dict:
    """A graphed row's runner whose graphs replayed on rank 0 only (spec.steps replays),
    and on the other ranks fell back to eager ``spec.warmup`` times."""
    graphs = {"captures": 1, "replays": spec.steps, "eager_fallbacks": 0, "comm_graphs": None}
    if rank != 0:
        graphs["eager_fallbacks"] = spec.warmup
    return {
        "times": [0.01] * spec.steps,
        "host_step_times": [0.005] * spec.steps,
        "losses": [1.0] * spec.steps,
        "final_loss": 1.0,
        "graphs": graphs,
    }


def _launch(rank: int, world: int, fallbacks_on_rank1: int) -> dict | None:
    spec = BenchSpec(cfg=TrainConfig(model=TINY), warmup=fallbacks_on_rank1, steps=3)

    def plan_rows(job):
        rows = [
            bench_runner.Row(name="claims graphs", runner=_fake_graphed, spec=spec, graphed=True),
            bench_runner.Row(
                name="claims graphs, none replayed",
                runner=_fake_graphed,
                spec=replace(spec, steps=0),
                graphed=True,
            ),
            bench_runner.Row(name="eager", runner=_fake_graphed, spec=spec),
        ]
        return rows

    bench_runner.plan_rows = plan_rows  # this spawned process only
    return bench_runner.bench_worker(rank, world, bench_runner.BenchJob(spec=spec))


FALLBACKS = [0, 2]


@pytest.fixture(scope="module")
def launches():
    """Both launches in one spawned group."""
    return spawn_cases({f"fallbacks:{n}": (_launch, n) for n in FALLBACKS}, 2)


@pytest.mark.parametrize("fallbacks_on_rank1", FALLBACKS)
def test_a_graphed_row_that_did_not_replay_is_failed_with_no_time(
    launches, fallbacks_on_rank1
) -> None:
    out = launches[f"fallbacks:{fallbacks_on_rank1}"][0]
    rows = {r["name"]: r for r in out["rows"]}
    replayed, none, eager = (
        rows["claims graphs"],
        rows["claims graphs, none replayed"],
        rows["eager"],
    )
    assert none["status"] == "failed" and "median_step_ms" not in none, none
    assert none["reason"].startswith("NOT GRAPHED: 0 replays"), none
    assert none["graph_replays"] == 0
    if fallbacks_on_rank1:  # rank 0 replayed; rank 1 fell back: the row fails on rank 0 too
        assert replayed["status"] == "failed" and "median_step_ms" not in replayed, replayed
        assert replayed["reason"] == "its graphs did not replay on another rank", replayed
    else:
        assert replayed["status"] == "ok" and replayed["median_step_ms"] == pytest.approx(10.0)
        assert (replayed["graph_replays"], replayed["graph_eager_fallbacks"]) == (3, 0)
    # A row that claims no graphs is not checked (and has no graph fields).
    assert eager["status"] == "ok" and "graph_replays" not in eager
