"""Double buffer ``serial_roles``: one slot, sized for the largest key, per serial role."""

from __future__ import annotations

import pytest
import torch

from graph_fsdp.buffers import DoubleBufferAllocator, SlotReuseError

CPU = torch.device("cpu")
F32, BF16 = torch.float32, torch.bfloat16
UNITS = {"layers.0": 100, "layers.1": 100, "layers.2": 100, "root": 300}


def make(serial: tuple[str, ...]) -> DoubleBufferAllocator:
    a = DoubleBufferAllocator(num_slots=2, serial_roles=serial)
    for unit, numel in UNITS.items():
        a.register((unit, "grad", BF16), numel, BF16, CPU)
        a.register((unit, "grad_comm", F32), numel, F32, CPU)
    return a


def reduce_in_backward_order(a: DoubleBufferAllocator) -> dict[str, int]:
    """What reduce_grads does per unit, last unit first: copy in, reduce, give back."""
    addresses = {}
    for unit in reversed(UNITS):
        buf = a.allocate((unit, "grad_comm", F32), UNITS[unit], F32, CPU)
        buf.fill_(1.0)
        addresses[unit] = buf.data_ptr()
        a.free((unit, "grad_comm", F32))
    return addresses


def test_serial_role_shares_one_slot_across_size_classes() -> None:
    a = make(("grad_comm",))
    addresses = reduce_in_backward_order(a)
    assert len(set(addresses.values())) == 1
    slots = {s["label"]: s["bytes"] for s in a.plan_json()["slots"]}
    comm = [b for label, b in slots.items() if label.startswith("grad_comm")]
    assert comm == [300 * 4]  # the root's size, once
    # Other roles keep their per-class slots: 2 for the layers, 1 for the root.
    assert sorted(b for label, b in slots.items() if label.startswith("grad[")) == [200, 200, 600]
    # Same sequence without serial roles: 2 layer slots + 1 root slot.
    b = make(())
    assert len(set(reduce_in_backward_order(b).values())) == 3
    assert a.stats.reserved["grad_comm"] == 1200 < b.stats.reserved["grad_comm"] == 2000


def test_serial_slot_held_twice_is_an_error() -> None:
    a = make(("grad_comm",))
    a.allocate(("root", "grad_comm", F32), 300, F32, CPU)
    with pytest.raises(SlotReuseError, match="still held by"):
        a.allocate(("layers.2", "grad_comm", F32), 100, F32, CPU)
