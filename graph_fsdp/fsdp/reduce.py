"""Gradient reduction: from a group's unsharded gradients to its main gradients.

Functions over tensors, as FSDP2 keeps ``foreach_reduce`` apart from its param group: a
group's post-backward (``FlatParamGroup.post_backward``) passes in its unsharded gradients, the
``no_sync`` accumulation it took (or None), its ``main_grad`` as the output - a static address
a graph may have captured, so the result is written there, never returned in a new tensor - and
a :class:`ReduceSpec` with the facts it is reduced by (mesh, dtypes, sizes, allocator keys).
These functions decide which collectives and kernels turn a backward's gradients into the
optimizer's, borrowing reduction buffers from the allocator under the spec's keys:

- by graph: the plain one-mesh-dim reduction as one graph launch, while a layerwise runner
  lends its communication graphs (capture/comm_graphs.py [Note: communication graphs]);
- reduces nothing: one data-parallel rank in the main gradients' dtype, a cast into
  ``main_grad``;
- fp32 accumulating: an all-to-all of the compute-dtype gradients and an fp32 sum
  ([Note: reduce-scatter with fp32 accumulation]);
- plain: cast to the communication dtype, reduce-scatter (all-reduce without sharded
  gradients), across the replicas for HSDP (param_group.py [Note: HSDP ranges]), then
  scale into ``main_grad``.

(``no_sync`` reduces nothing: the group adds the gradients into its ``accum`` itself.) Every
path runs on the reduce-scatter stream, which the caller made wait for the main stream
([Note: stream roles], comm.py), and gives each buffer back to the allocator with the streams
that used it.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial

import torch

from graph_fsdp.buffers.allocator import BufferAllocator
from graph_fsdp.fsdp.comm import CommContext, all_reduce, all_to_all, reduce_scatter


@dataclass(frozen=True)
class ReduceSpec:
    """What a reduction needs to know of a group (``FlatParamGroup.reduce_spec``)."""

    fqn: str
    comm: CommContext
    ident: int
    """The group's identity: the communication graphs' key."""
    grads_sharded: bool
    over_replicas: bool
    rs_direct: bool
    """The reduction's dtype is the main gradients': it may write ``main_grad`` itself."""
    fp32_accumulating: bool
    total: int
    """Elements of the unsharded flat layout."""
    shard_numel: int
    """Elements of the shard-group range (the reduce-scatter's output)."""
    owned_numel: int
    """Elements of this rank's owned range (the replica reduce-scatter's output)."""
    compute_dtype: torch.dtype
    comm_dtype: torch.dtype
    device: torch.device
    grad_key: tuple
    comm_key: tuple
    a2a_key: tuple
    rs_key: tuple
    rep_key: tuple

    @property
    def reduces_nothing(self) -> bool:
        """One data-parallel rank and a reduction in the main gradients' dtype: reducing is
        the identity, so the gradients are cast straight into ``main_grad`` - the values the
        cast, reduce-scatter (a copy) and scale-by-1 passes give, in one pass and without the
        unsharded fp32 buffer."""
        return self.comm.dp_size == 1 and self.rs_direct and not self.fp32_accumulating

    @property
    def buffer_keys(self) -> tuple:
        """The reduction buffers' allocator keys (prepared before the reduction)."""
        return (
            self.a2a_key if self.fp32_accumulating else self.comm_key,
            self.rs_key,
            self.rep_key,
        )


def reduce_grads(
    grads: torch.Tensor,
    accum: torch.Tensor | None,
    main_grad: torch.Tensor,
    spec: ReduceSpec,
    allocator: BufferAllocator,
    *,
    graphs,
    overwrite: bool,
) -> None:
    """Reduce ``grads`` (the allocator's ``spec.grad_key`` slot, given back here) plus the
    ``no_sync`` accumulation ``accum`` into ``main_grad``; ``overwrite``: ``main_grad`` holds
    nothing the step must keep (no sharded ``.grad``); ``graphs``: the lent communication
    graphs, or None."""
    if (
        graphs is not None
        and spec.grads_sharded
        and spec.comm.replicate_size == 1
        and not (spec.fp32_accumulating and accum is None)
    ):
        _reduce_by_graph(grads, accum, main_grad, spec, allocator, graphs, overwrite)
        return
    _reduce_eager(grads, accum, main_grad, spec, allocator, overwrite)


def _reduce_eager(
    grads, accum, main_grad, spec: ReduceSpec, allocator: BufferAllocator, overwrite: bool
) -> None:
    """Every path but the graph's, issued kernel by kernel."""
    comm = spec.comm
    src = grads
    if accum is not None:
        src = accum.add_(src)
    if spec.reduces_nothing:
        _scale_into(main_grad, src, comm, direct=False, overwrite=overwrite)
        allocator.free(spec.grad_key, used_on=comm.grad_streams() + comm.main_streams())
        return
    if spec.fp32_accumulating and src is grads:
        _reduce_scatter_fp32_accumulating(grads, main_grad, spec, allocator, overwrite)
        return
    comm_dtype = spec.comm_dtype
    used_comm = False
    if src.dtype != comm_dtype:
        buf = allocator.allocate(spec.comm_key, spec.total, comm_dtype, spec.device)
        buf.copy_(src)
        src, used_comm = buf, True
    # The unsharded grads are read for the last time above (the copy, or the add into
    # ``accum``): hand their bytes back before the reduction instead of after it.
    grad_done = src is not grads
    if grad_done:
        allocator.free(spec.grad_key, used_on=comm.grad_streams() + comm.main_streams())
    grads_sharded = spec.grads_sharded
    direct = grads_sharded and spec.rs_direct and overwrite
    used_rs = grads_sharded and not (direct and not spec.over_replicas)
    if grads_sharded:
        out = (
            allocator.allocate(spec.rs_key, spec.shard_numel, comm_dtype, spec.device)
            if used_rs
            else main_grad
        )
        reduce_scatter(out, src, comm, spec.fqn)
    else:
        all_reduce(src, comm, spec.fqn)
        out = src
    # HSDP: the shard-reduced gradients are reduced across replicas on their own stream
    # ([Note: stream roles], [Note: HSDP ranges]); the scaling follows on that stream.
    replicas = comm.replicate_size > 1
    if replicas:
        comm.wait(comm.rep_stream, comm.rs_stream)
    with comm.on(comm.rep_stream) if replicas else nullcontext():
        if replicas:
            out = _reduce_over_replicas(out, main_grad, spec, allocator, direct)
        _scale_into(main_grad, out, comm, direct=direct, overwrite=overwrite)
    streams = comm.reduction_streams()
    if used_rs:
        allocator.free(spec.rs_key, used_on=streams)
    if spec.over_replicas and grads_sharded and not direct:
        allocator.free(spec.rep_key, used_on=streams)
    if used_comm:
        allocator.free(spec.comm_key, used_on=streams)
    if not grad_done:
        allocator.free(spec.grad_key, used_on=streams + comm.main_streams())


def _reduce_by_graph(
    grads, accum, main_grad, spec: ReduceSpec, allocator: BufferAllocator, graphs, overwrite: bool
) -> None:
    """The plain one-mesh-dim reduction as one graph launch on the RS stream
    (capture/comm_graphs.py [Note: communication graphs]): the kernels of the eager path, the
    slot hand-offs around them."""
    comm_dtype = spec.comm_dtype
    src = grads if accum is None else accum
    buf = None
    if src.dtype != comm_dtype:
        buf = allocator.allocate(spec.comm_key, spec.total, comm_dtype, spec.device)
    direct = spec.rs_direct and overwrite
    out = (
        main_grad
        if direct
        else allocator.allocate(spec.rs_key, spec.shard_numel, comm_dtype, spec.device)
    )
    key = (
        "reduce",
        spec.ident,
        grads.data_ptr(),
        accum is not None,
        None if buf is None else buf.data_ptr(),
        out.data_ptr(),
        main_grad.data_ptr(),
        overwrite,
    )
    kernels = partial(
        _reduction_kernels,
        grads,
        accum,
        buf,
        out,
        main_grad,
        spec.comm,
        spec.fqn,
        direct=direct,
        overwrite=overwrite,
    )
    graphs.run(key, (spec.ident, "reduce"), kernels)
    streams = spec.comm.reduction_streams()
    if not direct:
        allocator.free(spec.rs_key, used_on=streams)
    if buf is not None:
        allocator.free(spec.comm_key, used_on=streams)
    allocator.free(spec.grad_key, used_on=streams + spec.comm.main_streams())


def _reduction_kernels(
    grads, accum, buf, out, main_grad, comm: CommContext, fqn: str, *, direct, overwrite
) -> None:
    """Accumulate, cast, reduce-scatter and scale into ``main_grad``: what the eager path
    queues for one mesh dimension, in the same order."""
    src = grads
    if accum is not None:
        src = accum.add_(src)
    if buf is not None:
        buf.copy_(src)
        src = buf
    reduce_scatter(out, src, comm, fqn)
    _scale_into(main_grad, out, comm, direct=direct, overwrite=overwrite)


def _scale_into(main_grad, out, comm: CommContext, *, direct: bool, overwrite: bool) -> None:
    """``main_grad`` (=, or += under accumulation) the reduced ``out`` / data-parallel
    size (the dense one for experts: experts.py [Note: expert groups]); ``direct``: the
    reduction wrote ``main_grad`` itself, scale it in place."""
    inv_world = 1.0 / comm.grad_divisor
    # One data-parallel rank: nothing to divide (x * 1.0 == x), a pass over the fp32
    # gradients saved.
    if direct:
        if inv_world != 1.0:
            main_grad.mul_(inv_world)
    elif overwrite:
        main_grad.copy_(out)
        if inv_world != 1.0:
            main_grad.mul_(inv_world)
    else:
        main_grad.add_(out, alpha=inv_world)


# [Note: reduce-scatter with fp32 accumulation] (MixedPrecisionPolicy's
# reduce_scatter_fp32_accumulation, Megatron's reduce_scatter_with_fp32_accumulation)
# A plain fp32 reduce-scatter of bf16 gradients first copies them into an fp32 buffer,
# then moves 4 bytes per element. Here the bf16 gradients themselves go through an
# all-to-all (the same bytes per rank as a ring reduce-scatter, in bf16: half the fp32
# traffic, and no copy kernel or fp32 buffer of the unsharded size), and each rank sums
# the world pieces of its shard in fp32 with one torch.sum over a fixed row order. Values
# are bf16 in both schemes before the sum, which is fp32 in both: only the order of the
# fp32 additions differs from NCCL's ring - with 2 ranks not at all (a + b == b + a), so
# 2-rank runs are bit-identical to the default. Microbatches accumulated under no_sync
# are fp32 already and take the plain fp32 reduce-scatter.
def _reduce_scatter_fp32_accumulating(
    grads, main_grad, spec: ReduceSpec, allocator: BufferAllocator, overwrite: bool
) -> None:
    comm = spec.comm
    pieces = allocator.allocate(spec.a2a_key, spec.total, spec.compute_dtype, spec.device)
    all_to_all(pieces, grads, comm, spec.fqn)
    allocator.free(spec.grad_key, used_on=comm.grad_streams() + comm.main_streams())
    rows = pieces.view(comm.world_size, spec.shard_numel)  # row r: rank r's gradients
    if overwrite:
        torch.sum(rows, dim=0, dtype=main_grad.dtype, out=main_grad)
        main_grad.mul_(1.0 / comm.grad_divisor)
    else:
        total = torch.sum(rows, dim=0, dtype=main_grad.dtype)
        main_grad.add_(total, alpha=1.0 / comm.grad_divisor)
    allocator.free(spec.a2a_key, used_on=comm.reduction_streams())


def _reduce_over_replicas(
    out: torch.Tensor, main_grad, spec: ReduceSpec, allocator: BufferAllocator, direct: bool
) -> torch.Tensor:
    """Sum ``out`` (this shard's reduced gradients) over the replicas: all-reduce, or with
    the optimizer and gradients sharded over replicas a reduce-scatter down to the owned
    piece (ZeRO-1 keeps full gradients: all-reduce)."""
    if not (spec.over_replicas and spec.grads_sharded):
        all_reduce(out, spec.comm, spec.fqn, over_replicas=True)
        return out
    dst = (
        main_grad
        if direct
        else allocator.allocate(spec.rep_key, spec.owned_numel, out.dtype, spec.device)
    )
    reduce_scatter(dst, out, spec.comm, spec.fqn, over_replicas=True)
    return dst
