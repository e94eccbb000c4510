"""The next step's first gathers started inside the step that updates their weights.

[Note: the next step's gathers in the step graph] Without it the one-graph step (whole_step.py)
begins with the first unit's all-gather exposed: nothing can run before the root's weights
are there. Its tail, the optimizer step, is compute the all-gather stream could overlap
(Megatron-LM's ``--overlap-param-gather-with-optimizer-step`` does this with host
scheduling). With ``StepPolicy(overlap_next_gather=True)`` the step updates the first
``next_gather_units`` units of the forward order one by one (``FSDPState`` s in
``RootContext.forward_order``: the root, then the unit its pre-forward prefetches), and
queues each unit's gather for the next step on the all-gather stream right after its own
update - a ZeRO-3 all-gather into its weight slot, or the ZeRO-1/2 main->compute refresh
([Note: weight refresh in the step graph]) - while the main stream updates the rest of the
parameters (in one optimizer call). The next step's pre-forward finds those units gathered
and not stale, and gathers nothing for them.

- **Same bits**: torch's fused Adam/AdamW/SGD kernels are elementwise per tensor, so
  stepping the parameters in several calls over disjoint subsets (``step_optimizer``'s
  ``params``) writes what one call writes; each call takes the same ``found_inf``, decided
  before the first update, so a skipped step skips every part and the gathers cast the
  unchanged main weights.
- **Slots**: the units held between steps are the ones the root's pre-forward holds before
  its first computation (with the default 2), so the weight slots they take are the ones
  the forward takes anyway (double_buffer.py: neighbours in the forward order use different
  slots). More units need as many slots (``BufferPolicy.num_slots``); a slot still held is a
  ``SlotReuseError`` naming it. In a capture the held slots predate it, so the capture keeps
  their bytes (allocator.py [Note: slots in a capture's pool]): every replay's forward reads
  them where the previous replay's tail wrote them.
- **Invalidation**: whatever changes the weights or the gathered buffers between two steps
  outside the runner - an eval forward that reshards, an eager optimizer step, a checkpoint
  load, offload, ``drop()`` - leaves a unit either not gathered or stale (``dirty`` / the
  main weights' version: ``FlatParamGroup.gathered_weights``). Before every step the runner
  gives such a unit's slot back (:meth:`NextGather.forget_stale`) so the forward gathers it
  again; before a replay it gathers it eagerly instead (:meth:`NextGather.gather_now`), and
  a graph whose forward would read another address is captured again.

[Note: the held slots in the graph's pool] A capture keeps the bytes of the slots it found
holding weights (allocator.py [Note: slots in a capture's pool]); gathered eagerly before
the first capture, the held units' slots were default-pool memory beside the graph's pool,
which activations never reuse: on the 16-layer hidden-1024 GPT at world 1 the one graph's
peak reserved rose from 5.07 to 5.26 GiB with the overlap, 0.40 GiB of the graph pool unused
at that peak. So before each capture the held units are gathered again into the graph's own
pool (:meth:`NextGather.gather_into`, a ``torch.cuda.MemPool`` the capture then uses): their
blocks stay allocated there between replays, at the addresses every replay's forward reads
and its tail writes. Measured in the same setting (one H200, e8932dd): 5.06 GiB without the
overlap, 5.16 with it - what remains is the held units' own bytes (0.086 GiB: the root's
and the first layer's bf16 weights), live through the whole step.
"""

from __future__ import annotations

import torch

from graph_fsdp.capture.step_optimizer import step_optimizer
from graph_fsdp.cuda_streams import nvtx_range
from graph_fsdp.fsdp.state import FSDPState


class NextGather:
    """The units whose next-step gathers the step queues after their update ([Note: the
    next step's gathers in the step graph])."""

    def __init__(self, root_state: FSDPState, units: int) -> None:
        if units < 1:
            raise ValueError(f"next_gather_units={units!r}: at least 1 (the root's own unit)")
        self.root_state = root_state
        self.units = units
        self.held: list[FSDPState] = []
        """The units the last step left gathered for the next one."""

    def next_units(self) -> list[FSDPState]:
        """The first ``units`` units of the recorded forward order ([] until the first
        training forward recorded it)."""
        root = self.root_state.root
        if root is None or not root.order_frozen:
            return []
        return root.forward_order[: self.units]

    def step_and_gather(self, optimizer: torch.optim.Optimizer, found_inf) -> None:
        """The optimizer step, unit by unit for the next forward's first units, each unit's
        gather queued right after its update, then the rest of the parameters in one call."""
        units = self.next_units()
        taken: set[int] = set()
        for state in units:
            params = [ref.sharded for g in state.groups for ref in g.params]
            taken.update(id(p) for p in params)
            step_optimizer(optimizer, found_inf, params=params)
            with nvtx_range(f"graph_fsdp/whole_step/next_gather/{state.fqn}"):
                if state.placements.params and any(g.holds_gather for g in state.groups):
                    state.reshard()  # a gather still held would be kept, not refreshed
                for group in state.groups:
                    group.dirty = True  # updated just now: the gather casts
                state.unshard()
        step_optimizer(optimizer, found_inf, exclude=taken)
        for state in units:
            for group in state.groups:
                # Joins the all-gather stream into the main stream (a capture must end
                # joined); the gathers overlapped the updates queued above.
                group.wait_unshard()
                # The later optimizer calls marked every group of the optimizer: these cast
                # their own main weights after their only update of the step.
                group.dirty = False
        self.held = list(units)

    def forget_stale(self) -> None:
        """Before a step: a held unit whose weights changed since its gather (or that was
        resharded) is gathered again by the forward: ZeRO-3 gives its slot back."""
        kept = []
        for state in self.held:
            if all(g.gathered_weights() is not None for g in state.groups):
                kept.append(state)
            elif state.placements.params:
                state.reshard()
        self.held = kept

    def forget(self) -> None:
        """Nothing held counts any more (``drop()``, ``suspend()``): ZeRO-3 units give their
        slots back, ZeRO-1/2 units are marked stale; the next forward gathers them again."""
        for state in self.held:
            if state.placements.params:
                state.reshard()
            else:
                for group in state.groups:
                    group.dirty = True
        self.held = []

    def let_go(self) -> None:
        """Before a capture, ahead of its release of idle slots and cached blocks (pools.py
        ``release_for_capture``): the held ZeRO-3 units give their slots back, so that their
        default-pool bytes go with the rest ([Note: the held slots in the graph's pool]).
        ``held`` stays: :meth:`gather_into` gathers them again."""
        for state in self.held:
            if state.placements.params:
                state.reshard()

    def gather_into(self, pool: torch.cuda.MemPool) -> list[int]:
        """After :meth:`let_go` and the release: the held units gathered again with their
        slots' bytes in the graph's ``pool`` - the capture keeps them ([Note: the held slots
        in the graph's pool]) - and the addresses the graph's forward reads them at."""
        with torch.cuda.use_mem_pool(pool):
            return self.gather_now()

    def gather_now(self) -> list[int]:
        """Before a graphed step: the next units gathered (eagerly where a step did not leave
        them gathered), and the addresses the graph's forward reads them at."""
        units = self.next_units()
        for state in units:
            if any(g.gathered_weights() is None for g in state.groups):
                if state.placements.params:
                    state.reshard()
                state.unshard()
                for group in state.groups:
                    group.wait_unshard()
        self.held = list(units)
        return [g.gathered_weights().data_ptr() for s in units for g in s.groups]
