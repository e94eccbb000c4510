"""Where a group's parameters lie in its flat buffers: ``ParamRef``, ranges and views.

Functions over a ``FlatLayout`` and tensors (no group state): which range of the flat layout
this rank owns (param_group.py [Note: HSDP ranges]), the slice of a parameter that falls into
it, one view per parameter of a flat buffer, and the pieces of a flat buffer no gradient
covers. ``FlatParamGroup`` builds and re-points its views with them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from graph_fsdp.buffers.layout import FlatLayout
from graph_fsdp.fsdp.api import Placements
from graph_fsdp.fsdp.comm import CommContext
from graph_fsdp.fsdp.experts import ExpertLayout
from graph_fsdp.fsdp.tensor_parallel import TPSpec


@dataclass
class ParamRef:
    """Where one original parameter lives: its owners and its slot in the flat layout."""

    fqn: str
    owners: list[tuple[nn.Module, str]]
    shape: torch.Size
    index: int
    sharded: nn.Parameter
    """1-D view of main_flat (this rank's part; may be empty). Registered on the module."""
    global_offset: int = 0
    """Offset of ``sharded`` inside the parameter's flattened numbering."""
    unsharded: nn.Parameter | None = None
    expert: ExpertLayout | None = None
    """Expert parameters: where this EP rank's parameter lies in the global one (None: dense,
    or an expert layout nobody declared - checkpoints refuse those)."""
    tp: TPSpec | None = None
    """Tensor-parallel parameters: where this TP rank's local tensor (``shape``) lies in the
    global one (tensor_parallel.py [Note: tensor-parallel parameters])."""
    local_fqn: str = ""
    """The name under the unit's module (``fqn`` becomes the name under the root at lazy
    init)."""
    grad_view: torch.Tensor | None = None
    """1-D view of ``main_grad`` beside ``sharded``: what the sharded ``.grad`` is set to."""


def owned_ranges(
    layout: FlatLayout, comm: CommContext, placements: Placements, over_replicas: bool
) -> tuple[tuple[int, int], tuple[int, int]]:
    """``(owned, shard_range)`` of this rank ([Note: HSDP ranges]; with one replica both are
    the 1-D shard range, or without a sharded optimizer the whole layout is owned)."""
    R = comm.replicate_size
    piece = layout.shard_numel
    slo, shi = comm.rank * R * piece, (comm.rank + 1) * R * piece
    if not placements.optim:
        lo, hi = 0, layout.total
    elif over_replicas:
        lo = slo + comm.replicate_rank * piece
        hi = lo + piece
    else:
        lo, hi = slo, shi
    return (lo, hi), (slo, shi)


def owned_slice(offset: int, numel: int, owned: tuple[int, int]) -> tuple[int, int]:
    """``(start, end)`` of a parameter at ``offset`` of ``numel`` elements that falls into
    the ``owned`` range, in the parameter's flattened numbering (``start == end``: none)."""
    lo, hi = owned
    start = min(max(lo - offset, 0), numel)
    end = max(min(hi - offset, numel), start)
    return start, end


def param_views(flat: torch.Tensor, refs: list[ParamRef], layout: FlatLayout) -> list:
    """One view of ``flat`` per parameter, shaped like it, at its layout offset."""
    return [
        flat[offset : offset + ref.shape.numel()].view(ref.shape)
        for ref, offset in zip(refs, layout.offsets)
    ]


def uncovered(flat: torch.Tensor, layout: FlatLayout, covered: tuple[bool, ...]) -> list:
    """Views of ``flat`` outside the parameters flagged in ``covered``: alignment gaps, the
    world-size padding, parameters without a gradient."""
    gaps, pos = [], 0
    for n, offset, cov in zip(layout.numels, layout.offsets, covered):
        if cov:
            if offset > pos:
                gaps.append(flat[pos:offset])
            pos = offset + n
    if flat.numel() > pos:
        gaps.append(flat[pos:])
    return gaps


def broadcast_from_first(full: torch.Tensor, comm: CommContext) -> None:
    """Meta-device init: every rank gets the values of the first rank of the mesh (first
    across replicas, then within the shard group)."""
    for group, size in ((comm.replicate_group, comm.replicate_size), (comm.group, comm.world_size)):
        if size > 1:
            torch.distributed.broadcast(
                full, src=torch.distributed.get_global_rank(group, 0), group=group
            )
