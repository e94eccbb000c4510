"""Gradient norms and clipping over sharded parameters.

[Note: global gradient norm] A sharded parameter holds this rank's piece of the main weights
and, after backward, of their gradients: the norm of the whole gradient needs every rank's
pieces. ``torch.nn.utils.clip_grad_norm_`` sees plain tensors and would clip each rank's
pieces by that rank's own norm - different coefficients on different ranks, silently not the
clipping of the unsharded model (torch FSDP2 gets it right through DTensor). So
``clip_grad_norm_`` here sums each element once: a group's contributions are reduced over
the ranks that own disjoint pieces (the shard group when the optimizer is sharded, and the
replicas when it is sharded over them too); gradients held whole on every rank (``no_shard``,
replicas of one shard) and parameters graph_fsdp does not manage count once, as torch
counts them. Expert parameters (experts.py [Note: expert groups]) are sharded over the
expert-data-parallel group and differ across the expert-parallel group: their pieces are
summed over the first (when sharded), then over the second - each element of the global
model once, as Megatron sums its expert norms over the expert-model-parallel ranks.
Tensor-parallel parameters (tensor_parallel.py) split over a TP group are summed over it
too; those every TP rank holds whole (norms under sequence parallelism) count once, as
Megatron counts only tensor-parallel parameters and TP rank 0's duplicates.
``fully_shard`` routes ``torch.nn.utils.clip_grad_norm_`` here whenever the
parameters include graph_fsdp's (``install_torch_clip``), so training loops written for
FSDP2, DDP or HuggingFace's Trainer clip by the global norm unchanged; a reference bound
before the first ``fully_shard`` call (``from torch.nn.utils import clip_grad_norm_`` at
import time) is not rerouted - call ``graph_fsdp.clip_grad_norm_`` or the model's method.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.utils as nn_utils
import torch.nn.utils.clip_grad as clip_grad

from graph_fsdp.fsdp.tensor_parallel import TP_ATTR, is_dtensor


def _reduction_groups(group) -> list:
    """Process groups over which ``group``'s gradient pieces are disjoint."""
    comm = group.comm
    out = []
    if group.placements.optim and comm.world_size > 1:
        out.append(comm.group)
    if group.over_replicas:
        out.append(comm.replicate_group)
    if group.expert is not None and group.expert.ep_size > 1:
        out.append(group.expert.ep)  # other experts: experts.py [Note: expert groups]
    return out


# [Note: the norm beside the last reduction] A step's global norm reads every reduced main
# gradient, and the main stream joins the reductions at the end of the backward
# (state.py ``root_final_callback``): so the last unit's reduce-scatter - in a ZeRO-3 GPT
# the input embedding's, vocab x hidden in fp32, after the last backward kernel - runs with
# nothing beside it, and the norm's pass over the main gradients (0.17 ms for 133M fp32
# elements per rank at world 2 on an H200) only starts after it. The one-graph step
# (whole_step.py, ``StepPolicy.norm_beside_last_reduction``) records its reductions in
# order (capture_context.py ``recording_reductions``) and hands the norm an
# :class:`EarlyReductions`: the per-tensor norms of the groups reduced before the last run on
# a side stream that waits only for their reductions, beside the last one; the main stream
# waits for that stream and adds the last groups' share. The per-tensor norms are the ones
# one ``_foreach_norm`` over all of them gives (each tensor's norm is reduced from its own
# chunks), combined in the same order: the same bits either way. Without CUDA, or where a
# reduction ends on the replicas' stream (HSDP), it is not used.


@dataclass(frozen=True)
class EarlyReductions:
    """The gradient groups whose reductions ended before the step's last one ([Note: the
    norm beside the last reduction]): their ``id``s, the event recorded after the last of
    them, and the stream their norms run on."""

    groups: frozenset[int]
    event: torch.cuda.Event
    stream: torch.cuda.Stream

    @classmethod
    def of(
        cls, reductions: Sequence[tuple[object, torch.cuda.Event | None]], stream
    ) -> EarlyReductions | None:
        """From ``(group, event)`` in reduction order (capture_context.py ``reductions``);
        None when there is nothing to split (fewer than two, or one without an event)."""
        if stream is None or len(reductions) < 2 or any(e is None for _, e in reductions):
            return None
        return cls(frozenset(id(g) for g, _ in reductions[:-1]), reductions[-2][1], stream)


def _tensor_norms(
    gs: list[torch.Tensor], owners: list[int | None], norm_type: float, early
) -> list[torch.Tensor]:
    """``torch._foreach_norm`` of ``gs`` (as float32); the ``early`` groups' on its stream
    ([Note: the norm beside the last reduction])."""
    first = [] if early is None else [i for i, o in enumerate(owners) if o in early.groups]
    if not first:
        return torch._foreach_norm([g.float() for g in gs], norm_type)
    rest = [i for i, o in enumerate(owners) if o not in early.groups]
    main = torch.cuda.current_stream(gs[0].device)
    early.stream.wait_event(early.event)
    with torch.cuda.stream(early.stream):
        side = torch._foreach_norm([gs[i].float() for i in first], norm_type)
    for n in side:
        n.record_stream(main)  # made on the side stream, read (and freed) on the main one
    main.wait_stream(early.stream)
    late = torch._foreach_norm([gs[i].float() for i in rest], norm_type) if rest else []
    out: list[torch.Tensor] = [None] * len(gs)  # type: ignore[list-item]
    for i, n in zip(first + rest, [*side, *late], strict=True):
        out[i] = n
    return out


def global_grad_norm(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    norm_type: float = 2.0,
    *,
    early: EarlyReductions | None = None,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``(norm, grads)``: the norm of order ``norm_type`` of the whole (unsharded) gradient
    ([Note: global gradient norm]) as a 0-d float32 tensor on the device - no host sync, so
    it can be captured in a CUDA graph - and the gradients it covers. Every rank must call
    it with the same parameters (one collective per set of reduction groups). ``early``: the
    groups reduced before the last one, normed beside it ([Note: the norm beside the last
    reduction])."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    norm_type = float(norm_type)
    if math.isnan(norm_type) or norm_type <= 0:
        raise ValueError(f"norm_type must be positive (or inf), got {norm_type}")
    # Per set of reduction groups (keyed by identity): the groups and their gradients; one
    # collective per set, in first-seen order - the same on every rank.
    buckets: dict[tuple, tuple[list, list[torch.Tensor], list[int | None]]] = {}
    grads: list[torch.Tensor] = []
    unmanaged_dtensors: list[torch.Tensor] = []
    device = None
    for p in params:
        group = getattr(p, "_graph_fsdp_group", None)
        over = _reduction_groups(group) if group is not None else []
        tp = getattr(p, TP_ATTR, None)
        if tp is not None and tp.sharded:  # the other TP ranks' pieces (replicated: once)
            over = [*over, tp.group]
        elif group is None and is_dtensor(p):
            unmanaged_dtensors.append(p)
            continue
        bucket = buckets.setdefault(tuple(id(g) for g in over), (over, [], []))
        if device is None:
            device = group.device if group is not None else p.device
        if p.grad is None:
            continue
        grads.append(p.grad)
        if p.grad.numel():
            bucket[1].append(p.grad)
            bucket[2].append(id(group) if group is not None else None)
    inf = math.isinf(norm_type)
    dtensor_total = _dtensor_norm(unmanaged_dtensors, norm_type, inf)
    if dtensor_total is not None:
        grads += [p.grad for p in unmanaged_dtensors if p.grad is not None]
        device = device or dtensor_total.device
    if device is None:
        return torch.zeros(()), grads
    total = torch.zeros((), dtype=torch.float32, device=device)
    if dtensor_total is not None:
        total = dtensor_total.to(device)
    for over, gs, owners in buckets.values():
        if gs:
            norms = _tensor_norms(gs, owners, norm_type, early)
            stacked = torch.stack([n.to(device) for n in norms])
            local = stacked.max() if inf else stacked.pow(norm_type).sum()
        else:
            local = torch.zeros((), dtype=torch.float32, device=device)
        for pg in over:
            dist.all_reduce(local, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, group=pg)
        total = torch.maximum(total, local) if inf else total + local
    if not inf:
        total = total.pow(1.0 / norm_type)
    return total, grads


def clip_grads_(grads: list[torch.Tensor], max_norm: float, total: torch.Tensor) -> None:
    """Scale ``grads`` by ``min(1, max_norm / (total + 1e-6))`` (torch's coefficient), on the
    device."""
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    by_dtype: dict[tuple, list[torch.Tensor]] = {}
    for g in grads:
        local = g._local_tensor if is_dtensor(g) else g
        by_dtype.setdefault((local.device, local.dtype), []).append(local)
    for (dev, dtype), gs in by_dtype.items():
        torch._foreach_mul_(gs, coef.to(device=dev, dtype=dtype))


def clip_grad_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` with the norm of the whole (unsharded) gradient
    ([Note: global gradient norm]); every rank must call it with the same parameters.
    ``foreach`` is accepted for torch's signature (the foreach kernels are always used)."""
    total, grads = global_grad_norm(parameters, norm_type)
    if error_if_nonfinite and not torch.isfinite(total).item():
        raise RuntimeError(
            f"the total norm of order {float(norm_type)} of the gradients is non-finite "
            f"({total.item()}), so it cannot be clipped; pass error_if_nonfinite=False to clip "
            "anyway"
        )
    clip_grads_(grads, max_norm, total)
    return total


def _dtensor_norm(params: list[torch.Tensor], norm_type: float, inf: bool) -> torch.Tensor | None:
    """The ``norm_type``-th power (max for inf) of the norm of DTensor gradients graph_fsdp
    does not manage (a plan's parameters left outside ``fully_shard``): DTensor's own
    reduction over their mesh, as torch's clip does."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return None
    norms = [torch.linalg.vector_norm(g.float(), norm_type).full_tensor() for g in grads]
    stacked = torch.stack(norms)
    return stacked.max() if inf else stacked.pow(norm_type).sum()


_TORCH_CLIP = None


def install_torch_clip() -> None:
    """Route ``torch.nn.utils.clip_grad_norm_`` to :func:`clip_grad_norm_` for parameter
    lists that hold graph_fsdp's sharded parameters (others go to torch's, unchanged)."""
    global _TORCH_CLIP
    if _TORCH_CLIP is not None:
        return
    original = _TORCH_CLIP = nn_utils.clip_grad_norm_

    def routed(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        if any(getattr(p, "_graph_fsdp_group", None) is not None for p in params):
            return clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite, foreach)
        return original(params, max_norm, norm_type, error_if_nonfinite, foreach)

    routed.__doc__ = original.__doc__
    routed.__wrapped__ = original
    routed._graph_fsdp_routed = True
    nn_utils.clip_grad_norm_ = routed
    clip_grad.clip_grad_norm_ = routed
