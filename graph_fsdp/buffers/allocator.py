"""One allocator interface for the unsharded buffers FSDP creates and releases.

Every request names a *key* (an identity such as ``("layers.3", "param", torch.bfloat16)``)
and the allocator returns a tensor for it. Keys are identities, not sequence numbers: the
same key gets the same tensor object for as long as the plan holds, so views made on it
(unsharded parameters, preset ``.grad``) stay valid across steps, eval passes and
microbatches. Implementations differ in where the bytes live:

- :class:`DynamicAllocator` - the caching allocator: the key's tensor keeps its identity but
  its storage is resized to zero on ``free`` (lowest memory; addresses change; eager only);
- :class:`~graph_fsdp.buffers.double_buffer.DoubleBufferAllocator` - N persistent slots per
  size class, units alternate slots;
- :class:`~graph_fsdp.buffers.trace_pool.TracePoolAllocator` - traces one step, then serves
  every key from a planned slot at a fixed address.

Stream safety: ``free(key, used_on=streams)`` says which streams still read or write the
buffer; reuse of the bytes waits for those streams (events for slots, ``record_stream`` for
the caching allocator). See [Note: slot reuse across streams].
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field

import torch

from graph_fsdp.cuda_streams import current_stream, nvtx_range, stream_capturing

Key = Hashable
Region = Callable[[], AbstractContextManager]
"""A context the allocations of persistent bytes run in (``SlotAllocator.set_region``)."""


BACKWARD_ROLES = frozenset({"grad", "grad_comm", "rs_out", "rep_out"})
"""Roles whose keys live only inside a backward (unsharded gradients, reduction buffers):
their slots hold nothing between steps ([Note: backward slots between steps])."""


def key_role(key: Key) -> str:
    """Role of a key for memory reports: the second element of tuple keys."""
    if isinstance(key, tuple) and len(key) >= 2 and isinstance(key[1], str):
        return key[1]
    return "other"


@dataclass
class MemoryStats:
    """Bytes by role: reserved now, live now and the live peak."""

    reserved: dict[str, int] = field(default_factory=dict)
    live: dict[str, int] = field(default_factory=dict)
    peak: dict[str, int] = field(default_factory=dict)

    def on_alloc(self, role: str, nbytes: int) -> None:
        self.live[role] = self.live.get(role, 0) + nbytes
        self.peak[role] = max(self.peak.get(role, 0), self.live[role])

    def on_free(self, role: str, nbytes: int) -> None:
        self.live[role] = self.live.get(role, 0) - nbytes

    def as_dict(self) -> dict[str, dict[str, int]]:
        return {
            "reserved_bytes": dict(self.reserved),
            "live_bytes": dict(self.live),
            "peak_live_bytes": dict(self.peak),
            "total_reserved_bytes": {"all": sum(self.reserved.values())},
        }


class SlotReuseError(RuntimeError):
    """A planned slot was requested while another key still holds it."""


class BufferAllocator(ABC):
    """Interface shared by all allocators (see module docstring)."""

    static_addresses: bool = False
    """True when a key's bytes never move while the plan holds (CUDA graphs need this)."""

    def __init__(self) -> None:
        self.stats = MemoryStats()
        self.generation = 0
        """Bumped whenever addresses handed out earlier become invalid (plan, release):
        graphs captured under an older generation must be dropped and recaptured."""

    def register(  # noqa: B027 - optional hook
        self, key: Key, numel: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        """Announce a key before the first step (lets planning allocators size slots)."""

    @abstractmethod
    def allocate(
        self, key: Key, numel: int, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """Bytes for ``key``, safe to write on the current stream."""

    @abstractmethod
    def free(self, key: Key, *, used_on: Sequence[torch.cuda.Stream] = ()) -> None:
        """Give ``key``'s bytes back once work already queued on ``used_on`` is done."""

    def step_boundary(self) -> None:  # noqa: B027 - optional hook
        """Called by the root between training steps, after the main stream waited for every
        reduction (trace pool plans here; slot allocators release backward slots)."""

    def prepare(self, keys: Sequence[Key]) -> None:  # noqa: B027 - optional hook
        """Give ``keys``' buffers their bytes now, on the current (main) stream."""

    def forward_boundary(self) -> None:  # noqa: B027 - optional hook
        """Called by the root after a training forward, on the main stream (slot allocators
        give back the bytes of idle weight slots: [Note: weight slots during backward])."""

    def pin_roles(self, roles: Sequence[str]) -> None:  # noqa: B027 - optional hook
        """Keep the buffers of ``roles`` at fixed addresses from now on (graphs read them)."""

    def static_grads(self) -> bool:
        """Whether graphs write the unsharded gradients at fixed addresses ("grad" pinned)."""
        return False

    def owning_capture(self):
        """Around a whole-step capture (slot allocators: [Note: slots in a capture's pool])."""
        return nullcontext()

    def release_idle(self) -> None:  # noqa: B027 - optional hook
        """Before a whole-step capture, ahead of the cached blocks: give back the bytes of
        every buffer no key holds (slot allocators: [Note: slots in a capture's pool])."""

    def release(self) -> None:  # noqa: B027 - optional hook
        """Free every persistent byte; later requests re-create them at new addresses."""

    def forget_events(self) -> None:  # noqa: B027 - optional hook
        """Drop the stream events buffers wait on before reuse: the device was synchronized,
        and a capture cannot wait on events recorded outside it (slot allocators)."""

    def set_region(self, region: Region) -> None:
        """Allocate persistent bytes inside ``region()`` from now on (slot allocators)."""
        raise TypeError(
            f"{type(self).__name__} keeps no persistent buffers to place in a memory region: "
            "use a slot allocator (BufferPolicy(allocator='double_buffer' or 'trace_pool'))"
        )

    def memory_report(self) -> dict[str, dict[str, int]]:
        return self.stats.as_dict()

    def plan_json(self) -> dict:
        return {"allocator": type(self).__name__}


class DynamicAllocator(BufferAllocator):
    """Caching-allocator path: storage resized to zero on free, object identity kept.

    Keeping the tensor object (and resizing its storage, as torch FSDP2 does) means views
    created once, and tensors autograd saved in forward, see the bytes again after the
    backward re-gather, although the address may differ.
    """

    def __init__(self) -> None:
        super().__init__()
        self._tensors: dict[Key, torch.Tensor] = {}

    def allocate(self, key, numel, dtype, device):
        tensor = self._tensors.get(key)
        if tensor is None or tensor.numel() != numel or tensor.dtype != dtype:
            tensor = torch.empty(numel, dtype=dtype, device=device)
            self._tensors[key] = tensor
        else:
            storage = tensor.untyped_storage()
            nbytes = numel * tensor.element_size()
            if storage.nbytes() != nbytes:
                storage.resize_(nbytes)
        nbytes = numel * tensor.element_size()
        self.stats.on_alloc(key_role(key), nbytes)
        self.stats.reserved[key_role(key)] = self.stats.live[key_role(key)]
        return tensor

    def free(self, key, *, used_on=()):
        tensor = self._tensors.get(key)
        if tensor is None or tensor.untyped_storage().nbytes() == 0:
            return
        for stream in used_on:
            tensor.record_stream(stream)
        self.stats.on_free(key_role(key), tensor.untyped_storage().nbytes())
        self.stats.reserved[key_role(key)] = self.stats.live[key_role(key)]
        tensor.untyped_storage().resize_(0)


class Slot:
    """A persistent buffer plus the events that must complete before it is reused.

    [Note: slot reuse across streams] A slot freed by a key whose last use was queued on
    stream S (e.g. the reduce-scatter stream reading a gradient) records an event on S; the
    next allocation waits for those events on the stream it allocates from. Inside a CUDA
    graph capture these records and waits become graph edges.
    """

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device, label: str):
        self.numel, self.dtype, self.device, self.label = numel, dtype, device, label
        self.tensor: torch.Tensor | None = None
        self.released = False
        """The tensor exists but its storage was given back (see ``release_storage``)."""
        self.holder: Key | None = None
        self.pending: list[torch.cuda.Event] = []
        self._events: dict[tuple, torch.cuda.Event] = {}
        """One reusable event per stream this slot is given back on (see ``give_back``)."""
        self.region: Region = nullcontext
        """Where its bytes are allocated (``SlotAllocator.set_region``)."""

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()

    def materialise(self) -> torch.Tensor:
        """The slot's tensor with its bytes, allocated on the current stream if it has none."""
        if self.tensor is None:
            with self.region():
                self.tensor = torch.empty(self.numel, dtype=self.dtype, device=self.device)
        elif self.released:
            with self.region():
                self.tensor.untyped_storage().resize_(self.nbytes)
            self.released = False
        return self.tensor

    def release_storage(self) -> None:
        """Give the bytes back to the caching allocator; the tensor and its views stay and
        ``materialise`` re-allocates them (a new address). Only between uses: the caller
        guarantees that no queued work still touches the bytes."""
        if self.tensor is not None and not self.released and self.holder is None:
            self.tensor.untyped_storage().resize_(0)
            self.released = True

    def take(self, key: Key, numel: int) -> torch.Tensor:
        return self.acquire(key)[:numel]

    def acquire(self, key: Key) -> torch.Tensor:
        """``take`` without the view: the slot's whole tensor (callers cache their view)."""
        if self.holder is not None and self.holder != key:
            raise SlotReuseError(
                f"slot {self.label} ({self.numel} x {self.dtype}) is still held by "
                f"{self.holder!r} when {key!r} asks for it: a unit was not resharded (or its "
                "gradient not reduced) before the next unit sharing its slot started. Raise "
                "BufferPolicy.num_slots or check the module call order."
            )
        self.holder = key
        tensor = self.materialise()
        if self.pending:
            if tensor.is_cuda:
                stream = current_stream(tensor.device)
                for event in self.pending:
                    stream.wait_event(event)
            self.pending = []
        return tensor

    def give_back(self, used_on: Sequence[torch.cuda.Stream]) -> None:
        # Events are reused, one per stream: a wait enqueued by ``take`` depends on the record
        # that was latest when the wait was enqueued, and ``free`` gives a slot back at most
        # once between two takes, so each pending event carries exactly the record a fresh
        # event would (inside a capture too: a record/wait pair becomes the same graph edge).
        self.holder = None
        for stream in used_on:
            sid = (stream.stream_id, stream.device_index, stream.device_type)
            event = self._events.get(sid)
            if event is None:
                event = self._events[sid] = torch.cuda.Event()
            event.record(stream)
            if event not in self.pending:
                self.pending.append(event)

    def drop(self) -> None:
        self.tensor, self.holder, self.pending, self.released = None, None, [], False
        self._events = {}


class SlotAllocator(BufferAllocator):
    """Shared machinery of the persistent allocators: key -> slot, one cached view per key.

    Subclasses fill ``_assignment`` (key -> Slot) in ``_plan``. A key with no assignment gets
    a persistent dedicated slot when ``persist_on_alloc_fail`` is set, else a clear error.
    """

    static_addresses = True

    # [Note: backward slots between steps] Slots that serve only BACKWARD_ROLES hold nothing
    # from the end of one backward to the start of the next, so ``step_boundary`` (the main
    # stream has waited for every reduction by then) gives their bytes back to the caching
    # allocator and ``prepare`` re-allocates them on the main stream when a unit's backward
    # begins - as torch FSDP2 allocates gradients only in backward. The next forward's
    # activations reuse those bytes instead of stacking on top of idle gradient slots.
    # Addresses change between steps, which only eager steps and a full-iteration capture
    # (whose allocations all come from its graph pool) allow: layerwise graphs write the
    # unsharded gradients at captured addresses and ``pin_roles(("grad",))`` them first.
    # Re-allocating on the main stream matters twice: the bytes come from (and return to)
    # the pool that activations use, and every side stream reaches them only after waiting
    # for the main stream, past the point of allocation.

    # [Note: weight slots during backward] The unsharded-weight slots are idle from the end
    # of forward until backward re-gathers the last unit, and the start of backward - every
    # activation, the logits and their gradients live - is the step's memory peak. Torch FSDP2
    # holds only the root's weights there (the rest were freed after their forward), so
    # ``forward_boundary`` gives the idle "param" slots' bytes back too and the next gather
    # re-allocates them (``prepare`` on the main stream, before the all-gather stream waits
    # for it: the bytes come from the pool activations use, and the gather writes them only
    # after the main stream got past the allocation). A held slot (the root, ZeRO-1/2 weights
    # kept after forward) stays. ``step_boundary`` releases the same slots: after backward
    # the root's weight slot is idle too, and the optimizer step (a foreach AdamW's fp32
    # temporaries) can be the peak of a small model; FSDP2 frees the root's weights after
    # backward as well. Only eager steps release weight slots: layerwise graphs read them at
    # captured addresses, so their capture pins "param" as it pins "grad", and nothing is
    # released while a stream captures (a user's own whole-step capture of an eager model
    # included) - except in a capture that owns its slots ([Note: slots in a capture's pool]).
    FORWARD_RELEASABLE = BACKWARD_ROLES | {"param"}

    # [Note: slots in a capture's pool] A full-iteration capture runs a whole step: nothing in
    # a slot outlives the step, so the capture can give its slots the lifetimes eager steps
    # give them. ``owning_capture`` releases every idle slot just before the capture (the
    # device is synchronized), so the step re-makes them from the graph's private pool, and
    # the boundaries inside the capture release those - freed bytes stay in that pool and
    # later allocations of the same capture reuse them, at the addresses every replay uses.
    # A slot the capture found holding bytes (held, or a user's capture without this scope)
    # came from the default pool: freed during the capture, the caching allocator could hand
    # those bytes to other tensors after it while the graph still writes them, so it keeps
    # them. After the capture, eager steps release the pool's blocks back to the pool (only a
    # capture into it can reuse them) and re-make slots from the default pool: the graph and
    # the eager step never share a slot's bytes, and nothing reads a slot across a replay.

    def __init__(self, *, persist_on_alloc_fail: bool = False) -> None:
        super().__init__()
        self.persist_on_alloc_fail = persist_on_alloc_fail
        self._assignment: dict[Key, Slot] = {}
        self._views: dict[Key, torch.Tensor] = {}
        self._dedicated: dict[Key, Slot] = {}
        self._planned = False
        self.pinned_roles: set[str] = set()
        self._releasable: list[Slot] | None = None
        """Slots the step and forward boundaries release, backward and weight slots ([Note:
        weight slots during backward]; computed from the plan and the pinned roles)."""
        self._capture_kept: set[int] | None = None
        """Inside ``owning_capture``: ids of the slots whose bytes predate the capture."""
        self._region: Region = nullcontext

    # -- subclass hooks ------------------------------------------------------------------
    def _plan(self) -> None:
        raise NotImplementedError

    def _unplanned(self, key: Key, numel: int, dtype: torch.dtype) -> str:
        """Why ``key`` has no slot (for the error message)."""
        return f"key {key!r} ({numel} x {dtype}) was not part of the plan"

    # -- interface -----------------------------------------------------------------------
    def _slot_for(self, key, numel, dtype, device) -> Slot:
        self._ensure_planned()
        # Dedicated first: a key that outgrew its planned slot must keep its dedicated one.
        slot = self._dedicated.get(key) or self._assignment.get(key)
        if slot is not None and slot.numel >= numel and slot.dtype == dtype:
            return slot
        if slot is not None:
            reason = (
                f"key {key!r} asks for {numel} x {dtype} but its planned slot {slot.label} "
                f"holds {slot.numel} x {slot.dtype} (a buffer grew after planning)"
            )
        else:
            reason = self._unplanned(key, numel, dtype)
        device = torch.device(device)
        if not self.persist_on_alloc_fail:
            raise SlotReuseError(
                f"{type(self).__name__}: {reason}. Set BufferPolicy(persist_on_alloc_fail=True) "
                "(--fsdp-db-use-persist-buf-on-alloc-fail) to give such requests a persistent "
                "dedicated buffer, or call release() and re-plan."
            )
        dedicated = self._new_slot(numel, dtype, device, label=f"dedicated[{key!r}]")
        self._dedicated[key] = dedicated
        self._releasable = None
        self._views.pop(key, None)
        self.stats.reserved["dedicated"] = (
            self.stats.reserved.get("dedicated", 0) + dedicated.nbytes
        )
        return dedicated

    def _ensure_planned(self) -> None:
        if not self._planned:
            with nvtx_range(f"graph_fsdp/allocator/plan/{type(self).__name__}"):
                self._plan()
            self._planned = True
            self._releasable = None

    def _new_slot(self, numel: int, dtype: torch.dtype, device: torch.device, label: str) -> Slot:
        """A slot whose bytes come from this allocator's region (``set_region``)."""
        slot = Slot(numel, dtype, device, label)
        slot.region = self._region
        return slot

    def set_region(self, region: Region) -> None:
        """Every slot's bytes are allocated inside ``region()`` from now on (offload that
        keeps addresses: address_keeping.py [Note: offload keeps addresses])."""
        self._region = region
        for slot in self.slots():
            slot.region = region

    def prepare(self, keys):
        self._ensure_planned()
        for key in keys:
            slot = self._dedicated.get(key) or self._assignment.get(key)
            if slot is not None:
                slot.materialise()

    def pin_roles(self, roles):
        self.pinned_roles.update(roles)
        self._releasable = None
        # Slots not created yet are created at their first use and never released.
        for key, slot in [*self._assignment.items(), *self._dedicated.items()]:
            if key_role(key) in self.pinned_roles and slot.tensor is not None:
                slot.materialise()

    def static_grads(self) -> bool:
        return "grad" in self.pinned_roles

    def _slots_serving_only(self, roles: frozenset[str]) -> list[Slot]:
        """Slots all of whose keys have a role in ``roles`` less the pinned roles."""
        by_slot: dict[int, set[str]] = {}
        for key, slot in [*self._assignment.items(), *self._dedicated.items()]:
            by_slot.setdefault(id(slot), set()).add(key_role(key))
        releasable = roles - self.pinned_roles
        return [s for s in self.slots() if by_slot[id(s)] <= releasable]

    def step_boundary(self) -> None:
        if self._planned:
            self._release()

    def forward_boundary(self) -> None:
        if not self._planned or (stream_capturing() and self._capture_kept is None):
            return
        self._release()

    def _release(self) -> None:
        if self._releasable is None:
            self._releasable = self._slots_serving_only(self.FORWARD_RELEASABLE)
        kept = self._capture_kept if stream_capturing() else None
        for slot in self._releasable:
            if kept is None or id(slot) not in kept:
                slot.release_storage()  # a held slot keeps its bytes

    def release_idle(self) -> None:
        for slot in self.slots():
            slot.release_storage()  # a held slot keeps its bytes

    @contextmanager
    def owning_capture(self):
        """Around a whole-step capture: its slots come from (and return to) the graph's pool
        ([Note: slots in a capture's pool]). The caller synchronized the device and called
        ``release_idle`` before giving the cached blocks back (else the idle slots' bytes
        would stay cached in the default pool through the capture)."""
        self.release_idle()
        self._capture_kept = {
            id(s) for s in self.slots() if s.tensor is not None and not s.released
        }
        try:
            yield
        finally:
            self._capture_kept = None

    def allocate(self, key, numel, dtype, device):
        slot = self._slot_for(key, numel, dtype, device)
        base = slot.acquire(key)
        cached = self._views.get(key)
        if cached is None or cached.data_ptr() != base.data_ptr() or cached.numel() != numel:
            self._views[key] = cached = base[:numel]
        self.stats.on_alloc(key_role(key), numel * cached.element_size())
        return cached

    def free(self, key, *, used_on=()):
        slot = self._dedicated.get(key) or self._assignment.get(key)
        if slot is None or slot.holder != key:
            return
        slot.give_back(used_on)
        view = self._views.get(key)
        if view is not None:
            self.stats.on_free(key_role(key), view.numel() * view.element_size())

    def release(self) -> None:
        for slot in [*set(self._assignment.values()), *self._dedicated.values()]:
            slot.drop()
        self._views.clear()
        self._releasable = None
        self.generation += 1

    def forget_events(self) -> None:
        for slot in self.slots():
            slot.pending = []

    def slots(self) -> list[Slot]:
        unique = {id(s): s for s in self._assignment.values()}
        return [*unique.values(), *self._dedicated.values()]

    def plan_json(self) -> dict:
        keys_by_slot: dict[int, list[str]] = {}
        for key, slot in self._assignment.items():
            keys_by_slot.setdefault(id(slot), []).append(repr(key))
        return {
            "allocator": type(self).__name__,
            "generation": self.generation,
            "slots": [
                {
                    "label": s.label,
                    "numel": s.numel,
                    "dtype": str(s.dtype),
                    "device": str(s.device),
                    "bytes": s.nbytes,
                    "keys": keys_by_slot.get(id(s), [f"{s.label}"]),
                }
                for s in self.slots()
            ],
        }

    def _account_reserved(self) -> None:
        self.stats.reserved = {}
        seen: set[int] = set()
        for key, slot in self._assignment.items():
            if id(slot) not in seen:
                seen.add(id(slot))
                role = key_role(key)
                self.stats.reserved[role] = self.stats.reserved.get(role, 0) + slot.nbytes
