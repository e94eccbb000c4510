"""Streams, events and the collectives FSDP issues (free functions over one context).

On CPU (gloo) there are no streams: every helper degrades to synchronous eager calls so the
same engine code is tested for real with several processes in CI.
"""

from __future__ import annotations

import copy
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions, ReduceScatterOptions

from graph_fsdp.cuda_streams import CUDA_GET_CURRENT_STREAM, current_stream, nvtx_range


class CommContext:
    """Every stream FSDP uses, created once per root.

    [Note: stream roles]
    - ``ag_stream``: all-gathers (unshard) and their copy-in, so the gather of unit k+1
      runs while unit k computes; high priority so NCCL is not starved by compute kernels.
    - ``rs_stream``: gradient casts and reduce-scatters/all-reduces, so unit k's reduction
      runs while unit k-1's backward computes.
    - ``rep_stream`` (HSDP, replicate size > 1 only): the reduction of the reduce-scattered
      shards across replicas (inter-node), so it overlaps the next unit's intra-node
      reduce-scatter instead of queueing behind it on ``rs_stream``.
    Every collective first makes its stream wait for the main stream (it reads what compute
    wrote); the main stream waits on the collective's event before using its result.

    ``group`` is the shard group (the whole data-parallel group with a 1-D mesh);
    ``replicate_group`` the replicas of this rank's shard (HSDP), or None. A unit's expert
    parameters use a context over the expert-data-parallel group that shares these streams
    (:meth:`over`, experts.py [Note: expert groups]). ``separate_all_gather_group``: the
    units' all-gathers get a communicator of their own once the root opens it
    (:meth:`open_gather_group`, [Note: a communicator for the all-gathers]).
    """

    def __init__(
        self,
        device: torch.device,
        group: dist.ProcessGroup,
        replicate_group: dist.ProcessGroup | None = None,
        *,
        separate_all_gather_group: bool = False,
    ) -> None:
        self.device = device
        self.group = group
        self.gather_group = group
        """What the units' all-gathers over the shard group run on: ``group``, or its twin."""
        self.separate_all_gather_group = separate_all_gather_group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.replicate_group = replicate_group
        self.replicate_size = 1 if replicate_group is None else dist.get_world_size(replicate_group)
        self.replicate_rank = 0 if replicate_group is None else dist.get_rank(replicate_group)
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.ag_stream = torch.cuda.Stream(device, priority=-1)
            self.rs_stream = torch.cuda.Stream(device, priority=-1)
        else:
            self.ag_stream = self.rs_stream = None
        self.rep_stream = (
            torch.cuda.Stream(device, priority=-1)
            if self.cuda and self.replicate_size > 1
            else None
        )
        self._wait_event: torch.cuda.Event | None = None
        self._grad_divisor: int | None = None

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks of this context's groups (shard x replicate)."""
        return self.world_size * self.replicate_size

    @property
    def grad_divisor(self) -> int:
        """What the summed gradients are divided by: the data-parallel size - for expert
        parameters the dense one, not the expert-data-parallel size ([Note: expert groups])."""
        return self._grad_divisor or self.dp_size

    def over(self, group: dist.ProcessGroup, *, grad_divisor: int) -> CommContext:
        """A context whose collectives run over ``group`` (1-D, no replicas) on this
        context's streams, dividing summed gradients by ``grad_divisor``
        (experts.py [Note: expert groups])."""
        other = copy.copy(self)  # the same stream objects
        other.group = other.gather_group = group
        other.world_size = dist.get_world_size(group)
        other.rank = dist.get_rank(group)
        other.replicate_group, other.replicate_size, other.replicate_rank = None, 1, 0
        other.rep_stream = None
        other._wait_event = None
        other._grad_divisor = grad_divisor
        return other

    def open_gather_group(self) -> None:
        """With ``separate_all_gather_group``: the all-gathers move to a new group over the
        same ranks ([Note: a communicator for the all-gathers]). Called once per context, by
        the root's lazy init, on every rank of the group in the same order."""
        if (
            self.separate_all_gather_group
            and self.world_size > 1
            and self.gather_group is self.group
        ):
            self.gather_group = twin_group(self.group)

    def same_mesh(self, other: CommContext) -> bool:
        return self.group is other.group and self.replicate_group is other.replicate_group

    def describe(self) -> str:
        """The mesh in words, for error messages."""
        ranks = dist.get_process_group_ranks(self.group)
        if self.replicate_group is None:
            return f"1-D mesh over ranks {ranks}"
        reps = dist.get_process_group_ranks(self.replicate_group)
        return (
            f"2-D mesh replicate {self.replicate_size} x shard {self.world_size} (this rank's "
            f"shard group {ranks}, replicate group {reps})"
        )

    def wait_reductions(self) -> None:
        """The main stream waits for every queued gradient reduction (both mesh dims)."""
        main = self.main_stream()
        # A step with no replica reduction (a no_sync microbatch) leaves rep_stream outside a
        # full_iteration capture; an event recorded on it there is uncaptured work the
        # captured main stream must not wait on. Chained behind rs_stream it joins first.
        self.wait(self.rep_stream, self.rs_stream)
        self.wait(main, self.rs_stream)
        self.wait(main, self.rep_stream)

    def main_stream(self):
        """The current stream of the device (a cached handle while it stays the same)."""
        return current_stream(self.device) if self.cuda else None

    # The streams a buffer was used on, for the allocator's ``free(key, used_on=...)``.
    def main_streams(self) -> list:
        """The current stream (see :meth:`main_stream`), or none on CPU."""
        main = self.main_stream()
        return [main] if main is not None else []

    def grad_streams(self) -> list:
        """The side stream that reads the unsharded grads (the replica stream never does: an
        event recorded on it before it joins a full_iteration capture is uncaptured work)."""
        return [self.rs_stream] if self.rs_stream is not None else []

    def reduction_streams(self) -> list:
        """The streams a reduction's buffers are used on: reduce-scatter and replicas."""
        return [s for s in (self.rs_stream, self.rep_stream) if s is not None]

    def on(self, stream):
        """Context that makes ``stream`` current (no-op on CPU).

        ``torch.cuda.stream(stream)`` semantics; when ``stream`` is on the current device
        (always, for FSDP's streams) a lighter context does the same two ``set_stream``.
        """
        if stream is None:
            return nullcontext()
        index = self.device.index
        if (
            index is None
            or stream.device_index != index
            or torch.cuda.current_device() != index
            or CUDA_GET_CURRENT_STREAM is None
        ):
            return torch.cuda.stream(stream)
        return _OnStream(self, stream)

    def wait(self, waiter, producer) -> None:
        """``waiter`` stream waits for all work queued so far on ``producer``.

        What ``waiter.wait_stream(producer)`` does, with one reused event instead of a new
        one per call: the wait is enqueued right after the record, and a wait depends on the
        record that was latest when it was enqueued, so later re-records do not affect it.
        """
        if waiter is not None and producer is not None and waiter is not producer:
            event = self._wait_event
            if event is None:
                event = self._wait_event = torch.cuda.Event()
            event.record(producer)
            waiter.wait_event(event)

    def record(self, stream, event: torch.cuda.Event | None = None) -> torch.cuda.Event | None:
        """Record ``event`` (a new one if None) on ``stream``; None on CPU."""
        if stream is None:
            return None
        if event is None:
            event = torch.cuda.Event()
        event.record(stream)
        return event

    def wait_event(self, event: torch.cuda.Event | None) -> None:
        if event is not None:
            self.main_stream().wait_event(event)


class _OnStream:
    """``torch.cuda.StreamContext`` for a stream of the current device: make ``stream``
    current, restore the previous current stream on exit."""

    __slots__ = ("comm", "prev", "stream")

    def __init__(self, comm: CommContext, stream) -> None:
        self.comm, self.stream, self.prev = comm, stream, None

    def __enter__(self) -> None:
        self.prev = self.comm.main_stream()
        torch.cuda.set_stream(self.stream)

    def __exit__(self, *exc) -> None:
        torch.cuda.set_stream(self.prev)


# [Note: a communicator for the all-gathers] One NCCL communicator runs one collective at a
# time: with the units' all-gathers and the gradients' reduce-scatters on one process group
# they queue behind each other on the wire although they run on two streams. In a ZeRO-3
# backward every unit has both (its weights gathered again, its gradients reduced), so the
# next unit's gather waits for the previous unit's fp32 reduce-scatter and the backward
# waits for the gather. ``fully_shard(..., separate_all_gather_group=True)`` (Megatron's
# ``--create-all-gather-group``) gives the all-gathers of the units a process group of their
# own over the same ranks, in the same rank order: two communicators, which NVLink or the
# network run side by side. Each stream still issues its collectives in program order, the
# same on every rank, so neither communicator can wait on the other in opposite orders
# (experts.py [Note: expert groups]); the bits are the same (the same collective on the same
# ranks). The cost is the second communicator's buffers (NCCL's, outside torch's caching
# allocator). The root opens the twin at lazy init (``CommContext.open_gather_group``) - the
# dense group's and, for experts, each expert-data-parallel group's - so every rank of a
# group creates it at the same point; gathers over replicas (HSDP ``optim_over_replicas``)
# and every other collective keep their groups. A group spanning the whole world is created
# by every rank; a sub-group only by its members (``use_local_synchronization``), which
# torch cannot do when the default group was created with a ``device_id`` (its sub-groups
# are split from the world's communicator, a call every rank must make): refused there.


def twin_group(group: dist.ProcessGroup) -> dist.ProcessGroup:
    """A new process group over ``group``'s ranks in its rank order, on its backend ([Note:
    a communicator for the all-gathers])."""
    ranks = dist.get_process_group_ranks(group)
    backend = dist.get_backend(group)
    desc = "graph_fsdp_all_gather"
    if len(ranks) == dist.get_world_size():
        twin = dist.new_group(ranks, backend=backend, sort_ranks=False, group_desc=desc)
    else:
        if dist.distributed_c10d._get_default_group().bound_device_id is not None:
            raise ValueError(
                f"separate_all_gather_group=True over the sub-group of ranks {ranks}: the "
                "default process group was created with a device_id, so torch splits every new "
                "sub-group from the world's communicator - a call every rank of the world would "
                "have to make, while only this group's ranks shard this model. Create the "
                "default group without device_id, or leave separate_all_gather_group False"
            )
        twin = dist.new_group(
            ranks,
            backend=backend,
            sort_ranks=False,
            use_local_synchronization=True,
            group_desc=desc,
        )
    if dist.get_rank(twin) != dist.get_rank(group):  # the gathers' layout follows the rank
        raise RuntimeError(
            f"the all-gather group's rank {dist.get_rank(twin)} differs from the shard group's "
            f"{dist.get_rank(group)} over ranks {ranks}"
        )
    return twin


def _collective(ctx: CommContext, op: str, fqn: str, over_replicas: bool):
    """``op``'s group and its size - the shard group (the units' all-gathers: its twin when
    there is one), or ``over_replicas`` the replicate group - and its NVTX range,
    ``graph_fsdp/<op>/<fqn>`` (``<op>_replicas`` over replicas)."""
    if over_replicas:
        group, size, op = ctx.replicate_group, ctx.replicate_size, f"{op}_replicas"
    else:
        group = ctx.gather_group if op == "all_gather" else ctx.group
        size = ctx.world_size
    return group, size, nvtx_range(f"graph_fsdp/{op}/{fqn}")


# [Note: direct collectives] ``dist.all_gather_into_tensor`` and ``dist.reduce_scatter_tensor``
# run Python on every call before they reach the process group (torch-function dispatch,
# argument checks, the coalescing-state lookup, the exception-logging and deprecation
# wrappers): on the GPU host that is a sizeable part of the host time of a layer in a
# layerwise-graphed step, which issues three of them per layer. FSDP's calls need none of it
# (plain dense tensors, never coalesced, a group this rank belongs to), so they call the
# group's own method with the options the blocking form sets - ``asyncOp`` False, which lets
# NCCL run on the current stream - and wait on the work as the blocking form does. Same
# collective, same stream semantics, same bits. ``DIRECT_COLLECTIVES = False`` goes through
# ``torch.distributed`` (tools/nccl_host_cost.py times both).
DIRECT_COLLECTIVES = True


def _direct_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    if not DIRECT_COLLECTIVES:
        return None
    return group if group is not None else dist.distributed_c10d._get_default_group()


def _blocking(options):
    options.asyncOp = False
    return options


def _wait(work) -> None:
    if work is not None:  # a blocking NCCL call may return none (it synchronised already)
        work.wait()


_AG_OPTIONS = _blocking(AllgatherOptions())
_RS_SUM_OPTIONS = _blocking(ReduceScatterOptions())
_RS_SUM_OPTIONS.reduceOp = dist.ReduceOp.SUM


def all_gather_into(
    out: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup | None
) -> None:
    """``dist.all_gather_into_tensor`` over ``group``, direct ([Note: direct collectives])."""
    pg = _direct_group(group)
    if pg is None:
        dist.all_gather_into_tensor(out, shard, group=group)
    else:
        _wait(pg._allgather_base(out, shard, _AG_OPTIONS))


def reduce_scatter_into(
    out: torch.Tensor, full: torch.Tensor, group: dist.ProcessGroup | None
) -> None:
    """``dist.reduce_scatter_tensor`` (SUM) over ``group``, direct ([Note: direct
    collectives])."""
    pg = _direct_group(group)
    if pg is None:
        dist.reduce_scatter_tensor(out, full, op=dist.ReduceOp.SUM, group=group)
    else:
        _wait(pg._reduce_scatter_base(out, full, _RS_SUM_OPTIONS))


def all_gather(
    out: torch.Tensor,
    shard: torch.Tensor,
    ctx: CommContext,
    fqn: str,
    *,
    over_replicas: bool = False,
) -> None:
    """All-gather over the shard group (or, ``over_replicas``, the replicate group)."""
    group, size, scope = _collective(ctx, "all_gather", fqn, over_replicas)
    with scope:
        if size > 1:
            all_gather_into(out, shard, group)
        elif out.data_ptr() != shard.data_ptr():  # in place ([Note: copy-in all-gather])
            out.copy_(shard)


def reduce_scatter(
    out: torch.Tensor,
    full: torch.Tensor,
    ctx: CommContext,
    fqn: str,
    *,
    over_replicas: bool = False,
) -> None:
    # SUM in both eager and graphed runs; the 1/world scaling happens in fp32 afterwards,
    # the same op on gloo and NCCL (gloo's AVG is not reliable).
    group, size, scope = _collective(ctx, "reduce_scatter", fqn, over_replicas)
    with scope:
        if size == 1:
            out.copy_(full)
        else:
            reduce_scatter_into(out, full, group)


def all_to_all(out: torch.Tensor, full: torch.Tensor, ctx: CommContext, fqn: str) -> None:
    """Piece ``r`` of ``full`` goes to rank ``r`` of the shard group; ``out``'s piece ``r``
    comes from rank ``r`` (reduce.py [Note: reduce-scatter with fp32 accumulation])."""
    group, size, scope = _collective(ctx, "all_to_all", fqn, False)
    with scope:
        if size > 1:
            dist.all_to_all_single(out, full, group=group)
        else:
            out.copy_(full)


def all_reduce(
    full: torch.Tensor, ctx: CommContext, fqn: str, *, over_replicas: bool = False
) -> None:
    group, size, scope = _collective(ctx, "all_reduce", fqn, over_replicas)
    with scope:
        if size > 1:
            dist.all_reduce(full, op=dist.ReduceOp.SUM, group=group)
