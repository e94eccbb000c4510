"""Offload that keeps addresses: device memory released, then mapped back where it was.

    policy = BufferPolicy(allocator="double_buffer", keep_addresses_on_offload=True)
    for layer in model.layers:
        fully_shard(layer, buffer_policy=policy)
    fully_shard(model, buffer_policy=policy)         # the root's policy decides
    ...                                              # graphed training steps
    offload.offload_params(model); offload.offload_grads(model)
    offload.offload_optimizer(model, optimizer)      # the device memory goes back to the driver
    ...                                              # a rollout uses it
    offload.onload_params(model); ...                # the same addresses: graphs replay at once

[Note: offload keeps addresses] A CUDA graph records virtual addresses. Recapturing after an
onload (offload.py [Note: CUDA graphs across offload]) costs every RL iteration a capture and
the warmup steps before it. Instead, everything a graph reads or writes that offload releases
lives in a *region*: memory whose physical pages can be unmapped while the virtual range stays
reserved, and mapped again (new pages, the same addresses) later - CUDA's virtual memory API,
through torch-memory-saver (the ``AddressBackend`` below; tests plug in another). One region per
kind and model (root):

========  =============================================  ================  ================
kind      tensors                                        released by       contents
========  =============================================  ================  ================
params    main weights, ZeRO-1/2 compute weights, HSDP   offload_params    main weights kept
          compute shard
buffers   the allocator's slots (gathered weights,       offload_params    dead
          unsharded gradients, reduction buffers)
graphs    the CUDA graphs' memory pools (activations),   offload_params    dead
          their static inputs and incoming gradients
grads     main gradients, ``no_sync`` accumulators       offload_grads     kept while live
optim     optimizer state (one region per optimizer)     offload_optimizer kept
========  =============================================  ================  ================

Contents that must survive are copied to pinned host memory before the release and back after
(the flat tensors' storage is swapped to the host copy meanwhile, offload.py [Note: offload
keeps identities], so the parameters stay readable, e.g. by ``iter_full_params``); dead ones
are not copied: the next step rewrites them (gathers refresh compute weights from the main
weights, ``dirty``; gradients and activations are recomputed). Main gradients are live while a
sharded ``.grad`` is attached or ``no_sync`` accumulates; otherwise the next reduction
overwrites them.

How tensors get into regions: at the root's lazy init the main weights, main gradients and
compute buffers made by ``fully_shard`` are copied into regions (once, by the group's
``adopt_addresses``; the optimizer's parameters keep their identity), the allocator makes its
slots inside the buffers region (``SlotAllocator.set_region``), accumulators are made inside the grads region
(``FlatParamGroup.persistent_region``), and main gradients are never released between steps
(param_group.py [Note: releasable main grads]: ``pin_main_grad()``, as a full-iteration graph
needs anyway). Optimizer state is made by the optimizer's first step, outside any region: the
first ``onload_optimizer`` re-makes it inside the optimizer's region (one address change, for
an optimizer that runs eagerly), after which it keeps its addresses. A capture's static
buffers outside its pool are made in the graphs region (:func:`static_memory`), and the
recorded sample inputs a capture starts from wait on the host. Allocations while a CUDA
graph is being captured stay in the graph's pool (``region`` steps aside). The graphs' pools
join the graphs region when captures run through :func:`graph_capture`: with
torch-memory-saver's preload hook (``LD_PRELOAD``), whose allocations are tagged per thread,
so backward runs on the capturing thread during capture (autograd multithreading off there);
its torch hook cannot tag a graph's private pool, so the pools stay on the device then, as they
do for TransformerEngine's captures.

While a kind is released nothing may touch its memory: forward, graph runners' steps, optimizer
steps and allocations in a released region are refused with the call that fixes it.
"""

from __future__ import annotations

import os
import sys
import weakref
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from graph_fsdp.cuda_streams import stream_capturing
from graph_fsdp.distributed import GRAPH_REGISTER_ENV

KINDS = ("params", "buffers", "graphs", "grads", "optim")
ONLOAD_CALL = {
    "params": "onload_params()",
    "buffers": "onload_params()",
    "graphs": "onload_params()",
    "grads": "onload_grads()",
    "optim": "onload_optimizer(optimizer)",
}
PRELOAD_LIBRARY = "torch_memory_saver_hook_mode_preload"
"""The stem of torch-memory-saver's preload library (``<stem>_cu13.abi3.so`` on CUDA 13)."""


class AddressBackend(Protocol):
    """Releases and restores the physical memory of tagged allocations at kept addresses."""

    description: str
    """What the offload notice says about this backend."""
    releases_graph_pools: bool
    """Whether :meth:`capture` puts a graph's pool into the tag it is given."""

    def region(self, tag: str) -> AbstractContextManager:
        """CUDA allocations inside (on this thread) belong to ``tag``."""

    def capture(self, graph, tag: str, **kwargs) -> AbstractContextManager:
        """``torch.cuda.graph(graph, **kwargs)``; the graph's pool belongs to ``tag``."""

    def pause(self, tag: str, tensors: list[torch.Tensor]) -> None:
        """Release the physical memory of ``tag``'s allocations (``tensors`` live there)."""

    def resume(self, tag: str, tensors: list[torch.Tensor]) -> None:
        """Map new physical memory at ``tag``'s addresses (contents undefined)."""


class MemorySaverBackend:
    """torch-memory-saver: ``region(tag)``, ``pause(tag)``/``resume(tag)``, and in its preload
    hook mode ``cuda_graph(...)`` for the graphs' pools."""

    def __init__(self, saver, preload: bool) -> None:
        self.saver, self.preload = saver, preload
        self.releases_graph_pools = preload
        self.description = (
            "torch-memory-saver, preload hook"
            if preload
            else "torch-memory-saver, torch hook; LD_PRELOAD="
            f"<{PRELOAD_LIBRARY}_cu*.so> releases the graphs' pools too"
        )

    def region(self, tag: str) -> AbstractContextManager:
        return self.saver.region(tag=tag)

    def capture(self, graph, tag: str, **kwargs) -> AbstractContextManager:
        if not self.preload:
            return torch.cuda.graph(graph, **kwargs)
        return self._preload_capture(graph, tag, kwargs)

    @contextmanager
    def _preload_capture(self, graph, tag: str, kwargs: dict) -> Iterator[None]:
        """Entered where ``torch.cuda.graph`` would be (not when made: callers build the
        context first and run capture-time hooks before entering it)."""
        # The preload hook tags the allocations of the thread that set the tag: backward
        # must run on the capturing thread, not on autograd's device thread.
        with (
            torch.autograd.set_multithreading_enabled(False),
            self.saver.cuda_graph(graph, tag=tag, **kwargs),
        ):
            yield

    def pause(self, tag: str, tensors: list[torch.Tensor]) -> None:
        self.saver.pause(tag)

    def resume(self, tag: str, tensors: list[torch.Tensor]) -> None:
        self.saver.resume(tag)


_OVERRIDE: AddressBackend | None = None
_SELECTED: dict[str, tuple[AddressBackend | None, str]] = {}


def set_backend(backend: AddressBackend | None) -> None:
    """Use ``backend`` for models whose lazy init runs from now on (None: torch-memory-saver
    when importable). For another address-keeping library, and for tests that check that
    nothing depends on released contents (a backend that overwrites them)."""
    global _OVERRIDE
    _OVERRIDE = backend


def preload_library() -> str | None:
    """The path of torch-memory-saver's preload library for this torch, or None (the
    package is not installed): ``LD_PRELOAD=<it> python train.py`` releases graph pools too."""
    try:
        from torch_memory_saver.utils import (  # noqa: PLC0415 (optional dependency)
            get_binary_path_from_package,
        )
    except ImportError:
        return None
    return str(get_binary_path_from_package(PRELOAD_LIBRARY))


def _select_backend(device: torch.device) -> tuple[AddressBackend | None, str]:
    """The backend for ``device``, or None and why not (decided once per device type)."""
    if _OVERRIDE is not None:
        return _OVERRIDE, ""
    if device.type != "cuda":
        return None, f"the model is on {device.type} (no CUDA graphs to keep)"
    if device.type in _SELECTED:
        return _SELECTED[device.type]
    _SELECTED[device.type] = chosen = _memory_saver()
    return chosen


def _memory_saver() -> tuple[AddressBackend | None, str]:
    try:
        from torch_memory_saver import (  # noqa: PLC0415 (optional dependency)
            torch_memory_saver as saver,
        )
    except ImportError:
        return None, "torch-memory-saver is not installed (pip install torch-memory-saver)"
    if "expandable_segments:True" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""):
        return None, (
            "PYTORCH_CUDA_ALLOC_CONF has expandable_segments:True, which torch-memory-saver "
            "does not support (drop it)"
        )
    preload = "torch_memory_saver" in os.environ.get("LD_PRELOAD", "")
    try:
        # Its default hook is the preload one: without LD_PRELOAD the torch hook (a pluggable
        # allocator) is the one that works. Refused once the saver is in use (then it keeps
        # the mode it was started in).
        saver.hook_mode = "preload" if preload else "torch"
    except (AssertionError, AttributeError):
        impl = getattr(saver, "_impl", None)
        preload = getattr(impl, "_hook_mode", "preload" if preload else "torch") == "preload"
    try:
        with saver.region(tag="graph_fsdp.init"):  # loads the library now: errors surface here
            pass
    except Exception as exc:  # noqa: BLE001 - any failure to start it means: fall back
        return None, f"torch-memory-saver did not start ({type(exc).__name__}: {exc})"
    return MemorySaverBackend(saver, preload), ""


# ---------------------------------------------------------------------- the mode of a model
@dataclass
class OffloadMode:
    """How offload treats one root's CUDA graphs, decided at its lazy init."""

    keeper: AddressKeeper | None
    """The model's regions (addresses kept), or None: graphs are recaptured after onload."""
    notice: str
    """The one line :func:`announce` prints at the first offload of the process."""


def offload_mode_for(states: list, keep_addresses: bool) -> OffloadMode:
    """The mode of a root's units ``states`` (their groups get their regions here)."""
    if not keep_addresses:
        return OffloadMode(
            None,
            "graph_fsdp offload: CUDA graphs are recaptured after onload "
            "(BufferPolicy(keep_addresses_on_offload=True) with torch-memory-saver keeps them)",
        )
    device = next(g.device for s in states for g in s.groups)
    backend, why_not = _select_backend(device)
    if backend is None:
        return OffloadMode(
            None,
            "graph_fsdp offload: CUDA graphs are recaptured after onload: keep_addresses_on_"
            f"offload is set, but {why_not}",
        )
    keeper = AddressKeeper(backend, device)
    for state in states:
        for group in state.groups:
            group.adopt_addresses(keeper)
    states[0].root.allocator.set_region(keeper.region_of("buffers"))
    _no_nccl_graph_registration()
    pools = (
        ", and the graphs' pools," if backend.releases_graph_pools else " (not the graphs' pools)"
    )
    return OffloadMode(
        keeper,
        f"graph_fsdp offload: addresses kept ({backend.description}): weights, gradients, "
        f"optimizer state and static buffers{pools} are released and mapped back at the same "
        "addresses; CUDA graphs replay after onload without recapture",
    )


def _no_nccl_graph_registration() -> None:
    """NCCL registers the buffers of collectives captured in a graph with its peers; a graph
    replayed over new physical pages at the old addresses would use stale registrations
    (torch-memory-saver's documented hang). Set before the first capture reads it."""
    os.environ.setdefault(GRAPH_REGISTER_ENV, "0")


_ANNOUNCED: set[str] = set()


def announce(mode: OffloadMode | None) -> None:
    """Print the mode's notice, once per process (rank 0)."""
    if mode is None or mode.notice in _ANNOUNCED:
        return
    _ANNOUNCED.add(mode.notice)
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(mode.notice, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------- regions of one model
_FREE_IDS: list[int] = []
_NEXT_ID = [0]


def _take_id() -> int:
    if _FREE_IDS:
        return _FREE_IDS.pop()
    _NEXT_ID[0] += 1
    return _NEXT_ID[0]


def _retire(ident: int, paused: set[str]) -> None:
    """A keeper was collected: its tags serve the next model (their pools' cached blocks are
    reused), unless memory under them is still released (then nothing may allocate there)."""
    if not paused:
        _FREE_IDS.append(ident)


class AddressKeeper:
    """The regions of one model (or one optimizer): tags ``graph_fsdp.<id>.<kind>``."""

    def __init__(self, backend: AddressBackend, device: torch.device) -> None:
        self.backend, self.device = backend, device
        self.id = _take_id()
        self.paused: set[str] = set()
        self.saved: dict[str, list] = {}
        """Per kind: what offload swapped to the host and onload swaps back (offload.py)."""
        self._released: dict[str, list[torch.Tensor]] = {}
        self._owned: set[int] = set()
        weakref.finalize(self, _retire, self.id, self.paused)

    def tag(self, kind: str) -> str:
        return f"graph_fsdp.{self.id}.{kind}"

    @contextmanager
    def region(self, kind: str) -> Iterator[None]:
        """Allocations inside (on this thread) live in ``kind``'s region; inside a capture
        they stay in the graph's pool."""
        if stream_capturing():
            yield
            return
        if kind in self.paused:
            raise RuntimeError(
                f"graph_fsdp: memory of the offloaded {kind} was requested (a step, capture or "
                f"gather of an offloaded model): call {ONLOAD_CALL[kind]} first"
            )
        with self.backend.region(self.tag(kind)):
            yield

    def region_of(self, kind: str) -> Callable[[], AbstractContextManager]:
        return lambda: self.region(kind)

    def empty(self, kind: str, shape, dtype: torch.dtype) -> torch.Tensor:
        with self.region(kind):
            out = torch.empty(shape, dtype=dtype, device=self.device)
        self._owned.add(out.untyped_storage().data_ptr())
        return out

    def adopt(self, kind: str, tensor: torch.Tensor) -> torch.Tensor:
        """A copy of ``tensor`` inside ``kind``'s region."""
        out = self.empty(kind, tensor.shape, tensor.dtype)
        out.copy_(tensor)
        return out

    def owns(self, tensor: torch.Tensor) -> bool:
        """``tensor``'s storage was made in one of these regions."""
        return tensor.untyped_storage().data_ptr() in self._owned

    def release(self, kind: str, tensors: list[torch.Tensor]) -> int:
        """Give ``kind``'s physical memory back to the driver; returns the bytes the driver
        got back (``cudaMemGetInfo``; 0 off CUDA). Queued work is finished first."""
        if kind in self.paused:
            raise RuntimeError(f"graph_fsdp: the {kind} region is already released")
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
            free = torch.cuda.mem_get_info(self.device)[0]
        self.backend.pause(self.tag(kind), tensors)
        self.paused.add(kind)
        self._released[kind] = tensors
        return torch.cuda.mem_get_info(self.device)[0] - free if cuda else 0

    def restore(self, kind: str) -> None:
        """Map ``kind``'s addresses again (contents undefined until the caller writes them)."""
        if kind not in self.paused:
            raise RuntimeError(f"graph_fsdp: the {kind} region is not released")
        self.backend.resume(self.tag(kind), self._released.pop(kind))
        self.paused.discard(kind)


# ---------------------------------------------------------------------- captures
def _keeper_of(states: list) -> AddressKeeper | None:
    root = states[0].root if states else None
    mode = getattr(root, "offload_mode", None)
    return mode.keeper if mode is not None else None


def static_memory(states: list) -> Callable[[], AbstractContextManager]:
    """Where a capture's static buffers outside its pool are made (the inputs copied in and
    the gradients written before every replay: dead between steps): for a model whose
    addresses are kept, the graphs region, released with the pools without a copy; else
    anywhere. Made anywhere, a few such tensors would keep whole cached segments of the
    caching allocator, and their bytes, on the device through an offload."""
    keeper = _keeper_of(states)
    return keeper.region_of("graphs") if keeper is not None else nullcontext


# [Note: growing capture segments] The caching allocator gives a graph's private pool a new
# segment whenever no free block of the pool fits a request (cudaMalloc of the request, or 20
# MiB for requests of 1-10 MiB). A step's allocation order leaves the pool fragmented: on the
# 16-layer GPT of the whole-step timing test (hidden 1024, 2 ranks) the full_iteration pool
# reserved 1628 MiB for at most 1019 MiB of live blocks - the backward's 24 MiB main gradients
# fit none of the holes the freed 2-8 MiB activations left in their 20 MiB segments, and took
# new segments. An eager step on the default stream settles into its cached blocks over many
# steps; a capture makes its pool once, from nothing. Expandable segments (one growing range
# of mapped pages per pool and stream, freed blocks merging with their neighbours) leave
# almost nothing unused, so a capture turns them on for itself and back off after, unless the
# process chose either way (PYTORCH_CUDA_ALLOC_CONF / PYTORCH_ALLOC_CONF name
# expandable_segments) or torch-memory-saver's preload hook is loaded (it does not support
# them); a model whose addresses are kept captures through that library and is left alone.
# Replays allocate nothing; only the pool's layout changes.


# [Note: expandable segments for the whole run] Growing only the capture's segments leaves
# the segments of the steps before it: the eager steps and the warmup cache their blocks in
# ordinary segments, whose holes stay reserved beside the graph's pool. With expandable
# segments for the whole process (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` before
# the first CUDA allocation) the packed 168M GPT at world size 1
# (bench/results/packed_bench_expandable_h200x2_2026-11-28_budget*.json) reserved at its peak
# 1.00x of the eager row with `full_iteration` at budget 8192 tokens (1.12x without), 1.01x at
# 2048 (1.06x), the one graph 1.03x and 1.11x (1.27x, 1.13x), whole-layer graphs 1.13x and
# 1.22x (1.31x, 1.23x), step times unchanged. But they cost host time where a step allocates
# and frees eagerly: on the 16-layer GPT at world size 1
# (bench/results/expandable_segments_ab_h200_2026-11-28_world1.json) graph_fsdp's eager step
# took 45.0 ms against 32.1 and whole-layer graphs 11.24 against 10.67 ms, while
# `full_iteration` took the same 10.06 ms and reserved 4.75 against 5.27 GiB. So they are a
# recommendation for `full_iteration` and one-graph runs (docs/cuda_graphs.md), not a default
# this library or its command line sets; torch-memory-saver (kept addresses) refuses them.


def _expandable_choice() -> bool:
    """Whether the process set expandable_segments itself (either way)."""
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + os.environ.get("PYTORCH_ALLOC_CONF", "")
    return "expandable_segments" in conf or "torch_memory_saver" in os.environ.get("LD_PRELOAD", "")


def _native_allocator() -> bool:
    """The caching allocator (not cudaMallocAsync); False for a build without CUDA."""
    try:
        return torch.cuda.get_allocator_backend() == "native"
    except (AttributeError, RuntimeError):
        return False


@contextmanager
def growing_segments() -> Iterator[None]:
    """Expandable segments for the allocations inside ([Note: growing capture segments]);
    nothing changes where the allocator cannot have them (its own segments are used)."""
    setter = getattr(torch.cuda.memory, "_set_allocator_settings", None)
    if (
        setter is None
        or _expandable_choice()
        or not torch.cuda.is_available()
        or not _native_allocator()
    ):
        yield
        return
    try:
        setter("expandable_segments:True")
    except RuntimeError:  # a torch build or platform without them
        yield
        return
    try:
        yield
    finally:
        setter("expandable_segments:False")


@contextmanager
def _growing_graph(graph, **kwargs) -> Iterator[None]:
    with growing_segments(), torch.cuda.graph(graph, **kwargs):
        yield


def capture_segments(states: list) -> AbstractContextManager:
    """Around a capture by another library (TransformerEngine's): growing segments for a model
    whose addresses are not kept ([Note: growing capture segments])."""
    return growing_segments() if _keeper_of(states) is None else nullcontext()


def graph_capture(
    states: list, *, keeper_pool: bool = True
) -> Callable[..., AbstractContextManager]:
    """``torch.cuda.graph`` with growing segments ([Note: growing capture segments]), or for a
    model whose addresses are kept the backend's capture, which puts the graph's pool into the
    model's graphs region (``keeper_pool=False``: plain ``torch.cuda.graph`` there): call it
    like ``torch.cuda.graph(graph, pool=..., stream=..., capture_error_mode=...)``."""
    keeper = _keeper_of(states)
    if keeper is None:
        return _growing_graph
    if not keeper.backend.releases_graph_pools or not keeper_pool:
        return torch.cuda.graph
    if "graphs" in keeper.paused:
        raise RuntimeError(
            "graph_fsdp: a CUDA graph capture of an offloaded model: call onload_params() first"
        )

    def capture(graph, **kwargs) -> AbstractContextManager:
        return keeper.backend.capture(graph, keeper.tag("graphs"), **kwargs)

    return capture
