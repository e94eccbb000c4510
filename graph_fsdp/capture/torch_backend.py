"""One captured callable: its call signature, its graphs, and how it replays.

[Note: gradients of graphed modules] The pure-PyTorch backend captures the backward with
``torch.autograd.grad(outputs, static_inputs + params)`` and adds the parameter gradients
*inside the graph* into the parameters' preset ``.grad`` - FSDP's zeroed ``grad_full`` views
at static addresses (param_group.py) - as autograd's AccumulateGrad adds into a preset
``.grad`` (``grad += g``, i.e. ``0 + g``; eager steps keep autograd's ``g`` and copy it: the
same bits, param_group.py [Note: gradients autograd creates]), so eager and graphed
gradients are bit-identical and no per-parameter host work is left for replay. (No AccumulateGrad node runs during capture: one created on
the default stream in an eager step would pull that stream into the capture.) The parameters
are therefore no inputs of the replay Function: when no recorded input requires grad but a
parameter does, one anchor leaf (never read, given ``None``) makes the outputs require grad,
as TE's anchor does. Which parameters get gradients is fixed at capture (the graph adds into
their ``.grad``). The TE backend keeps the same contract (te_backend.py, [Note: TE
parameter gradients]).

[Note: backward handlers in the replay] When a callable is a whole FSDP unit (the whole-layer
scope) and its replay Function is ours (torch backend), that Function is the unit's only
autograd node: its backward runs the unit's ``pre_backward`` (gather, zeroed ``.grad``)
before the backward graph and ``post_backward`` (reduce-scatter, reshard) after it, outside
the graph, where FSDP's registration hooks would have put an identity Function on the inputs
and a gradient hook on the outputs - two more autograd objects per layer and step. While
captured the unit's handlers are handed to the replay (``FSDPState.hand_handlers_to_replay``);
its eager calls (eval, fallbacks, verification) register them in the dispatcher (layerwise.py). TE's replay Function is TE's: there the
hooks stay.

[Note: capture and replay order] All forward graphs are captured first, in execution order,
then all backward graphs in reverse, in one shared memory pool - the order training replays
them. Memory a graph frees during capture (a backward releasing the activations its forward
saved) is only reused by graphs captured - hence replayed - after it, so replay never
overwrites a tensor a later replay still reads.
"""

from __future__ import annotations

import dataclasses
import enum
import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch
from torch import nn
from torch.autograd.function import once_differentiable
from torch.utils._pytree import tree_flatten, tree_unflatten

from graph_fsdp.capture.diagnosis import CAPTURE_ERROR_MODE, ModuleTracker, new_cuda_graph
from graph_fsdp.capture.scopes import GraphConfigError, Target
from graph_fsdp.cuda_streams import nvtx_range
from graph_fsdp.fsdp.tensor_parallel import data_address

CaptureHooks = dict[str, dict[int, Callable[[nn.Module], None]]]


class CallSignature:
    """The flattened ``(args, kwargs)`` of a call: tensor metadata plus non-tensor constants.

    A call matches when its structure and constants are equal and every tensor has the same
    shape, dtype, device and requires_grad; only matching calls replay (a graph reads and
    writes fixed-size buffers, so any other call runs eagerly).
    """

    def __init__(self, args: tuple, kwargs: dict, *, what: str = "a graphed call") -> None:
        flat, self.spec = tree_flatten((args, kwargs))
        check_constants(flat, self.spec, what)
        self.tensor_index = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor)]
        self.tensor_set = frozenset(self.tensor_index)
        self.consts = [None if isinstance(x, torch.Tensor) else x for x in flat]
        self.metas = [_meta(flat[i]) for i in self.tensor_index]
        self.samples = [flat[i].detach().clone() for i in self.tensor_index]
        self.sample_ptrs: list[int | None] = [data_address(flat[i]) for i in self.tensor_index]
        """The recorded call's tensor addresses: which were another callable's outputs
        ([Note: chained static buffers]); None where ``keep_sources`` found no live output
        there."""
        self.n_plain_args: int | None = (
            len(args) if not kwargs and all(isinstance(a, torch.Tensor) for a in args) else None
        )
        """``len(args)`` when the recorded call was positional tensors only (else None)."""

    def keep_sources(self, live_outputs: set[int]) -> None:
        """Forget the recorded addresses that belong to no live output of a graphed callable:
        the caching allocator hands a freed output's bytes to the next tensor (a norm after a
        residual add), whose equal address says nothing about where its values came from."""
        self.sample_ptrs = [p if p in live_outputs else None for p in self.sample_ptrs]

    def tensors_of(self, args: tuple, kwargs: dict) -> list[torch.Tensor] | None:
        """The call's tensors in signature order, or None if the call does not match."""
        if (
            self.n_plain_args is not None
            and not kwargs
            and len(args) == self.n_plain_args
            and all(isinstance(a, torch.Tensor) for a in args)
        ):
            # Fast path: such a call flattens to the recorded spec, its leaves are ``args``
            # and there are no constants to compare.
            tensors = list(args)
            for t, m in zip(tensors, self.metas):
                if _meta(t) != m:
                    return None
            return tensors
        flat, spec = tree_flatten((args, kwargs))
        if spec != self.spec:
            return None
        tensors = []
        for i, (x, const) in enumerate(zip(flat, self.consts)):
            if isinstance(x, torch.Tensor) != (i in self.tensor_set):
                return None  # a tensor where a constant was recorded, or the reverse
            if isinstance(x, torch.Tensor):
                tensors.append(x)
            elif not _same(x, const):
                return None
        if any(_meta(t) != m for t, m in zip(tensors, self.metas)):
            return None
        return tensors

    def mismatch(self, args: tuple, kwargs: dict) -> str | None:
        """Why a call does not match (the first difference, with values), or None."""
        flat, spec = tree_flatten((args, kwargs))
        if spec != self.spec:
            return (
                f"the arguments' structure differs: captured {_structure(self.spec)}, called "
                f"with {_structure(spec)}"
            )
        paths = _leaf_paths(self.spec)
        metas = iter(self.metas)
        for i, (path, x, const) in enumerate(zip(paths, flat, self.consts)):
            if isinstance(x, torch.Tensor) != (i in self.tensor_set):
                kind = "a tensor" if isinstance(x, torch.Tensor) else repr(x)
                was = "a tensor" if i in self.tensor_set else repr(const)
                return f"{path} is {kind}, captured as {was}"
            if isinstance(x, torch.Tensor):
                m, now = next(metas), _meta(x)
                if now != m:
                    return (
                        f"tensor {path} is {_fmt_meta(now)}, captured as {_fmt_meta(m)}: keep "
                        "shapes, dtypes and devices fixed (pad, or drop and recapture)"
                    )
            elif not _same(x, const):
                return f"{path} is {x!r}, captured as {const!r}: non-tensor arguments are constants"
        return None

    def static_copies(self) -> list[torch.Tensor]:
        """Fresh tensors holding the recorded samples, on the recorded devices: a capture's
        static inputs."""
        return [
            (s.clone() if s.device == m[2] else s.to(m[2])).requires_grad_(m[3])
            for s, m in zip(self.samples, self.metas)
        ]

    def samples_to_host(self) -> None:
        """Keep the samples in host memory once a capture has its static inputs: they are only
        read again by a recapture, and on the device they would hold bytes (and, through the
        caching allocator, whole segments) an offload cannot give back."""
        self.samples = [s.cpu() if type(s) is torch.Tensor else s for s in self.samples]

    def rebuild(self, tensors: list[torch.Tensor]) -> tuple[tuple, dict]:
        flat = list(self.consts)
        for i, t in zip(self.tensor_index, tensors):
            flat[i] = t
        return tree_unflatten(flat, self.spec)

    def describe(self) -> str:
        return ", ".join(f"{tuple(s)}:{str(d).replace('torch.', '')}" for s, d, _, _ in self.metas)


def describe_call(args: tuple, kwargs: dict) -> str:
    """The tensors of a call, as :meth:`CallSignature.describe` prints them (no copies)."""
    flat, _ = tree_flatten((args, kwargs))
    return ", ".join(
        f"{tuple(t.shape)}:{str(t.dtype).replace('torch.', '')}"
        for t in flat
        if isinstance(t, torch.Tensor)
    )


_CONSTANT_TYPES = (
    type(None),
    bool,
    int,
    float,
    complex,
    str,
    bytes,
    torch.dtype,
    torch.device,
    torch.layout,
    torch.memory_format,
    enum.Enum,
    type,
    slice,
    type(Ellipsis),
)


def check_constants(flat: list, spec, what: str) -> None:
    """Reject non-tensor arguments that carry state a graph cannot follow: a cache object
    (a HuggingFace ``past_key_values``) or an object holding tensors. Other objects are
    compared with ``==`` at every call (a call that differs runs eagerly)."""
    for path, x in zip(_leaf_paths(spec), flat):
        if isinstance(x, (torch.Tensor, *_CONSTANT_TYPES)) or callable(x) or _frozen_value(x):
            continue
        is_cache = any(c.__name__.endswith("Cache") for c in type(x).__mro__)
        if is_cache or _holds_tensors(x):
            raise GraphConfigError(
                f"{what}: argument {path} is a {type(x).__module__}.{type(x).__name__}, "
                f"{'a cache' if is_cache else 'an object holding tensors'}: a CUDA graph replays "
                "fixed buffers and cannot follow that object's state. For a KV cache pass "
                "use_cache=False / past_key_values=None in training; otherwise pass the "
                "tensors as arguments, or keep this module eager"
            )


def _holds_tensors(x) -> bool:
    values = list(getattr(x, "__dict__", {}).values())
    values += [getattr(x, n, None) for n in getattr(type(x), "__slots__", ())]
    return any(
        isinstance(v, torch.Tensor)
        or (isinstance(v, list | tuple) and any(isinstance(e, torch.Tensor) for e in v))
        for v in values
    )


def _frozen_value(x) -> bool:
    """A frozen dataclass without tensors: an immutable value, compared with ``==``."""
    if not dataclasses.is_dataclass(x) or not x.__dataclass_params__.frozen:
        return False
    return not any(isinstance(getattr(x, f.name), torch.Tensor) for f in dataclasses.fields(x))


def _leaf_paths(spec) -> list[str]:
    """Readable paths of a ``(args, kwargs)`` spec's leaves: ``args[0]``, ``kwargs['mask']``."""
    n = spec.num_leaves
    marked = tree_unflatten(list(range(n)), spec)
    out = [""] * n

    def walk(node, path):
        if isinstance(node, int) and not isinstance(node, bool) and path:
            out[node] = path
            return
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{path}[{k!r}]")
        elif isinstance(node, list | tuple):
            for i, v in enumerate(node):
                walk(v, f"{path}[{i}]")
        elif hasattr(node, "items"):
            for k, v in node.items():
                walk(v, f"{path}.{k}")

    args, kwargs = marked
    walk(args, "args")
    walk(kwargs, "kwargs")
    return [p or f"leaf {i}" for i, p in enumerate(out)]


def _structure(spec) -> str:
    try:
        # torch >= 2.13 deprecates ``children_specs`` for ``children()``; 2.11 has only it.
        args, kwargs = spec.children() if hasattr(spec, "children") else spec.children_specs
        return (
            f"{args.num_children} positional and keywords {list(kwargs.context)} "
            f"({spec.num_leaves} leaves)"
        )
    except (AttributeError, ValueError, TypeError):
        return " ".join(str(spec).split())[:300]


def _fmt_meta(m: tuple) -> str:
    shape, dtype, device, rg = m
    return f"{tuple(shape)}:{str(dtype).replace('torch.', '')} on {device}" + (
        " requiring grad" if rg else ""
    )


def _meta(t: torch.Tensor) -> tuple:
    return (t.shape, t.dtype, t.device, t.requires_grad)


def _same(a, b) -> bool:
    try:
        return a is b or bool(a == b)
    except Exception:  # noqa: BLE001 - uncomparable constants do not match
        return False


class CapturedCallable:
    """A target module, the signature it was captured with and its graphs (one record)."""

    def __init__(self, target: Target, orig_forward: Callable) -> None:
        self.target = target
        self.name = target.name
        self.module = target.module
        self.orig_forward = orig_forward
        self.signature: CallSignature | None = None
        self.params: tuple[nn.Parameter, ...] = ()
        self.static_inputs: list[torch.Tensor] = []
        # torch backend
        self.fwd_graph: torch.cuda.CUDAGraph | None = None
        self.bwd_graph: torch.cuda.CUDAGraph | None = None
        self.static_outputs: list[torch.Tensor] = []
        self.out_spec = None
        self.out_template: list = []
        self.out_has_consts = False
        self.out_tensor_pos: frozenset[int] = frozenset()
        self.out_requires_grad: list[bool] = []
        self.out_nondiff: tuple[int, ...] = ()
        """Indices of the outputs that did not require grad at capture."""
        self.replay_anchor: tuple[torch.Tensor, ...] = ()
        """The anchor leaf the replay Function takes when it needs one (module notes)."""
        self.unit_state = None
        """The FSDP state whose backward handlers the replay runs ([Note: backward handlers
        in the replay]), or None."""
        self.static_grad_outputs: list[torch.Tensor | None] = []
        self.static_grad_inputs: list[torch.Tensor | None] = []
        self.zeroes_grads_of = None
        """The FSDP state of the unit this callable wholly is (torch backend): its backward
        graph zeroes the unit's gradient buffers before adding into them."""
        self.recorded_output_ptrs: list[int] = []
        """Addresses of the recorded call's output tensors."""
        self.recorded_outputs: list[weakref.ref] = []
        """The recorded call's output tensors, while alive (``CallSignature.keep_sources``)."""
        self.chained: tuple[tuple[int, int], ...] = ()
        """``(j, i)``: static input ``j`` is output ``i`` of the callable captured just before
        (torch backend, [Note: chained static buffers])."""
        # te backend: the module TE returned (its forward replays) and its anchor input
        self.te_callable: nn.Module | None = None
        self.te_anchor: torch.Tensor | None = None
        self.replays = 0
        self.fallbacks = 0
        self.tracker: ModuleTracker | None = None
        """Set while capturing: names this callable if its capture fails (diagnosis.py)."""
        self.static_memory: Callable[[], AbstractContextManager] = nullcontext
        """Where the static inputs and incoming gradients are made (the runner sets it:
        address_keeping.static_memory)."""

    @property
    def captured(self) -> bool:
        return self.fwd_graph is not None or self.te_callable is not None

    def prepare(self) -> None:
        """Fresh static inputs from the recorded sample and the module's current params."""
        with self.static_memory():
            self.static_inputs = self.signature.static_copies()
        self.params = tuple(self.module.parameters())

    def drop(self) -> None:
        self.fwd_graph = self.bwd_graph = self.te_callable = self.te_anchor = None
        self.static_inputs, self.static_outputs = [], []
        self.static_grad_outputs, self.static_grad_inputs = [], []
        self.params, self.replay_anchor, self.out_nondiff = (), (), ()
        self.zeroes_grads_of = None
        self.chained = ()
        if self.unit_state is not None:
            self.unit_state.take_handlers_back()
            self.unit_state = None

    # ------------------------------------------------------------------ eager pieces
    def forward_eager(self) -> list[torch.Tensor]:
        """The original forward on the static inputs (warmup and capture): its tensors."""
        args, kwargs = self.signature.rebuild(self.static_inputs)
        return self.split_outputs(self.orig_forward(*args, **kwargs))

    def split_outputs(self, out) -> list[torch.Tensor]:
        """The tensors of ``out``; its structure and non-tensor leaves (a HuggingFace
        attention's ``attn_weights=None``) are kept as constants of the replay."""
        flat, self.out_spec = tree_flatten(out)
        self.out_template = [None if isinstance(o, torch.Tensor) else o for o in flat]
        self.out_tensor_pos = frozenset(
            i for i, o in enumerate(flat) if isinstance(o, torch.Tensor)
        )
        self.out_has_consts = len(self.out_tensor_pos) != len(flat)
        for o in flat:
            if not isinstance(o, (torch.Tensor, *_CONSTANT_TYPES)):
                raise TypeError(
                    f"{self.name} returns a {type(o).__name__}: a graphed module must return "
                    "tensors (a tensor or a nested tuple/list/dict of tensors) and constants "
                    "(None, numbers, ...)"
                )
        return [o for o in flat if isinstance(o, torch.Tensor)]

    def join_outputs(self, tensors) -> object:
        """The replay's result in the structure the module returns."""
        if not self.out_has_consts and self.out_spec.is_leaf():
            return tensors[0]  # a single tensor: what tree_unflatten returns
        it = iter(tensors)
        flat = [
            next(it) if i in self.out_tensor_pos else o for i, o in enumerate(self.out_template)
        ]
        return tree_unflatten(flat, self.out_spec)

    def backward_eager(self, outputs: list[torch.Tensor]) -> list[torch.Tensor | None]:
        """Backward of ``outputs``: returns the inputs' grads, adds the params' into ``.grad``.

        ``torch.autograd.grad`` rather than ``backward``: no AccumulateGrad node runs, so the
        whole backward stays on the capture stream (see [Note: gradients of graphed modules]).
        """
        if not self.static_grad_outputs:
            with self.static_memory():
                self.static_grad_outputs = [
                    torch.zeros_like(o) if o.requires_grad else None for o in outputs
                ]
        pairs = [(o, g) for o, g in zip(outputs, self.static_grad_outputs) if g is not None]
        inputs = [x for x in self.static_inputs if x.requires_grad]
        params = [p for p in self.params if p.requires_grad]
        if not pairs or not (inputs or params):
            return [None] * len(self.static_inputs)
        grads = torch.autograd.grad(
            [o for o, _ in pairs], inputs + params, [g for _, g in pairs], allow_unused=True
        )
        if self.zeroes_grads_of is not None:
            for group in self.zeroes_grads_of.groups:
                if group.grad_full is not None:
                    group.grad_full.zero_()
        for p, g in zip(params, grads[len(inputs) :]):
            if g is None:
                continue
            if p.grad is None:
                raise RuntimeError(
                    f"{self.name}: a parameter of shape {tuple(p.shape)} has no preset .grad at "
                    "capture; graphed modules must belong to a fully_shard-ed unit, whose "
                    "pre-backward presets the gradients the graph accumulates into"
                )
            p.grad.add_(g)  # what AccumulateGrad does with a defined grad: bit-identical
        it = iter(grads[: len(inputs)])
        return [next(it) if x.requires_grad else None for x in self.static_inputs]

    # ------------------------------------------------------------------ replay
    def replay(self, tensors: list[torch.Tensor]):
        self.replays += 1
        with nvtx_range(f"graph_fsdp/replay/{self.name}"):
            if self.te_callable is not None:
                outs = self.te_callable(*tensors, self.te_anchor)
                if not self.out_has_consts:
                    return outs
                # te_backend's wrapper returns the tensors alone when there are constants,
                # and TE unwraps a 1-tuple into a bare tensor.
                return self.join_outputs([outs] if isinstance(outs, torch.Tensor) else list(outs))
            return self.join_outputs(_Replay.apply(self, *tensors, *self.replay_anchor))

    def set_replay_anchor(self) -> None:
        """An anchor leaf iff no recorded input requires grad but a parameter does."""
        needed = not any(m[3] for m in self.signature.metas) and any(
            p.requires_grad for p in self.params
        )
        device = (self.static_inputs or list(self.params))[0].device if needed else None
        self.replay_anchor = (torch.zeros((), device=device, requires_grad=True),) if needed else ()


class _Replay(torch.autograd.Function):
    """Replays the forward graph; its backward replays the backward graph."""

    @staticmethod
    def forward(ctx, cap: CapturedCallable, *inputs: torch.Tensor):
        for static, x in zip(cap.static_inputs, inputs):
            if data_address(static) != data_address(x):
                static.copy_(x)
        cap.fwd_graph.replay()
        ctx.cap = cap
        outs = tuple([o.detach() for o in cap.static_outputs])
        if cap.out_nondiff:
            ctx.mark_non_differentiable(*[outs[i] for i in cap.out_nondiff])
        return outs

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):
        # Grad mode is off in a plain backward; create_graph=True takes once_differentiable's
        # path (the replay's gradients cannot be differentiated again).
        if torch.is_grad_enabled():
            return _replay_backward_once(ctx, *grads)
        return _replay_backward(ctx, *grads)


def _replay_backward(ctx, *grads: torch.Tensor | None):
    cap: CapturedCallable = ctx.cap
    state = cap.unit_state
    if state is not None:  # [Note: backward handlers in the replay]
        state.pre_backward(params_on_modules=False, zero_grads=False)
    with nvtx_range(f"graph_fsdp/replay_backward/{cap.name}"):
        for static, g in zip(cap.static_grad_outputs, grads):
            if static is None:
                continue
            if g is None:
                static.zero_()
            elif data_address(g) != data_address(static):
                static.copy_(g)
        cap.bwd_graph.replay()
    if state is not None:
        state.post_backward()
    grads_in = [None if g is None else g.detach() for g in cap.static_grad_inputs]
    return (None, *grads_in, *[None for _ in cap.replay_anchor])


_replay_backward_once = once_differentiable(_replay_backward)


def _phase(tracker: ModuleTracker | None, name: str, kind: str):
    return tracker.phase(name, kind) if tracker is not None else nullcontext()


def _run(hooks: CaptureHooks, key: str, module: nn.Module) -> None:
    for fn in hooks[key].values():
        fn(module)


def forward_step(
    cap: CapturedCallable,
    hooks: CaptureHooks,
    tracker: ModuleTracker | None,
    capture=None,
) -> list[torch.Tensor]:
    """One warmup or capture forward of ``cap``: FSDP's capture-time hooks around the
    original forward, which runs in the tracker's phase (it bypasses the module's
    ``__call__``, so the tracker's module hooks do not see it) inside ``capture`` (a
    ``torch.cuda.graph`` context, or None for a warmup)."""
    _run(hooks, "forward_pre_hooks", cap.module)
    with _phase(tracker, cap.name, "forward"), capture or nullcontext():
        out = cap.forward_eager()
    _run(hooks, "forward_hooks", cap.module)
    return out


def backward_step(
    cap: CapturedCallable,
    hooks: CaptureHooks,
    outputs: list[torch.Tensor],
    tracker: ModuleTracker | None,
    capture=None,
) -> list[torch.Tensor | None]:
    """One warmup or capture backward of ``cap`` (see :func:`forward_step`)."""
    _run(hooks, "backward_pre_hooks", cap.module)
    with _phase(tracker, cap.name, "backward"), capture or nullcontext():
        grads = cap.backward_eager(outputs)
    _run(hooks, "backward_hooks", cap.module)
    return grads


# [Note: chained static buffers] When the recorded step passed one callable's output
# straight into the next one (a stack of layers), the torch backend captures the next
# forward graph reading the previous graph's static output in place, and the previous
# backward graph reading the next one's static input gradient in place: at replay the
# tensors arrive at those addresses already, so neither the input copy before a forward
# replay nor the gradient copy before a backward replay is issued (two device copies and
# their launches per layer and step). The previous graph's output stays allocated as long as
# the graphs (it is its static output), and it is only rewritten by that graph's next
# replay, after the backward that reads it. A call whose chained input arrives from
# anywhere else runs eagerly (layerwise.py's dispatcher): copying it in would overwrite the
# previous graph's output, which its backward graph may read.
def _chain(prev: CapturedCallable, cap: CapturedCallable) -> tuple[tuple[int, int], ...]:
    pairs = []
    for j, ptr in enumerate(cap.signature.sample_ptrs):
        for i, out_ptr in enumerate(prev.recorded_output_ptrs):
            if ptr != out_ptr or i >= len(prev.static_outputs):
                continue
            src, dst = prev.static_outputs[i], cap.static_inputs[j]
            if (src.shape, src.stride(), src.dtype, src.device) == (
                dst.shape,
                dst.stride(),
                dst.dtype,
                dst.device,
            ):
                pairs.append((j, i))
                break
    return tuple(pairs)


def capture_torch(
    caps: list[CapturedCallable],
    hooks: list[CaptureHooks],
    *,
    warmup_iters: int,
    pool,
    tracker: ModuleTracker | None = None,
    cuda_graph=torch.cuda.graph,
) -> None:
    """Warm up and capture ``caps`` with torch.cuda graphs (see the module notes).

    Each callable's capture-time hooks run around every warmup and capture step, outside
    the capture, on the capture stream - TE's contract, so both backends share FSDP's side.
    ``cuda_graph``: ``torch.cuda.graph`` or a context with its signature (a model whose
    addresses offload keeps: address_keeping.graph_capture).
    """
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup_iters):
            outs = [forward_step(cap, h, tracker) for cap, h in zip(caps, hooks)]
            for cap, h, out in reversed(list(zip(caps, hooks, outs))):
                backward_step(cap, h, out, tracker)
            del outs
        prev = None
        for cap, h in zip(caps, hooks):
            cap.chained = _chain(prev, cap) if prev is not None else ()
            for j, i in cap.chained:  # [Note: chained static buffers]
                cap.static_inputs[j] = (
                    prev.static_outputs[i]
                    .detach()
                    .requires_grad_(cap.static_inputs[j].requires_grad)
                )
            prev = cap
            cap.fwd_graph = new_cuda_graph()
            graph = cuda_graph(
                cap.fwd_graph, pool=pool, stream=stream, capture_error_mode=CAPTURE_ERROR_MODE
            )
            with nvtx_range(f"graph_fsdp/capture/{cap.name}/fwd"):
                cap.static_outputs = forward_step(cap, h, tracker, graph)
            cap.out_requires_grad = [o.requires_grad for o in cap.static_outputs]
            cap.out_nondiff = tuple(i for i, rg in enumerate(cap.out_requires_grad) if not rg)
        nxt = None
        for cap, h in reversed(list(zip(caps, hooks))):
            for j, i in nxt.chained if nxt is not None else ():
                grad = nxt.static_grad_inputs[j]
                if grad is not None and cap.static_grad_outputs[i] is not None:
                    cap.static_grad_outputs[i] = grad.detach()
            nxt = cap
            cap.bwd_graph = new_cuda_graph()
            graph = cuda_graph(
                cap.bwd_graph, pool=pool, stream=stream, capture_error_mode=CAPTURE_ERROR_MODE
            )
            with nvtx_range(f"graph_fsdp/capture/{cap.name}/bwd"):
                cap.static_grad_inputs = backward_step(cap, h, cap.static_outputs, tracker, graph)
            # Drop the capture forward's autograd graph: only its buffers, owned by the
            # pool, remain (the backward graph reads them).
            cap.static_outputs = [o.detach() for o in cap.static_outputs]
    torch.cuda.current_stream().wait_stream(stream)
