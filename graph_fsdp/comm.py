"""Streams, events and the collectives FSDP issues (free functions over one context).

On CPU (gloo) there are no streams: every helper degrades to synchronous eager calls so the
same engine code is tested for real with several processes in CI.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.distributed as dist

from graph_fsdp.buffers.allocator import CUDA_GET_CURRENT_STREAM, current_stream, nvtx_range


class CommContext:
    """Every stream FSDP uses, created once per root.

    [Note: stream roles]
    - ``ag_stream``: all-gathers (unshard) and their copy-in, so the gather of unit k+1
      runs while unit k computes; high priority so NCCL is not starved by compute kernels.
    - ``rs_stream``: gradient casts and reduce-scatters/all-reduces, so unit k's reduction
      runs while unit k-1's backward computes.
    Every collective first makes its stream wait for the main stream (it reads what compute
    wrote); the main stream waits on the collective's event before using its result.
    """

    def __init__(self, device: torch.device, group: dist.ProcessGroup) -> None:
        self.device = device
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.ag_stream = torch.cuda.Stream(device, priority=-1)
            self.rs_stream = torch.cuda.Stream(device, priority=-1)
        else:
            self.ag_stream = self.rs_stream = None
        self._wait_event: torch.cuda.Event | None = None

    def main_stream(self):
        """The current stream of the device (a cached handle while it stays the same)."""
        return current_stream(self.device) if self.cuda else None

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


def all_gather(out: torch.Tensor, shard: torch.Tensor, ctx: CommContext, fqn: str) -> None:
    with nvtx_range(f"graph_fsdp/all_gather/{fqn}"):
        if ctx.world_size > 1:
            dist.all_gather_into_tensor(out, shard, group=ctx.group)
        elif out.data_ptr() != shard.data_ptr():
            out.copy_(shard)


def reduce_scatter(out: torch.Tensor, full: torch.Tensor, ctx: CommContext, fqn: str) -> None:
    # SUM in both eager and graphed runs; the 1/world scaling happens in fp32 afterwards,
    # the same op on gloo and NCCL (gloo's AVG is not reliable).
    with nvtx_range(f"graph_fsdp/reduce_scatter/{fqn}"):
        if ctx.world_size == 1:
            out.copy_(full)
        else:
            dist.reduce_scatter_tensor(out, full, op=dist.ReduceOp.SUM, group=ctx.group)


def all_reduce(full: torch.Tensor, ctx: CommContext, fqn: str) -> None:
    with nvtx_range(f"graph_fsdp/all_reduce/{fqn}"):
        if ctx.world_size > 1:
            dist.all_reduce(full, op=dist.ReduceOp.SUM, group=ctx.group)
