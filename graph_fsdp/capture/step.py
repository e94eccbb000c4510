"""What both graph runners share: the step call, its host clock, and the checks before capture.

:class:`GraphedStep` is what ``graphs.capture(step_fn)`` returns for either runner
(layerwise.py, full_iteration.py); :func:`eager_forward_backward` is the built-in step of the
older ``forward_backward(micro, x, y, denom, clock)`` call; :func:`check_capturable` is what
every capture needs of the model; ``verify`` options and results are handled alike by both.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from graph_fsdp.capture.diagnosis import ModuleTracker
from graph_fsdp.capture.scopes import (
    GraphConfigError,
    ScopeModules,
    check_scopes,
    check_static_buffers,
)
from graph_fsdp.capture.verify import GraphVerificationError, VerifyResult
from graph_fsdp.distributed import GRAPH_REGISTER_ENV
from graph_fsdp.fsdp.fully_shard import FSDPModule
from graph_fsdp.fsdp.state import FSDPState


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
    return timed_forward_backward(lambda: model(x, y) / denom, clock)


def timed_forward_backward(
    forward: Callable[[], torch.Tensor], clock: HostClock | None = None
) -> torch.Tensor:
    """``loss = forward()`` and its backward, their host times added to ``clock``; returns
    the loss, detached."""
    t0 = time.perf_counter()
    loss = forward()
    t1 = time.perf_counter()
    loss.backward()
    if clock is not None:
        clock.forward += t1 - t0
        clock.backward += time.perf_counter() - t1
    return loss.detach()


StepFn = Callable[..., object]


def detached(tree):
    """``tree`` with its tensors detached (no autograd graph kept alive by the caller)."""
    flat, spec = tree_flatten(tree)
    return tree_unflatten([x.detach() if isinstance(x, torch.Tensor) else x for x in flat], spec)


def fn_name(fn: StepFn) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__


class GraphedStep:
    """``graphs.capture(step_fn)``: call it like ``step_fn``; the runner decides whether the
    call runs eagerly, is captured or replays (``graphs.forward_backward(step_fn, ...)``)."""

    def __init__(self, graphs, fn: StepFn) -> None:
        if not callable(fn):
            raise TypeError(f"capture(step_fn): {fn!r} is not callable")
        self.graphs, self.fn = graphs, fn

    def __call__(self, *tensors, **kwargs):
        return self.graphs.forward_backward(self.fn, *tensors, **kwargs)


VERIFY_OPTIONS = (False, True, "raise")


def check_verify_option(verify) -> None:
    if not any(verify is v or (isinstance(v, str) and verify == v) for v in VERIFY_OPTIONS):
        raise GraphConfigError(
            f"verify={verify!r}: expected False, True (record and warn on a difference) or "
            "'raise' (raise GraphVerificationError)"
        )


def record_verification(
    results: list[VerifyResult], result: VerifyResult, mode, tracker: ModuleTracker
) -> None:
    results.append(result)
    if result.identical:
        return
    result.capture_queries = [
        f"{site}{f' (in {module})' if module else ''}"
        for site, module in tracker.capture_queries.items()
    ]
    if mode == "raise":
        raise GraphVerificationError(result.describe())
    warnings.warn(result.describe(), stacklevel=3)


def check_capturable(
    model: nn.Module,
    scopes: list[str] | tuple[str, ...],
    warmup_steps: int,
    *,
    graphs: bool = True,
    scope_modules: ScopeModules | None = None,
) -> FSDPState:
    """What every capture needs (layerwise or full_iteration); returns the root's state.

    ``graphs=False`` (an eager runner: the same step logic without graphs) checks only what
    does not depend on capturing: the scopes, the warmup steps and fully_shard.
    """
    check_scopes(scopes, scope_modules=scope_modules)
    if warmup_steps < 1:
        raise GraphConfigError(
            f"cuda_graph_warmup_steps={warmup_steps} must be >= 1 (--cuda-graph-warmup-steps):"
            " an eager step records the call shapes, plans FSDP's static buffers and (for "
            "full_iteration) warms up the capture stream"
        )
    if not isinstance(model, FSDPModule):
        raise GraphConfigError(
            f"{type(model).__name__} is not fully_shard-ed: apply fully_shard to every "
            "layer and then to the root before capturing CUDA graphs"
        )
    root: FSDPState = model._fsdp_state
    if not graphs:
        return root
    check_static_buffers(root.buffer_policy, scopes)
    device = next(model.parameters()).device
    if device.type != "cuda":
        raise GraphConfigError(
            f"CUDA graphs need a CUDA device, but the model is on {device}; use "
            "cuda_graph_impl='none' (--cuda-graph-impl none) on CPU, or eager=True to run the "
            "same step API without graphs"
        )
    return root


# [Note: NCCL graph registration and the all-to-all]
# NCCL registers the buffers of collectives captured in a graph by itself (NCCL_GRAPH_REGISTER,
# on by default). With that registration, replays of full_iteration and whole-step graphs
# holding NCCL all-to-alls never finished on two H200s (NCCL 2.28.9): both ranks wait in the
# graph. Seen twice: the gradients' all-to-all of reduce_scatter_fp32_accumulation (reduce.py
# [Note: reduce-scatter with fp32 accumulation]) on the 16-layer GPT, and the expert-parallel
# token dispatch (models/ep_dispatch.py) of an 8-layer MoE GPT of hidden 1024, EP 2; the
# 2-layer (hidden 256) and 4-layer MoE (hidden 256) versions of both replayed. With
# NCCL_GRAPH_REGISTER=0 the same graphs replay, bit-identical to eager. Layer graphs holding
# the same dispatch (whole layers, ``attn moe``) replayed with registration on, and the
# reduce-scatters and all-gathers that graphs capture replay either way, equally fast
# (bench/results/whole_step_nccl_graph_register_*). NCCL reads the variable once per process,
# at its first captured collective: set at a capture it could come too late (an earlier
# capture in the process read it), so graph_fsdp reads it only to refuse. While a
# full_iteration or whole-step graph is captured, every ``torch.distributed`` all-to-all is
# watched, whoever issues it (FSDP's reduction, a model's dispatch, Megatron's token
# dispatcher): one over NCCL and more than one rank is refused before NCCL sees it, naming
# where it was issued, unless the registration is off.
_ALL_TO_ALLS = ("all_to_all_single", "all_to_all")


@contextmanager
def refusing_registered_all_to_all(tracker: ModuleTracker, what: str) -> Iterator[None]:
    """While ``what`` (a full_iteration or whole-step graph) is captured: an NCCL all-to-all
    over more than one rank raises :class:`GraphConfigError` unless NCCL's graph buffer
    registration is off (the note above)."""
    value = os.environ.get(GRAPH_REGISTER_ENV)
    if value == "0":
        yield
        return
    modules = (dist, dist.distributed_c10d)
    originals = [(m, name, getattr(m, name)) for m in modules for name in _ALL_TO_ALLS]

    def watched(name, original):
        signature = inspect.signature(original)

        @functools.wraps(original)
        def call(*args, **kwargs):
            try:
                group = signature.bind(*args, **kwargs).arguments.get("group")
            except TypeError:  # a wrong call: torch's own error says what is wrong
                return original(*args, **kwargs)
            ranks = dist.get_world_size(group)
            if ranks > 1 and dist.get_backend(group) == "nccl":
                raise GraphConfigError(
                    _registered_all_to_all(name, sys._getframe(1), tracker, what, ranks, value)
                )
            return original(*args, **kwargs)

        return call

    for m, name, original in originals:
        setattr(m, name, watched(name, original))
    try:
        yield
    finally:
        for m, name, original in originals:
            setattr(m, name, original)


def _registered_all_to_all(name, frame, tracker, what, ranks, value) -> str:
    module, phase = tracker.running()
    inside = f"the {phase} of {module}" if module else "the step function"
    site = f"{frame.f_code.co_filename}:{frame.f_lineno}"
    fp32 = frame.f_globals.get("__name__") == "graph_fsdp.fsdp.comm"
    who = "FSDP's gradient reduction with reduce_scatter_fp32_accumulation calls " if fp32 else ""
    return (
        f"{who}torch.distributed.{name} over {ranks} NCCL ranks (called "
        f"at {site}, in {inside}) is captured into {what} with NCCL's graph buffer "
        f"registration on ({GRAPH_REGISTER_ENV}={value if value is not None else 'unset'}): "
        f"its replay hangs. Set {GRAPH_REGISTER_ENV}=0 in the environment before the process "
        "group is created (graph-fsdp's commands do it for --expert-model-parallel-size > 1 and "
        "--ddp-reduce-scatter-with-fp32-accumulation)"
        + (
            ", or drop reduce_scatter_fp32_accumulation (on 2 ranks the fp32 reduce-scatter "
            "gives the same bits), or capture layerwise scopes (FSDP's collectives stay eager)"
            if fp32
            else ", or capture layerwise scopes (layer graphs holding this dispatch replayed "
            "with registration on)"
        )
    )
