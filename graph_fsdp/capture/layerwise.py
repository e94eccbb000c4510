"""Layerwise CUDA graphs over a ``fully_shard``-ed model: record, capture, replay, recapture.

Usage (train.py does this)::

    graphs = LayerwiseGraphs(model, impl="te", scopes=["attn"], warmup_steps=2)
    for step in ...:
        graphs.before_step()  # captures once the warmup steps ran; recaptures after release()
        loss = model(x, y); loss.backward(); opt.step(); opt.zero_grad()

Each target module's ``forward`` is replaced by a ``Dispatcher``. During the last warmup step
it records the call signature (shapes, dtypes, constants); after capture it replays the
graphs for calls that match it in training mode with grad enabled, and runs the original
forward for everything else (eval, ``torch.no_grad``, a changed shape) - FSDP's hooks fire
around either, since they live on ``__call__``. Capture (``_capture``):

1. put every unit's unsharded parameters in place (the graphs' parameter inputs);
2. extract the hooks of the targets and their FSDP units; build each callable's
   ``capture_time_hooks`` from them (hooks/module_hooks.py);
3. inside the root's ``capture.layerwise_capture()`` (reductions skipped, grad buffers freed:
   capture_context.py [Note: capture context]), warm up and capture with the chosen backend
   in a shared memory pool;
4. restore the hooks (``finally``), reshard, and restore the RNG state;
5. lend the root the runner's communication graphs (``comm_graphs``, on by default): each
   unit's gather and reduction kernels become one graph launch (comm_graphs.py [Note:
   communication graphs]); ``drop()`` takes them back.
"""

from __future__ import annotations

import time
import warnings
import weakref
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from graph_fsdp.capture.comm_graphs import CommGraphs
from graph_fsdp.capture.diagnosis import ModuleTracker, explain_capture_failure, no_collection
from graph_fsdp.capture.module_hooks import (
    capture_time_hooks,
    extract_module_hooks,
    restore_module_hooks,
)
from graph_fsdp.capture.pools import pool_bytes, release_cached_blocks, release_for_capture
from graph_fsdp.capture.scopes import (
    GRAPH_IMPLS,
    GraphConfigError,
    ScopeModules,
    scope_label,
    select_targets,
)
from graph_fsdp.capture.step import (
    GraphedStep,
    check_capturable,
    check_verify_option,
    detached,
    eager_forward_backward,
    fn_name,
    record_verification,
)
from graph_fsdp.capture.te_backend import attention_capture_guard, capture_te, require_te
from graph_fsdp.capture.teardown import RunnerLifecycle, find_graphs, reset_graphs
from graph_fsdp.capture.torch_backend import (
    CallSignature,
    CapturedCallable,
    capture_torch,
    describe_call,
)
from graph_fsdp.capture.verify import (
    ChecksumRecorder,
    VerifyResult,
    rng_state,
    set_rng_state,
    verify_step,
)
from graph_fsdp.cuda_streams import nvtx_range
from graph_fsdp.fsdp.address_keeping import capture_segments, graph_capture, static_memory
from graph_fsdp.fsdp.state import FSDPState, collect_states, in_backward
from graph_fsdp.fsdp.tensor_parallel import data_address


class LayerwiseGraphs(RunnerLifecycle):
    """Captures the modules ``scopes`` name after ``warmup_steps`` eager steps."""

    def __init__(
        self,
        model: nn.Module,
        *,
        impl: str,
        scopes: list[str] | tuple[str, ...] = (),
        warmup_steps: int = 2,
        warmup_iters: int = 3,
        scope_modules: ScopeModules | None = None,
        verify: bool | str = False,
        comm_graphs: bool = True,
    ) -> None:
        if impl not in GRAPH_IMPLS or impl == "none":
            raise GraphConfigError(
                f"cuda_graph_impl={impl!r}: layerwise graphs need 'te' or 'torch' "
                f"(--cuda-graph-impl te|torch); accepted values are {', '.join(GRAPH_IMPLS)}"
            )
        check_verify_option(verify)
        check_capturable(model, scopes, warmup_steps, scope_modules=scope_modules)
        if impl == "te":
            require_te()
        self.model, self.impl, self.scopes = model, impl, list(scopes)
        self.scope_modules = dict(scope_modules or {})
        self.verify = verify
        self.verification: list[VerifyResult] = []
        self._verify_pending = False
        self.force_eager = False
        """True while a verification runs the step eagerly (the dispatchers call through)."""
        self._recorder = ChecksumRecorder(model) if verify else None
        self._tracker = ModuleTracker.for_model(model)
        self.warmup_steps, self.warmup_iters = warmup_steps, warmup_iters
        names = {id(m): n for n, m in model.named_modules()}
        self.states = collect_states(model)
        units = [(names[id(s.module)], s.module) for s in self.states if s.module is not model]
        self.caps: list[CapturedCallable] = []
        for target in select_targets(units, scopes, scope_modules=scope_modules):
            cap = CapturedCallable(target, target.module.forward)
            target.module.forward = Dispatcher(self, cap)
            self.caps.append(cap)
        self.steps_seen = 0
        self.captured_generation: int | None = None
        self.captured_at_step: int | None = None
        self.capture_seconds = 0.0
        self.captures = 0
        self.recording = False
        self._pool = None
        self.comm_graphs = comm_graphs
        self._comm: CommGraphs | None = None
        self._register_with_units()

    # ------------------------------------------------------------------ lifecycle
    @property
    def captured(self) -> bool:
        return self.captured_generation is not None

    def before_step(self) -> None:
        """Call at the start of every training step (before its first forward)."""
        self._check_open()
        allocator = self.states[0].root.allocator if self.states[0].root else None
        if self.captured and allocator is not None:
            if allocator.generation != self.captured_generation:
                # release() freed the buffers the graphs read and write: drop, then recapture.
                self.drop()
                self._capture()
        elif self.steps_seen == self.warmup_steps:
            self._capture()
        self.recording = not self.captured and self.steps_seen == self.warmup_steps - 1
        self.steps_seen += 1

    def capture(self, step_fn) -> GraphedStep:
        """``step_fn`` (forward+backward, returns the loss) as a step: ``step(*tensors, **kw)``."""
        return GraphedStep(self, step_fn)

    def forward_backward(self, step_fn, *tensors, **kwargs):
        """Run ``step_fn(*tensors, **kwargs)`` (forward+backward); the graphs replay inside the
        model's forward and backward. Returns its outputs, detached. With ``verify`` the first
        call after a capture is checked against an eager run (verify.py).

        The older ``forward_backward(micro, x, y, denom, clock=None)`` (an int first, the same
        call as FullIterationGraphs') runs ``loss = model(x, y) / denom; loss.backward()``.
        """
        if isinstance(step_fn, int) and not isinstance(step_fn, bool):
            micro, (x, y, denom, *rest) = step_fn, tensors
            clock = rest[0] if rest else kwargs.get("clock")

            def run():
                return eager_forward_backward(self.model, x, y, denom, clock)

            what = f"layerwise step (microbatch {micro})"
        else:

            def run():
                return detached(step_fn(*tensors, **kwargs))

            what = f"layerwise step ({fn_name(step_fn)})"
        if not (self._verify_pending and self.captured):
            return run()
        self._verify_pending = False
        return self._verify(what, run)

    @contextmanager
    def eagerly(self) -> Iterator[None]:
        """The dispatchers call the original forwards while inside (a verification's eager
        run, an overflowed step's repeat): no replay, no fallback counted."""
        self.force_eager = True
        try:
            yield
        finally:
            self.force_eager = False

    def _verify(self, what: str, run):
        def run_eager():
            with self.eagerly():
                return run()

        def graph_calls() -> tuple[int, int]:
            return sum(c.replays for c in self.caps), sum(c.fallbacks for c in self.caps)

        result, out = verify_step(
            what=f"{what}, scopes [{scope_label(self.scopes)}]",
            states=self.states,
            recorder=self._recorder,
            run_eager=run_eager,
            run_graphed=run,
            graph_calls=graph_calls,
            device=next(self.model.parameters()).device,
        )
        record_verification(self.verification, result, self.verify, self._tracker)
        return out

    def drop(self) -> None:
        """Forget the graphs (the modules run eagerly until the next capture)."""
        self._take_comm_graphs_back()
        for cap in self.caps:
            cap.drop()
        self.captured_generation = None
        self._pool = None

    def remove(self) -> None:
        """Drop the graphs and give every target its original forward back."""
        self.drop()
        for cap in self.caps:
            if "forward" in cap.module.__dict__:
                del cap.module.forward

    # ------------------------------------------------------------------ teardown
    def _free_graphs(self) -> None:
        """close(): reset every graph (torch backend: each callable's two; TE: those its
        callables hold), free the pool, give the targets their original forwards back."""
        self._reset_graphs()
        self.remove()
        for state in self.states:
            if state.root is not None and state.training_state.value == "idle":
                state.reshard()

    def _reset_graphs(self) -> None:
        self._take_comm_graphs_back()
        for cap in self.caps:
            reset_graphs((cap.fwd_graph, cap.bwd_graph))
            if cap.te_callable is not None:
                reset_graphs(find_graphs(cap.te_callable))

    def suspend(self) -> None:
        """Free the graphs and their pool now and recapture at the next ``before_step`` (for
        offload: the buffers the graphs address are about to move)."""
        if self.captured:
            self._reset_graphs()
            self.drop()
            self.captured_generation = -1  # never an allocator generation: recapture

    def graph_pool_bytes(self) -> dict[str, int]:
        """Bytes of the layer graphs' pool and the communication graphs' (pools.py)."""
        comm = self._comm.pool if self._comm is not None else None
        return pool_bytes([self._pool, comm])

    def report(self) -> dict:
        return {
            "impl": self.impl,
            "scopes": self.scopes,
            "scope_label": scope_label(self.scopes),
            "callables": [c.name for c in self.caps],
            "captured_at_step": self.captured_at_step,
            "captures": self.captures,
            "capture_seconds": self.capture_seconds,
            "replays": sum(c.replays for c in self.caps),
            "eager_fallbacks": sum(c.fallbacks for c in self.caps),
            "comm_graphs": self._comm.report() if self._comm is not None else self._comm_report,
            "verification": [
                vars(r) | {"summary": r.describe(), "verified": r.verified}
                for r in self.verification
            ],
        }

    # ------------------------------------------------------------------ capture
    @staticmethod
    def _renew_params(units: dict[int, FSDPState]) -> None:
        """Fresh unsharded parameter leaves on every captured unit (``renew_unsharded``):
        each unit is gathered, renewed and resharded in turn, then the new unsharded
        parameter objects are put on the modules (capture and ``cap.params`` read them)."""
        for state in units.values():
            state.unshard()
            for group in state.groups:
                group.renew_unsharded()
            state.wait_for_unshard()
            state.reshard()
        for state in units.values():
            for group in state.groups:
                group.use_unsharded()

    def _capture(self) -> None:
        missing = [c.name for c in self.caps if c.signature is None]
        if missing:
            raise RuntimeError(
                f"no training-mode call of {missing[:3]} was recorded in the warmup step before "
                "capture: graphed modules must run in every training step with grad enabled"
            )
        root = self.states[0].root
        t0 = time.perf_counter()
        # The eager steps' cached blocks (and the main gradients the next forward releases)
        # go back before the pool is made (pools.py [Note: capture memory]).
        release_for_capture(self._groups)
        device = next(self.model.parameters()).device
        rng = rng_state(device)  # warmups draw too: put every generator back after them
        unit_states = {id(s.module): s for s in self.states}
        units = {id(c.target.unit): unit_states[id(c.target.unit)] for c in self.caps}
        # The graphs read the unsharded weights and write the unsharded gradients at fixed
        # addresses: keep those slots from now on ([Note: backward slots between steps],
        # [Note: weight slots during backward]).
        root.allocator.pin_roles(("param", "grad"))
        # The graphs' parameter inputs are the unsharded params over the units' current
        # buffers (new ones after a release()), as fresh autograd leaves (renew_unsharded).
        self._renew_params(units)
        for cap in self.caps:
            cap.static_memory = static_memory(self.states)  # address_keeping.py
            cap.prepare()
            # A torch-backend capture of a whole unit zeroes its gradients in the backward
            # graph (torch_backend.py [Note: gradients of graphed modules]).
            whole_unit = self.impl == "torch" and cap.module is cap.target.unit
            cap.zeroes_grads_of = units[id(cap.module)] if whole_unit else None
        extracted = {}
        try:
            for module in {id(m): m for c in self.caps for m in (c.module, c.target.unit)}.values():
                extracted[id(module)] = extract_module_hooks(module)
            hooks = [
                capture_time_hooks(
                    *{id(m): extracted[id(m)] for m in (c.target.unit, c.module)}.values()
                )
                for c in self.caps
            ]
            with root.capture.layerwise_capture():
                self._pool = torch.cuda.graph_pool_handle()
                self._run_backend(hooks)
                # The warmup calls ran on the backend's side stream: what they cached there
                # is of no use to the main stream's eager work.
                release_cached_blocks()
            for cap in self.caps:
                cap.signature.samples_to_host()
        finally:
            for saved in extracted.values():
                restore_module_hooks(saved)
            for state in self.states:
                state.reshard()
                for group in state.groups:
                    root.allocator.free(group.grad_key)
                state.reset_backward_guards()
            set_rng_state(rng, device)
        # The graphs keep their capture's autograd graph, and with it AccumulateGrad nodes
        # bound to the capture stream: eager calls of the modules (fallbacks) get fresh
        # leaves, whose nodes are made on the main stream. The graphs read the same storage.
        self._renew_params(units)
        for cap in self.caps:
            cap.params = tuple(cap.module.parameters())
            if cap.fwd_graph is not None:
                cap.set_replay_anchor()
                if cap.module is cap.target.unit:  # [Note: backward handlers in the replay]
                    cap.unit_state = unit_states[id(cap.module)]
                    cap.unit_state.hand_handlers_to_replay()
        for state in units.values():
            state.reshard()
        self._lend_comm_graphs(root)
        self.captured_generation = root.allocator.generation
        self._verify_pending = bool(self.verify)
        self.captured_at_step = self.steps_seen
        self.captures += 1
        self.capture_seconds += time.perf_counter() - t0

    def _lend_comm_graphs(self, root) -> None:
        """Every unit gathers and reduces through one ``CommGraphs`` (comm_graphs.py [Note:
        communication graphs]): with NCCL over more than one rank, and buffers the graphs'
        pinned roles keep in place."""
        if not self.comm_graphs or not root.comm.cuda or root.comm.world_size < 2:
            return
        self._comm = CommGraphs(torch.cuda.graph_pool_handle())
        root.capture.lend_comm_graphs(self._comm)

    _comm_report: dict | None = None
    """The last communication graphs' counters (kept after they are taken back)."""

    def _take_comm_graphs_back(self) -> None:
        comm, self._comm = self._comm, None
        if comm is None:
            return
        self.states[0].root.capture.take_comm_graphs_back()
        self._comm_report = comm.report()
        comm.reset()

    def _run_backend(self, hooks) -> None:
        """Warm up and capture every callable; a failure names the module that was running."""
        label = scope_label(self.scopes)
        checksums = self._recorder.recording("capturing") if self._recorder else nullcontext()
        for cap in self.caps:
            cap.tracker = self._tracker
        try:
            with (
                self._tracker.active(),
                checksums,
                attention_capture_guard(self.impl, self._tracker.names),
                nvtx_range(f"graph_fsdp/capture/{self.impl}/{label}"),
                no_collection(),
            ):
                if self.impl == "te":
                    with capture_segments(self.states):  # address_keeping.py
                        capture_te(
                            self.caps, hooks, warmup_iters=self.warmup_iters, pool=self._pool
                        )
                else:
                    capture_torch(
                        self.caps,
                        hooks,
                        warmup_iters=self.warmup_iters,
                        pool=self._pool,
                        tracker=self._tracker,
                        cuda_graph=graph_capture(self.states),
                    )
        except GraphConfigError:
            raise  # a refusal before anything was captured says what to change itself
        except Exception as err:
            raise explain_capture_failure(
                err, self._tracker, what=f"layerwise graphs [{label}] ({self.impl})", layerwise=True
            ) from err
        finally:
            for cap in self.caps:
                cap.tracker = None


def under_activation_checkpoint() -> bool:
    """A forward inside ``torch.utils.checkpoint`` (non-reentrant, the default of torch and
    HuggingFace): its saved-tensor hooks are the innermost ones."""
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    return hooks is not None and "_checkpoint_hook" in getattr(hooks[0], "__qualname__", "")


class Dispatcher:
    """A target's ``forward`` while a runner holds it: replay when the call matches the
    capture, else the original forward (``del module.forward`` gives that back).

    A call is one of: a replay (captured, a training call whose tensors match the capture);
    an eager call (eval, ``torch.no_grad``, a verification's eager run, a call that does not
    match - counted and warned about once); the recording step's call, whose signature and
    outputs are kept for the capture. While the unit's handlers belong to the replay
    (state.py [Note: forward handlers in the dispatcher]), the dispatcher runs the unit's
    ``pre_forward``/``post_forward`` around either.
    """

    def __init__(self, graphs: LayerwiseGraphs, cap: CapturedCallable) -> None:
        self.graphs = graphs
        self.cap = cap

    def __call__(self, *args, **kwargs):
        tensors = self._replayable(args, kwargs)
        state = self.cap.unit_state
        if state is None or not state.forward_by_dispatcher:
            out = self._run(tensors, args, kwargs)
            if self.graphs.recording:
                self._record_outputs(out)
            return out
        # The unit's forward handlers: a replay leaves the sharded parameters on the module.
        state.pre_forward(params_on_modules=tensors is None)
        out = self._run(tensors, args, kwargs)
        state.post_forward()
        return out

    def _replayable(self, args: tuple, kwargs: dict) -> list[torch.Tensor] | None:
        """The call's tensors when it replays, else None (the recording step records the
        signature)."""
        cap, graphs = self.cap, self.graphs
        training_call = cap.module.training and torch.is_grad_enabled() and not in_backward()
        if training_call and under_activation_checkpoint():
            raise GraphConfigError(
                f"{cap.name} runs under activation checkpointing (torch.utils.checkpoint, e.g. "
                "HuggingFace gradient_checkpointing_enable()): a layerwise graph keeps its "
                "activations in static buffers, so recomputing it saves no memory, and the "
                "recomputation in backward would run it eagerly where the forward replayed. "
                "Turn checkpointing off for the layers with captured modules "
                "(model.gradient_checkpointing_disable()), or capture the whole step "
                "(full_iteration), whose graph records the recomputation too"
            )
        if cap.captured and training_call and not graphs.force_eager:
            return self._matching_tensors(args, kwargs)
        if graphs.recording and training_call and cap.signature is None:
            cap.signature = CallSignature(args, kwargs, what=cap.name)
            cap.signature.keep_sources(
                {
                    data_address(t)
                    for c in graphs.caps
                    for ref in c.recorded_outputs
                    if (t := ref()) is not None
                }
            )
        return None

    def _matching_tensors(self, args: tuple, kwargs: dict) -> list[torch.Tensor] | None:
        """The tensors of a training call after capture, or None (counted, warned about
        once) when they do not match the capture."""
        cap = self.cap
        tensors = cap.signature.tensors_of(args, kwargs)
        unchained = None
        if tensors is not None:  # torch_backend.py [Note: chained static buffers]
            static = cap.static_inputs
            for j, _ in cap.chained:
                if data_address(tensors[j]) != data_address(static[j]):
                    tensors, unchained = None, j
                    break
        if tensors is None:
            cap.fallbacks += 1
            if cap.fallbacks == 1:
                why = (
                    f"call ({describe_call(args, kwargs)}) does not match the captured "
                    f"signature ({cap.signature.describe()})"
                    if unchained is None
                    else f"tensor input {unchained} is not the previous graphed module's "
                    "output, as it was at capture (the graph reads that output in place)"
                )
                # Past this method, _replayable, __call__ and torch's two module-call frames.
                warnings.warn(f"{cap.name}: {why}; running it eagerly", stacklevel=5)
        return tensors

    def _run(self, tensors, args: tuple, kwargs: dict):
        cap = self.cap
        if tensors is not None:
            return cap.replay(tensors)
        if cap.unit_state is not None:  # the replay owns the unit's backward handlers
            return cap.unit_state.forward_with_backward_handlers(cap.orig_forward, args, kwargs)
        return cap.orig_forward(*args, **kwargs)

    def _record_outputs(self, out) -> None:
        cap = self.cap
        if not cap.recorded_output_ptrs and cap.signature is not None:
            flat = tree_flatten(out)[0]
            outputs = [t for t in flat if isinstance(t, torch.Tensor)]
            cap.recorded_output_ptrs = [data_address(t) for t in outputs]
            cap.recorded_outputs = [weakref.ref(t) for t in outputs]
