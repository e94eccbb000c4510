"""``full_iteration``: forward + backward of the whole model in one CUDA graph per microbatch.

FSDP's all-gathers, reduce-scatters, stream waits and buffer hand-offs are recorded *inside*
the graph, so a replayed step costs one graph launch instead of host work at every layer
boundary. The optimizer step stays eager (any torch optimizer works; it updates the main
weights in place, at the addresses the graph reads). Usage (train.py does this)::

    graphs = FullIterationGraphs(model, warmup_steps=2)
    for step in ...:
        graphs.before_step()
        for micro, (x, y) in enumerate(batches):
            model.set_requires_gradient_sync(micro == last)
            loss = graphs.forward_backward(micro, x, y, denom)  # eager, capture or replay
        opt.step(); opt.zero_grad()

[Note: full-iteration capture] What makes the step capturable:
- static buffers: every FSDP buffer comes from a slot allocator (double buffer / trace
  pool), so the gathered weights and gradients live at fixed addresses; activations come
  from the graph's private pool;
- warmup on the capture stream: the last eager warmup step runs on the capture stream, so
  lazily created per-stream state (cuBLAS workspaces, NCCL's stream bookkeeping) exists
  before capture;
- no stale host state inside the graph: ``force_refresh`` puts the main->compute weight copy
  in the graph (the optimizer updates main weights between replays), and slot events
  recorded outside the capture are dropped after a device synchronize (waiting on them
  inside the capture would be illegal); events recorded inside it are dropped after it,
  because the graph joins its side streams back into the capture stream before it ends;
- fresh autograd leaves (``renew_unsharded``) so no AccumulateGrad node from an eager step
  pulls the default stream into the capture;
- Python-side effects of the step are redone after every replay: the sharded ``.grad``
  views the optimizer reads (``zero_grad(set_to_none=True)`` removes them).
Each microbatch position has its own graph (the no_sync accumulation and the final
reduction differ), captured in order on first use and sharing one memory pool.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from graph_fsdp.buffers.allocator import SlotAllocator, nvtx_range
from graph_fsdp.capture.shutdown import RunnerLifecycle, reset_graphs


@dataclass
class HostClock:
    """Host seconds spent issuing the model's forward and backward calls (one step).

    Nothing in forward or backward waits for the GPU (no host syncs: required for capture),
    so this is the host cost of launching the work: eager kernels, graph replays and
    FSDP's hooks between them. A full_iteration replay has no separate forward/backward
    call and leaves both at zero (train.run's per-step host time covers it).
    """

    forward: float = 0.0
    backward: float = 0.0


def eager_forward_backward(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, denom: float, clock: HostClock | None = None
) -> torch.Tensor:
    """One microbatch: ``loss = model(x, y) / denom``, its backward; returns the loss."""
    t0 = time.perf_counter()
    loss = model(x, y) / denom
    t1 = time.perf_counter()
    loss.backward()
    if clock is not None:
        clock.forward += t1 - t0
        clock.backward += time.perf_counter() - t1
    return loss.detach()


class FullIterationGraphs(RunnerLifecycle):
    def __init__(self, model: nn.Module, *, warmup_steps: int = 2) -> None:
        from graph_fsdp.capture.runner import check_capturable  # noqa: PLC0415 (cycle)
        from graph_fsdp.fully_shard import collect_states  # noqa: PLC0415

        check_capturable(model, ["full_iteration"], warmup_steps)
        device = next(model.parameters()).device
        self.model = model
        self.states = collect_states(model)
        self.warmup_steps = warmup_steps
        self.stream = torch.cuda.Stream(device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        self.losses: dict[int, torch.Tensor] = {}
        self.denoms: dict[int, float] = {}
        self.steps_seen = 0
        self.captured_generation: int | None = None
        self.captured_at_step: int | None = None
        self.captures = 0
        self.capture_seconds = 0.0
        self.replays = 0
        self._pool = None
        self._phase = "eager"

    # ------------------------------------------------------------------ lifecycle
    @property
    def _allocator(self):
        root = self.states[0].root
        return root.allocator if root is not None else None

    def before_step(self) -> None:
        """Call at the start of every training step."""
        self._check_open()
        alloc = self._allocator
        if self.graphs and alloc is not None and alloc.generation != self.captured_generation:
            self.drop()  # release() moved the buffers the graphs address
        if self.graphs or self.steps_seen >= self.warmup_steps:
            self._phase = "graph"
        elif self.steps_seen == self.warmup_steps - 1:
            self._phase = "warmup"
        else:
            self._phase = "eager"
        self.steps_seen += 1

    def drop(self) -> None:
        self.graphs.clear()
        self.losses.clear()
        self.denoms.clear()
        self.captured_generation = None
        self._pool = None

    # ------------------------------------------------------------------ teardown
    def _free_graphs(self) -> None:
        """close(): reset every graph (NCCL lets go of the communicator), free the pool,
        leave every unit resharded and idle (see [Note: graphs and process-group teardown])."""
        reset_graphs(graph for graph, _, _ in self.graphs.values())
        self.drop()
        self._phase = "eager"
        for state in self.states:
            if state.root is not None and state.training_state.value == "idle":
                state.reshard()

    def suspend(self) -> None:
        """Free the graphs and their pool now; the next step captures again (for offload:
        the buffers the graphs address are about to move)."""
        reset_graphs(graph for graph, _, _ in self.graphs.values())
        self.drop()
        # Warm up again: released slots must be re-made by eager steps, not inside a capture.
        self.steps_seen = 0

    def report(self) -> dict:
        return {
            "impl": "torch",
            "scopes": ["full_iteration"],
            "scope_label": "full_iteration",
            "callables": [f"microbatch {i}" for i in sorted(self.graphs)],
            "captured_at_step": self.captured_at_step,
            "captures": self.captures,
            "capture_seconds": self.capture_seconds,
            "replays": self.replays,
            "eager_fallbacks": 0,
        }

    # ------------------------------------------------------------------ one microbatch
    def forward_backward(
        self,
        micro: int,
        x: torch.Tensor,
        y: torch.Tensor,
        denom: float,
        clock: HostClock | None = None,
    ) -> torch.Tensor:
        if self._phase == "eager":
            return eager_forward_backward(self.model, x, y, denom, clock)
        if self._phase == "warmup":
            with self._on_capture_stream():
                return eager_forward_backward(self.model, x, y, denom, clock)
        if micro not in self.graphs:
            self._capture(micro, x, y, denom)
        if self.denoms[micro] != denom:
            raise ValueError(
                f"full_iteration graph of microbatch {micro} was captured with loss scale "
                f"1/{self.denoms[micro]}, called with 1/{denom}; keep grad accumulation fixed"
            )
        graph, sx, sy = self.graphs[micro]
        if sx.shape != x.shape or sy.shape != y.shape:
            raise ValueError(
                f"full_iteration graph of microbatch {micro} was captured for inputs "
                f"{tuple(sx.shape)}/{tuple(sy.shape)}, called with {tuple(x.shape)}/"
                f"{tuple(y.shape)}; keep the micro-batch size and sequence length fixed"
            )
        with nvtx_range(f"graph_fsdp/replay/full_iteration/{micro}"):
            sx.copy_(x)
            sy.copy_(y)
            graph.replay()
            self.replays += 1
            self._after_replay()
        return self.losses[micro]

    @contextmanager
    def _on_capture_stream(self):
        main = torch.cuda.current_stream()
        self.stream.wait_stream(main)
        with torch.cuda.stream(self.stream):
            yield
        main.wait_stream(self.stream)

    def _drop_slot_events(self) -> None:
        alloc = self._allocator
        if isinstance(alloc, SlotAllocator):
            for slot in alloc.slots():
                slot.pending = []
        for state in self.states:
            for group in state.groups:
                group.ag_event = None

    def _capture(self, micro: int, x: torch.Tensor, y: torch.Tensor, denom: float) -> None:
        t0 = time.perf_counter()
        torch.cuda.synchronize()
        if not self.graphs:
            for state in self.states:
                for group in state.groups:
                    group.renew_unsharded()
            self._pool = torch.cuda.graph_pool_handle()
        self._drop_slot_events()
        sx, sy = x.clone(), y.clone()
        graph = torch.cuda.CUDAGraph()
        groups = [g for s in self.states for g in s.groups]
        for g in groups:
            g.force_refresh = True
        try:
            with nvtx_range(f"graph_fsdp/capture/full_iteration/{micro}"):
                with torch.cuda.graph(graph, pool=self._pool, stream=self.stream):
                    self.losses[micro] = eager_forward_backward(self.model, sx, sy, denom)
        finally:
            for g in groups:
                g.force_refresh = False
        self._drop_slot_events()
        self.graphs[micro] = (graph, sx, sy)
        self.denoms[micro] = denom
        self.captured_generation = self._allocator.generation
        if self.captured_at_step is None or micro == 0:
            self.captured_at_step = self.steps_seen - 1
        self.captures += micro == 0
        self.capture_seconds += time.perf_counter() - t0

    def _after_replay(self) -> None:
        for state in self.states:
            if state.requires_grad_sync:
                for group in state.groups:
                    group.attach_sharded_grads()
