"""Gradient reduction of one ``FlatParamGroup``: from the unsharded gradients to ``main_grad``.

Free functions over a group, as FSDP2 keeps ``foreach_reduce`` apart from its param group: the
group holds the layout, the buffers and their allocator keys; this module decides which
collectives and kernels turn a backward's gradients into the optimizer's. A unit's
post-backward calls :func:`reduce_grads` once per group; it takes one of these paths:

- accumulate (``no_sync``): add the gradients into the group's fp32 ``accum`` buffer, reduce
  nothing;
- by graph: the plain one-mesh-dim reduction as one graph launch, while a layerwise runner
  lends its communication graphs (capture/comm_graphs.py [Note: communication graphs]);
- reduces nothing: one data-parallel rank in the main gradients' dtype, a cast into
  ``main_grad``;
- fp32 accumulating: an all-to-all of the compute-dtype gradients and an fp32 sum
  ([Note: reduce-scatter with fp32 accumulation]);
- plain: cast to the communication dtype, reduce-scatter (all-reduce without sharded
  gradients), across the replicas for HSDP (param_group.py [Note: HSDP ranges]), then
  scale into ``main_grad``.

Every path runs on the reduce-scatter stream after waiting for the main stream ([Note: stream
roles], comm.py) and gives each buffer back to the allocator with the streams that used it.
"""

from __future__ import annotations

from contextlib import nullcontext
from functools import partial
from typing import TYPE_CHECKING

import torch

from graph_fsdp.buffers.allocator import BufferAllocator
from graph_fsdp.cuda_streams import nvtx_range
from graph_fsdp.fsdp.comm import all_reduce, all_to_all, reduce_scatter

if TYPE_CHECKING:
    from graph_fsdp.fsdp.param_group import FlatParamGroup


def reduces_nothing(group: FlatParamGroup) -> bool:
    """One data-parallel rank and a reduction in the main gradients' dtype: reducing is
    the identity, so the gradients are cast straight into ``main_grad`` - the values the
    cast, reduce-scatter (a copy) and scale-by-1 passes give, in one pass and without the
    unsharded fp32 buffer."""
    return group.comm.dp_size == 1 and group.rs_direct() and not group.fp32_accumulating


def _reduction_keys(group: FlatParamGroup) -> tuple:
    return (
        group.a2a_key if group.fp32_accumulating else group.comm_key,
        group.rs_key,
        group.rep_key,
    )


def reduce_grads(
    group: FlatParamGroup, allocator: BufferAllocator, *, sync: bool, overwrite: bool
) -> None:
    """Reduce this backward's gradients into ``main_grad`` (or keep them under no_sync);
    ``overwrite``: ``main_grad`` holds nothing the step must keep (no sharded ``.grad``)."""
    comm = group.comm
    if group.grads_in_autograd:
        group.collect_grads(allocator)
    if sync:
        group.ensure_main_grad()  # on the main stream: [Note: releasable main grads]
        # The reduction's buffers get their bytes here, after this unit's backward was
        # queued and on the main stream, not on the reduce-scatter stream that uses them
        # ([Note: backward slots between steps]): at the start of backward, the memory
        # peak (every activation and the loss gradients live), they hold nothing yet.
        if not reduces_nothing(group):
            allocator.prepare(_reduction_keys(group))
    main = comm.main_stream()
    comm.wait(comm.rs_stream, main)
    with comm.on(comm.rs_stream), nvtx_range(f"graph_fsdp/reduce_grads/{group.fqn}"):
        if not sync:
            _accumulate(group, allocator)
            return
        graphs = group.capture.comm_graphs
        if (
            graphs is not None
            and group.placements.grads
            and comm.replicate_size == 1
            and not (group.fp32_accumulating and not group.accum_pending)
        ):
            _reduce_by_graph(group, allocator, graphs, overwrite)
            return
        _reduce_eager(group, allocator, overwrite)


def _accumulate(group: FlatParamGroup, allocator: BufferAllocator) -> None:
    """``no_sync``: the gradients into (or added to) the fp32 ``accum`` buffer."""
    if group.accum is None:
        with group.persistent_region():  # address_keeping.py
            group.accum = torch.empty(
                group.layout.total, dtype=group.mp.main_grads_dtype, device=group.device
            )
    if group.accum_pending:
        group.accum.add_(group.grad_full)
    else:
        group.accum.copy_(group.grad_full)
    group.accum_pending = True
    allocator.free(group.grad_key, used_on=group.grad_streams())


def _reduce_eager(group: FlatParamGroup, allocator: BufferAllocator, overwrite: bool) -> None:
    """Every synchronising path but the graph's, issued kernel by kernel."""
    comm = group.comm
    src = group.grad_full
    if group.accum_pending:
        src = group.accum.add_(src)
        group.accum_pending = False
    if reduces_nothing(group):
        _scale_into_main_grad(group, src, direct=False, overwrite=overwrite)
        allocator.free(group.grad_key, used_on=group.grad_streams() + group.main_streams())
        return
    if group.fp32_accumulating and src is group.grad_full:
        _reduce_scatter_fp32_accumulating(group, allocator, overwrite)
        return
    comm_dtype = group.mp.comm_dtype()
    used_comm = False
    if src.dtype != comm_dtype:
        buf = allocator.allocate(group.comm_key, group.layout.total, comm_dtype, group.device)
        buf.copy_(src)
        src, used_comm = buf, True
    # The unsharded grads are read for the last time above (the copy, or the add into
    # ``accum``): hand their bytes back before the reduction instead of after it.
    grad_done = src is not group.grad_full
    if grad_done:
        allocator.free(group.grad_key, used_on=group.grad_streams() + group.main_streams())
    grads_sharded = group.placements.grads
    direct = grads_sharded and group.rs_direct() and overwrite
    used_rs = grads_sharded and not (direct and not group.over_replicas)
    if grads_sharded:
        out = (
            allocator.allocate(group.rs_key, group.shard_numel, comm_dtype, group.device)
            if used_rs
            else group.main_grad
        )
        reduce_scatter(out, src, comm, group.fqn)
    else:
        all_reduce(src, comm, group.fqn)
        out = src
    # HSDP: the shard-reduced gradients are reduced across replicas on their own stream
    # ([Note: stream roles], [Note: HSDP ranges]); the scaling follows on that stream.
    replicas = comm.replicate_size > 1
    if replicas:
        comm.wait(comm.rep_stream, comm.rs_stream)
    with comm.on(comm.rep_stream) if replicas else nullcontext():
        if replicas:
            out = _reduce_over_replicas(group, allocator, out, direct)
        _scale_into_main_grad(group, out, direct=direct, overwrite=overwrite)
    streams = group.rs_streams()
    if used_rs:
        allocator.free(group.rs_key, used_on=streams)
    if group.over_replicas and grads_sharded and not direct:
        allocator.free(group.rep_key, used_on=streams)
    if used_comm:
        allocator.free(group.comm_key, used_on=streams)
    if not grad_done:
        allocator.free(group.grad_key, used_on=streams + group.main_streams())


def _reduce_by_graph(
    group: FlatParamGroup, allocator: BufferAllocator, graphs, overwrite: bool
) -> None:
    """The plain one-mesh-dim reduction as one graph launch on the RS stream
    (capture/comm_graphs.py [Note: communication graphs]): the kernels of the eager path, the
    slot hand-offs around them."""
    comm_dtype = group.mp.comm_dtype()
    accum = group.accum if group.accum_pending else None
    group.accum_pending = False
    src = group.grad_full if accum is None else accum
    buf = None
    if src.dtype != comm_dtype:
        buf = allocator.allocate(group.comm_key, group.layout.total, comm_dtype, group.device)
    direct = group.rs_direct() and overwrite
    out = (
        group.main_grad
        if direct
        else allocator.allocate(group.rs_key, group.shard_numel, comm_dtype, group.device)
    )
    key = (
        "reduce",
        id(group),
        group.grad_full.data_ptr(),
        accum is not None,
        None if buf is None else buf.data_ptr(),
        out.data_ptr(),
        group.main_grad.data_ptr(),
        overwrite,
    )
    kernels = partial(
        _reduction_kernels, group, accum, buf, out, direct=direct, overwrite=overwrite
    )
    graphs.run(key, (id(group), "reduce"), kernels)
    streams = group.rs_streams()
    if not direct:
        allocator.free(group.rs_key, used_on=streams)
    if buf is not None:
        allocator.free(group.comm_key, used_on=streams)
    allocator.free(group.grad_key, used_on=streams + group.main_streams())


def _reduction_kernels(
    group: FlatParamGroup, accum, buf, out, *, direct: bool, overwrite: bool
) -> None:
    """Accumulate, cast, reduce-scatter and scale into ``main_grad``: what the eager path
    queues for one mesh dimension, in the same order."""
    src = group.grad_full
    if accum is not None:
        src = accum.add_(src)
    if buf is not None:
        buf.copy_(src)
        src = buf
    reduce_scatter(out, src, group.comm, group.fqn)
    _scale_into_main_grad(group, out, direct=direct, overwrite=overwrite)


def _scale_into_main_grad(group: FlatParamGroup, out, *, direct: bool, overwrite: bool) -> None:
    """``main_grad`` (=, or += under accumulation) the reduced ``out`` / data-parallel
    size (the dense one for experts: experts.py [Note: expert groups]); ``direct``: the
    reduction wrote ``main_grad`` itself, scale it in place."""
    main_grad = group.main_grad
    inv_world = 1.0 / group.comm.grad_divisor
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
    group: FlatParamGroup, allocator: BufferAllocator, overwrite: bool
) -> None:
    comm, main_grad = group.comm, group.main_grad
    pieces = allocator.allocate(
        group.a2a_key, group.layout.total, group.compute_dtype, group.device
    )
    all_to_all(pieces, group.grad_full, comm, group.fqn)
    allocator.free(group.grad_key, used_on=group.grad_streams() + group.main_streams())
    rows = pieces.view(comm.world_size, group.shard_numel)  # row r: rank r's gradients
    if overwrite:
        torch.sum(rows, dim=0, dtype=main_grad.dtype, out=main_grad)
        main_grad.mul_(1.0 / comm.grad_divisor)
    else:
        total = torch.sum(rows, dim=0, dtype=main_grad.dtype)
        main_grad.add_(total, alpha=1.0 / comm.grad_divisor)
    allocator.free(group.a2a_key, used_on=group.rs_streams())


def _reduce_over_replicas(
    group: FlatParamGroup, allocator: BufferAllocator, out: torch.Tensor, direct: bool
) -> torch.Tensor:
    """Sum ``out`` (this shard's reduced gradients) over the replicas: all-reduce, or with
    the optimizer and gradients sharded over replicas a reduce-scatter down to the owned
    piece (ZeRO-1 keeps full gradients: all-reduce)."""
    if not (group.over_replicas and group.placements.grads):
        all_reduce(out, group.comm, group.fqn, over_replicas=True)
        return out
    lo, hi = group.owned
    dst = (
        group.main_grad
        if direct
        else allocator.allocate(group.rep_key, hi - lo, out.dtype, group.device)
    )
    reduce_scatter(dst, out, group.comm, group.fqn, over_replicas=True)
    return dst
