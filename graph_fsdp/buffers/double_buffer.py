"""Persistent double (N-) buffers: units of one size alternate between N slots.

Keys are grouped into size classes by (role, numel, dtype, device, tag) in registration
order (the engine registers units in forward order); the tag is what a tuple key holds past
its third element (nothing for most keys): keys of different tags never share a class, so
a unit holding two buffers of one role and size under different tags (its dense and expert
parameters) alternates slots per tag instead of competing with its neighbours for one. Within a class the i-th key uses slot
``i % N`` - so unit k always sees the same address, and neighbours in execution order use
different slots, letting the all-gather of unit k+1 overlap the compute of unit k. Classes
with fewer members than N get one slot per member: asymmetric models (dense and MoE
layers, a large root unit) cost ``min(N, members) x size`` per class, never a max-size pool.

``serial_roles`` names roles whose buffers are allocated, used and freed by work queued on one
stream, in order (the engine's gradient-communication copies and reduce-scatter outputs, all
on the reduce-scatter stream): a later key cannot start before the earlier one is done with
its bytes, so a second slot buys no overlap. Each such role gets one slot per (dtype, device),
sized for its largest key, shared by every size class.
"""

from __future__ import annotations

import torch

from graph_fsdp.buffers.allocator import Key, SlotAllocator


class DoubleBufferAllocator(SlotAllocator):
    def __init__(
        self,
        *,
        num_slots: int = 2,
        persist_on_alloc_fail: bool = False,
        serial_roles: tuple[str, ...] = (),
    ) -> None:
        super().__init__(persist_on_alloc_fail=persist_on_alloc_fail)
        if num_slots < 1:
            raise ValueError(f"num_slots={num_slots} must be >= 1")
        self.num_slots = num_slots
        self.serial_roles = frozenset(serial_roles)
        self._registered: dict[Key, tuple[int, torch.dtype, torch.device]] = {}

    def register(self, key, numel, dtype, device):
        if self._planned and key not in self._registered:
            # A key announced after planning joins as a dedicated request.
            return
        self._registered[key] = (numel, dtype, torch.device(device))

    def _plan(self) -> None:
        classes: dict[tuple, list[Key]] = {}
        serial: dict[tuple, list[Key]] = {}
        for key, (numel, dtype, device) in self._registered.items():
            role = key[1] if isinstance(key, tuple) and len(key) > 1 else "other"
            tag = key[3:] if isinstance(key, tuple) else ()
            if role in self.serial_roles:
                serial.setdefault((role, dtype, device), []).append(key)
            else:
                classes.setdefault((role, numel, dtype, device, tag), []).append(key)
        for (role, dtype, device), keys in serial.items():
            numel = max(self._registered[k][0] for k in keys)
            slot = self._new_slot(numel, dtype, device, label=f"{role}[{numel}x{dtype}]#serial")
            for key in keys:
                self._assignment[key] = slot
        for (role, numel, dtype, device, tag), keys in classes.items():
            label = f"{role}[{numel}x{dtype}]" + "".join(f"/{t}" for t in tag)
            ring = [
                self._new_slot(numel, dtype, device, label=f"{label}#{i}")
                for i in range(min(self.num_slots, len(keys)))
            ]
            for i, key in enumerate(keys):
                self._assignment[key] = ring[i % len(ring)]
        self._account_reserved()

    def _unplanned(self, key, numel, dtype):
        return (
            f"key {key!r} ({numel} x {dtype}) was never registered with the double buffer "
            f"(registered size classes: {sorted({(v[0], str(v[1])) for v in self._registered.values()})})"
        )
