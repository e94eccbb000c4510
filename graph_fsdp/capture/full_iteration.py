"""``full_iteration``: forward + backward of the whole model in one CUDA graph per microbatch.

FSDP's all-gathers, reduce-scatters, stream waits and buffer hand-offs are recorded *inside*
the graph, so a replayed step costs one graph launch instead of host work at every layer
boundary. The optimizer step stays eager (any torch optimizer works; it updates the main
weights in place, at the addresses the graph reads). Usage (train.py does this)::

    def step_fn(input_ids, labels, *, scale):  # forward + backward, returns the loss
        loss = model(input_ids=input_ids, labels=labels).loss * scale
        loss.backward()
        return loss.detach()

    graphs = FullIterationGraphs(model, warmup_steps=2)  # eager=True: same API, no graphs
    step = graphs.capture(step_fn)
    for _ in range(steps):
        graphs.before_step()
        for micro, (x, y) in enumerate(batches):
            model.set_requires_gradient_sync(micro == last)
            loss = step(x, y, scale=1 / len(batches))  # eager, capture or replay
        opt.step(); opt.zero_grad()

``step_fn(*tensors, **kwargs)`` runs forward *and* backward and returns a tensor or any
pytree of them (a dict, a HuggingFace output object); non-tensor leaves are returned as
they are. The tensor arguments are copied into the graph's static inputs at every replay;
non-tensor arguments are constants of the graph (a different value is an error, as is a
different shape, dtype or argument structure). The returned tensors are the caller's: clones
of the graph's static outputs (which the next replay overwrites) - one device copy per
output tensor per call, a few bytes for a loss. The older call
``graphs.forward_backward(micro, x, y, denom, clock)`` (``loss = model(x, y) / denom``) still
works; it is ``forward_backward(step_fn, x, y, denom=denom)`` with a built-in step function.

[Note: full-iteration capture] What makes the step capturable:
- static buffers: every FSDP buffer comes from a slot allocator (double buffer / trace
  pool), so the gathered weights and gradients live at fixed addresses; activations come
  from the graph's private pool;
- warmup on the capture stream: the last eager warmup step runs on the capture stream, so
  lazily created per-stream state (cuBLAS workspaces, NCCL's stream bookkeeping) exists
  before capture;
- no stale host state inside the graph: the root's ``capture.refreshing_weights()`` puts the
  main->compute weight copy in the graph (the optimizer updates main weights between replays), and slot events
  recorded outside the capture are dropped after a device synchronize (waiting on them
  inside the capture would be illegal); events recorded inside it are dropped after it,
  because the graph joins its side streams back into the capture stream before it ends;
- fresh autograd leaves (``renew_unsharded``) so no AccumulateGrad node from an eager step
  pulls the default stream into the capture;
- Python-side effects of the step are redone after every replay: the sharded ``.grad``
  views the optimizer reads (``zero_grad(set_to_none=True)`` removes them).
- the same attention as eager for HuggingFace models: transformers would build another mask
  because a capture is running ([Note: transformers masks under capture]).
Each microbatch position (the n-th call after ``before_step()``) has its own graph (the
no_sync accumulation and the final reduction differ), captured in order on first use and
sharing one memory pool. A capture that fails is re-raised as ``CaptureFailedError`` naming
the module that was running (diagnosis.py); ``verify=True`` checks the first replay of each
position against an eager run of the same step ([Note: verification], verify.py).

[Note: main gradients in the step's pool] An eager step makes the main gradients at its first
reduction, when the backward has freed some activations, and releases them at the next
forward ([Note: releasable main grads], param_group.py): the step's peak never holds both
all activations and all main gradients. The graph writes them at fixed addresses, so they
must be there at every replay and for the eager optimizer after it. Capturing with them made
beforehand added their bytes to the graph's peak: on the GPU tests' Megatron-Core MoE GPT
(11.0M parameters, 42.0 MiB of fp32 main gradients) the `full_iteration` row's own peak
allocated exceeded the eager row's by 42.6 MiB. So the first capture into a pool releases them (those no ``.grad`` holds,
not those kept in an offload region) and the capture re-makes them where the eager step
would, from the graph's pool, sharing its bytes with activations already freed; then they
are pinned. Nothing else allocates from the pool outside a capture into it, so those bytes
are theirs between replays. Pins are counted per holder (each runner pins a group once; an
offload region pins for good): when the runner drops its graphs, or is collected without
``close()``, it takes its pins back, and once no holder is left the next forward releases the
main gradients and the pool's bytes go back with the graphs. A second runner that captured
while the first held them writes the same bytes and holds its own pin on them. The pins are a
``MainGradPins`` (pools.py); the one-graph step holds its own the same way (whole_step.py
[Note: main gradients in the step graph's pool]).

[Note: eager steps on the capture stream] This runner runs the steps before its capture on
its capture stream, not only the warmup step. cuBLAS keeps a workspace per handle and stream
(32 MiB each under CUBLAS_WORKSPACE_CONFIG=:4096:8; the forward's thread and autograd's each
have a handle): eager steps on the caller's stream left a set there that stayed allocated,
unused, through the capture and every replay, beside the capture stream's set the graph uses.
Freeing them is not safe (pools.py [Note: capture memory]); not making them is. The blocks
those steps cache are the capture stream's as well, where the warmup step and the capture can
reuse them; before the first, what the model's build cached on the caller's stream goes back.
The caller's stream waits for each step (``on_side_stream``): the optimizer and the caller
read its results in order. ``eager=True`` runs on the caller's stream. Measured, each row
paying for its own workspaces: the pool test's small GPT reserved 148 MiB, was 214 (eager:
146; a window that left the eager run's garbage uncollected: 174 after, in the bench rows'
window); the 16-layer GPT of the whole-step timing test 3.252 GiB on 2 H200s, was 3.578 (eager:
2.93 - 2.98); the MoE benchmark's dropless GPT 0.93x its eager row's peak, was 1.17x.
The whole-step runner (whole_step.py) keeps its eager steps on the caller's stream: on the
capture stream its row reserved 3.539 GiB, against 3.293 on the caller's stream (with its
two sets of workspaces). What differs there is the optimizer inside those steps, whose state
the first of them would make among the capture stream's segments; not examined further.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from graph_fsdp.capture.diagnosis import (
    CAPTURE_ERROR_MODE,
    ModuleTracker,
    explain_capture_failure,
    new_cuda_graph,
    no_collection,
)
from graph_fsdp.capture.pools import (
    MainGradPins,
    pool_bytes,
    release_cached_blocks,
    release_for_capture,
)
from graph_fsdp.capture.scopes import GraphConfigError
from graph_fsdp.capture.step import (
    GraphedStep,
    HostClock,
    StepFn,
    check_capturable,
    check_verify_option,
    detached,
    eager_forward_backward,
    fn_name,
    record_verification,
    refusing_registered_all_to_all,
)
from graph_fsdp.capture.te_backend import attention_capture_guard
from graph_fsdp.capture.teardown import RunnerLifecycle, reset_graphs
from graph_fsdp.capture.torch_backend import CallSignature
from graph_fsdp.capture.transformers_masks import eager_mask_decisions
from graph_fsdp.capture.verify import (
    ChecksumRecorder,
    GradState,
    VerifyResult,
    verify_step,
)
from graph_fsdp.cuda_streams import nvtx_range, on_side_stream
from graph_fsdp.fsdp.address_keeping import graph_capture, static_memory
from graph_fsdp.fsdp.state import collect_states
from graph_fsdp.fsdp.tensor_parallel import data_address


def same_step_fn(a: StepFn, b: StepFn) -> bool:
    """The same function, or the same method of the same object (a bound method is a new
    object at every attribute access)."""
    if a is b:
        return True
    return getattr(a, "__func__", a) is getattr(b, "__func__", b) and getattr(
        a, "__self__", None
    ) is getattr(b, "__self__", None)


@dataclass
class StepPosition:
    """One microbatch position: the call it was first made with and its graph."""

    fn: StepFn
    signature: CallSignature
    sync: tuple[bool, ...]
    graph: torch.cuda.CUDAGraph | None = None
    static_inputs: list[torch.Tensor] = field(default_factory=list)
    static_flat: list = field(default_factory=list)
    out_spec: object = None


def check_step_call(
    pos: StepPosition, micro: int, fn: StepFn, args: tuple, kwargs: dict, sync: tuple
) -> None:
    """A later call at a position must be the call the position was recorded with."""
    where = f"step call {micro} of the training step (microbatch position {micro})"
    if not same_step_fn(pos.fn, fn):
        raise GraphConfigError(
            f"{where} was first made with step function {fn_name(pos.fn)}, now with "
            f"{fn_name(fn)}: create the step function once (step = graphs.capture(step_fn)) "
            "outside the training loop, or call drop() before switching"
        )
    if pos.sync != sync:
        raise GraphConfigError(
            f"{where} ran with gradient sync {_onoff(pos.sync)} when it was recorded, now "
            f"{_onoff(sync)}: each position has its own graph (no_sync accumulates, the last "
            "microbatch reduces), so keep the set_requires_gradient_sync pattern of a step fixed"
        )
    if pos.signature.tensors_of(args, kwargs) is None:  # the fast check; explain only here
        why = pos.signature.mismatch(args, kwargs) or "the call does not match its record"
        raise GraphConfigError(f"{where}: {why}")


def _onoff(sync: tuple) -> str:
    return "on" if all(sync) else "off" if not any(sync) else f"mixed {sync}"


class FullIterationGraphs(RunnerLifecycle):
    """Forward+backward of a ``fully_shard``-ed model, one CUDA graph per microbatch position.

    ``eager=True`` runs the same step logic without graphs (signature checks, positions,
    owned outputs; any device, e.g. CPU + gloo). ``verify`` (False | True | "raise") checks
    the first replay of each position against an eager run (verify.py); True records the
    result in ``verification`` and warns on a difference, "raise" raises.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        warmup_steps: int = 2,
        eager: bool = False,
        verify: bool | str = False,
    ) -> None:
        check_verify_option(verify)
        check_capturable(model, ["full_iteration"], warmup_steps, graphs=not eager)
        self.device = next(model.parameters()).device
        self.model, self.eager, self.verify = model, eager, verify
        self.states = collect_states(model)
        self.warmup_steps = warmup_steps
        self.stream = None if eager else torch.cuda.Stream(self.device)
        self.positions: dict[int, StepPosition] = {}
        self.verification: list[VerifyResult] = []
        self._recorder = ChecksumRecorder(model) if verify and not eager else None
        self._tracker = ModuleTracker.for_model(model)
        self.steps_seen = 0
        self.captured_generation: int | None = None
        self.captured_at_step: int | None = None
        self.captures = 0
        self.capture_seconds = 0.0
        self.replays = 0
        self._pool = None
        self._main_grad_pins = MainGradPins(self)
        """The groups whose main gradients this runner's graphs write (one pin each)."""
        self._phase = "eager"
        self._calls = 0
        self._clock: HostClock | None = None
        self._register_with_units()

    # ------------------------------------------------------------------ lifecycle
    @property
    def graphs(self) -> dict[int, torch.cuda.CUDAGraph]:
        return {m: p.graph for m, p in self.positions.items() if p.graph is not None}

    def capture(self, step_fn: StepFn) -> GraphedStep:
        """``step_fn`` as a replayable step: ``step(*tensors, **kwargs)``."""
        return GraphedStep(self, step_fn)

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
        self._calls = 0

    def drop(self) -> None:
        """Forget the graphs; the next graphed step captures again (the recorded calls stay)."""
        for pos in self.positions.values():
            pos.graph, pos.static_inputs, pos.static_flat = None, [], []
        self.captured_generation = None
        self._pool = None
        self._main_grad_pins.unpin()  # [Note: main gradients in the step's pool]

    @contextmanager
    def eagerly(self) -> Iterator[None]:
        """The caller runs the step function itself (not through :meth:`forward_backward`:
        no position is called) on its stream, with the main -> compute weight copy at every
        gather that the graphs hold (as a verification's eager run does): an overflowed
        step's repeat (parallel/dropless_ep.py [Note: dropless overflow reports])."""
        with self.states[0].root.capture.refreshing_weights():
            yield

    # ------------------------------------------------------------------ teardown
    def _free_graphs(self) -> None:
        """close(): reset every graph (NCCL lets go of the communicator), free the pool,
        leave every unit resharded and idle (see [Note: graphs and process-group teardown])."""
        reset_graphs(self.graphs.values())
        self.drop()
        self._phase = "eager"
        for state in self.states:
            if state.root is not None and state.training_state.value == "idle":
                state.reshard()

    def suspend(self) -> None:
        """Free the graphs and their pool now; the next step captures again (for offload:
        the buffers the graphs address are about to move)."""
        reset_graphs(self.graphs.values())
        self.drop()
        # Warm up again: released slots must be re-made by eager steps, not inside a capture.
        self.steps_seen = 0

    def graph_pool_bytes(self) -> dict[str, int]:
        """Bytes of the graphs' shared memory pool (pools.py); zeros when none is captured."""
        return pool_bytes([self._pool] if self._pool is not None else [])

    def report(self) -> dict:
        return {
            "impl": "eager" if self.eager else "torch",
            "scopes": ["full_iteration"],
            "scope_label": "full_iteration",
            "callables": [f"microbatch {i}" for i in sorted(self.graphs)],
            "captured_at_step": self.captured_at_step,
            "captures": self.captures,
            "capture_seconds": self.capture_seconds,
            "replays": self.replays,
            "eager_fallbacks": 0,
            "verification": [
                vars(r) | {"summary": r.describe(), "verified": r.verified}
                for r in self.verification
            ],
        }

    # ------------------------------------------------------------------ one step call
    def forward_backward(self, step_fn, *tensors, **kwargs):
        """Run ``step_fn(*tensors, **kwargs)`` (forward+backward) at the next microbatch
        position: eagerly, captured, or replayed. Returns its outputs, owned by the caller.

        The older ``forward_backward(micro, x, y, denom, clock=None)`` (an int first) runs
        ``loss = model(x, y) / denom; loss.backward()`` at position ``micro``.
        """
        if isinstance(step_fn, int) and not isinstance(step_fn, bool):
            return self._model_loss_call(step_fn, *tensors, **kwargs)
        micro = self._calls
        self._calls += 1
        return self._run(micro, step_fn, tensors, kwargs)

    def _model_loss_call(self, micro, x, y, denom, clock: HostClock | None = None):
        self._calls = micro + 1
        self._clock = clock
        try:
            return self._run(micro, self._model_loss, (x, y), {"denom": denom})
        finally:
            self._clock = None

    def _model_loss(self, x: torch.Tensor, y: torch.Tensor, *, denom: float) -> torch.Tensor:
        return eager_forward_backward(self.model, x, y, denom, self._clock)

    def _sync_state(self) -> tuple[bool, ...]:
        return tuple(s.requires_grad_sync for s in self.states)

    def _run(self, micro: int, fn: StepFn, args: tuple, kwargs: dict):
        self._check_open()
        if self.steps_seen == 0:
            raise GraphConfigError(
                "forward_backward before the first before_step(): call graphs.before_step() at "
                "the start of every training step (it counts the warmup steps and the "
                "microbatch positions)"
            )
        sync = self._sync_state()
        pos = self.positions.get(micro)
        if pos is None:
            what = f"full_iteration step call {micro}"
            pos = self.positions[micro] = StepPosition(
                fn, CallSignature(args, kwargs, what=what), sync
            )
        else:
            check_step_call(pos, micro, fn, args, kwargs, sync)
        if self.eager:
            return detached(fn(*args, **kwargs))
        if self._phase == "eager":  # [Note: eager steps on the capture stream]
            if self.steps_seen == 1 and micro == 0:
                release_cached_blocks()  # what the model's build cached on the caller's stream
            with on_side_stream(self.stream):
                return detached(fn(*args, **kwargs))
        if self._phase == "warmup":
            if micro == 0:
                release_for_capture(self._groups)  # pools.py [Note: capture memory]
            # The step before the capture also checks TE attention (te_backend.py [Note: TE
            # attention under capture]): refused here, it never reaches the capture.
            with on_side_stream(self.stream), attention_capture_guard("torch", self._tracker.names):
                return detached(fn(*args, **kwargs))
        if pos.graph is None:
            # The capture runs the step's Python (FSDP's flags) but none of its kernels:
            # verification starts from the state before it.
            before = GradState.save(self.states) if self.verify else None
            self._capture(micro, pos)
            if self.verify:
                # ... and ends in the Python state the capture left: replays run no Python.
                after = GradState.save(self.states, tensors=False)
                return self._verify(micro, pos, args, kwargs, before, after)
        return self._replay(micro, pos, args, kwargs)

    def _replay(self, micro: int, pos: StepPosition, args: tuple, kwargs: dict):
        tensors = pos.signature.tensors_of(args, kwargs)
        with nvtx_range(f"graph_fsdp/replay/full_iteration/{micro}"):
            for static, x in zip(pos.static_inputs, tensors):
                if data_address(static) != data_address(x):
                    static.copy_(x)
            pos.graph.replay()
            self.replays += 1
            self._after_replay()
        # The caller's copy: the next replay overwrites the static outputs.
        flat = [x.clone() if isinstance(x, torch.Tensor) else x for x in pos.static_flat]
        return tree_unflatten(flat, pos.out_spec)

    def _verify(
        self, micro: int, pos: StepPosition, args: tuple, kwargs: dict, before, after
    ) -> object:
        capture = self.states[0].root.capture

        def run_eager():
            # The graph refreshes the compute weights from the main weights (capture_context.py
            # [Note: capture context]); the capture marked them fresh without running: refresh
            # here as well. On the capture stream, like the warmup step: autograd nodes it
            # creates are bound to that stream, so the next position's capture is not pulled
            # off it.
            with capture.refreshing_weights(), on_side_stream(self.stream):
                return detached(pos.fn(*args, **kwargs))

        result, out = verify_step(
            what=f"full_iteration step call {micro}",
            states=self.states,
            recorder=self._recorder,
            run_eager=run_eager,
            run_graphed=lambda: self._replay(micro, pos, args, kwargs),
            graph_calls=lambda: (self.replays, 0),  # a position replays its graph or raises
            device=self.device,
            saved=before,
            after=after,
        )
        record_verification(self.verification, result, self.verify, self._tracker)
        return out

    def _capture(self, micro: int, pos: StepPosition) -> None:
        t0 = time.perf_counter()
        torch.cuda.synchronize()
        if not self.graphs:
            for group in self._groups:
                group.renew_unsharded()
            # Main gradients ([Note: main gradients in the step's pool]) and idle slots
            # ([Note: slots in a capture's pool]) first: pools.py [Note: capture memory].
            release_for_capture(self._groups, self._allocator)
            self._pool = torch.cuda.graph_pool_handle()
        self.states[0].root.capture.forget_events()
        sig = pos.signature
        with static_memory(self.states)():  # address_keeping.py
            pos.static_inputs = sig.static_copies()
        args, kwargs = sig.rebuild(pos.static_inputs)
        graph = new_cuda_graph()
        capture = self.states[0].root.capture
        try:
            # The slots come from the graph's pool: allocator.py [Note: slots in a capture's
            # pool].
            with (
                capture.refreshing_weights(),
                self._tracker.active(),
                refusing_registered_all_to_all(self._tracker, "a full_iteration graph"),
                self._checksums(),
                self._allocator.owning_capture(),
            ):
                # transformers' mask decisions as in eager: transformers_masks.py
                with (
                    nvtx_range(f"graph_fsdp/capture/full_iteration/{micro}"),
                    no_collection(),
                    eager_mask_decisions(self.model),
                ):
                    with graph_capture(self.states)(  # address_keeping.py
                        graph,
                        pool=self._pool,
                        stream=self.stream,
                        capture_error_mode=CAPTURE_ERROR_MODE,
                    ):
                        out = pos.fn(*args, **kwargs)
        except Exception as err:
            raise explain_capture_failure(
                err,
                self._tracker,
                what=f"full_iteration step call {micro} ({fn_name(pos.fn)})",
                layerwise=False,
            ) from err
        flat, pos.out_spec = tree_flatten(out)
        pos.static_flat = [x.detach() if isinstance(x, torch.Tensor) else x for x in flat]
        self.states[0].root.capture.forget_events()
        pos.graph = graph
        # The graph reduces into the main gradients: their address is fixed from now on, for
        # as long as the graphs live ([Note: main gradients in the step's pool]).
        self._main_grad_pins.pin(self._groups)
        sig.samples_to_host()
        self.captured_generation = self._allocator.generation
        if self.captured_at_step is None or micro == 0:
            self.captured_at_step = self.steps_seen - 1
        self.captures += micro == 0
        self.capture_seconds += time.perf_counter() - t0

    @contextmanager
    def _checksums(self):
        if self._recorder is None:
            yield
            return
        with self._recorder.recording("capturing"):
            yield

    def _after_replay(self) -> None:
        for state in self.states:
            if state.requires_grad_sync:
                for group in state.groups:
                    group.attach_sharded_grads()
