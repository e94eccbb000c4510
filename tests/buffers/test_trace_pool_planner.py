"""plan_slots on synthetic traces: valid colourings, bounded bytes, optimal on interval graphs."""

from __future__ import annotations

import math
import random

import pytest
import torch

from graph_fsdp.buffers import plan_slots
from graph_fsdp.buffers.trace_pool import KeyTrace

CPU = torch.device("cpu")
META = torch.device("meta")
F32, BF16 = torch.float32, torch.bfloat16


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _intervals_overlap(a: list[list[float]], b: list[list[float]]) -> bool:
    """Half-open [start, end) intervals; independent of KeyTrace.overlaps."""
    for a0, a1 in a:
        for b0, b1 in b:
            if max(a0, b0) < min(a1, b1):
                return True
    return False


def _max_live(traces: dict) -> int:
    """Most keys live at one time (ends sort before starts at equal times: half-open)."""
    events = []
    for trace in traces.values():
        for start, end in trace.intervals:
            events.append((start, 1))
            events.append((end, -1))
    live = best = 0
    for _, delta in sorted(events):
        live += delta
        best = max(best, live)
    return best


def check_plan(traces: dict, assignment: dict, specs: list) -> None:
    assert set(assignment) == set(traces)
    members: dict[int, list] = {}
    for key, index in assignment.items():
        assert 0 <= index < len(specs), (key, index)
        members.setdefault(index, []).append(key)
    assert set(members) == set(range(len(specs))), "every slot serves at least one key"

    for index, keys in members.items():
        numel, dtype, device = specs[index]
        for key in keys:
            trace = traces[key]
            # Dtypes (and devices) never mix in a slot; the slot fits every member.
            assert trace.dtype == dtype, (key, trace.dtype, dtype)
            assert trace.device == device, (key, trace.device, device)
            assert numel >= trace.numel, (key, trace.numel, numel)
        # A slot is no larger than its largest member.
        assert numel == max(traces[k].numel for k in keys)
        # (a) keys sharing a slot are never live at the same time.
        for i, a in enumerate(keys):
            for b in keys[i + 1 :]:
                assert not _intervals_overlap(traces[a].intervals, traces[b].intervals), (
                    f"{a} {traces[a].intervals} and {b} {traces[b].intervals} share slot {index}"
                )

    # (b) the pool never costs more than one buffer per key.
    slot_bytes = sum(n * _itemsize(dt) for n, dt, _ in specs)
    key_bytes = sum(t.numel * _itemsize(t.dtype) for t in traces.values())
    assert slot_bytes <= key_bytes


def _trace(numel: int, *intervals, dtype=F32, device=CPU) -> KeyTrace:
    return KeyTrace(numel, dtype, device, [list(iv) for iv in intervals])


def test_disjoint_keys_share_one_slot() -> None:
    traces = {k: _trace(100, (2 * i, 2 * i + 1)) for i, k in enumerate("abcd")}
    assignment, specs = plan_slots(traces)
    check_plan(traces, assignment, specs)
    assert len(specs) == 1


def test_touching_intervals_do_not_overlap() -> None:
    traces = {"a": _trace(8, (0, 2)), "b": _trace(8, (2, 4)), "c": _trace(8, (4, 6))}
    assignment, specs = plan_slots(traces)
    check_plan(traces, assignment, specs)
    assert len(specs) == 1


def test_overlapping_keys_get_separate_slots() -> None:
    traces = {"a": _trace(8, (0, 3)), "b": _trace(8, (1, 4)), "c": _trace(8, (2, 5))}
    assignment, specs = plan_slots(traces)
    check_plan(traces, assignment, specs)
    assert len(set(assignment.values())) == 3


def test_multi_interval_keys_overlap_in_any_interval() -> None:
    # "a" is live in forward and again in backward; "b" sits in a's backward interval.
    traces = {"a": _trace(16, (0, 2), (8, 12)), "b": _trace(16, (9, 10)), "c": _trace(16, (3, 5))}
    assignment, specs = plan_slots(traces)
    check_plan(traces, assignment, specs)
    assert assignment["a"] != assignment["b"]
    assert assignment["a"] == assignment["c"] or assignment["b"] == assignment["c"]


def test_open_ended_key_blocks_later_keys() -> None:
    traces = {"held": _trace(4, (1, math.inf)), "later": _trace(4, (5, 6))}
    assignment, specs = plan_slots(traces)
    check_plan(traces, assignment, specs)
    assert assignment["held"] != assignment["later"]


def test_dtypes_and_devices_never_share() -> None:
    traces = {
        "f32": _trace(64, (0, 1)),
        "bf16": _trace(64, (2, 3), dtype=BF16),
        "meta": _trace(64, (4, 5), device=META),
        "f32_again": _trace(32, (6, 7)),
    }
    assignment, specs = plan_slots(traces)
    check_plan(traces, assignment, specs)
    assert len(specs) == 3
    assert assignment["f32"] == assignment["f32_again"]


def test_mixed_sizes_slot_takes_largest_member() -> None:
    traces = {"small": _trace(10, (0, 1)), "big": _trace(1000, (2, 3)), "mid": _trace(500, (4, 5))}
    assignment, specs = plan_slots(traces)
    check_plan(traces, assignment, specs)
    assert len(specs) == 1 and specs[0][0] == 1000


def test_best_fit_prefers_a_slot_that_already_fits() -> None:
    # Two slots (100 and 1000) free at time 10: a 900-element key must reuse the 1000 slot
    # instead of growing the 100 one (which would cost 800 more elements).
    traces = {
        "a": _trace(100, (0, 5)),
        "b": _trace(1000, (1, 6)),
        "c": _trace(900, (10, 11)),
    }
    assignment, specs = plan_slots(traces)
    check_plan(traces, assignment, specs)
    assert assignment["c"] == assignment["b"]
    assert sorted(n for n, _, _ in specs) == [100, 1000]


def _random_interval_graph(rng: random.Random, n_keys: int, horizon: int) -> dict:
    traces = {}
    for k in range(n_keys):
        start = rng.randrange(horizon)
        end = math.inf if rng.random() < 0.05 else start + rng.randint(1, horizon // 3)
        traces[("k", k)] = _trace(256, (start, end))
    return traces


@pytest.mark.parametrize("seed", range(10))
def test_interval_graphs_use_minimum_slots(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(30):
        traces = _random_interval_graph(rng, rng.randint(1, 40), rng.randint(6, 60))
        assignment, specs = plan_slots(traces)
        check_plan(traces, assignment, specs)
        # Left-edge colouring is optimal on interval graphs: slots == max simultaneously live.
        assert len(specs) == _max_live(traces), [t.intervals for t in traces.values()]


def test_interval_graph_lower_bound_example() -> None:
    # Max live is 3 (at time 4: b, c, d); left-edge needs exactly 3 slots.
    traces = {
        "a": _trace(1, (0, 3)),
        "b": _trace(1, (1, 5)),
        "c": _trace(1, (3, 7)),
        "d": _trace(1, (4, 6)),
        "e": _trace(1, (5, 9)),
        "f": _trace(1, (6, 8)),
    }
    assignment, specs = plan_slots(traces)
    check_plan(traces, assignment, specs)
    assert _max_live(traces) == 3
    assert len(specs) == 3


def _random_trace(rng: random.Random) -> dict:
    horizon = rng.randint(10, 120)
    traces = {}
    for k in range(rng.randint(1, 25)):
        cuts = sorted(rng.sample(range(horizon), 2 * rng.randint(1, 4)))
        intervals = [[cuts[i], cuts[i + 1]] for i in range(0, len(cuts), 2)]
        if rng.random() < 0.1:
            intervals[-1][1] = math.inf
        dtype = rng.choice([F32, BF16])
        numel = rng.choice([64, 128, 1000, rng.randint(1, 4096)])
        traces[(f"unit{k}", rng.choice(["param", "grad"]), dtype)] = KeyTrace(
            numel, dtype, CPU, intervals
        )
    return traces


def test_random_traces() -> None:
    rng = random.Random(12345)
    shared = 0
    for _ in range(200):
        traces = _random_trace(rng)
        assignment, specs = plan_slots(traces)
        check_plan(traces, assignment, specs)
        shared += len(traces) - len(specs)
    assert shared > 0, "the planner never reused a slot on 200 random traces"


def test_key_trace_overlaps_matches_reference() -> None:
    rng = random.Random(7)
    for _ in range(500):
        a, b = (
            _trace(1, *[sorted(rng.sample(range(20), 2)) for _ in range(rng.randint(1, 3))])
            for _ in range(2)
        )
        expected = _intervals_overlap(a.intervals, b.intervals)
        assert a.overlaps(b) == expected == b.overlaps(a)
