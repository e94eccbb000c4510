"""The whole training step as one CUDA graph: every microbatch's forward+backward, FSDP's
reductions, the global gradient norm and clipping, the optimizer step with an Inf/NaN skip
decided on the device, and the gradients dropped for the next step - one replay per step::

    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_then_decay)
    runner = WholeStepGraph(model, opt, policy=StepPolicy(clip_grad=1.0))  # eager=True: CPU

    def step_fn(input_ids, labels, *, scale):  # one microbatch: forward AND backward
        loss = model(input_ids, labels) * scale
        loss.backward()
        return loss.detach()

    step = runner.capture(step_fn)
    for batch in data:
        out = step([(x0, y0), (x1, y1)], scale=0.5)  # the microbatches, in order
        sched.step()                                # the lr tensor, updated in place
        losses.append(out.loss)                     # tensors the caller owns: no sync here

``step(microbatches, **kwargs)`` calls ``step_fn(*microbatch, **kwargs)`` for each
microbatch (a tuple: positional arguments; a dict: keyword arguments; anything else: one
argument), gradient sync off for all but the last (no_sync accumulation), then reduces, takes
the global norm (grad_norm.py [Note: global gradient norm]), clips when the policy says so,
steps the optimizer (skipped on the device when the norm is not finite: step_optimizer.py
[Note: the update skipped on the device]) and drops the gradients (``zero_grad(set_to_none=
True)``: the next step's reduction overwrites the main gradients). It returns a
:class:`StepResult`: each microbatch's outputs, their summed loss, the norm before clipping
and whether the update was skipped - clones of the graph's outputs, one small copy each.

The first ``warmup_steps - 1`` steps run eagerly, the next one eagerly on the capture stream,
the one after is captured and replayed; every later step replays. ``eager=True`` runs the
same step without graphs on any device: the graphed step equals it bit for bit. Tensor
arguments are copied into the graph's static inputs; non-tensor arguments, the number of
microbatches, their shapes and dtypes, the step function and the optimizer's settings other
than the learning rate are fixed at capture (a change is a ``GraphConfigError`` naming it).
Supported optimizers and the learning rate on the device: step_optimizer.py.

[Note: weight refresh in the step graph] The optimizer updates the main weights inside the
graph, so the graph must also contain the next step's main->compute copy: the capture starts
with every group marked stale (``dirty``, as an optimizer step marks it eagerly), so the
first gather of each group casts inside the graph and clears the mark, and later gathers of
the same step (other microbatches; the backward of ZeRO-1/2, whose weights stay gathered)
copy nothing, as in the eager step. (``FullIterationGraphs`` forces the copy at every gather,
``refreshing_weights`` of capture_context.py: its optimizer runs between replays, outside its
graphs.) A ZeRO-3 gather always casts its shard ([Note: copy-in all-gather]). With
``StepPolicy(overlap_next_gather=True)`` the units the previous step gathered are fresh and
left unmarked: the graph's own tail refreshes them after their update, for the next replay
(next_gather.py [Note: the next step's gathers in the step graph]).

[Note: main gradients in the step graph's pool] Their whole life - made at the step's first
reduction, read by the norm and the optimizer, dropped - is inside the one graph. The capture
starts with them released (pools.py ``release_for_capture``; param_group.py [Note: releasable
main grads]) and re-makes them from the graph's pool after the backward began, where the
eager step makes them too, so they share the pool's bytes with the activations freed by then
- as ``FullIterationGraphs`` does (full_iteration.py [Note: main gradients in the step's
pool]), and like it the runner then pins them while its graph lives (``MainGradPins``).
Nothing reads them between replays (the next reduction overwrites them), but eager steps
write them. Unpinned (as they first were), an eager forward (an eval, an overflowed step's
repeat) released them into the graph's pool, whose bytes stay reserved while it lives, and
the repeat's backward made a second set from the default pool, kept until the next eager
forward; and a capture that could not release them (another runner's pin, a ``.grad`` still
attached) left the graph writing bytes it did not own, which a later forward released for
anyone to reuse.
Pinned, eager steps between replays use the graph's bytes; ``drop()`` (and ``close()``,
``suspend()``) takes the pin back. The step's own peak is the same either way.

[Note: the build's cached blocks] Blocks the model's build freed (initial weights cast or
copied, temporaries) stay cached on the caller's stream, and the eager steps before the
capture could not use all of them: on the packed 168M GPT (budget 2048, one H200) the one
graph's peak held 0.41 GiB unused in the default pool against `full_iteration`'s 0.04, which
gives them back before its first eager step (full_iteration.py [Note: eager steps on the
capture stream]); this runner now does too: its peak reserved went from 4.07 to 3.99 GiB,
1.11x -> 1.09x the eager row's, expandable segments on both times
(bench/results/packed_bench_build_blocks_released_h200_2026-11-28_budget2048.md).

[Note: main gradients before the warmup step] The warmup step on the capture stream starts
from an emptied cache (pools.py [Note: capture memory]). Its forward's activations took 20
MiB segments and its backward's main gradients (66 MiB each on the 16-layer GPT of the
whole-step timing test) then found none large enough: 0.3 GiB more reserved than needed.
Made on the capture stream just before that step, the main gradients reserve their segments
first; the forward releases them ([Note: releasable main grads]), its activations are carved
from those segments, and the backward's main gradients fit there again as the activations
go (the capture releases them once more and makes them in its pool: [Note: main gradients in
the step graph's pool]). Measured on 2 H200s: peak reserved 3.293 GiB, was 3.578 (each row
paying for its cuBLAS workspaces). This runner's eager steps stay on the caller's stream
(full_iteration.py [Note: eager steps on the capture stream] says why).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field

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
from graph_fsdp.capture.full_iteration import same_step_fn
from graph_fsdp.capture.next_gather import NextGather
from graph_fsdp.capture.pools import (
    MainGradPins,
    pool_bytes,
    release_cached_blocks,
    release_for_capture,
)
from graph_fsdp.capture.scopes import GraphConfigError
from graph_fsdp.capture.step import (
    StepFn,
    check_capturable,
    detached,
    fn_name,
    refusing_registered_all_to_all,
)
from graph_fsdp.capture.step_optimizer import (
    DeviceLearningRates,
    capturable_for_capture,
    changed_hyperparameter,
    check_optimizer,
    hyperparameters,
    step_optimizer,
)
from graph_fsdp.capture.te_backend import attention_capture_guard
from graph_fsdp.capture.teardown import RunnerLifecycle, reset_graphs
from graph_fsdp.capture.torch_backend import CallSignature
from graph_fsdp.cuda_streams import nvtx_range, on_side_stream
from graph_fsdp.fsdp.address_keeping import graph_capture
from graph_fsdp.fsdp.grad_norm import EarlyReductions, clip_grads_, global_grad_norm
from graph_fsdp.fsdp.state import collect_states
from graph_fsdp.fsdp.tensor_parallel import data_address
from graph_fsdp.parallel.dropless_ep import bounded_buffers, overflow_in_step


@dataclass(frozen=True, kw_only=True)
class StepPolicy:
    """What the step does between the backward and the next forward."""

    clip_grad: float | None = None
    """Clip the gradients to this global norm (torch's coefficient, ``min(1, clip / (norm +
    1e-6))``); None: no clipping (the norm is still computed and returned)."""
    norm_type: float = 2.0
    """Order of the gradient norm (``inf`` for the max norm)."""
    skip_nonfinite: bool = True
    """Skip the optimizer update of a step whose global gradient norm is Inf or NaN, decided
    on the device (needs a fused optimizer: step_optimizer.py)."""
    overlap_next_gather: bool = False
    """Update the next forward's first units first and queue their next-step all-gathers
    (ZeRO-3) or weight refreshes (ZeRO-1/2) on the all-gather stream right after, under the
    rest of the optimizer step: the next step starts with them gathered (next_gather.py
    [Note: the next step's gathers in the step graph]). The same bits either way."""
    next_gather_units: int = 2
    """How many units of the forward order ``overlap_next_gather`` gathers for the next step:
    2 = the root and the unit its pre-forward prefetches (what the forward holds before its
    first computation). More need as many weight slots (``BufferPolicy.num_slots``)."""
    norm_beside_last_reduction: bool = False
    """The global norm's pass over the gradients reduced before the step's last reduction
    runs beside it, on a side stream (grad_norm.py [Note: the norm beside the last
    reduction]); CUDA only. The same bits either way."""

    def __post_init__(self) -> None:
        if self.clip_grad is not None and not self.clip_grad > 0:
            raise ValueError(
                f"StepPolicy.clip_grad={self.clip_grad!r}: a positive max norm, or None for no "
                "clipping"
            )
        if not float(self.norm_type) > 0:
            raise ValueError(f"StepPolicy.norm_type={self.norm_type!r} must be positive (or inf)")
        if self.next_gather_units < 1:
            raise ValueError(
                f"StepPolicy.next_gather_units={self.next_gather_units!r}: at least 1 (the "
                "root's unit); 2 gathers the root and the unit its pre-forward prefetches"
            )


@dataclass
class StepResult:
    """One training step's results; every tensor belongs to the caller (reading one waits
    for the step, nothing else does)."""

    outputs: list
    """``step_fn``'s return value per microbatch (tensors detached)."""
    loss: torch.Tensor | None
    """Sum of the microbatches' outputs in float32 when each is a one-element tensor (the
    scaled losses), else None."""
    grad_norm: torch.Tensor
    """The global gradient norm before clipping (float32, 0-d)."""
    skipped: torch.Tensor
    """1.0 when the update was skipped for a non-finite norm, else 0.0 (float32, 0-d)."""
    overflowed: torch.Tensor
    """1.0 when a dropless exchange with a receive-buffer factor overflowed on some rank: the
    update was skipped and the step must be repeated (``WholeStep.eagerly``), else 0.0
    (float32, 0-d; parallel/dropless_ep.py [Note: dropless overflow reports])."""


@dataclass
class _Recorded:
    """The step as first called, and its graph once captured."""

    fn: StepFn
    signatures: list[CallSignature]
    graph: torch.cuda.CUDAGraph | None = None
    static_inputs: list[list[torch.Tensor]] = field(default_factory=list)
    static_outputs: list[tuple[list, object]] = field(default_factory=list)
    static_summary: torch.Tensor | None = None
    has_loss: bool = False
    hyperparameters: list[dict] | None = None
    optimizer_state: tuple | None = None
    """``(optimizer.state, [(per-param state dict, key, tensor)])`` the graph addresses."""
    next_addresses: list[int] | None = None
    """Where the graph's forward reads the units the previous replay gathered (next_gather.py),
    None without ``overlap_next_gather``."""


class WholeStep:
    """``runner.capture(step_fn)``: ``step(microbatches, **kwargs)`` runs one training step."""

    def __init__(self, runner: WholeStepGraph, fn: StepFn) -> None:
        if not callable(fn):
            raise TypeError(f"capture(step_fn): {fn!r} is not callable")
        self.runner, self.fn = runner, fn

    def __call__(self, microbatches: Sequence, **kwargs) -> StepResult:
        return self.runner.step(self.fn, microbatches, **kwargs)

    def eagerly(self, microbatches: Sequence, **kwargs) -> StepResult:
        """The same step run eagerly, outside the graph (``WholeStepGraph.run_eagerly``)."""
        return self.runner.run_eagerly(self.fn, microbatches, **kwargs)


class WholeStepGraph(RunnerLifecycle):
    """One CUDA graph per training step of a ``fully_shard``-ed model and its optimizer
    (module docstring). ``eager=True``: the same step without graphs (any device)."""

    owns_optimizer_step = True

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        policy: StepPolicy | None = None,
        warmup_steps: int = 2,
        eager: bool = False,
    ) -> None:
        self.policy = policy if policy is not None else StepPolicy()
        check_capturable(model, ["full_iteration"], warmup_steps, graphs=not eager)
        check_optimizer(optimizer, skip_nonfinite=self.policy.skip_nonfinite, graphs=not eager)
        self._bounded = bounded_buffers(model)
        if self._bounded and not all(g.get("fused") for g in optimizer.param_groups):
            raise GraphConfigError(
                f"{type(optimizer).__name__} is not fused=True, but the dropless exchanges of "
                f"{self._bounded[0][0]} have a receive-buffer factor: the one-graph step skips "
                "an overflowed step's update on the device through found_inf, which only fused "
                "optimizers take. Create it with fused=True, or leave the factor unset"
            )
        self.model, self.optimizer, self.eager = model, optimizer, eager
        self.device = next(model.parameters()).device
        self.states = collect_states(model)
        self.warmup_steps = warmup_steps
        self.next_gather = (
            NextGather(self.states[0], self.policy.next_gather_units)
            if self.policy.overlap_next_gather and self.states
            else None
        )
        self.learning_rates = DeviceLearningRates(optimizer)
        self.stream = None if eager else torch.cuda.Stream(self.device)
        self._norm_stream = (
            torch.cuda.Stream(self.device)
            if self.policy.norm_beside_last_reduction and self.device.type == "cuda"
            else None
        )
        self._tracker = ModuleTracker.for_model(model)
        self._recorded: _Recorded | None = None
        self._pool = self._mem_pool = None
        self._main_grad_pins = MainGradPins(self)
        """The groups whose main gradients the graph writes ([Note: main gradients in the step
        graph's pool])."""
        self.captured_generation: int | None = None
        self.steps_seen = 0
        self.captured_at_step: int | None = None
        self.captures = 0
        self.capture_seconds = 0.0
        self.replays = 0
        self._register_with_units()

    # ------------------------------------------------------------------ public
    def capture(self, step_fn: StepFn) -> WholeStep:
        """``step_fn`` (one microbatch's forward+backward) as a whole training step."""
        return WholeStep(self, step_fn)

    @property
    def graph(self) -> torch.cuda.CUDAGraph | None:
        return self._recorded.graph if self._recorded is not None else None

    def step(self, step_fn: StepFn, microbatches: Sequence, **kwargs) -> StepResult:
        """One training step over ``microbatches``: eagerly, captured or replayed."""
        self._check_open()
        calls = _calls(microbatches, kwargs)
        rec, tensors = self._check_call(step_fn, calls)
        alloc = self._allocator
        if self.graph is not None and alloc.generation != self.captured_generation:
            self.drop()  # release() moved the buffers the graph addresses
        if self.graph is not None and not _same_state(self.optimizer, rec.optimizer_state):
            self.drop()  # [Note: optimizer state the graph addresses]
        if self.next_gather is not None:
            self.next_gather.forget_stale()  # changed outside the step: gathered again
        self.learning_rates.sync()
        phase = self._phase()
        self.steps_seen += 1
        # Eager steps on the caller's stream (full_iteration.py [Note: eager steps on the
        # capture stream] says why not on the capture stream here); before the first, what
        # the model's build cached goes back, as there ([Note: the build's cached blocks]).
        if self.eager or phase == "eager":
            if not self.eager and self.steps_seen == 1:
                release_cached_blocks()
            return self._result(*self._body(rec.fn, calls), owned=True)
        if phase == "warmup":
            # What the capture will need exists before it, made on its stream (per-stream
            # workspaces, NCCL's stream state); the cached blocks of earlier steps go back
            # first: this stream cannot reuse another stream's (pools.py [Note: capture memory]).
            release_for_capture(self._groups)
            with on_side_stream(self.stream), attention_capture_guard("torch", self._tracker.names):
                for group in self._groups:  # [Note: main gradients before the warmup step]
                    group.ensure_main_grad()
                return self._result(*self._body(rec.fn, calls), owned=True)
        if self.next_gather is not None:
            addresses = self.next_gather.gather_now()
            if rec.graph is not None and addresses != rec.next_addresses:
                self.drop()  # the slots moved: the forward reads them elsewhere now
                addresses = self.next_gather.gather_now()
            rec.next_addresses = addresses
        if rec.graph is None:
            self._capture(rec)
        else:
            why = changed_hyperparameter(self.optimizer, rec.hyperparameters)
            if why is not None:
                raise GraphConfigError(
                    f"the optimizer changed after the whole-step capture: {why}. The graph "
                    "baked it in; only the learning rate may change between steps (an "
                    "LR scheduler, or group['lr'] = value). Call drop() to capture again "
                    "(a momentum-cycling scheduler needs cycle_momentum=False)"
                )
        return self._replay(rec, tensors)

    def run_eagerly(self, step_fn: StepFn, microbatches: Sequence, **kwargs) -> StepResult:
        """The step over ``microbatches`` eagerly on the caller's stream, outside the graph,
        which replays again at the next :meth:`step` (no recapture; not a step of the warmup
        count): the repeat of a step whose dropless exchange overflowed, with every copy's
        buffer (parallel/dropless_ep.py [Note: dropless overflow reports])."""
        self._check_open()
        rec, _ = self._check_call(step_fn, _calls(microbatches, kwargs))
        self.learning_rates.sync()
        out = self._result(*self._body(rec.fn, _calls(microbatches, kwargs)), owned=True)
        for g in self._groups:
            g.dirty = True  # as after a replay: the main weights stepped
        return out

    def drop(self) -> None:
        """Forget the graph; the next graphed step captures again (the call stays recorded)."""
        rec = self._recorded
        if rec is not None and rec.graph is not None:
            torch.cuda.synchronize()  # no replay still runs when the graph is freed
        if rec is not None:
            rec.graph, rec.static_inputs, rec.static_outputs = None, [], []
            rec.static_summary = rec.next_addresses = None
        if self.next_gather is not None:
            self.next_gather.forget()
        self.captured_generation = None
        self._pool = self._mem_pool = None
        self._main_grad_pins.unpin()  # [Note: main gradients in the step graph's pool]

    def suspend(self) -> None:
        """Free the graph and its pool now; warm up and capture again (offload)."""
        reset_graphs([self.graph])
        self.drop()
        self.steps_seen = 0

    def _free_graphs(self) -> None:
        reset_graphs([self.graph])
        self.drop()
        for state in self.states:
            if state.root is not None and state.training_state.value == "idle":
                state.reshard()

    def graph_pool_bytes(self) -> dict[str, int]:
        """Bytes of the graph's private memory pool: ``reserved`` (its segments) and
        ``allocated`` (blocks live now); zeros when nothing is captured."""
        return pool_bytes([self._pool] if self._pool is not None else [])

    def report(self) -> dict:
        rec = self._recorded
        return {
            "impl": "eager" if self.eager else "torch",
            "scopes": ["full_iteration"],
            "scope_label": "full_iteration + optimizer (whole step)",
            "whole_step": True,
            "policy": asdict(self.policy),
            "microbatches": len(rec.signatures) if rec is not None else None,
            "callables": ["whole step"] if self.graph is not None else [],
            "captured_at_step": self.captured_at_step,
            "captures": self.captures,
            "capture_seconds": self.capture_seconds,
            "replays": self.replays,
            "eager_fallbacks": 0,
            "verification": [],
        }

    # ------------------------------------------------------------------ the step
    def _phase(self) -> str:
        if self.graph is not None or self.steps_seen >= self.warmup_steps:
            return "graph"
        return "warmup" if self.steps_seen == self.warmup_steps - 1 else "eager"

    def _check_call(self, fn: StepFn, calls: list[tuple[tuple, dict]]):
        """The recorded step (recorded now if first) and the call's tensors per microbatch."""
        rec = self._recorded
        if rec is None:
            sigs = [
                CallSignature(a, k, what=f"whole-step microbatch {m}")
                for m, (a, k) in enumerate(calls)
            ]
            rec = self._recorded = _Recorded(fn, sigs)
            return rec, [s.tensors_of(a, k) for s, (a, k) in zip(sigs, calls)]
        if not same_step_fn(rec.fn, fn):
            raise GraphConfigError(
                f"the whole step was first run with step function {fn_name(rec.fn)}, now "
                f"with {fn_name(fn)}: create the step once (step = runner.capture(step_fn)) "
                "outside the training loop"
            )
        if len(calls) != len(rec.signatures):
            raise GraphConfigError(
                f"the whole step was first run with {len(rec.signatures)} microbatches, now "
                f"with {len(calls)}: the graph holds a fixed number (keep gradient "
                "accumulation fixed, or create another runner)"
            )
        tensors = []
        for m, (sig, (a, k)) in enumerate(zip(rec.signatures, calls)):
            found = sig.tensors_of(a, k)
            if found is None:
                why = sig.mismatch(a, k) or "the call does not match its record"
                raise GraphConfigError(f"whole-step microbatch {m}: {why}")
            tensors.append(found)
        return rec, tensors

    def _body(self, fn: StepFn, calls: list[tuple[tuple, dict]]):
        """The step itself, the same code eagerly and under capture: ``(outputs, summary)``
        where summary is ``[loss, grad norm, skipped]`` (float32)."""
        outputs = []
        last = len(calls) - 1
        root = self.states[0].root if self._norm_stream is not None else None
        # grad_norm.py [Note: the norm beside the last reduction] (the root exists from the
        # first forward on: the first step records nothing and norms as before, same bits)
        recording = root.capture.recording_reductions() if root is not None else nullcontext()
        try:
            with recording as reductions:
                for m, (args, kwargs) in enumerate(calls):
                    self.model.set_requires_gradient_sync(m == last)
                    outputs.append(detached(fn(*args, **kwargs)))
        finally:
            self.model.set_requires_gradient_sync(True)
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        early = EarlyReductions.of(reductions or (), self._norm_stream)
        with nvtx_range("graph_fsdp/whole_step/grad_norm"):
            norm, grads = global_grad_norm(params, self.policy.norm_type, early=early)
            if self.policy.clip_grad is not None:
                clip_grads_(grads, self.policy.clip_grad, norm)
            skipped = torch.isfinite(norm).logical_not().to(torch.float32)
            if not self.policy.skip_nonfinite:
                skipped = torch.zeros_like(norm)  # applied whatever the norm
            # A dropless exchange that overflowed: the update is skipped as for Inf/NaN, and
            # reported apart (dropless_ep.py [Note: dropless overflow reports]).
            overflowed = overflow_in_step(self._bounded)
            if overflowed is None:
                overflowed = torch.zeros_like(norm)
            found_inf = torch.maximum(skipped, overflowed)
        with nvtx_range("graph_fsdp/whole_step/optimizer"):
            skips = self.policy.skip_nonfinite or bool(self._bounded)
            found_inf = found_inf if skips else None
            if self.next_gather is not None:
                self.next_gather.step_and_gather(self.optimizer, found_inf)
            else:
                step_optimizer(self.optimizer, found_inf)
            self.optimizer.zero_grad(set_to_none=True)
        loss = _loss_sum(outputs)
        has_loss = loss is not None
        summary = torch.stack(
            [loss if has_loss else torch.zeros_like(norm), norm, skipped, overflowed]
        )
        return outputs, summary, has_loss

    def _result(self, outputs: list, summary: torch.Tensor, has_loss: bool, *, owned: bool):
        if not owned:  # the graph's static outputs: the next replay overwrites them
            outputs = [_cloned(out) for out in outputs]
            summary = summary.clone()
        return StepResult(
            outputs=outputs,
            loss=summary[0] if has_loss else None,
            grad_norm=summary[1],
            skipped=summary[2],
            overflowed=summary[3],
        )

    # ------------------------------------------------------------------ capture / replay
    def _capture(self, rec: _Recorded) -> None:
        t0 = time.perf_counter()
        torch.cuda.synchronize()
        groups = self._groups
        for g in groups:
            g.renew_unsharded()  # fresh autograd leaves (full_iteration.py [Note: ...])
        self.states[0].root.capture.forget_events()
        # The held units' slots too (next_gather.py [Note: the held slots in the graph's
        # pool]), then main gradients ([Note: main gradients in the step graph's pool]) and
        # idle slots first: pools.py [Note: capture memory].
        regather = self.next_gather is not None and bool(self.next_gather.held)
        if regather:
            self.next_gather.let_go()
        release_for_capture(groups, self._allocator)
        # A pool object of its own (held while the graph lives), so that the held units'
        # slots can be made in it before the capture.
        self._mem_pool = torch.cuda.MemPool()
        self._pool = self._mem_pool.id
        if regather:
            rec.next_addresses = self.next_gather.gather_into(self._mem_pool)
        rec.static_inputs = [sig.static_copies() for sig in rec.signatures]
        calls = [sig.rebuild(inputs) for sig, inputs in zip(rec.signatures, rec.static_inputs)]
        graph = new_cuda_graph()
        held = self._held_groups()
        for g in groups:
            if id(g) not in held:  # held ones the previous step gathered (next_gather.py)
                g.dirty = True  # [Note: weight refresh in the step graph]
        try:
            with (
                self._tracker.active(),
                refusing_registered_all_to_all(self._tracker, "the whole-step graph"),
                self._allocator.owning_capture(),
            ):
                with nvtx_range("graph_fsdp/capture/whole_step"), no_collection():
                    with (
                        capturable_for_capture(self.optimizer),
                        graph_capture(self.states, keeper_pool=False)(
                            graph,
                            pool=self._pool,
                            stream=self.stream,
                            capture_error_mode=CAPTURE_ERROR_MODE,
                        ),
                    ):
                        outputs, summary, has_loss = self._body(rec.fn, calls)
        except Exception as err:
            raise explain_capture_failure(
                err, self._tracker, what=f"the whole step ({fn_name(rec.fn)})", layerwise=False
            ) from err
        rec.static_outputs = [tree_flatten(out) for out in outputs]
        rec.static_summary, rec.has_loss = summary, has_loss
        rec.hyperparameters = hyperparameters(self.optimizer)
        rec.optimizer_state = _state_tensors(self.optimizer)
        rec.graph = graph
        # The graph writes the main gradients where its capture made them: pinned there while
        # it lives ([Note: main gradients in the step graph's pool]).
        self._main_grad_pins.pin(groups)
        self.states[0].root.capture.forget_events()
        self.captured_generation = self._allocator.generation
        self.captured_at_step = self.steps_seen - 1
        self.captures += 1
        self.capture_seconds += time.perf_counter() - t0

    def _held_groups(self) -> set[int]:
        """ids of the groups the last step left gathered for the next (next_gather.py)."""
        if self.next_gather is None:
            return set()
        return {id(g) for s in self.next_gather.held for g in s.groups}

    def _replay(self, rec: _Recorded, tensors: list[list[torch.Tensor]]) -> StepResult:
        with nvtx_range("graph_fsdp/replay/whole_step"):
            for statics, given in zip(rec.static_inputs, tensors):
                for static, x in zip(statics, given):
                    if data_address(static) != data_address(x):
                        static.copy_(x)
            rec.graph.replay()
        self.replays += 1
        held = self._held_groups()
        for g in self._groups:
            if id(g) not in held:  # held ones the graph gathered again after their update
                g.dirty = True  # the graph stepped the main weights: eager gathers must refresh
        self.optimizer._opt_called = True  # LR schedulers check that the optimizer stepped
        outputs = [tree_unflatten(flat, spec) for flat, spec in rec.static_outputs]
        return self._result(outputs, rec.static_summary, rec.has_loss, owned=False)


# [Note: optimizer state the graph addresses] The captured optimizer step reads and writes
# the state tensors (moments, step counts, momentum buffers) that existed at capture. Loading
# a checkpoint into the optimizer (``load_state_dict`` makes new tensors) or moving its state
# (``offload_optimizer``) replaces them: the old ones are freed, and a replay would write
# memory that now belongs to something else. Before every replay the state is compared by
# identity (a few microseconds for hundreds of tensors); if anything was replaced, the graph
# is dropped and the step captures again - around the new tensors, or, for an offloaded
# state, into the refusal of the optimizer's step.
def _state_tensors(optimizer: torch.optim.Optimizer) -> tuple:
    entries = [
        (st, key, value)
        for st in optimizer.state.values()
        for key, value in st.items()
        if isinstance(value, torch.Tensor)
    ]
    return optimizer.state, entries


def _same_state(optimizer: torch.optim.Optimizer, recorded: tuple | None) -> bool:
    if recorded is None or optimizer.state is not recorded[0]:
        return False
    now = [v for st in optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    return len(now) == len(recorded[1]) and all(
        st.get(key) is value for st, key, value in recorded[1]
    )


def _calls(microbatches: Sequence, kwargs: dict) -> list[tuple[tuple, dict]]:
    if isinstance(microbatches, torch.Tensor | dict) or not isinstance(microbatches, Sequence):
        raise TypeError(
            "step(microbatches, **kwargs): microbatches must be a list of the microbatches' "
            f"arguments (e.g. [(x0, y0), (x1, y1)]), got {type(microbatches).__name__}"
        )
    if not microbatches:
        raise ValueError("step(microbatches): at least one microbatch is needed")
    calls = []
    for m, mb in enumerate(microbatches):
        if isinstance(mb, tuple):
            calls.append((mb, kwargs))
        elif isinstance(mb, dict):
            both = sorted(set(mb) & set(kwargs))
            if both:
                raise ValueError(
                    f"microbatch {m} passes {both} that step(...) also passes as shared keyword "
                    "arguments: give each argument once"
                )
            calls.append(((), {**kwargs, **mb}))
        else:
            calls.append(((mb,), kwargs))
    return calls


def _loss_sum(outputs: list) -> torch.Tensor | None:
    """The float32 sum of the outputs when each is a one-element tensor, in microbatch order."""
    if not all(isinstance(o, torch.Tensor) and o.numel() == 1 for o in outputs):
        return None
    total = outputs[0].detach().float().reshape(())
    for o in outputs[1:]:
        total = total + o.detach().float().reshape(())
    return total


def _cloned(out):
    flat, spec = tree_flatten(out)
    return tree_unflatten([x.clone() if isinstance(x, torch.Tensor) else x for x in flat], spec)
