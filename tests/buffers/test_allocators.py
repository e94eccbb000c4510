"""The allocators driven directly on CPU with FSDP-like allocate/free sequences."""

from __future__ import annotations

import json

import pytest
import torch

from graph_fsdp.buffers import (
    BACKWARD_ROLES,
    DoubleBufferAllocator,
    DynamicAllocator,
    SlotReuseError,
    TracePoolAllocator,
)

CPU = torch.device("cpu")
F32, BF16 = torch.float32, torch.bfloat16
LAYERS = 4
PARAM_NUMEL = 1000


def pkey(i: int) -> tuple:
    return (f"layers.{i}", "param", F32)


def gkey(i: int) -> tuple:
    return (f"layers.{i}", "grad", F32)


def ckey(i: int) -> tuple:
    return (f"layers.{i}", "grad_comm", BF16)


SIZES: dict = {}
for _i in range(LAYERS):
    SIZES[pkey(_i)] = (PARAM_NUMEL, F32)
    SIZES[gkey(_i)] = (PARAM_NUMEL, F32)
    SIZES[ckey(_i)] = (PARAM_NUMEL, BF16)


def _nbytes(key) -> int:
    numel, dtype = SIZES[key]
    return numel * torch.empty((), dtype=dtype).element_size()


# ---------------------------------------------------------------------- sequences
def forward(*, keep_last: bool) -> list[tuple[str, tuple]]:
    """Forward with one-unit prefetch; training keeps the last unit for backward."""
    ops = [("alloc", pkey(0))]
    for i in range(LAYERS):
        if i + 1 < LAYERS:
            ops.append(("alloc", pkey(i + 1)))
        if i + 1 < LAYERS or not keep_last:
            ops.append(("free", pkey(i)))
    return ops


def backward() -> list[tuple[str, tuple]]:
    """Backward with prefetch of the previous unit; grads are reduced and freed per unit."""
    ops = []
    for i in reversed(range(LAYERS)):
        if i > 0:
            ops.append(("alloc", pkey(i - 1)))
        ops += [("alloc", gkey(i)), ("free", pkey(i))]
        ops += [("alloc", ckey(i)), ("free", ckey(i)), ("free", gkey(i))]
    return ops


def train_step(microbatches: int = 1) -> list[tuple[str, tuple]]:
    return (forward(keep_last=True) + backward()) * microbatches


def eval_step() -> list[tuple[str, tuple]]:
    return forward(keep_last=False)


def backward_only() -> list[tuple[str, tuple]]:
    """A capture that skipped the forward hooks: only backward's requests."""
    return [("alloc", pkey(LAYERS - 1))] + backward()


class Driver:
    """Runs op sequences, checks live buffers are never clobbered, records addresses."""

    def __init__(self, allocator, sizes: dict | None = None) -> None:
        self.allocator = allocator
        self.sizes = SIZES if sizes is None else sizes
        self.live: dict = {}
        self.counter = 0
        self.ptrs: dict = {}
        self.tensors: dict = {}

    def alloc(self, key) -> torch.Tensor:
        numel, dtype = self.sizes[key]
        tensor = self.allocator.allocate(key, numel, dtype, CPU)
        assert tensor.numel() == numel and tensor.dtype == dtype, key
        self.counter += 1
        value = self.counter % 97 + 1
        tensor.fill_(value)
        self.live[key] = (tensor, value)
        self.ptrs.setdefault(key, set()).add(tensor.data_ptr())
        self.tensors.setdefault(key, []).append(tensor)
        return tensor

    def free(self, key) -> None:
        tensor, value = self.live.pop(key)
        assert bool((tensor == value).all()), f"{key!r} was overwritten while live"
        self.allocator.free(key)

    def run(self, ops) -> None:
        for op, key in ops:
            self.alloc(key) if op == "alloc" else self.free(key)
        # Everything still live is intact at the end of the sequence.
        for key, (tensor, value) in self.live.items():
            assert bool((tensor == value).all()), f"{key!r} was overwritten while live"

    def reset(self) -> None:
        self.ptrs.clear()
        self.tensors.clear()


def traced_pool(*, pin: bool = True, **kwargs) -> tuple[TracePoolAllocator, Driver]:
    """A planned trace pool; ``pin`` keeps every role at fixed addresses across steps, as
    graphs that read the weight and backward buffers need (unpinned, they are released
    between steps)."""
    pool = TracePoolAllocator(**kwargs)
    if pin:
        pool.pin_roles(BACKWARD_ROLES | {"param"})
    driver = Driver(pool)
    assert pool.tracing and not pool.static_addresses
    driver.run(train_step())
    pool.step_boundary()
    assert not pool.tracing and pool.static_addresses
    assert pool.generation == 1
    driver.reset()
    return pool, driver


# ---------------------------------------------------------------------- trace pool
def test_trace_pool_addresses_stable_across_eval_and_microbatches() -> None:
    pool, driver = traced_pool()
    schedule = [
        train_step(),
        eval_step(),
        train_step(2),
        eval_step(),
        eval_step(),
        backward_only(),
        train_step(3),
    ]
    first_ptr: dict = {}
    first_obj: dict = {}
    for step in range(24):
        driver.run(schedule[step % len(schedule)])
        pool.step_boundary()
        assert not driver.live
        for key, ptrs in driver.ptrs.items():
            assert len(ptrs) == 1, f"{key!r} moved within step {step}: {ptrs}"
            ptr = next(iter(ptrs))
            assert first_ptr.setdefault(key, ptr) == ptr, f"{key!r} moved at step {step}"
        for key, tensors in driver.tensors.items():
            first = first_obj.setdefault(key, tensors[0])
            assert all(t is first for t in tensors), f"{key!r} got a new tensor object"
        driver.reset()
    assert set(first_ptr) == set(SIZES)
    assert pool.generation == 1
    report = pool.memory_report()
    assert all(v == 0 for v in report["live_bytes"].values()), report
    # The plan reuses memory: fewer bytes than one buffer per key.
    reserved = report["total_reserved_bytes"]["all"]
    assert 0 < reserved < sum(_nbytes(k) for k in SIZES)


def test_trace_pool_slot_sharing_keys_alternate() -> None:
    pool, driver = traced_pool()
    driver.run(train_step())
    ptr = {k: next(iter(v)) for k, v in driver.ptrs.items()}
    # Neighbouring units are live together (prefetch) and must not share bytes.
    for i in range(LAYERS - 1):
        assert ptr[pkey(i)] != ptr[pkey(i + 1)]


def test_trace_pool_key_held_at_step_boundary() -> None:
    # "held" (e.g. a ZeRO-1/2 unsharded weight) is still allocated when the step ends; a key
    # used and freed before it was allocated must not be planned into its slot.
    sizes = {("a", "param", F32): (64, F32), ("held", "param", F32): (64, F32)}
    pool = TracePoolAllocator()
    driver = Driver(pool, sizes)
    driver.alloc(("a", "param", F32))
    driver.free(("a", "param", F32))
    held = driver.alloc(("held", "param", F32))
    held.copy_(torch.arange(64, dtype=F32))
    pool.step_boundary()
    held_view = pool.allocate(("held", "param", F32), 64, F32, CPU)
    assert torch.equal(held_view, torch.arange(64, dtype=F32)), "contents lost at planning"
    for _ in range(20):
        a = pool.allocate(("a", "param", F32), 64, F32, CPU)
        a.fill_(-1)
        pool.free(("a", "param", F32))
        assert pool.allocate(("held", "param", F32), 64, F32, CPU) is held_view
        assert torch.equal(held_view, torch.arange(64, dtype=F32))
        pool.step_boundary()


def test_trace_pool_late_key_raises() -> None:
    pool, driver = traced_pool()
    late = ("late_unit", "param", F32)
    with pytest.raises(SlotReuseError) as info:
        pool.allocate(late, 10, F32, CPU)
    assert repr(late) in str(info.value)


def test_trace_pool_late_key_persistent() -> None:
    pool, driver = traced_pool(persist_on_alloc_fail=True)
    late = ("late_unit", "param", F32)
    driver.sizes = {**SIZES, late: (500, F32)}
    seen = set()
    for _ in range(20):
        driver.alloc(late)  # live through the whole step, next to every planned key
        driver.run(train_step())
        driver.free(late)
        pool.step_boundary()
        seen |= driver.ptrs[late]
    assert len(seen) == 1, seen
    assert pool.memory_report()["reserved_bytes"]["dedicated"] == 500 * 4
    assert pool.generation == 1


@pytest.mark.parametrize("persist", [False, True])
def test_trace_pool_growth_after_planning_raises(persist: bool) -> None:
    pool, driver = traced_pool(persist_on_alloc_fail=persist)
    with pytest.raises(SlotReuseError) as info:
        pool.allocate(pkey(1), 1234, F32, CPU)
    message = str(info.value)
    assert repr(pkey(1)) in message and "1234" in message and str(PARAM_NUMEL) in message


def test_trace_pool_growth_within_a_larger_shared_slot_raises() -> None:
    small, big = ("small", "param", F32), ("big", "param", F32)
    pool = TracePoolAllocator()
    driver = Driver(pool, {small: (100, F32), big: (1000, F32)})
    driver.run([("alloc", small), ("free", small), ("alloc", big), ("free", big)])
    pool.step_boundary()
    assert len(pool.plan_json()["slots"]) == 1  # both keys share the 1000-element slot
    with pytest.raises(SlotReuseError) as info:
        pool.allocate(small, 500, F32, CPU)
    assert "500" in str(info.value) and "100" in str(info.value)


def test_trace_pool_busy_slot_is_an_error() -> None:
    a, b = ("a", "param", F32), ("b", "param", F32)
    pool = TracePoolAllocator()
    driver = Driver(pool, {a: (64, F32), b: (64, F32)})
    driver.run([("alloc", a), ("free", a), ("alloc", b), ("free", b)])
    pool.step_boundary()
    ta = pool.allocate(a, 64, F32, CPU)
    ta.fill_(7)
    with pytest.raises(SlotReuseError) as info:
        pool.allocate(b, 64, F32, CPU)
    assert repr(a) in str(info.value) and repr(b) in str(info.value)
    # Not silently reassigned: a still owns its bytes, b gets them only after a's free.
    assert bool((ta == 7).all())
    pool.free(a)
    tb = pool.allocate(b, 64, F32, CPU)
    assert tb.data_ptr() == ta.data_ptr()
    pool.free(b)


def test_trace_pool_release() -> None:
    pool, driver = traced_pool()
    driver.run(train_step())
    before = pool.memory_report()["total_reserved_bytes"]["all"]
    pool.release()
    assert pool.generation == 2
    driver.reset()
    ptrs: dict = {}
    for _ in range(5):
        driver.run(train_step())
        driver.run(eval_step())
        pool.step_boundary()
        for key, p in driver.ptrs.items():
            assert len(p) == 1
            assert ptrs.setdefault(key, next(iter(p))) == next(iter(p))
        driver.reset()
    assert set(ptrs) == set(SIZES)
    assert pool.generation == 2
    assert pool.memory_report()["total_reserved_bytes"]["all"] == before


def test_trace_pool_trace_steps() -> None:
    pool = TracePoolAllocator(trace_steps=2)
    driver = Driver(pool)
    driver.run(train_step())
    pool.step_boundary()
    assert pool.tracing and pool.generation == 0
    driver.run(train_step())
    pool.step_boundary()
    assert not pool.tracing and pool.generation == 1
    driver.run(train_step(2))


def test_trace_pool_step_boundary_without_trace_keeps_tracing() -> None:
    pool = TracePoolAllocator()
    pool.step_boundary()
    assert pool.tracing and pool.generation == 0


def test_trace_pool_plan_json() -> None:
    pool, driver = traced_pool(persist_on_alloc_fail=True)
    late = ("late_unit", "param", F32)
    pool.allocate(late, 10, F32, CPU)
    pool.free(late)
    plan = json.loads(json.dumps(pool.plan_json()))
    assert plan["allocator"] == "TracePoolAllocator"
    assert plan["generation"] == 1
    slots = plan["slots"]
    listed = [key for slot in slots for key in slot["keys"]]
    for key in SIZES:
        assert listed.count(repr(key)) == 1, key
    assert any(repr(late) in key for key in listed)
    for slot in slots:
        assert {"label", "numel", "dtype", "device", "bytes", "keys"} <= set(slot)
    assert sum(s["bytes"] for s in slots) == sum(pool.memory_report()["reserved_bytes"].values())
    assert set(plan["intervals"]) == {repr(k) for k in SIZES}


# ---------------------------------------------------------------------- double buffer
DENSE, MOE, ROOT = 96, 160, 200


def asymmetric_keys() -> tuple[list, list, tuple]:
    """12 layers, every third one MoE (4 MoE, 8 dense), plus a root unit."""
    dense, moe = [], []
    for i in range(12):
        (moe if i % 3 == 2 else dense).append((f"layers.{i}", "param", F32))
    return dense, moe, ("", "param", F32)


def asymmetric_sizes() -> dict:
    dense, moe, root = asymmetric_keys()
    sizes = {k: (DENSE, F32) for k in dense}
    sizes.update({k: (MOE, F32) for k in moe})
    sizes[root] = (ROOT, F32)
    return sizes


def asymmetric_step() -> list[tuple[str, tuple]]:
    layers = [(f"layers.{i}", "param", F32) for i in range(12)]
    root = ("", "param", F32)
    ops = [("alloc", root), ("alloc", layers[0])]
    for i in range(12):  # forward, prefetching the next unit
        if i + 1 < 12:
            ops.append(("alloc", layers[i + 1]))
        if i + 1 < 12:
            ops.append(("free", layers[i]))
    for i in reversed(range(12)):  # backward, prefetching the previous unit
        if i > 0:
            ops.append(("alloc", layers[i - 1]))
        ops.append(("free", layers[i]))
    ops.append(("free", root))
    return ops


def registered_double_buffer(num_slots: int = 2, **kwargs) -> DoubleBufferAllocator:
    allocator = DoubleBufferAllocator(num_slots=num_slots, **kwargs)
    for key, (numel, dtype) in asymmetric_sizes().items():
        allocator.register(key, numel, dtype, CPU)
    return allocator


@pytest.mark.parametrize("num_slots", [2, 3, 5])
def test_double_buffer_alternates_slots(num_slots: int) -> None:
    allocator = registered_double_buffer(num_slots)
    allocator.pin_roles(("param",))  # addresses name the slots below: keep them across steps
    driver = Driver(allocator, asymmetric_sizes())
    first: dict = {}
    for _ in range(20):
        driver.run(asymmetric_step())
        allocator.step_boundary()
        assert not driver.live
        for key, ptrs in driver.ptrs.items():
            assert len(ptrs) == 1, key
            assert first.setdefault(key, next(iter(ptrs))) == next(iter(ptrs)), key
        driver.reset()

    dense, moe, root = asymmetric_keys()
    for members in (dense, moe):
        ring = min(num_slots, len(members))
        for i, key in enumerate(members):
            assert first[key] == first[members[i % ring]], (i, key)
        assert len({first[members[i]] for i in range(ring)}) == ring
    assert len({first[k] for k in first}) == min(num_slots, 8) + min(num_slots, 4) + 1

    expected = (min(num_slots, 8) * DENSE + min(num_slots, 4) * MOE + ROOT) * 4
    report = allocator.memory_report()
    assert report["total_reserved_bytes"]["all"] == expected
    assert report["live_bytes"]["param"] == 0
    # Peak: root + two prefetched neighbours (dense + dense or dense + MoE).
    assert report["peak_live_bytes"]["param"] == (ROOT + DENSE + MOE) * 4
    assert allocator.generation == 0


def test_double_buffer_roles_are_separate_classes() -> None:
    allocator = DoubleBufferAllocator()
    for i in range(4):
        allocator.register((f"l{i}", "param", F32), 64, F32, CPU)
        allocator.register((f"l{i}", "grad", F32), 64, F32, CPU)
    p = allocator.allocate(("l0", "param", F32), 64, F32, CPU)
    g = allocator.allocate(("l0", "grad", F32), 64, F32, CPU)
    assert p.data_ptr() != g.data_ptr()
    assert allocator.memory_report()["reserved_bytes"] == {"param": 2 * 64 * 4, "grad": 2 * 64 * 4}


def test_double_buffer_tagged_keys_get_their_own_rings() -> None:
    """A unit holding a dense and an expert group of one size (keys tagged "experts",
    graph_fsdp/fsdp/experts.py): while unit 0's two buffers are held, unit 1's prefetch gets two
    other slots - one ring per tag - and unit 2 reuses unit 0's."""
    allocator = DoubleBufferAllocator()
    keys = [[(f"l{i}", "param", F32), (f"l{i}.experts", "param", F32, "experts")] for i in range(3)]
    for unit in keys:
        for key in unit:
            allocator.register(key, 64, F32, CPU)
    held = [[allocator.allocate(key, 64, F32, CPU).data_ptr() for key in unit] for unit in keys[:2]]
    assert len({*held[0], *held[1]}) == 4
    for key in keys[0]:
        allocator.free(key)
    third = [allocator.allocate(key, 64, F32, CPU).data_ptr() for key in keys[2]]
    assert third == held[0]
    labels = {slot.label for slot in allocator.slots()}
    assert labels == {"param[64xtorch.float32]#0", "param[64xtorch.float32]#1"} | {
        "param[64xtorch.float32]/experts#0",
        "param[64xtorch.float32]/experts#1",
    }


def test_double_buffer_one_slot_prefetch_is_busy_error() -> None:
    allocator = registered_double_buffer(num_slots=1)
    dense, _, _ = asymmetric_keys()
    allocator.allocate(dense[0], DENSE, F32, CPU)
    with pytest.raises(SlotReuseError) as info:
        allocator.allocate(dense[1], DENSE, F32, CPU)
    assert repr(dense[0]) in str(info.value) and repr(dense[1]) in str(info.value)
    allocator.free(dense[0])
    allocator.allocate(dense[1], DENSE, F32, CPU)


def test_double_buffer_invalid_num_slots() -> None:
    with pytest.raises(ValueError):
        DoubleBufferAllocator(num_slots=0)


def test_double_buffer_unregistered_key_raises() -> None:
    allocator = registered_double_buffer()
    key = ("head", "param", F32)
    with pytest.raises(SlotReuseError) as info:
        allocator.allocate(key, 50, F32, CPU)
    assert repr(key) in str(info.value)


def test_double_buffer_unregistered_key_persistent() -> None:
    allocator = registered_double_buffer(persist_on_alloc_fail=True)
    key = ("head", "param", F32)
    sizes = {**asymmetric_sizes(), key: (50, F32)}
    driver = Driver(allocator, sizes)
    seen = set()
    for _ in range(20):
        driver.alloc(key)
        driver.run(asymmetric_step())
        driver.free(key)
        seen |= driver.ptrs[key]
        driver.reset()
    assert len(seen) == 1
    report = allocator.memory_report()
    assert report["reserved_bytes"]["dedicated"] == 50 * 4
    assert report["live_bytes"]["param"] == 0


def test_double_buffer_oversized_unit() -> None:
    dense, _, _ = asymmetric_keys()
    strict = registered_double_buffer()
    with pytest.raises(SlotReuseError) as info:
        strict.allocate(dense[3], DENSE + 7, F32, CPU)
    assert repr(dense[3]) in str(info.value)
    assert str(DENSE + 7) in str(info.value) and str(DENSE) in str(info.value)

    # With persist_on_alloc_fail a unit that outgrew its class gets ONE persistent buffer.
    allocator = registered_double_buffer(persist_on_alloc_fail=True)
    sizes = {**asymmetric_sizes(), dense[3]: (DENSE + 7, F32)}
    driver = Driver(allocator, sizes)
    seen = set()
    for _ in range(20):
        driver.run(asymmetric_step())
        seen |= driver.ptrs[dense[3]]
        driver.reset()
    assert len(seen) == 1, f"oversized unit moved between steps: {len(seen)} addresses"
    report = allocator.memory_report()
    assert report["reserved_bytes"]["dedicated"] == (DENSE + 7) * 4
    assert report["live_bytes"]["param"] == 0


def test_double_buffer_release() -> None:
    allocator = registered_double_buffer()
    driver = Driver(allocator, asymmetric_sizes())
    driver.run(asymmetric_step())
    allocator.release()
    assert allocator.generation == 1
    driver.reset()
    for _ in range(3):
        driver.run(asymmetric_step())
    assert all(len(p) == 1 for p in driver.ptrs.values())


def test_double_buffer_plan_json() -> None:
    allocator = registered_double_buffer(num_slots=3)
    allocator.allocate(("", "param", F32), ROOT, F32, CPU)
    plan = json.loads(json.dumps(allocator.plan_json()))
    assert plan["allocator"] == "DoubleBufferAllocator"
    assert len(plan["slots"]) == 3 + 3 + 1
    listed = [key for slot in plan["slots"] for key in slot["keys"]]
    assert sorted(listed) == sorted(repr(k) for k in asymmetric_sizes())


# ---------------------------------------------------------------------- dynamic
def test_dynamic_allocator_identity_and_storage() -> None:
    allocator = DynamicAllocator()
    key = ("layers.0", "param", F32)
    first = allocator.allocate(key, 100, F32, CPU)
    view = first[10:20]
    for step in range(5):
        tensor = allocator.allocate(key, 100, F32, CPU) if step else first
        assert tensor is first
        assert tensor.untyped_storage().nbytes() == 400
        tensor.fill_(step)
        assert bool((view == step).all())  # views made once see the bytes again
        allocator.free(key)
        assert first.untyped_storage().nbytes() == 0
    assert not allocator.static_addresses


def test_dynamic_allocator_memory_report() -> None:
    allocator = DynamicAllocator()
    p0, p1 = ("l0", "param", F32), ("l1", "param", F32)
    g0 = ("l0", "grad", BF16)

    def report(kind: str) -> dict:
        return allocator.memory_report()[kind]

    allocator.allocate(p0, 100, F32, CPU)
    allocator.allocate(p1, 50, F32, CPU)
    allocator.allocate(g0, 30, BF16, CPU)
    assert report("live_bytes") == {"param": 600, "grad": 60}
    assert report("peak_live_bytes") == {"param": 600, "grad": 60}
    allocator.free(p0)
    allocator.free(p0)  # a second free is a no-op
    assert report("live_bytes") == {"param": 200, "grad": 60}
    assert report("reserved_bytes") == {"param": 200, "grad": 60}
    allocator.free(g0)
    allocator.allocate(p0, 100, F32, CPU)
    allocator.free(p1)
    assert report("live_bytes") == {"param": 400, "grad": 0}
    assert report("peak_live_bytes") == {"param": 600, "grad": 60}
    allocator.free(p0)
    assert report("live_bytes") == {"param": 0, "grad": 0}
    assert allocator.memory_report()["total_reserved_bytes"]["all"] == 0
    allocator.free(("never", "param", F32))  # unknown keys are ignored


def test_dynamic_allocator_new_size_new_tensor() -> None:
    allocator = DynamicAllocator()
    key = ("l0", "param", F32)
    a = allocator.allocate(key, 10, F32, CPU)
    allocator.free(key)
    b = allocator.allocate(key, 20, F32, CPU)
    assert b.numel() == 20 and b is not a
    assert b.untyped_storage().nbytes() == 80
    assert float(b.fill_(1).sum()) == 20


# ---------------------------------------------------------------------- backward slots
def _backward_slots(allocator) -> tuple[list, list]:
    """(slots serving only backward roles, the other slots) of a planned allocator."""
    roles: dict = {}
    for key, slot in allocator._assignment.items():
        roles.setdefault(id(slot), set()).add(key[1])
    slots = allocator.slots()
    backward = [s for s in slots if roles[id(s)] <= BACKWARD_ROLES]
    return backward, [s for s in slots if s not in backward]


def registered_layers(**kwargs) -> DoubleBufferAllocator:
    allocator = DoubleBufferAllocator(serial_roles=("grad_comm",), **kwargs)
    for key, (numel, dtype) in SIZES.items():
        allocator.register(key, numel, dtype, CPU)
    return allocator


def layers_and_driver(kind: str):
    """The layer stack's allocator of ``kind`` (double_buffer, or a trace pool planned from a
    traced step) and a driver over it."""
    if kind == "trace_pool":
        return traced_pool(pin=False)
    allocator = registered_layers()
    return allocator, Driver(allocator)


@pytest.mark.parametrize("kind", ["double_buffer", "trace_pool"])
def test_backward_slots_released_between_steps(kind: str) -> None:
    # [Note: backward slots between steps], [Note: weight slots during backward]: after a
    # step every idle slot gives its bytes back - the backward buffers and the weight slots
    # (the last unit's, held into backward, is idle again) - unless a role is pinned.
    allocator, driver = layers_and_driver(kind)
    objects: dict = {}
    for step in range(4):
        if step == 2:
            allocator.pin_roles(("param",))  # what layerwise graphs do
        driver.run(train_step())
        allocator.step_boundary()
        backward, weights = _backward_slots(allocator)
        assert backward and weights, "the plan has backward-only and weight slots"
        for slot in backward + (weights if step < 2 else []):
            assert slot.released and slot.tensor.untyped_storage().nbytes() == 0, slot.label
        for slot in weights if step >= 2 else []:
            assert not slot.released and slot.tensor.untyped_storage().nbytes() == slot.nbytes
        # The same tensor objects come back (views made on them stay valid).
        for key, tensors in driver.tensors.items():
            assert all(t is objects.setdefault(key, tensors[0]) for t in tensors), key
        driver.reset()
    assert all(v == 0 for v in allocator.memory_report()["live_bytes"].values())


def test_prepare_gives_backward_slots_their_bytes_before_use() -> None:
    allocator = registered_layers()
    driver = Driver(allocator)
    driver.run(train_step())
    allocator.step_boundary()
    slot = allocator._assignment[ckey(0)]
    assert slot.released
    allocator.prepare([ckey(0), ("layers.0", "rs_out", F32)])  # an unregistered key is skipped
    assert not slot.released and slot.tensor.untyped_storage().nbytes() == slot.nbytes
    driver.run(train_step())  # values written and checked through the re-allocated bytes


def test_pinned_roles_stay_at_fixed_addresses() -> None:
    allocator = registered_layers()
    driver = Driver(allocator)
    driver.run(train_step())
    allocator.step_boundary()
    allocator.pin_roles(("grad",))  # after a release: the pinned slots get their bytes back
    ptrs = {}
    for _ in range(3):
        driver.reset()
        driver.run(train_step())
        allocator.step_boundary()
        for i in range(LAYERS):
            ptr = next(iter(driver.ptrs[gkey(i)]))
            assert ptrs.setdefault(gkey(i), ptr) == ptr
            assert not allocator._assignment[gkey(i)].released
            assert allocator._assignment[ckey(i)].released


@pytest.mark.parametrize("kind", ["double_buffer", "trace_pool"])
def test_idle_weight_slots_released_after_forward(kind: str) -> None:
    # [Note: weight slots during backward]: at the forward boundary the weight slots no key
    # holds give their bytes back (the last unit, kept for backward, keeps its slot); the
    # next gather re-allocates them and values survive through the new bytes.
    allocator, driver = layers_and_driver(kind)
    for _ in range(3):
        driver.run(forward(keep_last=True))
        allocator.forward_boundary()
        held = allocator._assignment[pkey(LAYERS - 1)]
        assert not held.released and held.tensor.untyped_storage().nbytes() == held.nbytes
        idle = [
            allocator._assignment[pkey(i)]
            for i in range(LAYERS)
            if allocator._assignment[pkey(i)] is not held
        ]
        assert idle, "some weight slot is idle after forward"
        for slot in idle:
            assert slot.released and slot.tensor.untyped_storage().nbytes() == 0, slot.label
        driver.run(backward())
        allocator.step_boundary()
        driver.reset()


def test_pinned_weight_slots_are_not_released_after_forward() -> None:
    allocator = registered_layers()
    driver = Driver(allocator)
    allocator.pin_roles(("param",))
    driver.run(forward(keep_last=True))
    ptrs = {pkey(i): next(iter(driver.ptrs[pkey(i)])) for i in range(LAYERS)}
    allocator.forward_boundary()
    assert not any(allocator._assignment[pkey(i)].released for i in range(LAYERS))
    driver.run(backward())
    allocator.step_boundary()
    driver.reset()
    driver.run(forward(keep_last=True))
    assert {k: next(iter(driver.ptrs[k])) for k in ptrs} == ptrs


def test_owning_capture_releases_only_slots_made_in_the_capture(monkeypatch) -> None:
    # allocator.py [Note: slots in a capture's pool]: a whole-step capture starts with every
    # idle slot released (the capture re-makes it from its pool) and releases at its forward
    # boundary only slots it made; a slot already holding bytes (default pool) keeps them
    # through the capture even once idle. Without the scope, a capture releases nothing.
    import graph_fsdp.buffers.allocator as allocator_module

    allocator = registered_layers(num_slots=3)  # weight slots: p0 p3 | p1 | p2
    driver = Driver(allocator)
    driver.run(train_step())
    allocator.step_boundary()
    driver.reset()
    weights = [allocator._assignment[pkey(i)] for i in range(3)]
    monkeypatch.setattr(allocator_module, "stream_capturing", lambda: True)
    driver.run(forward(keep_last=True))
    allocator.forward_boundary()  # a user's own capture: nothing released
    assert not any(s.released for s in weights)
    driver.run(backward())
    allocator.step_boundary()
    driver.reset()

    last, before, made_here = weights  # held by p3 after forward | held into the capture | idle
    driver.alloc(pkey(1))
    with allocator.owning_capture():
        assert not before.released
        assert all(s.released for s in allocator.slots() if s is not before)
        driver.free(pkey(1))
        driver.run(forward(keep_last=True))
        allocator.forward_boundary()
        assert last.holder is not None and not last.released
        assert before.holder is None and not before.released  # its bytes predate the capture
        assert made_here.holder is None and made_here.released
        driver.run(backward())
        allocator.step_boundary()
        driver.reset()
    monkeypatch.setattr(allocator_module, "stream_capturing", lambda: False)
    driver.run(forward(keep_last=True))
    allocator.forward_boundary()  # eager again: every idle weight slot gives its bytes back
    assert before.released and made_here.released and not last.released
    driver.run(backward())


def test_idle_slots_and_main_grads_go_before_the_cached_blocks(monkeypatch) -> None:
    # pools.py [Note: capture memory]: before a capture the idle slots and the main gradients
    # the step would release are released first, then the cached blocks go back - so their
    # bytes go back too. A held slot keeps its bytes; the base allocator has nothing to give.
    import graph_fsdp.capture.pools as pools

    allocator = registered_layers(num_slots=3)
    driver = Driver(allocator)
    driver.run(forward(keep_last=True))
    held = [s for s in allocator.slots() if s.holder is not None]
    assert held and any(s.holder is None and not s.released for s in allocator.slots())
    order: list[str] = []

    class Group:
        def __init__(self, name: str) -> None:
            self.name = name

        def release_main_grad(self) -> None:
            order.append(self.name)

    def give_back() -> None:
        order.append("cached blocks")
        idle = [s for s in allocator.slots() if s.holder is None and s.tensor is not None]
        assert idle and all(s.released for s in idle)
        assert all(not s.released for s in held)

    # The device as pools.py sees it: synchronized once, first; then the cached blocks go.
    monkeypatch.setattr(pools.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(pools.torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(pools.torch.cuda, "synchronize", lambda: order.append("synchronize"))
    monkeypatch.setattr(pools.torch.cuda, "empty_cache", give_back)
    # cuBLAS's workspaces stay: a graph captured earlier may replay into one (pools.py).
    clear = lambda: order.append("cuBLAS workspaces")  # noqa: E731
    monkeypatch.setattr(pools.torch._C, "_cuda_clearCublasWorkspaces", clear, raising=False)
    pools.release_for_capture([Group("g0"), Group("g1")], allocator)
    assert order == ["synchronize", "g0", "g1", "cached blocks"]
    DynamicAllocator().release_idle()  # nothing idle to give back: a no-op


def test_which_allocators_keep_gradients_at_fixed_addresses() -> None:
    # param_group.py [Note: gradients autograd creates]: eager steps and whole-step captures
    # leave gradients to autograd unless layerwise graphs pinned them; a trace pool always
    # presets them, so its plan, traced in eager steps, covers the longer lifetime graphs
    # give them.
    assert not DynamicAllocator().static_grads()
    allocator = registered_layers()
    assert not allocator.static_grads()
    allocator.pin_roles(("grad",))
    assert allocator.static_grads()
    assert TracePoolAllocator().static_grads()
