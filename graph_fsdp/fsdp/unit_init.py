"""What ``fully_shard`` checks and builds before a module becomes a unit.

In the order ``fully_shard`` (fully_shard.py) calls them: the module and its mesh are checked
(:func:`check_shardable`, :func:`mesh_groups`), the parameters it manages are found
(:func:`managed_params`: those no already-sharded descendant owns, tied ones refused), its
expert parameters' layouts read (:func:`expert_layouts`), its device resolved (meta-device
parameters materialised: :func:`resolve_device`), its parameters grouped per kind and compute
dtype into flat groups (:func:`make_groups`) and the sharded parameters put on its modules
(:func:`shard_params`); :func:`full_tensor_loader` lets ``load_state_dict`` take full tensors.
A unit is recognised by its state (``state_of``), so nothing here needs the unit's class.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from graph_fsdp.fsdp.comm import CommContext
from graph_fsdp.fsdp.experts import EXPERT_ATTR, ExpertGroups, ExpertLayout, is_expert, layout_of
from graph_fsdp.fsdp.param_group import FlatParamGroup
from graph_fsdp.fsdp.state import state_of
from graph_fsdp.fsdp.tensor_parallel import TP_ATTR, TPSpec


def check_shardable(module: nn.Module) -> None:
    if state_of(module) is not None:
        raise ValueError(
            f"fully_shard was already applied to {type(module).__name__}; apply it once per module"
        )
    if not dist.is_initialized():
        raise RuntimeError(
            "fully_shard needs torch.distributed: call dist.init_process_group('nccl' or 'gloo') "
            "first (torchrun sets the environment), even for a single process"
        )


def check_same_mesh(module: nn.Module, comm: CommContext) -> None:
    """Every already-sharded descendant must use this unit's (dense) mesh: one comm per root.
    Expert meshes may differ between units (experts.py [Note: expert groups])."""
    names = {id(m): name for name, m in module.named_modules()}
    for child in module.modules():
        if child is module or state_of(child) is None:
            continue
        other = state_of(child).comm
        if not other.same_mesh(comm):
            raise ValueError(
                f"{type(module).__name__} is being sharded on a {comm.describe()}, but its "
                f"already-sharded submodule {names[id(child)]!r} was sharded on a "
                f"{other.describe()}: pass the same DeviceMesh object to every fully_shard call "
                "of one model"
            )


_SHARD_NAMES = ("shard", "dp_shard")


_REPLICATE_NAMES = ("replicate", "dp_replicate")


def mesh_groups(
    mesh, owner: str, optim_over_replicas: bool
) -> tuple[dist.ProcessGroup, dist.ProcessGroup | None]:
    """(shard group, replicate group or None) of ``mesh`` (None: the default group)."""
    ndim = None if mesh is None else mesh.ndim
    if optim_over_replicas and ndim != 2:
        raise ValueError(
            f"fully_shard({owner}, optim_over_replicas=True) shards the optimizer across the "
            f"replicas of a 2-D (replicate, shard) mesh, but got "
            f"{'no mesh' if mesh is None else f'a {ndim}-D mesh'}; pass mesh=init_device_mesh("
            "device, (replicas, shard_size), mesh_dim_names=('replicate', 'shard'))"
        )
    if mesh is None:
        return dist.group.WORLD, None
    if ndim not in (1, 2):
        raise ValueError(
            f"fully_shard({owner}) takes a 1-D data-parallel mesh or a 2-D (replicate, shard) "
            f"HSDP mesh, got a {ndim}-D mesh {mesh}: pass the data-parallel sub-mesh, e.g. "
            "mesh['dp'] or mesh['replicate', 'shard']. With tensor parallelism the TP "
            "dimension is not fully_shard's: parallelize_module(model, mesh['tp'], plan) first, "
            "then fully_shard(..., mesh=mesh['dp']) (FSDP + TP on a (dp, tp) mesh) or "
            "mesh=mesh['replicate', 'shard'] (HSDP + TP on a (replicate, shard, tp) mesh); "
            "tensor_parallel.py"
        )
    world = dist.get_world_size()
    if world % mesh.size() != 0 or mesh.get_coordinate() is None:
        raise ValueError(
            f"fully_shard({owner}): the mesh of shape {tuple(mesh.shape)} ({mesh.size()} ranks) "
            f"does not fit the world of {world} ranks: its size must divide {world} and it must "
            f"contain this rank ({dist.get_rank()}); build it with init_device_mesh(device, "
            f"(replicas, shard_size)) where replicas x shard_size = {world}"
        )
    if ndim == 1:
        return mesh.get_group(), None
    names = mesh.mesh_dim_names
    if names is not None and (names[0] in _SHARD_NAMES or names[1] in _REPLICATE_NAMES):
        raise ValueError(
            f"fully_shard({owner}): HSDP meshes are (replicate, shard) - dimension 0 replicates, "
            f"dimension 1 shards - but this mesh is named {names}: build it as "
            f"init_device_mesh(device, ({mesh.shape[1]}, {mesh.shape[0]}), "
            "mesh_dim_names=('replicate', 'shard'))"
        )
    replicas = mesh.shape[0]
    if optim_over_replicas and replicas == 1:
        raise ValueError(
            f"fully_shard({owner}, optim_over_replicas=True): the mesh {tuple(mesh.shape)} has "
            "replicate size 1, so there are no replicas to shard the optimizer across: use a "
            f"1-D mesh (or None) for plain FSDP over {mesh.shape[1]} ranks, or a replicate "
            "size > 1"
        )
    return mesh.get_group(1), mesh.get_group(0)


def dense_ranks(mesh) -> list[int]:
    if mesh is None:
        return list(range(dist.get_world_size()))
    return mesh.mesh.flatten().tolist()


def managed_params(
    module: nn.Module,
) -> list[tuple[str, list[tuple[nn.Module, str]], nn.Parameter]]:
    """Parameters of ``module`` not owned by an already-sharded descendant, deduplicated."""
    found: dict[int, tuple[str, list, nn.Parameter]] = {}
    _visit_params(module, module, "", found)
    return list(found.values())


def _visit_params(module: nn.Module, m: nn.Module, prefix: str, found: dict) -> None:
    """``m``'s parameters into ``found`` (by id, first name first), then its children's.

    A function of its own, not a closure that calls itself: such a closure is a reference
    cycle that keeps ``found`` - every parameter of the unit, materialised full-size by a
    meta-device init - alive until the cyclic garbage collector runs."""
    for name, p in m._parameters.items():
        if p is None:
            continue
        if getattr(p, "_graph_fsdp_sharded", False):
            raise ValueError(
                f"parameter {prefix}{name} is already sharded by an enclosing fully_shard: "
                "apply fully_shard to children (layers) first, then to their parents and "
                "the root last"
            )
        if getattr(p, "_graph_fsdp_sharded_as", None) is not None:
            raise ValueError(_tied_message(module, f"{prefix}{name}", p._graph_fsdp_sharded_as))
        entry = found.setdefault(id(p), (prefix + name, [], p))
        entry[1].append((m, name))
    for child_name, child in m._modules.items():
        if child is not None and state_of(child) is None:
            _visit_params(module, child, f"{prefix}{child_name}.", found)


def _tied_message(module: nn.Module, name: str, sharded: nn.Parameter) -> str:
    """[Note: tied parameters]: ``name`` holds the original of ``sharded``, another unit's."""
    tied_to = next(
        (n for n, q in module.named_parameters(remove_duplicate=False) if q is sharded),
        f"{sharded._graph_fsdp_fqn} of {sharded._graph_fsdp_unit}",
    )
    return (
        f"parameter {name} of {type(module).__name__} is the same tensor as {tied_to} (tied "
        "weights), which an earlier "
        f"fully_shard sharded in another unit: a tied parameter must belong to one unit, or "
        "the copies would train apart. Apply fully_shard to a module that holds every use of "
        f"it (a tied embedding and output layer: do not fully_shard the module holding "
        f"{tied_to} by itself, leave both to the root's fully_shard), or untie them first"
    )


def resolve_device(
    module: nn.Module, entries: list, mesh, group: dist.ProcessGroup
) -> tuple[torch.device, bool, list]:
    """``(device, broadcast_from_rank0, entries)`` of the unit: its parameters' one device, or
    for meta-device parameters the process group's device, where they are materialised (new
    entries; every rank takes the first rank's values)."""
    devices = {p.device for _, _, p in entries}
    if len(devices) > 1:
        by_dev = {str(d): [f for f, _, p in entries if p.device == d][:3] for d in devices}
        raise ValueError(
            f"{type(module).__name__} has parameters on several devices {by_dev}; move it to one device first"
        )
    device = devices.pop()
    backend = dist.get_backend(group)
    broadcast = device.type == "meta"
    if broadcast:
        device = (
            torch.device("cuda", torch.cuda.current_device())
            if backend == "nccl"
            else torch.device("cpu")
        )
        _materialise(module, device)
        entries = managed_params(module)
    if backend == "nccl" and device.type != "cuda":
        raise ValueError(
            f"{type(module).__name__} is on {device} but the process group uses NCCL; move it to CUDA"
        )
    if mesh is not None and mesh.device_type != device.type:
        raise ValueError(
            f"mesh device type {mesh.device_type!r} does not match the module's device {device}: "
            f"build the mesh with init_device_mesh({device.type!r}, ...) or move the module"
        )
    return device, broadcast, entries


def _materialise(module: nn.Module, device: torch.device) -> None:
    """Meta-device init: allocate this unit's own params and run ``reset_parameters``."""

    def own(m: nn.Module) -> Iterator[nn.Module]:
        yield m
        for child in m.children():
            if state_of(child) is None:
                yield from own(child)

    mods = list(own(module))
    for m in mods:
        m.to_empty(device=device, recurse=False)
    for m in mods:
        if hasattr(m, "reset_parameters"):
            m.reset_parameters()


def expert_layouts(
    module: nn.Module, entries: list, expert_mesh, owner: str
) -> dict[str, ExpertLayout | None]:
    """FQN -> layout of the unit's expert parameters (experts.py [Note: expert groups]);
    empty when it has none. Expert parameters without an expert mesh are refused."""
    experts = [(fqn, owners, p) for fqn, owners, p in entries if is_expert(p)]
    if not experts:
        return {}
    if expert_mesh is None:
        marked = [fqn for fqn, _, p in experts if getattr(p, EXPERT_ATTR, None) is not None]
        names = marked or [fqn for fqn, _, _ in experts]
        why = (
            "were marked by mark_expert_params"
            if marked
            else "are Megatron-Core expert parameters (allreduce=False: it marks them when "
            "its expert_model_parallel_size > 1)"
        )
        raise ValueError(
            f"fully_shard({owner}): parameters {names[:4]}{' ...' if len(names) > 4 else ''} "
            f"{why}, but no expert_mesh was given: reduced over the data-parallel group, "
            "different experts would be summed. Pass expert_mesh=graph_fsdp."
            "init_expert_mesh(device, ep_size) (or expert_mesh_from_groups) so they are "
            "sharded and reduced over the expert-data-parallel group"
        )
    return {fqn: layout_of(module, fqn, p, owners[0][0]) for fqn, owners, p in experts}


def check_partitions(
    layouts: dict[str, ExpertLayout | None], experts: ExpertGroups, owner: str
) -> None:
    """Parameters partitioned over known ranks need the expert mesh's EP group to be those."""
    ep_ranks = tuple(dist.get_process_group_ranks(experts.ep))
    for fqn, layout in layouts.items():
        if layout is not None and layout.partitioned_over not in (None, ep_ranks):
            raise ValueError(
                f"fully_shard({owner}): {fqn} was partitioned over ranks "
                f"{list(layout.partitioned_over)}, but the expert mesh's EP group is ranks "
                f"{list(ep_ranks)}: its pieces would be sharded and reduced as copies of one "
                "another. Pass an expert mesh whose EP group is those ranks (for a "
                "vocab-parallel embedding over every rank: init_expert_mesh(device, "
                "ep_size=world size))"
            )


def refuse_tp_experts(
    tp_specs: dict[str, TPSpec], layouts: dict[str, ExpertLayout | None], owner: str
) -> None:
    both = [fqn for fqn in tp_specs if fqn in layouts]
    if both:
        raise ValueError(
            f"fully_shard({owner}): parameters {both[:4]} are expert parameters and "
            "tensor-parallel at once; graph_fsdp shards expert parameters over the "
            "expert-data-parallel group without tensor parallelism: keep the experts whole "
            "on each TP rank (Megatron: expert_tensor_parallel_size=1) or leave them to TP "
            "without an expert mesh"
        )


def make_groups(
    module: nn.Module,
    entries: list,
    layouts: dict[str, ExpertLayout | None],
    experts: ExpertGroups | None,
    comm: CommContext,
    **kwargs,
) -> list[FlatParamGroup]:
    """One group per (kind, compute dtype): the dense groups first, then the expert ones."""
    mp = kwargs["mp"]
    kinds: dict[bool, dict[torch.dtype, list]] = {False: {}, True: {}}
    for entry in entries:
        by_dtype = kinds[entry[0] in layouts]
        by_dtype.setdefault(mp.compute_dtype(entry[2].dtype), []).append(entry)
    expert_comm = None
    if kinds[True]:
        expert_comm = comm.over(experts.edp, grad_divisor=comm.dp_size)
    fqn = type(module).__name__  # renamed to the FQN under the root at lazy init
    groups = []
    for is_expert_kind, by_dtype in kinds.items():
        for dt, ents in by_dtype.items():
            parts = ["experts"] if is_expert_kind else []
            if len(by_dtype) > 1:
                parts.append(str(dt).removeprefix("torch."))
            suffix = ".".join(parts)
            groups.append(
                FlatParamGroup(
                    f"{fqn}.{suffix}" if suffix else fqn,
                    ents,
                    comm=expert_comm if is_expert_kind else comm,
                    suffix=suffix,
                    expert=experts if is_expert_kind else None,
                    expert_layouts=layouts if is_expert_kind else None,
                    **kwargs,
                )
            )
    return groups


def shard_params(
    module: nn.Module,
    groups: list[FlatParamGroup],
    tp_specs: dict[str, TPSpec],
    originals: dict[str, nn.Parameter],
) -> None:
    """Mark the sharded parameters (and the originals they replace) and put them on the
    unit's modules."""
    for g in groups:
        for ref in g.params:
            ref.tp = tp_specs.get(ref.local_fqn)
            if ref.tp is not None:  # tensor_parallel.py [Note: tensor-parallel parameters]
                setattr(ref.sharded, TP_ATTR, ref.tp)
            ref.sharded._graph_fsdp_sharded = True
            ref.sharded._graph_fsdp_fqn = ref.fqn
            # [Note: tied parameters] Only this unit's modules get the sharded parameter; a
            # module elsewhere holding the same tensor (tied embedding and output layer
            # sharded apart) would keep the original and train it on its own. The original
            # is marked, and a later fully_shard that meets it refuses (managed_params).
            ref.sharded._graph_fsdp_unit = type(module).__name__
            originals[ref.local_fqn]._graph_fsdp_sharded_as = ref.sharded
        g.use_sharded(initial=True)


def full_tensor_loader(module: nn.Module, groups: list[FlatParamGroup]):
    """``load_state_dict`` pre-hook: a value of a parameter's full (unsharded) shape - a
    pretrained or unsharded checkpoint, present on every rank - loads as this rank's piece
    of it (no collective); a value of the shard's shape loads as is (``model.state_dict()``
    of the same sharding). The main weights change in place, so the next gather refreshes
    the compute weights. An expert parameter's full shape is its EP rank's (its local
    experts); a stacked one (experts.py ``ExpertLayout``) also takes the global tensor of every
    EP rank's experts and loads its rank's rows."""
    paths = {id(m): name for name, m in module.named_modules()}
    entries = []
    for group in groups:
        for ref in group.params:
            for owner, name in ref.owners:
                key = f"{paths[id(owner)]}.{name}" if paths[id(owner)] else name
                base, shapes = 0, (ref.shape,)
                if ref.tp is not None:  # the global tensor: this TP rank's piece first
                    shapes = (ref.shape, ref.tp.shape)
                if group.expert is not None and ref.expert is not None:
                    if ref.expert.template is None and group.expert.ep_size > 1:
                        _, base, global_shape = ref.expert.global_entry(
                            key, ref.shape, group.expert.ep_rank, group.expert.ep_size
                        )
                        shapes = (ref.shape, global_shape)
                entries.append((key, ref, group, base, shapes))

    def hook(mod, state_dict, prefix, *args) -> None:
        for key, ref, group, base, shapes in entries:
            value = state_dict.get(prefix + key)
            if not isinstance(value, torch.Tensor) or value.shape not in shapes:
                continue
            if group._unsharded_on_modules:
                raise RuntimeError(
                    f"load_state_dict({prefix + key}) while {group.fqn}'s weights are gathered "
                    "(between a forward and its backward): load between steps"
                )
            if ref.tp is not None and value.shape != ref.shape:
                value = ref.tp.local_of(value)
            if value.shape == ref.sharded.shape:
                state_dict[prefix + key] = value
                continue  # this rank holds the whole parameter
            start = ref.global_offset + (base if value.shape != ref.shape else 0)
            state_dict[prefix + key] = value.reshape(-1)[start : start + ref.sharded.numel()]

    return hook
