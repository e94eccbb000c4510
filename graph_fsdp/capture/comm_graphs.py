"""Communication graphs: a unit's gather and reduction kernels replayed as one CUDA graph each.

[Note: communication graphs] Layerwise graphs keep FSDP's collectives out of the layers'
graphs (DESIGN.md, "Hooks and capture"): each unit's all-gather and reduce-scatter run
between the replays, issued from Python. On a host-bound step (small layers, many of them)
that issue cost is the step: a gather is a cast kernel plus an NCCL call (~23 us of host
time on an H200 host), a reduction a cast, an NCCL call and a scaling kernel (~30 us), all
on the side streams. Once a layerwise runner has captured, the buffers those kernels touch
sit at fixed addresses (the weight and gradient slots are pinned, the main weights never
move), so the runner lends its units a ``CommGraphs``: the first gather (reduction) of a
group with a given set of addresses is captured - on a private capture stream, kernels
recorded, none run - then replayed on the stream the eager kernels would have run on, and
every later one with the same addresses is one graph launch. The graph holds the same
kernels with the same arguments as the eager path (``fn`` is that path), so the bits are
the same; everything else - slot hand-offs, stream waits, events, which unit runs when -
stays in Python around the replay, exactly as before.

The key of a graph is every address and flag its kernels depend on: a buffer that moved
(the main gradients get new storage each step unless pinned; the comm buffer comes back
after each step) is a new key, captured once more. A group whose addresses keep changing
stops being captured after ``MAX_CAPTURES`` (its calls run eagerly). Nothing is captured or
replayed while another stream captures (a full-iteration capture records the eager path).
The runner resets the graphs when it drops its own (recapture, offload, close): the graphs
hold NCCL communicator references (teardown.py [Note: graphs and process-group teardown]).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Hashable

import torch

from graph_fsdp.capture.diagnosis import CAPTURE_ERROR_MODE, no_collection
from graph_fsdp.cuda_streams import stream_capturing

MAX_CAPTURES = 4
"""Captures per (group, kind) before a group's calls stay eager."""


class CommGraphs:
    """The communication graphs of one layerwise runner's units."""

    def __init__(self, pool) -> None:
        self.pool = pool
        self.stream: torch.cuda.Stream | None = None
        """The capture stream (created at the first capture, on the current device)."""
        self.graphs: dict[Hashable, torch.cuda.CUDAGraph] = {}
        self.captures: dict[Hashable, int] = {}
        self.replays = 0
        self.eager_calls = 0
        self.failed: str | None = None
        """Why capturing stopped (a capture raised): every later call runs eagerly."""

    def run(self, key: Hashable, owner: Hashable, fn: Callable[[], None]) -> None:
        """Run ``fn`` (kernels only, on the current stream) as the graph of ``key``:
        replayed if captured, captured then replayed if new, eagerly otherwise."""
        graph = None if stream_capturing() else self.graphs.get(key) or self._new(key, owner, fn)
        if graph is None:
            self.eager_calls += 1
            fn()
            return
        graph.replay()
        self.replays += 1

    def _new(self, key: Hashable, owner: Hashable, fn: Callable[[], None]):
        """The graph of ``fn`` for ``key``, or None: capturing failed before, ``owner``
        used up its captures, or this capture failed."""
        count = self.captures.get(owner, 0)
        if self.failed is not None or count >= MAX_CAPTURES:
            return None
        self.captures[owner] = count + 1
        graph = self._capture(fn)
        if graph is not None:
            self.graphs[key] = graph
        return graph

    def _capture(self, fn: Callable[[], None]) -> torch.cuda.CUDAGraph | None:
        graph = torch.cuda.CUDAGraph()
        if self.stream is None:
            self.stream = torch.cuda.Stream()
        try:
            with torch.cuda.stream(self.stream), no_collection():
                graph.capture_begin(pool=self.pool, capture_error_mode=CAPTURE_ERROR_MODE)
                try:
                    fn()
                finally:
                    graph.capture_end()
        except Exception as err:  # noqa: BLE001 - any failure: the eager path still works
            self.failed = f"{type(err).__name__}: {err}"
            warnings.warn(
                f"graph_fsdp: capturing a unit's communication kernels failed ({self.failed}); "
                "gathers and reductions run eagerly from now on (comm_graphs.py "
                "[Note: communication graphs])",
                stacklevel=3,
            )
            return None
        return graph

    def report(self) -> dict:
        return {
            "graphs": len(self.graphs),
            "replays": self.replays,
            "eager_calls": self.eager_calls,
            "failed": self.failed,
        }

    def reset(self) -> None:
        """Free every graph now (and the communicator references they hold)."""
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.captures.clear()
