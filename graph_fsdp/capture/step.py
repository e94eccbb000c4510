"""What both graph runners share: the step call, its host clock, and the checks before capture.

:class:`GraphedStep` is what ``graphs.capture(step_fn)`` returns for either runner
(layerwise.py, full_iteration.py); :func:`eager_forward_backward` is the built-in step of the
older ``forward_backward(micro, x, y, denom, clock)`` call; :func:`check_capturable` is what
every capture needs of the model; ``verify`` options and results are handled alike by both.
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable
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
from graph_fsdp.fully_shard import FSDPModule
from graph_fsdp.state import FSDPState, collect_states


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
    if "full_iteration" in scopes:
        check_graphed_all_to_all(model)
    return root


# [Note: NCCL graph registration and the all-to-all]
# With reduce_scatter_fp32_accumulation the gradients go through dist.all_to_all_single
# (reduce.py [Note: reduce-scatter with fp32 accumulation]); a full_iteration or whole-step
# graph captures it. NCCL registers the buffers of collectives captured in a graph by itself
# (NCCL_GRAPH_REGISTER, on by default), and with that registration the replay of the
# all-to-all never finished on two H200s (NCCL 2.28.9, the 16-layer GPT: both ranks wait in
# the graph; a 2-layer GPT of hidden 256 replayed). With NCCL_GRAPH_REGISTER=0 the same graph
# replays (21 timed replays per row). Eager and layerwise steps run the all-to-all outside
# any graph and need nothing. The reduce-scatters and all-gathers the graphs capture
# otherwise replay either way, equally fast (bench/results/whole_step_nccl_graph_register_*).


def check_graphed_all_to_all(model: nn.Module) -> None:
    """Refuse to capture an NCCL all-to-all of gradients while NCCL would register its
    buffers in the graph (a replay that hangs: the note above)."""
    if os.environ.get(GRAPH_REGISTER_ENV) == "0":
        return
    units = [
        group.fqn or "root"
        for state in collect_states(model)
        for group in state.groups
        if group.fp32_accumulating
        and group.comm.world_size > 1
        and dist.get_backend(group.comm.group) == "nccl"
    ]
    if units:
        raise GraphConfigError(
            f"reduce_scatter_fp32_accumulation sends the gradients of {units[0]}"
            f"{f' and {len(units) - 1} more units' if len(units) > 1 else ''} through an NCCL "
            "all-to-all that a full_iteration graph captures; with NCCL's graph buffer "
            f"registration on ({GRAPH_REGISTER_ENV}="
            f"{os.environ.get(GRAPH_REGISTER_ENV, 'unset')}) its replay hangs. Set "
            f"{GRAPH_REGISTER_ENV}=0 in the environment before the process group is created "
            "(graph-fsdp's commands do it for --ddp-reduce-scatter-with-fp32-accumulation), "
            "or drop reduce_scatter_fp32_accumulation (on 2 ranks the fp32 reduce-scatter "
            "gives the same bits), or capture layerwise scopes (the collectives stay eager)"
        )
