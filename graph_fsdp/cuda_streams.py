"""Host-cheap CUDA helpers every layer uses: NVTX ranges, the current stream, capture state.

``nvtx_range(name)`` emits a range only while a profiler listens (or ``GRAPH_FSDP_NVTX=1``);
``current_stream(device)`` reuses the stream handle while the stream is unchanged;
``stream_capturing()`` says whether a CUDA graph is being recorded; ``on_side_stream(stream)``
runs a block on another stream, ordered after and before the current one's work. They sit on
the ground floor so that buffers/, the core and capture/ share them without importing each
other.
"""

from __future__ import annotations

import os
from contextlib import contextmanager, nullcontext

import torch


class _NvtxRange:
    """``torch.cuda.nvtx.range(name)`` without a generator per use: stateless, reentrant."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __enter__(self) -> None:
        torch.cuda.nvtx.range_push(self.name)

    def __exit__(self, *exc) -> None:
        torch.cuda.nvtx.range_pop()


_NULL_RANGE = nullcontext()
_NVTX_ON: bool | None = None
_RANGES: dict[str, _NvtxRange] = {}
_MAX_CACHED_RANGES = 65536

NVTX_ENV = "GRAPH_FSDP_NVTX"
"""``1``: always emit graph_fsdp's NVTX ranges (on CUDA); ``0``: never; unset: only while a
profiler listens (see :func:`nvtx_enabled`)."""
_LISTENER_ENV = ("NSYS_PROFILING_SESSION_ID", "NVTX_INJECTION64_PATH")
"""Set in a process that Nsight Systems (or another NVTX tool) profiles."""


def nvtx_enabled() -> bool:
    """Whether :func:`nvtx_range` emits ranges (decided once per process).

    Each layer opens ~17 ranges per step; with no tool attached every push and pop is host
    time for nothing (layerwise host cost), so by default ranges are emitted only
    under Nsight Systems (it sets ``NSYS_PROFILING_SESSION_ID``) or another NVTX tool (an
    ``NVTX_INJECTION64_PATH`` library). ``GRAPH_FSDP_NVTX=1``/``0`` forces them on/off;
    ``graph-fsdp profile`` sets 1 for the nsys run it starts.
    """
    global _NVTX_ON
    if _NVTX_ON is None:
        forced = os.environ.get(NVTX_ENV, "").strip()
        if forced not in ("", "0", "1"):
            raise ValueError(f"{NVTX_ENV}={forced!r}: use 1 (ranges on), 0 (off) or unset (auto)")
        listening = any(os.environ.get(v) for v in _LISTENER_ENV)
        wanted = forced == "1" or (forced == "" and listening)
        _NVTX_ON = wanted and torch.cuda.is_available()
    return _NVTX_ON


def set_nvtx_ranges(enabled: bool | None) -> None:
    """Turn graph_fsdp's NVTX ranges on or off for this process (None: decide again from the
    environment, as :func:`nvtx_enabled` does)."""
    global _NVTX_ON
    _NVTX_ON = None if enabled is None else bool(enabled) and torch.cuda.is_available()


def nvtx_range(name: str):
    """NVTX range when :func:`nvtx_enabled`; a no-op context otherwise.

    Host time matters here (several ranges per layer and direction around graph replays):
    whether ranges are on is decided once, and each name's range object is built once.
    """
    on = _NVTX_ON
    if on is None:
        on = nvtx_enabled()
    if not on:
        return _NULL_RANGE
    rng = _RANGES.get(name)
    if rng is None:
        rng = _NvtxRange(name)
        if len(_RANGES) < _MAX_CACHED_RANGES:
            _RANGES[name] = rng
    return rng


STEP_RANGE_PREFIX = "graph_fsdp/step/"
"""A training step's range: ``graph_fsdp/step/<i>`` (bench/trace.py delimits a profiled step by
it)."""


def step_range(step: int):
    """``graph_fsdp/step/<step>`` around one training step: a torch-profiler range while the
    profiler records (so a graphed step, whose optimizer runs inside a replay or outside any
    Python range, still has a window), an NVTX range when :func:`nvtx_enabled`, else nothing."""
    name = f"{STEP_RANGE_PREFIX}{step}"
    if torch.autograd.profiler._is_profiler_enabled:
        return torch.profiler.record_function(name)
    return nvtx_range(name)


_CURRENT: dict[int, tuple[tuple, torch.cuda.Stream]] = {}
CUDA_GET_CURRENT_STREAM = getattr(torch._C, "_cuda_getCurrentStream", None)
"""What ``torch.cuda.current_stream`` reads (absent from CPU-only builds)."""


def current_stream(device: torch.device) -> torch.cuda.Stream:
    """``torch.cuda.current_stream(device)``, reusing the handle while the stream is the same.

    The handle is rebuilt whenever the current stream (per thread, as CUDA's) differs from
    the cached one, so callers always get the stream that is current now.
    """
    index = device.index
    if CUDA_GET_CURRENT_STREAM is None or index is None:
        return torch.cuda.current_stream(device)
    data = CUDA_GET_CURRENT_STREAM(index)
    cached = _CURRENT.get(index)
    if cached is None or cached[0] != data:
        stream = torch.cuda.Stream(stream_id=data[0], device_index=data[1], device_type=data[2])
        _CURRENT[index] = cached = (data, stream)
    return cached[1]


def stream_capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


@contextmanager
def on_side_stream(stream: torch.cuda.Stream):
    """Run the block on ``stream``: it starts after the work queued on the current stream and
    the current stream's later work waits for it. Tensors the block makes are ``stream``'s in
    the caching allocator; the next block on ``stream`` waits for the current stream again,
    so their bytes are not reused while the current stream may still read them."""
    main = torch.cuda.current_stream()
    stream.wait_stream(main)
    with torch.cuda.stream(stream):
        yield
    main.wait_stream(stream)
