"""Per-unit FSDP state: the hooks, as named lifecycle methods, and the shared root context.

Hook registration (see ``register_hooks``) keeps capture in mind: the hooks are methods, and
those that only *register* autograd backward handlers carry a sentinel naming the handler
(``_cuda_graph_backward_handler`` / ``_cuda_graph_backward_pre_handler``), so the capture
layer can withhold them and route the handler to the backward keys (capture/module_hooks.py).
"""

from __future__ import annotations

import enum
import functools
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from graph_fsdp.buffers.allocator import BufferAllocator
from graph_fsdp.cuda_streams import nvtx_range
from graph_fsdp.fsdp.address_keeping import OffloadMode, offload_mode_for
from graph_fsdp.fsdp.allocators import make_allocator
from graph_fsdp.fsdp.api import BufferPolicy, MixedPrecisionPolicy, Placements
from graph_fsdp.fsdp.capture_context import CaptureContext
from graph_fsdp.fsdp.comm import CommContext
from graph_fsdp.fsdp.hook_markers import (
    BACKWARD_HANDLER,
    BACKWARD_PRE_HANDLER,
    CAPTURE_TIME_FN,
    mark,
)
from graph_fsdp.fsdp.param_group import FlatParamGroup


class TrainingState(enum.Enum):
    IDLE = "idle"
    FORWARD = "forward"
    PRE_BACKWARD = "pre_backward"
    POST_BACKWARD = "post_backward"


def in_backward() -> bool:
    """True while autograd executes (activation recompute re-enters forward hooks then)."""
    return torch._C._current_graph_task_id() != -1


@dataclass
class RootContext:
    """State shared by all units under one root (streams, allocator, execution order)."""

    comm: CommContext
    allocator: BufferAllocator
    states: list[FSDPState]
    forward_order: list[FSDPState] = field(default_factory=list)
    order_frozen: bool = False
    callback_queued: bool = False
    backward_done: set[int] = field(default_factory=set)
    order_positions: dict[int, int] = field(default_factory=dict)
    """id(state) -> first index in ``forward_order`` (cache for ``FSDPState._neighbour``)."""
    offloaded: set[str] = field(default_factory=set)
    """State kinds moved off the device by graph_fsdp.fsdp.offload (forward is refused)."""
    offload_mode: OffloadMode | None = None
    """Whether offload keeps the addresses CUDA graphs read (set at lazy init:
    address_keeping.py [Note: offload keeps addresses])."""
    awaiting_backward: bool = False
    """A training forward (grad enabled) ran and its backward has not finished: the step is
    open, and offload is refused (offload.py ``check_idle``)."""
    expert_comms: dict[int, CommContext] = field(default_factory=dict)
    """id(expert-data-parallel group) -> the root's streams over it (``comm_for``)."""
    capture: CaptureContext = field(init=False)
    """What the CUDA-graph tools switch in these units (capture_context.py [Note: capture
    context]); every group under the root shares it."""

    def __post_init__(self) -> None:
        self.capture = CaptureContext(self.states, self.allocator)

    def comm_for(self, unit_comm: CommContext) -> CommContext:
        """The root's context for a group a unit built ``unit_comm`` for: the root's own for
        the dense mesh, the root's streams over the expert-data-parallel group for experts
        (experts.py [Note: expert groups])."""
        if unit_comm.same_mesh(self.comm):
            return self.comm
        shared = self.expert_comms.get(id(unit_comm.group))
        if shared is None:
            shared = self.comm.over(unit_comm.group, grad_divisor=unit_comm.grad_divisor)
            shared.open_gather_group()  # comm.py [Note: a communicator for the all-gathers]
            self.expert_comms[id(unit_comm.group)] = shared
        return shared


def refuse_offloaded(root: RootContext, action: str = "forward") -> None:
    """Called by the root's pre-forward (and others) while something is offloaded."""
    kinds = sorted(root.offloaded)
    calls = " and ".join(f"onload_{k}()" for k in kinds)
    raise RuntimeError(
        f"{action} with offloaded {', '.join(kinds)}: call model.{calls} before training or "
        "evaluating again"
    )


class GraphRunner(Protocol):
    """What the core asks of a CUDA graph runner (capture/) that registered with a unit."""

    def suspend(self) -> None:
        """Free the graphs and their pool now; capture again at the next step."""


# [Note: autograd holds FSDP states weakly]
# The backward handlers FSDP puts into a forward's autograd graph (``_PostBackward``'s ctx, the
# pre-backward tensor hook) reach their ``FSDPState`` through a weak reference. A graph node is
# a C++ object: what it holds is invisible to Python's garbage collector. A module that keeps
# a tensor of its last forward - Megatron-Core's token dispatchers keep the routing
# probabilities (``MoEAlltoAllTokenDispatcher.probs``, ``MoEAllGatherTokenDispatcher.
# local_probs``) - keeps that graph alive, and with strong references the cycle model ->
# tensor -> graph node -> state -> model could never be collected: a dropped model (and its
# main weights and gradients) stayed on the device for the rest of the process. A state that
# is gone has nothing left to gather or reduce, so its handlers do nothing.


class _PostBackward(torch.autograd.Function):
    """Identity on the unit's inputs whose backward runs after the unit's backward."""

    @staticmethod
    def forward(ctx, state_ref: weakref.ref, *inputs: torch.Tensor):
        ctx.state_ref = state_ref  # [Note: autograd holds FSDP states weakly]
        return inputs

    @staticmethod
    def backward(ctx, *grads):
        state = ctx.state_ref()
        if state is not None:
            state.post_backward()
        return (None, *grads)


def _pre_backward_grad_hook(state_ref: weakref.ref, grad: torch.Tensor) -> None:
    """The tensor hook ``_hook_outputs`` registers ([Note: autograd holds FSDP states
    weakly])."""
    state = state_ref()
    if state is not None:
        state.pre_backward()


class FSDPState:
    def __init__(
        self,
        module: nn.Module,
        fqn_hint: str,
        groups: list[FlatParamGroup],
        *,
        placements: Placements,
        mp: MixedPrecisionPolicy,
        buffer_policy: BufferPolicy,
        comm: CommContext,
        reshard_after_forward: bool,
    ) -> None:
        self.module = module
        self.fqn = fqn_hint
        self.groups = groups
        self.placements = placements
        self.mp = mp
        self.buffer_policy = buffer_policy
        self.comm = comm
        self.reshard_after_forward = reshard_after_forward
        self.training_state = TrainingState.IDLE
        self.root: RootContext | None = None
        self.is_root = False
        self._pre_backward_done = False
        self._post_backward_done = False
        self.requires_grad_sync = True
        self._backward_by_replay = False
        self._forward_by_dispatcher = False
        self._handles: list = []
        self.grad_sync_hooks: list[Callable[[], None]] = []
        """Run after this unit's gradients are reduced and exposed (``add_grad_sync_hook``)."""
        self.graph_runners: weakref.WeakSet[GraphRunner] = weakref.WeakSet()
        """The graph runners capturing this unit (they register themselves): offload
        suspends them before it moves the buffers their graphs address (offload.py [Note:
        CUDA graphs across offload])."""
        self._ref = weakref.ref(self)
        self._pre_backward_grad_hook = functools.partial(_pre_backward_grad_hook, self._ref)

    # ------------------------------------------------------------------ registration
    def add_grad_sync_hook(self, hook: Callable[[], None]) -> None:
        """Call ``hook()`` at the end of every backward that synchronised this unit's
        gradients - after every reduction finished and the sharded ``.grad`` views are set,
        on the main stream, before the optimizer reads them; inside a full-iteration capture
        it is captured, layerwise captures skip it as they skip the reductions. For the
        gradients a model's own tensor parallelism still reduces (Megatron's
        ``finalize_model_grads`` all-reduce of sequence-parallel norms: integrations/
        megatron/tp.py)."""
        self.grad_sync_hooks.append(hook)

    def register_hooks(self) -> None:
        m = self.module
        self._handles = [
            m.register_forward_pre_hook(self._pre_forward_hook, with_kwargs=True),
            m.register_forward_pre_hook(self._register_post_backward_hook, with_kwargs=True),
            m.register_forward_hook(self._post_forward_hook),
            m.register_forward_hook(self._register_pre_backward_hook),
        ]

    # [Note: forward handlers in the dispatcher] While a torch-backend replay of the unit's
    # whole module owns its backward handlers ([Note: backward handlers in the replay]), the
    # capture layer's dispatcher (the module's ``forward``) runs ``pre_forward`` and
    # ``post_forward`` itself, and the four registration hooks come off the module, so its
    # call takes torch's hook-free path (each hook-running module call costs host time in
    # torch's ``_call_impl``, per layer and step). A replay then neither puts the unsharded
    # parameters on the module nor the sharded ones back (``params_on_modules=False``): no
    # code of the module runs, the graph reads the gathered buffer. Eager calls (fallbacks,
    # eval, verification, activation recompute) put them on as before. Only when FSDP's hooks
    # are the module's only ones: a user's hook keeps its place before or after FSDP's.
    @property
    def backward_by_replay(self) -> bool:
        """A graph replay of this unit's whole module runs the unit's ``pre_backward``/
        ``post_backward`` itself (capture/torch_backend.py [Note: backward handlers in the
        replay]): the registration hooks stand aside, and eager calls of the module register
        the handlers through :meth:`forward_with_backward_handlers`."""
        return self._backward_by_replay

    @property
    def forward_by_dispatcher(self) -> bool:
        """The capture layer's dispatcher runs ``pre_forward``/``post_forward`` (the
        registration hooks are off the module)."""
        return self._forward_by_dispatcher

    def hand_handlers_to_replay(self, *, forward: bool = True) -> bool:
        """A replay of the whole module runs the unit's backward handlers from now on and,
        with ``forward``, the dispatcher its forward handlers: the registration hooks come
        off. Returns whether the forward handlers were handed over (False, and the forward
        hooks stay, when the module has hooks of its own)."""
        self._backward_by_replay = True
        if not forward:
            return False
        m = self.module
        ours = {h.id for h in self._handles}
        present = {*m._forward_pre_hooks, *m._forward_hooks}
        if present != ours or m._backward_hooks or m._backward_pre_hooks:
            return False
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._forward_by_dispatcher = True
        return True

    def take_handlers_back(self) -> None:
        """The registration hooks run every handler again (the graphs were dropped)."""
        self._backward_by_replay = False
        if self._forward_by_dispatcher:
            self._forward_by_dispatcher = False
            self.register_hooks()

    # The hooks themselves. Sentinels (capture/module_hooks.py, [Note: sentinel hooks]) name
    # the methods the capture layer runs instead of them around warmup and capture.
    @mark(CAPTURE_TIME_FN, "pre_forward")
    def _pre_forward_hook(self, module, args, kwargs) -> None:
        self.pre_forward()

    @mark(CAPTURE_TIME_FN, "post_forward")
    def _post_forward_hook(self, module, args, output) -> None:
        self.post_forward()

    @mark(BACKWARD_HANDLER, "capture_post_backward")
    def _register_post_backward_hook(self, module, args, kwargs):
        if self._backward_by_replay:
            return None
        return self._wrap_inputs(args, kwargs)

    def _wrap_inputs(self, args: tuple, kwargs: dict):
        """``(args, kwargs)`` with the inputs that require grad passed through
        ``_PostBackward`` (its backward runs ``post_backward``), or None to keep them."""
        if not torch.is_grad_enabled() or in_backward():
            return None
        # The usual ``layer(x)`` (positional tensors only) skips tree_flatten: its leaves are
        # ``args``, in order.
        simple = not kwargs and all(isinstance(a, torch.Tensor) for a in args)
        flat, spec = (list(args), None) if simple else tree_flatten((args, kwargs))
        idx = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not idx:
            return None
        outs = _PostBackward.apply(self._ref, *[flat[i] for i in idx])
        for i, t in zip(idx, outs):
            flat[i] = t
        return (tuple(flat), {}) if spec is None else tree_unflatten(flat, spec)

    @mark(BACKWARD_PRE_HANDLER, "capture_pre_backward")
    def _register_pre_backward_hook(self, module, args, output) -> None:
        if not self._backward_by_replay:
            self._hook_outputs(output)

    def _hook_outputs(self, output) -> None:
        """``pre_backward`` runs when the first gradient of ``output`` arrives."""
        if not torch.is_grad_enabled() or in_backward():
            return
        flat = (output,) if isinstance(output, torch.Tensor) else tree_flatten(output)[0]
        for t in flat:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(self._pre_backward_grad_hook)

    def forward_with_backward_handlers(self, forward, args: tuple, kwargs: dict):
        """``forward(*args, **kwargs)`` with the backward handlers the registration hooks would
        have attached: an eager call of a module whose replay owns them (``backward_by_replay``:
        an eval pass, a call that does not match the capture, a verification's eager run)."""
        wrapped = self._wrap_inputs(args, kwargs)
        if wrapped is not None:
            args, kwargs = wrapped
        out = forward(*args, **kwargs)
        self._hook_outputs(out)
        return out

    @property
    def allocator(self) -> BufferAllocator:
        return self.root.allocator

    # ------------------------------------------------------------------ lazy init
    def lazy_init(self) -> None:
        """Run by the first unit whose forward starts: it becomes the root."""
        if self.root is not None:
            return
        states = collect_states(self.module)
        for other in states:
            if other.root is not None:
                raise RuntimeError(
                    f"{other.fqn} already belongs to another root's forward; call the outermost "
                    "fully_shard-ed module, or fully_shard the root last"
                )
            if not other.comm.same_mesh(self.comm):
                raise ValueError(
                    f"{other.fqn} was sharded on a different mesh than the root {self.fqn}; "
                    "pass the same mesh to every fully_shard call of one model"
                )
        names = {id(m): name for name, m in self.module.named_modules()}
        ctx = RootContext(self.comm, make_allocator(self.buffer_policy), states)
        self.comm.open_gather_group()  # comm.py [Note: a communicator for the all-gathers]
        for other in states:
            prefix = names[id(other.module)]
            other.fqn = prefix or "root"
            other.root = ctx
            other.comm = self.comm  # one set of streams for the whole model
            for group in other.groups:
                group.join_root(other.fqn, prefix, ctx.comm_for(group.comm), ctx.capture)
                group.register_buffers(ctx.allocator)
        ctx.offload_mode = offload_mode_for(states, self.buffer_policy.keep_addresses_on_offload)
        self.is_root = True
        # The root's weights are used first in forward and backward: keep them gathered.
        self.reshard_after_forward = False

    # ------------------------------------------------------------------ forward
    def pre_forward(self, *, params_on_modules: bool = True) -> None:
        if self.root is None:
            self.lazy_init()
        if in_backward():  # activation recompute: weights are gathered by pre_backward
            self.unshard()
            self.wait_for_unshard()
            return
        root = self.root
        if root.offloaded:  # any unit: a submodule called by itself reads offloaded state too
            refuse_offloaded(root)
        if self.is_root:
            root.backward_done.clear()
            root.callback_queued = False
            if torch.is_grad_enabled():
                root.awaiting_backward = True
            for s in root.states:
                s.reset_backward_guards()
                for group in s.groups:
                    group.release_main_grad()
        with nvtx_range(f"graph_fsdp/pre_forward/{self.fqn}"):
            self.training_state = TrainingState.FORWARD
            if not root.order_frozen and torch.is_grad_enabled():
                if self in root.forward_order:
                    root.order_frozen = True
                else:
                    root.forward_order.append(self)
            self.unshard()
            nxt = self._neighbour(+1)
            if nxt is not None:
                nxt.unshard()
            self.wait_for_unshard(params_on_modules)

    def post_forward(self) -> None:
        if in_backward():  # recompute must not reshard what the running backward needs
            return
        with nvtx_range(f"graph_fsdp/post_forward/{self.fqn}"):
            keep = not self.reshard_after_forward and torch.is_grad_enabled()
            if self.is_root and not torch.is_grad_enabled():
                keep = False
            if not keep:
                self.reshard()
            self.training_state = TrainingState.IDLE
            if self.is_root:
                self.root.order_frozen = self.root.order_frozen or bool(self.root.forward_order)
                if torch.is_grad_enabled():
                    self.allocator.forward_boundary()  # [Note: weight slots during backward]

    # ------------------------------------------------------------------ backward
    def pre_backward(self, *, params_on_modules: bool = True, zero_grads: bool = True) -> None:
        """``params_on_modules``/``zero_grads`` False: a replay whose backward graph zeroes
        the gradients itself and runs no module code ([Note: forward handlers in the
        dispatcher], capture/torch_backend.py [Note: gradients of graphed modules])."""
        if self._pre_backward_done:
            return
        root = self.root
        self._pre_backward_done = True
        if not root.callback_queued and in_backward():
            root.callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(root_final_callback(root))
        with nvtx_range(f"graph_fsdp/pre_backward/{self.fqn}"):
            self.training_state = TrainingState.PRE_BACKWARD
            self.unshard()
            prev = self._neighbour(-1)
            if prev is not None and not prev.is_root:
                prev.unshard()
            self.wait_for_unshard(params_on_modules)  # and puts the params on the modules
            for group in self.groups:
                group.prepare_grads(self.allocator, zero=zero_grads)

    def post_backward(self) -> None:
        if self._post_backward_done:
            return
        self._post_backward_done = True
        with nvtx_range(f"graph_fsdp/post_backward/{self.fqn}"):
            self.training_state = TrainingState.POST_BACKWARD
            for group in self.groups:
                group.post_backward(self.allocator, sync=self.requires_grad_sync)
            if not self.is_root:
                self.reshard()
            self.training_state = TrainingState.IDLE

    # ------------------------------------------------------------------ capture time
    # Around warmup and capture each captured callable runs its unit's handlers once per
    # iteration, and several callables may share one unit (attn and mlp scopes): the
    # once-per-backward guards must not hold there.
    def capture_pre_backward(self) -> None:
        self._pre_backward_done = False
        self.pre_backward()

    def capture_post_backward(self) -> None:
        self._post_backward_done = False
        self.post_backward()

    def reset_backward_guards(self) -> None:
        """Let ``pre_backward``/``post_backward`` run again: at the root's forward, and after a
        capture ran them for its callables."""
        self._pre_backward_done = self._post_backward_done = False

    # ------------------------------------------------------------------ primitives
    def unshard(self) -> None:
        for group in self.groups:
            group.unshard(self.allocator)

    def wait_for_unshard(self, params_on_modules: bool = True) -> None:
        for group in self.groups:
            group.wait_unshard()
            if params_on_modules:
                group.use_unsharded()

    def reshard(self) -> None:
        for group in self.groups:
            if self.placements.params:
                group.reshard(self.allocator)
            else:
                group.use_sharded()

    def _neighbour(self, step: int) -> FSDPState | None:
        root = self.root
        if not root.order_frozen:
            return None
        order = root.forward_order
        positions = root.order_positions
        if len(positions) != len(order):  # the order is only ever appended to
            positions.clear()
            for i, s in enumerate(order):
                positions.setdefault(id(s), i)
        i = positions.get(id(self))
        if i is None:
            return None
        i += step
        return order[i] if 0 <= i < len(order) else None


def root_final_callback(root: RootContext):
    def finish() -> None:
        with nvtx_range("graph_fsdp/final_backward/root"):
            for state in reversed(root.states):
                if state._pre_backward_done and not state._post_backward_done:
                    state.post_backward()
            for state in root.states:
                if state.is_root:
                    state.reshard()
            root.comm.wait_reductions()  # both mesh dims: the full_iteration capture joins them
            if not root.capture.capturing_layers:
                for state in root.states:
                    if state.requires_grad_sync:
                        for group in state.groups:
                            group.attach_sharded_grads()
                        for hook in state.grad_sync_hooks:
                            hook()
            root.allocator.step_boundary()
            root.callback_queued = False
            root.awaiting_backward = False

    return finish


def state_of(module: nn.Module) -> FSDPState | None:
    """The FSDP state ``fully_shard`` gave ``module`` (None: not a unit)."""
    state = module.__dict__.get("_fsdp_state")
    return state if isinstance(state, FSDPState) else None


def collect_states(module: nn.Module) -> list[FSDPState]:
    """FSDP states at or below ``module`` in pre-order (construction == forward order)."""
    return [state for m in module.modules() if (state := state_of(m)) is not None]


def discard_gradients(module: nn.Module) -> None:
    """Forget the gradients every unit at or below ``module`` accumulated since the last
    optimizer step, once its backward is over: no pending ``no_sync`` accumulation, and, with
    the optimizer's ``zero_grad(set_to_none=True)`` (no sharded ``.grad`` attached), the next
    reduction overwrites the main gradients (param_group.py ``post_backward``). For a step
    that is run again (training/overflow.py)."""
    for state in collect_states(module):
        for group in state.groups:
            group.restore_accumulation(False)
