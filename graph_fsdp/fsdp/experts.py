"""Expert parallelism with FSDP: expert parameters sharded over their own process group.

    ep_mesh = init_expert_mesh("cuda", ep_size=2)   # 2-D (edp, ep) DeviceMesh over the world
    # (or expert_mesh_from_groups("cuda", ep_group=..., edp_group=...) from existing groups)
    # the model holds the experts of its rank of ep_mesh["ep"] and dispatches tokens to the
    # other EP ranks itself (an all-to-all over ep_mesh["ep"].get_group())
    for layer in model.layers:
        mark_expert_params(layer.moe.experts)      # or Megatron's ``param.allreduce = False``
        fully_shard(layer, expert_mesh=ep_mesh)    # dense: over DP; experts: over EDP
    fully_shard(model)

This is Megatron-FSDP's layout: experts are partitioned over the expert-parallel (EP) group;
each expert parameter is sharded over the expert-data-parallel (EDP) group - the ranks that
hold the same experts, world / EP of them - and every other parameter over the data-parallel
(DP) group, as without experts.

[Note: expert groups]
- Which parameters: those :func:`mark_expert_params` marked, and Megatron-Core's expert
  parameters (``param.allreduce is False``, which its expert linears set when its
  ``expert_model_parallel_size`` > 1). A unit holding either needs ``fully_shard(...,
  expert_mesh=...)``: without one it is refused (reduced over DP, different experts would be
  summed). An expert mesh whose EP size differs from Megatron's initialised parallel state
  is refused too.
- One ``FlatParamGroup`` per (kind, compute dtype): a unit's dense and expert parameters
  never share a flat buffer. The expert groups' ``CommContext`` is the root's re-bound to the
  EDP group (``CommContext.over``): the same all-gather and reduce-scatter streams. Both kinds'
  collectives queue on one stream in program order - the same order on every rank, so two
  communicators can never wait on each other in opposite orders - and keep their overlap
  with compute; a unit's dense and expert collectives do not overlap each other. The root's
  ``wait_reductions`` (final backward callback, ``finish_grad_sync``) therefore covers both.
- Gradients: dense ones are summed over DP, expert ones over EDP, and both are divided by the
  DP size (``CommContext.grad_divisor``), as Megatron's DDP does without
  ``average_in_collective`` (``gradient_scaling_factor`` and
  ``expert_gradient_scaling_factor`` are both 1/DP): an expert's gradient on this rank already
  sums what every EP rank's tokens contributed (the dispatch's backward brings them back), so
  the sum over EDP adds each DP rank's contribution exactly once.
- Static buffers: the expert groups' allocator keys carry the tag ``"experts"`` (a fourth
  element), so their names never collide with the dense groups' and the double buffer gives
  them their own slot rings: units alternate slots per kind, and a unit's two kinds never
  ask for one slot (capture paths key on the groups and see both).
- Gradient norm (grad_norm.py): an expert shard is summed over EDP (when sharded) and then
  over EP (different experts), so each element of the global model counts once.
- Checkpoints (checkpoint.py): an expert parameter is saved as its piece of the *global*
  parameter - every EP rank's experts - under a global name, so a checkpoint written at one
  EP size loads at another (:class:`ExpertLayout` says where the piece lies).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

EXPERT_ATTR = "_graph_fsdp_expert"
"""Attribute :func:`mark_expert_params` sets on a parameter: its :class:`ExpertLayout`."""
EXPERT_KEY_TAG = "experts"
"""Fourth element of an expert group's allocator keys ([Note: expert groups])."""
EP_DIM, EDP_DIM = "ep", "edp"
"""The dimension names an expert mesh must have."""


@dataclass(frozen=True)
class ExpertLayout:
    """Where one EP rank's expert parameter lies in the global parameter (all experts).

    ``template`` None (stacked): dimension 0 of the parameter indexes this rank's experts,
    e.g. a ``(num_local_experts, hidden, ffn)`` weight; the global parameter stacks every EP
    rank's along dimension 0 (EP rank r's at rows ``[r * n, (r + 1) * n)``), under the same
    name. Otherwise the parameter is local expert ``local_index`` of ``num_local``, whose
    name ends with ``template`` filled with that index (``"{}.linear_fc1.weight"`` for
    Megatron's ``local_experts.3.linear_fc1.weight``, ``"weight{}"`` for TE's grouped
    ``weight3``); its global name carries the global index ``ep_rank * num_local + i``.
    """

    template: str | None = None
    local_index: int = 0
    num_local: int = 1
    partitioned_over: tuple[int, ...] | None = None
    """The global ranks the parameter was partitioned over, when its holder knows them
    (vocab_parallel.py): ``fully_shard`` refuses an expert mesh whose EP group is another."""

    def global_entry(
        self, fqn: str, shape: torch.Size, ep_rank: int, ep_size: int
    ) -> tuple[str, int, torch.Size]:
        """``(global name, offset of this parameter's first element in the flattened global
        parameter, global shape)``."""
        if self.template is None:
            if len(shape) == 0:
                raise ValueError(
                    f"expert parameter {fqn} is a scalar: a stacked expert parameter indexes "
                    "its experts along dimension 0; mark it with mark_expert_params(..., "
                    "per_expert_children=True) or leave it dense"
                )
            return fqn, ep_rank * shape.numel(), torch.Size((ep_size * shape[0], *shape[1:]))
        tail = self.template.format(self.local_index)
        if not fqn.endswith(tail):
            raise ValueError(
                f"expert parameter {fqn}: its name does not end with {tail!r}, the local "
                f"expert index it was marked with; mark the module holding the experts again"
            )
        index = ep_rank * self.num_local + self.local_index
        return fqn[: len(fqn) - len(tail)] + self.template.format(index), 0, shape


def mark_expert_params(
    module_or_params: nn.Module | Iterable[nn.Parameter], *, per_expert_children: bool = False
) -> nn.Module | list[nn.Parameter]:
    """Mark parameters as expert parameters (sharded over ``fully_shard``'s ``expert_mesh``).

    By default every parameter indexes this rank's experts along dimension 0 (stacked
    experts). ``per_expert_children=True``: ``module`` holds one child per local expert,
    named ``0 .. n-1`` (an ``nn.ModuleList``), and child i's parameters are local expert i's.
    Call before ``fully_shard``. Returns its argument.
    """
    if isinstance(module_or_params, nn.Module):
        module = module_or_params
        if not per_expert_children:
            params = list(module.parameters())
            layouts = [ExpertLayout()] * len(params)
        else:
            children = list(module.named_children())
            names = [name for name, _ in children]
            if not children or names != [str(i) for i in range(len(children))]:
                raise ValueError(
                    f"mark_expert_params({type(module).__name__}, per_expert_children=True) "
                    f"needs one child per local expert named 0..n-1 (an nn.ModuleList), got "
                    f"children {names[:6]}: pass the list of experts itself"
                )
            params, layouts = [], []
            for i, (_, child) in enumerate(children):
                for name, p in child.named_parameters():
                    params.append(p)
                    layouts.append(ExpertLayout("{}." + name, i, len(children)))
        result: nn.Module | list[nn.Parameter] = module
    else:
        if per_expert_children:
            raise ValueError(
                "mark_expert_params(params, per_expert_children=True) needs the module that "
                "holds one child per local expert, not a list of parameters"
            )
        params = list(module_or_params)
        layouts = [ExpertLayout()] * len(params)
        result = params
    if not params:
        raise ValueError(
            f"mark_expert_params: {type(module_or_params).__name__} holds no parameters to mark"
        )
    for p, layout in zip(params, layouts):
        if getattr(p, "_graph_fsdp_sharded", False) or getattr(p, "_graph_fsdp_sharded_as", None):
            raise ValueError(
                "mark_expert_params after fully_shard: mark the experts before sharding the "
                "unit that holds them"
            )
        setattr(p, EXPERT_ATTR, layout)
    return result


def is_expert(p: torch.Tensor) -> bool:
    """Marked by :func:`mark_expert_params` or by Megatron-Core (``allreduce is False``)."""
    return getattr(p, EXPERT_ATTR, None) is not None or getattr(p, "allreduce", True) is False


_LOCAL_EXPERTS = re.compile(r"(?:^|\.)local_experts\.(\d+)\.")
_GROUPED = re.compile(r"(weight|bias)(\d+)")


def layout_of(unit: nn.Module, fqn: str, p: nn.Parameter, owner: nn.Module) -> ExpertLayout | None:
    """The layout :func:`mark_expert_params` set, or the one Megatron-Core's expert modules
    imply (``SequentialMLP``'s ``local_experts.<i>.``, TE ``GroupedLinear``'s
    ``weight<i>``); None when unknown (training works, checkpoints refuse it)."""
    marked = getattr(p, EXPERT_ATTR, None)
    if marked is not None:
        return marked
    match = _LOCAL_EXPERTS.search(fqn)
    if match is not None:
        container = fqn[: match.start(1)].rstrip(".")
        experts = unit.get_submodule(container)
        return ExpertLayout("{}." + fqn[match.end() :], int(match.group(1)), len(experts))
    name = fqn.rsplit(".", 1)[-1]
    grouped = _GROUPED.fullmatch(name)
    if grouped is not None and isinstance(getattr(owner, "num_gemms", None), int):
        return ExpertLayout(grouped.group(1) + "{}", int(grouped.group(2)), owner.num_gemms)
    return None


@dataclass(frozen=True)
class ExpertGroups:
    """The process groups of an expert mesh, resolved once per ``fully_shard`` call."""

    mesh: object
    """The 2-D ``(edp, ep)`` DeviceMesh the user passed."""
    edp: dist.ProcessGroup
    """Shards the expert parameters and reduces their gradients."""
    ep: dist.ProcessGroup
    """The ranks holding the other experts (gradient norm, checkpoint offsets)."""
    ep_size: int
    ep_rank: int

    def describe(self) -> str:
        return (
            f"expert mesh ep {self.ep_size} x edp {dist.get_world_size(self.edp)} (this rank's "
            f"EP group {dist.get_process_group_ranks(self.ep)}, EDP group "
            f"{dist.get_process_group_ranks(self.edp)})"
        )


def init_expert_mesh(device_type: str, ep_size: int, *, world_size: int | None = None):
    """The 2-D ``(edp, ep)`` DeviceMesh over the world for ``ep_size``-way expert
    parallelism, in Megatron's rank order: consecutive ranks form an EP group (ranks 0..EP-1
    hold different experts), ranks ``EP`` apart hold the same experts (an EDP group)."""
    world = dist.get_world_size() if world_size is None else world_size
    if not isinstance(ep_size, int) or ep_size < 1 or world % ep_size:
        raise ValueError(
            f"init_expert_mesh: ep_size={ep_size!r} must be a positive divisor of the world "
            f"size {world} (the expert-data-parallel size is world / ep_size)"
        )
    return init_device_mesh(device_type, (world // ep_size, ep_size), mesh_dim_names=("edp", "ep"))


def expert_mesh_from_groups(
    device_type: str, *, ep_group: dist.ProcessGroup, edp_group: dist.ProcessGroup
):
    """The 2-D ``(edp, ep)`` DeviceMesh of process groups that exist already (Megatron's
    ``parallel_state.get_expert_model_parallel_group()`` and
    ``get_expert_data_parallel_group()``), for ``fully_shard(..., expert_mesh=...)``. A
    collective over the default group (each rank's coordinates are exchanged once)."""
    ep, edp, world = (
        dist.get_world_size(ep_group),
        dist.get_world_size(edp_group),
        dist.get_world_size(),
    )
    coords: list = [None] * world
    dist.all_gather_object(coords, (dist.get_rank(edp_group), dist.get_rank(ep_group)))
    fix = "pass groups with EP x EDP = world (tensor and pipeline parallel size 1)"
    if ep * edp != world:
        raise ValueError(
            f"expert_mesh_from_groups: EP groups of {ep} ranks and EDP groups of {edp} ranks "
            f"cannot tile the {world} ranks of the world; {fix}"
        )
    grid = torch.full((edp, ep), -1, dtype=torch.int64)
    for rank, (i, j) in enumerate(coords):
        if grid[i, j] != -1:
            raise ValueError(
                f"expert_mesh_from_groups: ranks {int(grid[i, j])} and {rank} are both EDP rank "
                f"{i} and EP rank {j}: the groups do not tile the world; {fix}"
            )
        grid[i, j] = rank
    return DeviceMesh.from_group(
        [edp_group, ep_group], device_type, mesh=grid, mesh_dim_names=(EDP_DIM, EP_DIM)
    )


def resolve_expert_mesh(mesh, owner: str, dense_ranks: list[int], device: torch.device):
    """The :class:`ExpertGroups` of ``mesh``, or a clear error when it does not fit."""
    fix = (
        f"build it with graph_fsdp.init_expert_mesh({device.type!r}, ep_size) (a 2-D mesh with "
        f"dimensions named {EDP_DIM!r} and {EP_DIM!r} over the data-parallel ranks)"
    )
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(
            f"fully_shard({owner}, expert_mesh={type(mesh).__name__}): expected a DeviceMesh; {fix}"
        )
    names = mesh.mesh_dim_names
    if mesh.ndim != 2 or names is None or set(names) != {EP_DIM, EDP_DIM}:
        raise ValueError(
            f"fully_shard({owner}): expert_mesh must be 2-D with dimensions {EDP_DIM!r} (shards "
            f"the expert parameters) and {EP_DIM!r} (holds the other experts), got a "
            f"{mesh.ndim}-D mesh named {names}; {fix}"
        )
    if mesh.device_type != device.type:
        raise ValueError(
            f"fully_shard({owner}): expert_mesh device type {mesh.device_type!r} does not match "
            f"the module's device {device}; {fix}"
        )
    ranks = sorted(mesh.mesh.flatten().tolist())
    if ranks != sorted(dense_ranks) or mesh.get_coordinate() is None:
        raise ValueError(
            f"fully_shard({owner}): expert_mesh {tuple(mesh.shape)} {names} covers ranks "
            f"{ranks[:8]}{' ...' if len(ranks) > 8 else ''}, but the data-parallel mesh covers "
            f"{sorted(dense_ranks)[:8]}{' ...' if len(dense_ranks) > 8 else ''} (this rank "
            f"{dist.get_rank()}): EP x EDP must be the data-parallel ranks themselves; {fix}"
        )
    ep, edp = mesh[EP_DIM].get_group(), mesh[EDP_DIM].get_group()
    groups = ExpertGroups(mesh, edp, ep, dist.get_world_size(ep), dist.get_rank(ep))
    known = megatron_expert_parallel_size()
    if known is not None and known != groups.ep_size:
        raise ValueError(
            f"fully_shard({owner}): expert_mesh has EP size {groups.ep_size} but Megatron's "
            f"parallel state has expert_model_parallel_size {known}: the model's experts were "
            f"partitioned {known} ways; build the expert mesh with ep_size={known}"
        )
    return groups


def megatron_expert_parallel_size() -> int | None:
    """Megatron-Core's expert-model-parallel size when its parallel state is initialised (None
    when Megatron is not imported or not initialised)."""
    ps = sys.modules.get("megatron.core.parallel_state")
    if ps is None:
        return None
    try:
        if not ps.model_parallel_is_initialized():
            return None
        return int(ps.get_expert_model_parallel_world_size())
    except Exception:  # noqa: BLE001 - a partly initialised state says nothing reliable
        return None


def unknown_layout(fqn: str) -> str:
    """Why an expert parameter without a layout cannot be saved or exported globally."""
    return (
        f"expert parameter {fqn} has no known global layout (Megatron's allreduce=False "
        "outside local_experts.<i> / weight<i>): mark its module with graph_fsdp."
        "mark_expert_params before fully_shard (dimension 0 = experts, or "
        "per_expert_children=True) so it can be saved and exported across EP sizes"
    )


def global_expert_params(
    full: torch.Tensor,
    params: list[tuple[str, torch.Size, ExpertLayout | None, int]],
    groups: ExpertGroups,
) -> list[tuple[str, torch.Tensor]]:
    """The global expert parameters (every EP rank's experts), ``(global name, tensor)``,
    from this rank's unsharded flat ``full`` (its experts, gathered over EDP) and its
    ``(fqn, shape, layout, offset in full)``: an all-gather over the EP group."""
    for fqn, _, layout, _ in params:
        if layout is None:  # the same on every rank: all refuse before any collective
            raise ValueError(unknown_layout(fqn))
    if groups.ep_size > 1:
        every = torch.empty(groups.ep_size * full.numel(), dtype=full.dtype, device=full.device)
        dist.all_gather_into_tensor(every, full, group=groups.ep)
        every = every.view(groups.ep_size, full.numel())
    else:
        every = full.unsqueeze(0)
    out: dict[str, torch.Tensor] = {}
    for fqn, shape, layout, offset in params:
        n = shape.numel()
        for r in range(groups.ep_size):
            key, base, global_shape = layout.global_entry(fqn, shape, r, groups.ep_size)
            t = out.get(key)
            if t is None:
                t = out[key] = torch.empty(global_shape, dtype=full.dtype, device=full.device)
            t.view(-1)[base : base + n].copy_(every[r, offset : offset + n])
    return list(out.items())
