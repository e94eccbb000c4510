"""One unit's parameters of one compute dtype: flat buffers, unshard/reshard, reduction.

Tensors per group (W = data-parallel world size, "owned" = this rank's shard when the
optimizer is sharded, else the whole flat buffer):

============== ===================== =====================================================
name           size, dtype            lifetime
============== ===================== =====================================================
main_flat      owned, main dtype      persistent; the optimizer's parameters are 1-D views
main_grad      owned|full, main grad  persistent; sharded ``param.grad`` views
compute_shard  shard, compute dtype   persistent (sharded params); cast of main_flat
full           total, compute dtype   allocator key ``(fqn, "param", dtype)`` (ZeRO-3) or
                                      persistent (ZeRO-0/1/2); unsharded params are views
grad_full      total, compute dtype   allocator key ``(fqn, "grad", dtype)``; the unsharded
                                      params' preset ``.grad`` (autograd adds into it)
accum          total, main grad dtype persistent, lazily, only under ``no_sync``
============== ===================== =====================================================

The unsharded parameters' ``.grad`` is preset to views of ``grad_full`` and zeroed before
backward, so autograd's AccumulateGrad writes gradients in place - inside a captured graph
too - and the reduction reads them from a fixed address without a copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from graph_fsdp.api import MixedPrecisionPolicy, Placements
from graph_fsdp.buffers.allocator import BufferAllocator, nvtx_range
from graph_fsdp.buffers.layout import FlatLayout
from graph_fsdp.comm import CommContext, all_gather, all_reduce, reduce_scatter


@dataclass
class ParamRef:
    """Where one original parameter lives: its owners and its slot in the flat layout."""

    fqn: str
    owners: list[tuple[nn.Module, str]]
    shape: torch.Size
    index: int
    sharded: nn.Parameter
    """1-D view of main_flat (this rank's part; may be empty). Registered on the module."""
    global_offset: int = 0
    """Offset of ``sharded`` inside the parameter's flattened numbering."""
    unsharded: nn.Parameter | None = None


class FlatParamGroup:
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
    ) -> None:
        self.fqn, self.placements, self.mp, self.comm, self.device = (
            fqn,
            placements,
            mp,
            comm,
            device,
        )
        originals = [p for _, _, p in entries]
        self.compute_dtype = mp.compute_dtype(originals[0].dtype)
        self.layout = FlatLayout(tuple(p.numel() for p in originals), comm.world_size)
        W, rank = comm.world_size, comm.rank
        lo, hi = self.layout.shard_range(rank) if placements.optim else (0, self.layout.total)
        self.owned = (lo, hi)

        full = torch.zeros(self.layout.total, dtype=mp.main_params_dtype, device=device)
        for offset, p in zip(self.layout.offsets, originals):
            full[offset : offset + p.numel()].copy_(p.detach().reshape(-1))
        if broadcast_from_rank0 and W > 1:
            torch.distributed.broadcast(
                full, src=torch.distributed.get_global_rank(comm.group, 0), group=comm.group
            )
        self.main_flat = full[lo:hi].clone()
        grad_numel = self.layout.shard_numel if placements.grads else self.layout.total
        self.main_grad = torch.zeros(grad_numel, dtype=mp.main_grads_dtype, device=device)
        grad_lo = lo if placements.grads else 0

        self.params: list[ParamRef] = []
        for index, (pfqn, owners, p) in enumerate(entries):
            offset = self.layout.offsets[index]
            start, end = (
                self.layout.local_range(index, rank) if placements.optim else (0, p.numel())
            )
            view = self.main_flat[offset + start - lo : offset + end - lo]
            sharded = nn.Parameter(view, requires_grad=p.requires_grad)
            ref = ParamRef(pfqn, owners, p.shape, index, sharded, global_offset=start)
            ref.local_fqn = pfqn
            sharded._graph_fsdp_group = self
            ref.grad_view = self.main_grad[offset + start - grad_lo : offset + end - grad_lo]
            self.params.append(ref)
        del full

        if placements.params:
            self.compute_shard = torch.empty(
                self.layout.shard_numel, dtype=self.compute_dtype, device=device
            )
        else:
            self.compute_shard = torch.empty(hi - lo, dtype=self.compute_dtype, device=device)
            self._persistent_full = torch.empty(
                self.layout.total, dtype=self.compute_dtype, device=device
            )
        self._synced_version = -1
        self.full: torch.Tensor | None = None
        self.grad_full: torch.Tensor | None = None
        self.accum: torch.Tensor | None = None
        self.accum_pending = False
        self.ag_event = None
        self._ag_event_obj = None
        """The event ``unshard`` records on the AG stream, created once and reused."""
        self._nonempty_sharded = [ref.sharded for ref in self.params if ref.sharded.numel()]
        self.dirty = False
        """Set by an optimizer step over this group's parameters (see fully_shard.py)."""
        self.force_refresh = False
        """Set while capturing a full iteration: the graph must contain the refresh."""

    # Allocator keys are identities (unit name, role, dtype): see buffers/allocator.py.
    @property
    def param_key(self):
        return (self.fqn, "param", self.compute_dtype)

    @property
    def grad_key(self):
        return (self.fqn, "grad", self.compute_dtype)

    @property
    def comm_key(self):
        return (self.fqn, "grad_comm", self.mp.comm_dtype())

    @property
    def rs_key(self):
        return (self.fqn, "rs_out", self.mp.comm_dtype())

    # ---------------------------------------------------------------- registration
    def register_buffers(self, allocator: BufferAllocator) -> None:
        total, dt = self.layout.total, self.compute_dtype
        if self.placements.params:
            allocator.register(self.param_key, total, dt, self.device)
        allocator.register(self.grad_key, total, dt, self.device)
        if self.mp.comm_dtype() != dt:
            allocator.register(self.comm_key, total, self.mp.comm_dtype(), self.device)
        if self.placements.grads and not self._rs_direct():
            allocator.register(
                self.rs_key, self.layout.shard_numel, self.mp.comm_dtype(), self.device
            )

    def _rs_direct(self) -> bool:
        return self.mp.comm_dtype() == self.mp.main_grads_dtype

    def sharded_params(self) -> list[nn.Parameter]:
        return [ref.sharded for ref in self.params]

    # ---------------------------------------------------------------- unshard / reshard
    def stale(self) -> bool:
        # The version counter catches in-place updates through the views (foreach AdamW,
        # checkpoint loads); fused kernels do not bump it, so optimizer steps also mark
        # the group dirty through the step hook in fully_shard.py.
        return self.force_refresh or self.dirty or self.main_flat._version != self._synced_version

    def unshard(self, allocator: BufferAllocator) -> None:
        """Queue the all-gather (or refresh) of the compute weights on the AG stream."""
        comm = self.comm
        needs_gather = self.placements.params or self.stale()
        if self.placements.params:
            if self._holds_full:
                return  # gathered or being gathered (prefetch, root kept for backward)
        elif not needs_gather:
            self.full = self._persistent_full
            return
        with nvtx_range(f"graph_fsdp/unshard/{self.fqn}"):
            if self.stale():
                with nvtx_range(f"graph_fsdp/optimizer_copy/{self.fqn}"):
                    self.compute_shard.copy_(self.main_flat)
                self._synced_version = self.main_flat._version
                self.dirty = False
            comm.wait(comm.ag_stream, comm.main_stream())
            with comm.on(comm.ag_stream):
                if self.placements.params:
                    full = allocator.allocate(
                        self.param_key, self.layout.total, self.compute_dtype, self.device
                    )
                    all_gather(full, self.compute_shard, comm, self.fqn)
                elif self.placements.optim:
                    full = self._persistent_full
                    all_gather(full, self.compute_shard, comm, self.fqn)
                else:
                    full = self._persistent_full
                    full.copy_(self.compute_shard)
                # One event per group, re-recorded: ``wait_unshard`` waits on the latest
                # record, exactly what a fresh event per gather gives (see comm.wait).
                self.ag_event = self._ag_event_obj = comm.record(comm.ag_stream, self._ag_event_obj)
        self._rebuild_unsharded(full)
        self._holds_full = True

    def wait_unshard(self) -> None:
        if self.ag_event is not None:
            self.comm.wait_event(self.ag_event)
            self.ag_event = None

    _holds_full = False

    def reshard(self, allocator: BufferAllocator) -> None:
        self.use_sharded()
        if self.placements.params and self._holds_full:
            with nvtx_range(f"graph_fsdp/reshard/{self.fqn}"):
                # A pending gather is consumed before the slot can be handed on.
                self.wait_unshard()
                allocator.free(self.param_key, used_on=self._main_streams())
            self._holds_full = False

    def _main_streams(self):
        main = self.comm.main_stream()
        return [main] if main is not None else []

    def _rebuild_unsharded(self, full: torch.Tensor) -> None:
        """(Re)create unsharded parameters when the flat tensor object changed."""
        if full is self.full and self._unsharded_built:
            return
        self.full = full
        # The params view an alias with its own version counter: re-gathering into ``full``
        # before backward must not look like an in-place change of tensors autograd saved.
        alias = full.data
        for ref, offset in zip(self.params, self.layout.offsets):
            view = alias[offset : offset + ref.shape.numel()].view(ref.shape)
            ref.unsharded = nn.Parameter(view, requires_grad=ref.sharded.requires_grad)
        self._grads_attached_to = None
        self._unsharded_built = True

    _unsharded_built = False
    """Every ``ref.unsharded`` exists (cleared by ``renew_unsharded``, which drops them)."""

    def renew_unsharded(self) -> None:
        """New unsharded parameter objects over the same buffer: fresh autograd leaves.

        Before CUDA graph capture: a leaf's AccumulateGrad node is bound to the stream it was
        created on, and one kept alive from an eager step (a live ``loss``) would make the
        capture stream wait on the default stream.
        """
        if self.full is None:
            return
        for ref in self.params:
            ref.unsharded = None
        self._unsharded_built = False
        self._rebuild_unsharded(self.full)

    def use_unsharded(self) -> None:
        for ref in self.params:
            unsharded = ref.unsharded
            for module, name in ref.owners:
                module._parameters[name] = unsharded

    def use_sharded(self, *, initial: bool = False) -> None:
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
    def prepare_grads(self, allocator: BufferAllocator) -> None:
        """Give the unsharded params zeroed ``.grad`` views before their backward runs."""
        grad_full = allocator.allocate(
            self.grad_key, self.layout.total, self.compute_dtype, self.device
        )
        grad_full.zero_()
        if self.grad_full is not grad_full or self._grads_attached_to is not self.full:
            self.grad_full = grad_full
            for ref, offset in zip(self.params, self.layout.offsets):
                if ref.unsharded is not None and ref.unsharded.requires_grad:
                    ref.unsharded.grad = grad_full[offset : offset + ref.shape.numel()].view(
                        ref.shape
                    )
            self._grads_attached_to = self.full

    def reduce_grads(self, allocator: BufferAllocator, *, sync: bool, overwrite: bool) -> None:
        """Reduce this backward's gradients into ``main_grad`` (or keep them under no_sync)."""
        comm, mp = self.comm, self.mp
        main = comm.main_stream()
        comm.wait(comm.rs_stream, main)
        with comm.on(comm.rs_stream), nvtx_range(f"graph_fsdp/reduce_grads/{self.fqn}"):
            src = self.grad_full
            if not sync:
                if self.accum is None:
                    self.accum = torch.empty(
                        self.layout.total, dtype=mp.main_grads_dtype, device=self.device
                    )
                if self.accum_pending:
                    self.accum.add_(src)
                else:
                    self.accum.copy_(src)
                self.accum_pending = True
                allocator.free(self.grad_key, used_on=self._rs_streams())
                return
            if self.accum_pending:
                src = self.accum.add_(src)
                self.accum_pending = False
            comm_dtype = mp.comm_dtype()
            used_comm = False
            if src.dtype != comm_dtype:
                buf = allocator.allocate(self.comm_key, self.layout.total, comm_dtype, self.device)
                buf.copy_(src)
                src, used_comm = buf, True
            # The unsharded grads are read for the last time above (the copy, or the add into
            # ``accum``): hand their bytes back before the reduction instead of after it.
            grad_done = src is not self.grad_full
            if grad_done:
                allocator.free(self.grad_key, used_on=self._rs_streams() + self._main_streams())
            inv_world = 1.0 / comm.world_size
            if self.placements.grads:
                direct = self._rs_direct() and overwrite
                out = (
                    self.main_grad
                    if direct
                    else allocator.allocate(
                        self.rs_key, self.layout.shard_numel, comm_dtype, self.device
                    )
                )
                reduce_scatter(out, src, comm, self.fqn)
            else:
                all_reduce(src, comm, self.fqn)
                out, direct = src, False
            if direct:
                self.main_grad.mul_(inv_world)
            elif overwrite:
                self.main_grad.copy_(out).mul_(inv_world)
            else:
                self.main_grad.add_(out, alpha=inv_world)
            streams = self._rs_streams()
            if self.placements.grads and not direct:
                allocator.free(self.rs_key, used_on=streams)
            if used_comm:
                allocator.free(self.comm_key, used_on=streams)
            if not grad_done:
                allocator.free(self.grad_key, used_on=streams + self._main_streams())

    def _rs_streams(self):
        return [self.comm.rs_stream] if self.comm.rs_stream is not None else []

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
