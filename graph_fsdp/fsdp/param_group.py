"""One unit's parameters of one compute dtype: flat buffers, unshard/reshard, gradients.

The group owns its tensors: only its methods assign them - gathers, the gradients' hand-over
to reduce.py (functions over tensors; :meth:`FlatParamGroup.post_backward` passes its buffers
in), and the storage moves of offload (offload.py) and kept addresses (address_keeping.py).

Tensors per group (W = data-parallel world size, "owned" = this rank's shard when the
optimizer is sharded, else the whole flat buffer; see [Note: HSDP ranges] for 2-D meshes):

============== ===================== =====================================================
name           size, dtype            lifetime
============== ===================== =====================================================
main_flat      owned, main dtype      persistent; the optimizer's parameters are 1-D views
main_grad      owned|full, main grad  storage freed between steps (see release_main_grad);
                                      sharded ``param.grad`` views
compute_shard  shard, compute dtype   HSDP ``optim_over_replicas`` only: the shard-group range,
                                      refreshed (cast + gather across replicas) when stale
full           total, compute dtype   allocator key ``(fqn, "param", dtype)`` (ZeRO-3) or
                                      persistent (ZeRO-0/1/2); unsharded params are views
grad_full      total, compute dtype   allocator key ``(fqn, "grad", dtype)``; under graphs the
                                      unsharded params' preset ``.grad`` (autograd adds into
                                      it), in eager steps filled from autograd's ``.grad``
accum          total, main grad dtype persistent, lazily, only under ``no_sync``
============== ===================== =====================================================

[Note: copy-in all-gather] There is no persistent compute-dtype copy of the shard: each
gather casts ``main_flat`` straight into this rank's part of ``full`` and all-gathers in
place (``all_gather_into_tensor(full, full[lo:hi])``, NCCL's in-place form), as torch FSDP2
does. The cast is 1/W of the unit per gather and gives the same values as a cached copy.

[Note: gradients autograd creates] Under layerwise CUDA graphs (the "grad" role pinned) the
unsharded parameters' ``.grad`` is preset to views of ``grad_full`` and zeroed before
backward, so the backward graph adds the gradients in place and the reduction reads them at
the address it captured. Everywhere else - eager steps, and a full-iteration (or the user's
own whole-step) capture, whose allocations all come from the graph's pool - ``.grad`` stays
unset, as torch FSDP2 does: AccumulateGrad keeps the gradient autograd computed, and the
unit's post-backward copies them into ``grad_full`` (zeroing only what no gradient covers:
padding, parameters without a gradient). A zeroed preset would hold a unit-sized buffer
*next to* each freshly computed gradient until the add - at the start of backward, the
memory peak, that is the output projection's gradient twice - and the add reads both.
Values are the same bits (``0 + g == g``; the sign of a zero gradient aside).

[Note: HSDP ranges] With a 2-D (replicate R, shard S) mesh the layout is cut into R*S equal
pieces of ``e`` elements in shard-major order: shard rank s holds (params, grads) the
contiguous range ``[s*R*e, (s+1)*R*e)``, its ``R*e`` compute shard, replicated over the R
replicas; with ``optim_over_replicas`` replica r owns (main weights, optimizer state, main
grads) only ``[(s*R + r)*e, (s*R + r + 1)*e)`` of it. Gradients are reduce-scattered over the
shard group into the ``R*e`` range, then all-reduced (or reduce-scattered down to the owned
piece) over the replicate group on ``rep_stream``; updated weights are all-gathered across
replicas into the compute shard, then over the shard group. With R == 1 every range is the
1-D one and no replicate collective runs.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from functools import partial

import torch
from torch import nn

from graph_fsdp.buffers.allocator import BufferAllocator
from graph_fsdp.buffers.layout import FlatLayout
from graph_fsdp.cuda_streams import nvtx_range
from graph_fsdp.fsdp.api import MixedPrecisionPolicy, Placements
from graph_fsdp.fsdp.capture_context import CaptureContext
from graph_fsdp.fsdp.comm import CommContext, all_gather
from graph_fsdp.fsdp.experts import (
    EXPERT_KEY_TAG,
    ExpertGroups,
    ExpertLayout,
    global_expert_params,
)
from graph_fsdp.fsdp.group_storage import StorageMoves
from graph_fsdp.fsdp.param_ref import (
    ParamRef,
    broadcast_from_first,
    owned_ranges,
    owned_slice,
    param_views,
    uncovered,
)
from graph_fsdp.fsdp.reduce import ReduceSpec, reduce_grads

__all__ = ["FlatParamGroup", "ParamRef"]


class FlatParamGroup(StorageMoves):
    def __init__(
        self,
        fqn: str,
        entries: list[tuple[str, list[tuple[nn.Module, str]], nn.Parameter]],
        *,
        placements: Placements,
        mp: MixedPrecisionPolicy,
        comm: CommContext,
        device: torch.device,
        broadcast_from_rank0: bool,
        suffix: str = "",
        expert: ExpertGroups | None = None,
        expert_layouts: dict[str, ExpertLayout | None] | None = None,
    ) -> None:
        self.fqn, self.placements, self.mp, self.comm, self.device = (
            fqn,
            placements,
            mp,
            comm,
            device,
        )
        self.suffix = suffix
        """The group's name within its unit ("", a dtype, "experts", ...): FQN = unit + it."""
        self.expert = expert
        """The expert mesh's groups when this group holds expert parameters (sharded over its
        EDP group, ``comm``; experts.py [Note: expert groups]), else None."""
        self._key_tag = () if expert is None else (EXPERT_KEY_TAG,)
        originals = [p for _, _, p in entries]
        self.compute_dtype = mp.compute_dtype(originals[0].dtype)
        R = comm.replicate_size
        self.layout = FlatLayout(tuple(p.numel() for p in originals), comm.world_size * R)
        self.over_replicas = placements.optim_over_replicas and R > 1
        self.owned, self.shard_range = owned_ranges(
            self.layout, comm, placements, self.over_replicas
        )
        """This rank's owned range (main weights, main grads) and shard-group range."""
        slo, shi = self.shard_range
        self.shard_numel = shi - slo
        """Elements of the shard-group range (compute shard, reduce-scatter output)."""
        if mp.reduce_scatter_fp32_accumulation and not (placements.grads and R == 1):
            raise ValueError(
                f"{fqn or 'root'}: MixedPrecisionPolicy.reduce_scatter_fp32_accumulation "
                "reduce-scatters over one shard group: it needs sharded gradients (strategy "
                "optim_grads or optim_grads_params) and a 1-D mesh (not HSDP)"
            )
        self.fp32_accumulating = (
            mp.reduce_scatter_fp32_accumulation and self.compute_dtype != mp.main_grads_dtype
        )
        """reduce.py [Note: reduce-scatter with fp32 accumulation] (with fp32 compute the
        gradients are fp32 already: the plain reduce-scatter)."""

        self.main_flat, self.main_grad = self._make_main(originals, broadcast_from_rank0)
        self.params = self._make_refs(entries, expert_layouts)

        self.persistent_full: torch.Tensor | None = (
            None
            if placements.params
            else torch.empty(self.layout.total, dtype=self.compute_dtype, device=device)
        )
        """ZeRO-0/1/2: the compute weights, kept between steps (ZeRO-3 gathers into slots)."""
        # Kept between gathers so the gather across replicas runs once per refresh.
        self.compute_shard = (
            torch.empty(self.shard_numel, dtype=self.compute_dtype, device=device)
            if self.over_replicas
            else None
        )
        self._synced_version = -1
        self.full: torch.Tensor | None = None
        self.grad_full: torch.Tensor | None = None
        self.accum: torch.Tensor | None = None
        self.accum_pending = False
        self.ag_event = None
        self._ag_event_obj = None
        """The event ``unshard`` records on the AG stream, created once and reused."""
        self._reduction_event = None
        """The event a recorded reduction ends with (``_reduced_event``), created once."""
        self._nonempty_sharded = [ref.sharded for ref in self.params if ref.sharded.numel()]
        self.dirty = False
        """Set by an optimizer step over this group's parameters (see fully_shard.py)."""
        self._main_grad_pins = 0
        """Holders whose graphs write ``main_grad`` at its address ([Note: releasable main
        grads]): released only at 0."""
        self.capture = CaptureContext()
        """The root's capture switches (capture_context.py [Note: capture context]), set at
        the root's lazy init."""
        self.persistent_region: Callable = nullcontext
        """Where persistent tensors made after construction (``accum``) are allocated: a
        region whose memory offload releases at kept addresses (address_keeping.py [Note:
        offload keeps addresses])."""
        self._holds_full = False
        """``full`` is a gathered (or being gathered) slot this group must give back."""
        self._unsharded_built = False
        """Every ``ref.unsharded`` exists (cleared by ``renew_unsharded``, which drops them)."""
        self._unsharded_on_modules = False
        """The modules hold the unsharded parameters (``use_unsharded`` ran since the last
        ``use_sharded``); a replay leaves the sharded ones in place (state.py [Note: forward
        handlers in the dispatcher])."""
        self.grads_in_autograd = False
        """This backward's gradients are in the unsharded params' ``.grad``, not yet in
        ``grad_full`` ([Note: gradients autograd creates])."""
        self._grads_attached_to: torch.Tensor | None = None
        """The ``full`` whose unsharded params hold ``.grad`` views of ``grad_full``."""
        self._gather_views: tuple | None = None
        """``(full, its address, full[owned], full[shard_range])``: slicing costs host time at
        every gather, and ``full`` is the same slot view gather after gather."""
        self._grad_views: tuple | None = None
        """``(grad_full, one view per parameter)``, rebuilt when the allocator hands out
        another tensor object."""
        self._gaps: tuple | None = None
        """``(grad_full, covered, views of what those parameters leave uncovered)``."""
        self._detached_grads: set[int] = set()
        """Indices of the parameters whose sharded ``.grad`` an offload unset, re-attached once
        params and grads share a device again (:meth:`detach_grads`)."""
        self._reduce_spec: ReduceSpec | None = None
        """What reduce.py reads of this group, made at the first reduction after the group
        joined its root (:meth:`join_root`)."""

    def _make_main(
        self, originals: list[nn.Parameter], broadcast_from_rank0: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The owned main weights (copied from the originals, or from the first rank's after
        meta-device init) and the zeroed main gradients."""
        lo, hi = self.owned
        mp, device = self.mp, self.device
        full = torch.zeros(self.layout.total, dtype=mp.main_params_dtype, device=device)
        for offset, p in zip(self.layout.offsets, originals):
            full[offset : offset + p.numel()].copy_(p.detach().reshape(-1))
        if broadcast_from_rank0:
            broadcast_from_first(full, self.comm)
        main_flat = full[lo:hi].clone()
        grad_numel = hi - lo if self.placements.grads else self.layout.total
        main_grad = torch.zeros(grad_numel, dtype=mp.main_grads_dtype, device=device)
        return main_flat, main_grad

    def _make_refs(
        self, entries: list, expert_layouts: dict[str, ExpertLayout | None] | None
    ) -> list[ParamRef]:
        """One ``ParamRef`` per parameter: its sharded parameter (a view of ``main_flat``,
        maybe empty) and gradient view (of ``main_grad``)."""
        lo, hi = self.owned
        grad_lo = lo if self.placements.grads else 0
        refs = []
        for index, (pfqn, owners, p) in enumerate(entries):
            offset = self.layout.offsets[index]
            start, end = owned_slice(offset, p.numel(), self.owned)
            view = self.main_flat[offset + start - lo : offset + end - lo]
            sharded = nn.Parameter(view, requires_grad=p.requires_grad)
            ref = ParamRef(pfqn, owners, p.shape, index, sharded, global_offset=start)
            if self.expert is not None:
                ref.expert = (expert_layouts or {}).get(pfqn)
                if getattr(p, "allreduce", None) is False:
                    sharded.allreduce = False  # Megatron's expert mark, for its own tools
            ref.local_fqn = pfqn
            sharded._graph_fsdp_group = self
            ref.grad_view = self.main_grad[offset + start - grad_lo : offset + end - grad_lo]
            refs.append(ref)
        return refs

    def join_root(
        self, unit_fqn: str, prefix: str, comm: CommContext, capture: CaptureContext
    ) -> None:
        """At the root's lazy init: the names under the root (``unit_fqn``, the unit's module
        path ``prefix``), the root's context for this group's mesh and its capture switches."""
        self.fqn = ".".join(x for x in (unit_fqn, self.suffix) if x)
        for ref in self.params:
            ref.fqn = ref.local_fqn if not prefix else f"{prefix}.{ref.local_fqn}"
        self.comm, self.capture = comm, capture
        self._reduce_spec = None

    # Allocator keys are identities (unit name, role, dtype[, tag]): buffers/allocator.py;
    # expert groups' carry a tag (experts.py [Note: expert groups]).
    @property
    def param_key(self):
        return (self.fqn, "param", self.compute_dtype, *self._key_tag)

    @property
    def grad_key(self):
        return (self.fqn, "grad", self.compute_dtype, *self._key_tag)

    @property
    def comm_key(self):
        return (self.fqn, "grad_comm", self.mp.comm_dtype(), *self._key_tag)

    @property
    def a2a_key(self):
        return (self.fqn, "grad_comm", self.compute_dtype, *self._key_tag)

    @property
    def rs_key(self):
        return (self.fqn, "rs_out", self.mp.comm_dtype(), *self._key_tag)

    @property
    def rep_key(self):
        return (self.fqn, "rep_out", self.mp.comm_dtype(), *self._key_tag)

    # ---------------------------------------------------------------- registration
    def register_buffers(self, allocator: BufferAllocator) -> None:
        total, dt = self.layout.total, self.compute_dtype
        if self.placements.params:
            allocator.register(self.param_key, total, dt, self.device)
        allocator.register(self.grad_key, total, dt, self.device)
        if self.fp32_accumulating:
            allocator.register(self.a2a_key, total, dt, self.device)
        elif self.mp.comm_dtype() != dt:
            allocator.register(self.comm_key, total, self.mp.comm_dtype(), self.device)
        if self.placements.grads and (not self.rs_direct() or self.over_replicas):
            allocator.register(self.rs_key, self.shard_numel, self.mp.comm_dtype(), self.device)
        if self.placements.grads and self.over_replicas and not self.rs_direct():
            allocator.register(
                self.rep_key, self.owned[1] - self.owned[0], self.mp.comm_dtype(), self.device
            )

    def rs_direct(self) -> bool:
        """The reduction's dtype is the main gradients': it may write ``main_grad`` itself."""
        return self.mp.comm_dtype() == self.mp.main_grads_dtype

    def sharded_params(self) -> list[nn.Parameter]:
        return [ref.sharded for ref in self.params]

    def full_params(self, full: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """``(name, parameter)`` from the unsharded flat ``full`` (gathered over this group's
        ranks): views named by FQN, or for expert groups new global tensors under their
        global names (every EP rank's experts; a collective over the EP group)."""
        if self.expert is None:
            views = param_views(full, self.params, self.layout)
            return [  # tensor-parallel ones gathered over tp too (a collective, in order)
                (ref.fqn, view if ref.tp is None else ref.tp.full_tensor(view))
                for ref, view in zip(self.params, views)
            ]
        refs = [
            (ref.fqn, ref.shape, ref.expert, offset)
            for ref, offset in zip(self.params, self.layout.offsets)
        ]
        return global_expert_params(full, refs, self.expert)

    # ---------------------------------------------------------------- unshard / reshard
    def stale(self) -> bool:
        # The version counter catches in-place updates through the views (foreach AdamW,
        # checkpoint loads); fused kernels do not bump it, so optimizer steps also mark
        # the group dirty through the step hook in fully_shard.py.
        return (
            self.capture.refresh_weights
            or self.dirty
            or self.main_flat._version != self._synced_version
        )

    @property
    def holds_gather(self) -> bool:
        """ZeRO-3: ``full`` is a slot this group gathered (or is gathering) and must give
        back."""
        return self._holds_full

    def gathered_weights(self) -> torch.Tensor | None:
        """The compute weights a forward would use now without gathering or refreshing them
        (ZeRO-3: the held slot; ZeRO-0/1/2: the kept weights), or None where the next gather
        must run (nothing held, or the main weights changed since the cast: ``stale``)."""
        if self.stale():
            return None
        if self.placements.params:
            return self.full if self._holds_full else None
        return self.persistent_full

    def unshard(self, allocator: BufferAllocator) -> None:
        """Queue the all-gather (or refresh) of the compute weights on the AG stream."""
        comm = self.comm
        needs_gather = self.placements.params or self.stale()
        if self.placements.params:
            if self._holds_full:
                return  # gathered or being gathered (prefetch, root kept for backward)
        elif not needs_gather:
            self.full = self.persistent_full
            return
        with nvtx_range(f"graph_fsdp/unshard/{self.fqn}"):
            if self.placements.params:  # [Note: weight slots during backward]
                allocator.prepare((self.param_key,))
            # The cast reads main_flat, which the optimizer updates on the main stream.
            comm.wait(comm.ag_stream, comm.main_stream())
            with comm.on(comm.ag_stream):
                if self.placements.params:
                    full = allocator.allocate(
                        self.param_key, self.layout.total, self.compute_dtype, self.device
                    )
                else:
                    full = self.persistent_full
                graphs = self.capture.comm_graphs
                if graphs is not None and self.compute_shard is None and self.placements.optim:
                    # One graph launch: capture/comm_graphs.py [Note: communication graphs].
                    key = ("gather", id(self), full.data_ptr(), self.main_flat.data_ptr())
                    graphs.run(key, (id(self), "gather"), partial(self._gather_into, full))
                    self._synced_version = self.main_flat._version
                    self.dirty = False
                else:
                    self._gather_into(full)
                # One event per group, re-recorded: ``wait_unshard`` waits on the latest
                # record, exactly what a fresh event per gather gives (see comm.wait).
                self.ag_event = self._ag_event_obj = comm.record(comm.ag_stream, self._ag_event_obj)
        self._rebuild_unsharded(full)
        self._holds_full = True

    def _gather_into(self, full: torch.Tensor) -> None:
        shard = self._compute_shard_in(full)
        if self.placements.optim:
            all_gather(full, shard, self.comm, self.fqn)

    def _compute_shard_in(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's shard-group range in compute dtype, the input of the shard all-gather:
        cast straight into ``full`` ([Note: copy-in all-gather]), or with the optimizer over
        replicas kept in ``compute_shard``, refreshed only when stale ([Note: HSDP ranges])."""
        if self.compute_shard is None:
            views = self._gather_views
            if views is None or views[0] is not full or views[1] != full.data_ptr():
                views = self._gather_views = self._make_gather_views(full)
            self._cast_main_into(views[2])
            return views[3]
        lo, hi = self.owned
        slo, shi = self.shard_range
        if self.stale():
            piece = self.compute_shard[lo - slo : hi - slo]
            self._cast_main_into(piece)
            all_gather(self.compute_shard, piece, self.comm, self.fqn, over_replicas=True)
        return self.compute_shard

    def _make_gather_views(self, full: torch.Tensor) -> tuple:
        (lo, hi), (slo, shi) = self.owned, self.shard_range
        return (full, full.data_ptr(), full[lo:hi], full[slo:shi])

    def _cast_main_into(self, target: torch.Tensor) -> None:
        with nvtx_range(f"graph_fsdp/optimizer_copy/{self.fqn}"):
            target.copy_(self.main_flat)
        self._synced_version = self.main_flat._version
        self.dirty = False

    def wait_unshard(self) -> None:
        if self.ag_event is not None:
            self.comm.wait_event(self.ag_event)
            self.ag_event = None

    def reshard(self, allocator: BufferAllocator) -> None:
        self.use_sharded()
        if self.placements.params and self._holds_full:
            with nvtx_range(f"graph_fsdp/reshard/{self.fqn}"):
                # A pending gather is consumed before the slot can be handed on.
                self.wait_unshard()
                allocator.free(self.param_key, used_on=self.comm.main_streams())
            self._holds_full = False

    def _rebuild_unsharded(self, full: torch.Tensor) -> None:
        """(Re)create unsharded parameters when the flat tensor object changed."""
        if full is self.full and self._unsharded_built:
            return
        self.full = full
        # The params view an alias with its own version counter: re-gathering into ``full``
        # before backward must not look like an in-place change of tensors autograd saved.
        for ref, view in zip(self.params, param_views(full.data, self.params, self.layout)):
            if ref.tp is None:
                ref.unsharded = nn.Parameter(view, requires_grad=ref.sharded.requires_grad)
            else:  # a DTensor again for a TP plan's modules
                ref.unsharded = ref.tp.compute_param(view, ref.sharded.requires_grad)
        self._grads_attached_to = None
        self._unsharded_built = True

    def renew_unsharded(self) -> None:
        """New unsharded parameter objects over the same buffer: fresh autograd leaves.

        Before CUDA graph capture: a leaf's AccumulateGrad node is bound to the stream it was
        created on, and one kept alive from an eager step (a live ``loss``) would make the
        capture stream wait on the default stream. A weight slot released between steps
        (allocator.py [Note: weight slots during backward]) has no bytes to view: its
        parameters are built when the next gather re-makes it.
        """
        if self.full is None:
            return
        for ref in self.params:
            ref.unsharded = None
        self._unsharded_built = False
        if self.full.untyped_storage().nbytes():
            self._rebuild_unsharded(self.full)

    def drop_unsharded(self) -> None:
        """Forget the unsharded params and gathered buffers (offload: their bytes go with
        them); the next gather builds them again."""
        for ref in self.params:
            ref.unsharded = None
        self.full = self.grad_full = None
        self._unsharded_built = False
        self._holds_full = False
        self._grads_attached_to = None
        self._gather_views = self._grad_views = None
        self.ag_event = None

    def use_unsharded(self) -> None:
        for ref in self.params:
            unsharded = ref.unsharded
            for module, name in ref.owners:
                module._parameters[name] = unsharded
        self._unsharded_on_modules = True

    def use_sharded(self, *, initial: bool = False) -> None:
        if not (initial or self._unsharded_on_modules):
            return
        self._unsharded_on_modules = False
        for ref in self.params:
            sharded = ref.sharded
            for module, name in ref.owners:
                params = module._parameters
                current = params.get(name)
                if current is sharded:
                    continue
                if not initial and current is not ref.unsharded:
                    raise RuntimeError(
                        f"parameter {ref.fqn} was replaced after fully_shard (now "
                        f"{tuple(module._parameters[name].shape) if module._parameters.get(name) is not None else None},"
                        f" sharded as {tuple(ref.shape)}): parameters must not change after "
                        "sharding; assign new values in place (param.data.copy_) or re-create "
                        "the module before fully_shard"
                    )
                params[name] = sharded

    # ---------------------------------------------------------------- gradients
    def prepare_grads(self, allocator: BufferAllocator, *, zero: bool = True) -> None:
        """Before the unit's backward: zeroed ``.grad`` views under layerwise graphs (``zero``
        False: the backward graph zeroes them), none otherwise ([Note: gradients autograd
        creates])."""
        if not allocator.static_grads():
            for ref in self.params:
                if ref.unsharded is not None:
                    ref.unsharded.grad = None
            self._grads_attached_to = None
            self.grads_in_autograd = True
            return
        self.grads_in_autograd = False
        grad_full = self._allocate_grad_full(allocator)
        if zero:
            grad_full.zero_()
        if self.grad_full is not grad_full or self._grads_attached_to is not self.full:
            self.grad_full = grad_full
            for ref, view in zip(self.params, self._grad_views_of(grad_full)):
                if ref.unsharded is not None and ref.unsharded.requires_grad:
                    ref.unsharded.grad = view if ref.tp is None else ref.tp.grad_holder(view)
            self._grads_attached_to = self.full

    def collect_grads(self, allocator: BufferAllocator) -> None:
        """Copy autograd's gradients into ``grad_full`` (on the main stream) and drop them."""
        self.grads_in_autograd = False
        grad_full = self._allocate_grad_full(allocator)
        self.grad_full = grad_full
        dst, src, covered = [], [], []
        for ref, view in zip(self.params, self._grad_views_of(grad_full)):
            p = ref.unsharded
            covered.append(p is not None and p.grad is not None)
            if covered[-1]:
                dst.append(view)
                src.append(p.grad if ref.tp is None else ref.tp.local_grad(p.grad))
                p.grad = None
        gaps = self._gaps_of(grad_full, tuple(covered))
        if gaps:
            torch._foreach_zero_(gaps)
        if dst:
            torch._foreach_copy_(dst, src)

    def _gaps_of(self, flat: torch.Tensor, covered: tuple[bool, ...]) -> list[torch.Tensor]:
        """What the parameters flagged in ``covered`` leave of ``flat`` (param_ref.py
        ``uncovered``), cached while ``flat`` and ``covered`` stay the same."""
        cached = self._gaps
        if cached is not None and cached[0] is flat and cached[1] == covered:
            return cached[2]
        gaps = uncovered(flat, self.layout, covered)
        self._gaps = (flat, covered, gaps)
        return gaps

    def _allocate_grad_full(self, allocator: BufferAllocator) -> torch.Tensor:
        return allocator.allocate(self.grad_key, self.layout.total, self.compute_dtype, self.device)

    def _grad_views_of(self, grad_full: torch.Tensor) -> list[torch.Tensor]:
        views = self._grad_views
        if views is None or views[0] is not grad_full:
            views = self._grad_views = (grad_full, param_views(grad_full, self.params, self.layout))
        return views[1]

    # [Note: releasable main grads] Like torch FSDP2, which frees sharded gradients on
    # ``zero_grad(set_to_none=True)``, ``main_grad``'s storage is released at the next forward
    # once the optimizer dropped every sharded ``.grad`` (nothing can read it then), and
    # re-allocated - on the main stream, so the caching allocator hands the freed bytes to
    # activations - just before the next reduction, which overwrites all of it. The tensor
    # object and its ``grad_view``s stay; only their storage comes and goes. A full-iteration
    # or whole-step graph writes ``main_grad`` at a fixed address, so its capture re-makes it
    # inside the graph's pool and pins it while the graphs live (full_iteration.py [Note: main
    # gradients in the step's pool]).
    def release_main_grad(self) -> None:
        storage = self.main_grad.untyped_storage()
        if self._main_grad_pins or storage.nbytes() == 0 or self.grads_defined():
            return
        storage.resize_(0)

    def pin_main_grad(self) -> None:
        """Give ``main_grad`` its bytes and keep them until every pin is taken back: a graph
        writes it at this address."""
        self.ensure_main_grad()
        self._main_grad_pins += 1

    def unpin_main_grad(self) -> None:
        """Take one :meth:`pin_main_grad` back (a runner dropped the graphs that wrote it);
        at none left, the next forward releases it once no sharded ``.grad`` is attached."""
        if self._main_grad_pins == 0:
            raise RuntimeError("graph_fsdp: unpin_main_grad() without a pin_main_grad()")
        self._main_grad_pins -= 1

    @property
    def main_grad_pinned(self) -> bool:
        return self._main_grad_pins > 0

    def ensure_main_grad(self) -> None:
        storage = self.main_grad.untyped_storage()
        if storage.nbytes() == 0:
            storage.resize_(self.main_grad.numel() * self.main_grad.element_size())

    def grads_defined(self) -> bool:
        for p in self._nonempty_sharded:
            if p.grad is not None:
                return True
        return False

    def attach_sharded_grads(self) -> None:
        for ref in self.params:
            # Empty shards never get a grad: optimizers skip them, so a zero-numel tensor
            # never reaches a fused/foreach kernel.
            p = ref.sharded
            if p.grad is None and p.requires_grad and p.numel():
                p.grad = ref.grad_view

    # ---------------------------------------------------------------- post-backward
    def post_backward(self, allocator: BufferAllocator, *, sync: bool) -> None:
        """After the unit's backward: reduce this backward's gradients into ``main_grad``
        (reduce.py, over the tensors this group passes in), or under ``no_sync`` keep them in
        ``accum``; inside a layerwise capture only give the gradient slot back ([Note:
        capture context])."""
        if self.grad_full is None and not self.grads_in_autograd:
            return
        comm = self.comm
        if self.capture.capturing_layers:
            allocator.free(self.grad_key, used_on=comm.main_streams())
            return
        overwrite = not self.grads_defined()  # main_grad holds nothing the step must keep
        if self.grads_in_autograd:
            self.collect_grads(allocator)
        spec = self.reduce_spec()
        if sync:
            self.ensure_main_grad()  # on the main stream: [Note: releasable main grads]
            # The reduction's buffers get their bytes here, after this unit's backward was
            # queued and on the main stream, not on the reduce-scatter stream that uses them
            # ([Note: backward slots between steps]): at the start of backward, the memory
            # peak (every activation and the loss gradients live), they hold nothing yet.
            if not spec.reduces_nothing:
                allocator.prepare(spec.buffer_keys)
        comm.wait(comm.rs_stream, comm.main_stream())
        with comm.on(comm.rs_stream), nvtx_range(f"graph_fsdp/reduce_grads/{self.fqn}"):
            if not sync:
                self._accumulate()
                allocator.free(self.grad_key, used_on=comm.grad_streams())
                return
            reduce_grads(
                self.grad_full,
                self.take_accumulation(),
                self.main_grad,
                spec,
                allocator,
                graphs=self.capture.comm_graphs,
                overwrite=overwrite,
            )
            if self.capture.reductions is not None:  # grad_norm.py [Note: the norm beside
                self.capture.reductions.append((self, self._reduced_event()))  # the last ...]

    def _reduced_event(self) -> torch.cuda.Event | None:
        """An event after this group's reduction on the reduce-scatter stream (one object,
        recorded again each time); None on CPU or where the reduction continues on the
        replicas' stream."""
        comm = self.comm
        if comm.rs_stream is None or comm.rep_stream is not None:
            return None
        if self._reduction_event is None:
            self._reduction_event = torch.cuda.Event()
        self._reduction_event.record(comm.rs_stream)
        return self._reduction_event

    def reduce_spec(self) -> ReduceSpec:
        """What reduce.py needs to know of this group (fixed once it joined its root)."""
        spec = self._reduce_spec
        if spec is None:
            lo, hi = self.owned
            spec = self._reduce_spec = ReduceSpec(
                fqn=self.fqn,
                comm=self.comm,
                ident=id(self),
                grads_sharded=self.placements.grads,
                over_replicas=self.over_replicas,
                rs_direct=self.rs_direct(),
                fp32_accumulating=self.fp32_accumulating,
                total=self.layout.total,
                shard_numel=self.shard_numel,
                owned_numel=hi - lo,
                compute_dtype=self.compute_dtype,
                comm_dtype=self.mp.comm_dtype(),
                device=self.device,
                grad_key=self.grad_key,
                comm_key=self.comm_key,
                a2a_key=self.a2a_key,
                rs_key=self.rs_key,
                rep_key=self.rep_key,
            )
        return spec

    def _accumulate(self) -> None:
        """``no_sync``: this backward's gradients into (or added to) the fp32 ``accum``."""
        if self.accum is None:
            with self.persistent_region():  # address_keeping.py
                self.accum = torch.empty(
                    self.layout.total, dtype=self.mp.main_grads_dtype, device=self.device
                )
        if self.accum_pending:
            self.accum.add_(self.grad_full)
        else:
            self.accum.copy_(self.grad_full)
        self.accum_pending = True

    def take_accumulation(self) -> torch.Tensor | None:
        """The ``no_sync`` accumulation the next reduction adds in (None: nothing pending);
        taken, it is no longer pending."""
        if not self.accum_pending:
            return None
        self.accum_pending = False
        return self.accum

    def restore_accumulation(self, pending: bool) -> None:
        """Put back whether ``accum`` holds pending gradients (a verification's snapshot)."""
        self.accum_pending = pending
