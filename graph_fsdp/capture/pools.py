"""Bytes of CUDA graphs' private memory pools, for memory reports.

A graph's pool holds everything its capture allocated (activations, FSDP's slots made inside
the capture, the main gradients: :class:`MainGradPins`); a replay does not call the allocator, so
these bytes never show as *allocated* while the graph runs, only as *reserved*. The caching
allocator's snapshot names each segment's pool (``segment_pool_id``): summing the segments
of a runner's pools gives the graph's memory as its own role (``fsdp_memory_report()``'s
``graph_pool``).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch


def pool_bytes(pools: Iterable) -> dict[str, int]:
    """``{"reserved": ..., "allocated": ...}`` bytes of the segments of ``pools`` (graph pool
    handles, ``torch.cuda.graph_pool_handle()`` / ``CUDAGraph.pool()``); zeros without CUDA
    or pools."""
    wanted = {tuple(p) for p in pools if p is not None}
    out = {"reserved": 0, "allocated": 0}
    if not wanted or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return out
    for seg in torch.cuda.memory_snapshot():
        if tuple(seg.get("segment_pool_id", (0, 0))) in wanted:
            out["reserved"] += seg["total_size"]
            out["allocated"] += seg["allocated_size"]
    return out


# [Note: capture memory] The caching allocator keeps freed blocks per stream, and a graph's
# pool is memory of its own: an eager step on the capture stream cannot reuse the blocks the
# earlier eager steps cached on the default stream, and a capture can reuse neither. So before
# both, every cached block no tensor uses goes back to the driver (after a device synchronize,
# so nothing queued still uses them): the process's peak reserved memory is then the larger of
# one eager step's and the graph's, not their sum. Once per capture; steps are untouched.
# Bytes the step itself frees count too: made on the default stream, the main gradients the
# step's forward releases ([Note: releasable main grads]) and the slots a capture releases
# ([Note: slots in a capture's pool]) would be cached there, out of the other stream's
# reach, for the whole step. On the 16-layer GPT of the whole-step timing test (2 ranks) the
# capture-stream warmup step reserved 1.0 GiB more than an eager step, with 1.3 GiB of the
# default pool unused at that peak (the main gradients alone are 0.5 GiB). So they are
# released first (``release_for_capture``), as the step would release them, and their bytes
# go back with the cached blocks. Layerwise graphs too: their capture returns the eager
# steps' cached blocks before the pool is made, and after it what the warmup calls cached on
# the backend's side stream (of no use to the main stream). The layerwise row of that test
# reserved 1.41x the eager row's peak, with 1.32 GiB of the default pool unused at its peak.
# cuBLAS's workspaces (a cached block per cuBLAS handle and stream, 32 MiB under
# CUBLAS_WORKSPACE_CONFIG=:4096:8) are not given back here: a graph captured with a workspace
# made before its capture (the warmup step on the capture stream makes it) replays matmuls into
# that block, so clearing the workspaces before a later capture - the next layer's graph, a
# TransformerEngine graph, a user's - frees memory a live graph still writes. Measured on 2 H200s:
# layerwise graphs of a 16-layer GPT failed with "unspecified launch failure" in the steps
# after their captures while this function cleared them. So a graphed run whose eager steps
# ran on the caller's stream keeps their set beside the capture stream's (64 MiB on the pool
# test's small GPT, 4 layers, hidden 256): layerwise graphs and the whole-step graph do;
# full_iteration runs its eager steps on the capture stream and makes one set
# (full_iteration.py [Note: eager steps on the capture stream]).
def release_cached_blocks() -> None:
    """Give the caching allocator's unused cached blocks back ([Note: capture memory])."""
    release_for_capture(())


def release_for_capture(groups: Iterable, allocator=None) -> None:
    """Before a step on the capture stream or a capture ([Note: capture memory]): the main
    gradients the step's forward would release (those no ``.grad`` holds and no graph pins),
    the allocator's idle buffers when it is given (a capture that owns its slots), then the
    cached blocks - after one device synchronize, so nothing queued still reads them."""
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    if cuda:
        torch.cuda.synchronize()
    for group in groups:
        group.release_main_grad()
    if allocator is not None:
        allocator.release_idle()
    if cuda:
        torch.cuda.empty_cache()


class MainGradPins:
    """The parameter groups whose main gradients a runner's graphs write, one pin each
    (full_iteration.py [Note: main gradients in the step's pool]): :meth:`pin` them after a
    capture, :meth:`unpin` when the graphs go; a runner collected without ``close()`` takes
    them back through a finalizer."""

    def __init__(self, owner: object) -> None:
        self.groups: list = []
        weakref.finalize(owner, _unpin_all, self.groups)  # the list, never the owner

    def pin(self, groups: Iterable) -> None:
        """Pin each of ``groups`` this holder has not pinned yet (their main gradients get
        bytes now if they have none)."""
        for group in groups:
            if all(group is not held for held in self.groups):
                group.pin_main_grad()
                self.groups.append(group)

    def unpin(self) -> None:
        """Take back every pin of this holder (the graphs that wrote the gradients are gone)."""
        _unpin_all(self.groups)


def _unpin_all(groups: list) -> None:
    """Unpin ``groups`` and empty the list in place (a finalizer holds it)."""
    for group in groups:
        group.unpin_main_grad()
    groups.clear()
