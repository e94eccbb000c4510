"""Trace-then-plan pool allocator.

Phase 1 (trace): one step runs on the caching allocator while every ``allocate``/``free`` is
recorded as an interval per key. Phase 2 (plan, at the next step boundary): keys are
coloured onto slots with greedy left-edge colouring per (dtype, device) - keys sorted by
first use, each placed in the best-fitting slot none of whose keys is live during any of
its intervals. Phase 3 (serve): every key gets its slot at a fixed address, one
``torch.empty`` per slot.

Unlike a replay cursor, the plan is keyed by identity, so a forward-only evaluation pass,
capture runs that skip hooks, or extra microbatches cannot desynchronise it. A key first
seen after planning gets a dedicated persistent slot (``persist_on_alloc_fail``) or a clear
error; a key that grows after planning is always an error naming the key and both sizes.
``release()`` frees the slots and bumps ``generation`` so graphs captured on the old
addresses are dropped and recaptured.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from graph_fsdp.buffers.allocator import (
    DynamicAllocator,
    Key,
    SlotAllocator,
    SlotReuseError,
)


@dataclass
class KeyTrace:
    numel: int
    dtype: torch.dtype
    device: torch.device
    intervals: list[list[float]] = field(default_factory=list)
    """[start, end) event indices; end is inf while the key is still held."""

    def overlaps(self, other: KeyTrace) -> bool:
        return any(a0 < b1 and b0 < a1 for a0, a1 in self.intervals for b0, b1 in other.intervals)


def plan_slots(
    traces: dict[Key, KeyTrace],
) -> tuple[dict[Key, int], list[tuple[int, torch.dtype, torch.device]]]:
    """Greedy left-edge colouring of keys onto slots.

    Returns (key -> slot index, slot specs as (numel, dtype, device)). Only keys whose
    intervals never overlap share a slot; a slot's size is the largest key it serves.
    """
    order = sorted(traces, key=lambda k: (traces[k].intervals[0][0], -traces[k].numel))
    slot_keys: list[list[Key]] = []
    specs: list[list] = []
    assignment: dict[Key, int] = {}
    for key in order:
        trace = traces[key]
        best, best_cost = None, None
        for index, members in enumerate(slot_keys):
            numel, dtype, device = specs[index]
            if dtype != trace.dtype or device != trace.device:
                continue
            if any(trace.overlaps(traces[m]) for m in members):
                continue
            # Best fit: smallest slot that already fits; else the one that grows least.
            cost = (0, numel) if numel >= trace.numel else (1, trace.numel - numel)
            if best_cost is None or cost < best_cost:
                best, best_cost = index, cost
        if best is None:
            best = len(slot_keys)
            slot_keys.append([])
            specs.append([trace.numel, trace.dtype, trace.device])
        slot_keys[best].append(key)
        specs[best][0] = max(specs[best][0], trace.numel)
        assignment[key] = best
    return assignment, [tuple(s) for s in specs]


def _held(trace: KeyTrace) -> bool:
    """True when the key was still allocated at the end of the trace."""
    return bool(trace.intervals) and trace.intervals[-1][1] == math.inf


class TracePoolAllocator(SlotAllocator):
    def __init__(self, *, persist_on_alloc_fail: bool = False, trace_steps: int = 1) -> None:
        super().__init__(persist_on_alloc_fail=persist_on_alloc_fail)
        self._tracer = DynamicAllocator()
        self._traces: dict[Key, KeyTrace] = {}
        self._clock = 0
        self._steps_traced = 0
        self.trace_steps = trace_steps
        self.static_addresses = False  # becomes True once planned

    @property
    def tracing(self) -> bool:
        return not self._planned

    def allocate(self, key, numel, dtype, device):
        if not self.tracing:
            return super().allocate(key, numel, dtype, device)
        trace = self._traces.get(key)
        if trace is None:
            trace = self._traces[key] = KeyTrace(numel, dtype, torch.device(device))
        trace.numel = max(trace.numel, numel)
        trace.intervals.append([self._clock, math.inf])
        self._clock += 1
        self.stats.on_alloc("trace", numel * torch.empty((), dtype=dtype).element_size())
        return self._tracer.allocate(key, numel, dtype, device)

    def free(self, key, *, used_on=()):
        if not self.tracing:
            return super().free(key, used_on=used_on)
        trace = self._traces.get(key)
        if trace is not None and trace.intervals and trace.intervals[-1][1] == math.inf:
            trace.intervals[-1][1] = self._clock
            self._clock += 1
            self.stats.on_free(
                "trace", trace.numel * torch.empty((), dtype=trace.dtype).element_size()
            )
        self._tracer.free(key, used_on=used_on)

    def step_boundary(self) -> None:
        if not self.tracing:
            super().step_boundary()
        elif self._traces:
            self._steps_traced += 1
            if self._steps_traced >= self.trace_steps:
                self._slot_for_plan()

    def prepare(self, keys):
        if not self.tracing:
            super().prepare(keys)

    def static_grads(self) -> bool:
        # The plan comes from eager steps and must hold under graphs, which give a unit its
        # gradient buffer when its backward starts (param_group.py [Note: gradients autograd
        # creates]): eager steps must trace that lifetime too, not the shorter one of
        # gradients collected after the backward.
        return True

    def _slot_for_plan(self) -> None:
        self._plan()
        self._planned = True
        self.static_addresses = True
        self.generation += 1

    def _plan(self) -> None:
        if not self._traces:
            raise RuntimeError(
                "TracePoolAllocator has no trace to plan from: run at least one training step "
                "(forward + backward) before capturing graphs"
            )
        # Keys still held at the step boundary (e.g. ZeRO-1/2 weights) live forever: plan
        # them as live over the whole step, or a key traced before their allocation could
        # share their slot and find it busy on the next step.
        whole_step = [[-math.inf, math.inf]]
        assignment, specs = plan_slots(
            {
                key: KeyTrace(t.numel, t.dtype, t.device, whole_step) if _held(t) else t
                for key, t in self._traces.items()
            }
        )
        slots = [
            self._new_slot(numel, dtype, device, label=f"pool[{i}]:{numel}x{dtype}")
            for i, (numel, dtype, device) in enumerate(specs)
        ]
        self._assignment = {key: slots[i] for key, i in assignment.items()}
        # Keys the tracer still holds keep their contents: copy them into their slots.
        for key, trace in self._traces.items():
            if _held(trace):
                old = self._tracer._tensors.get(key)
                slot = self._assignment[key]
                view = slot.take(key, trace.numel)
                if old is not None and old.untyped_storage().nbytes():
                    view.copy_(old[: trace.numel])
                self._views[key] = view
        self._tracer = DynamicAllocator()
        self._account_reserved()

    def _slot_for(self, key, numel, dtype, device):
        trace = self._traces.get(key)
        if trace is not None and (numel > trace.numel or dtype != trace.dtype):
            # Never a dedicated slot (even with persist_on_alloc_fail): growth is a bug.
            raise SlotReuseError(
                f"TracePoolAllocator: key {key!r} asks for {numel} x {dtype} but was traced "
                f"and planned as {trace.numel} x {trace.dtype}: a buffer grew after planning"
            )
        return super()._slot_for(key, numel, dtype, device)

    def _unplanned(self, key, numel, dtype):
        return f"key {key!r} ({numel} x {dtype}) first appeared after the trace was planned"

    def plan_json(self) -> dict:
        out = super().plan_json()
        out["intervals"] = {
            repr(k): [[a, None if b == math.inf else b] for a, b in t.intervals]
            for k, t in self._traces.items()
        }
        return out
