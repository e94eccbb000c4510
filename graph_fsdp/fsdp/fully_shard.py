"""``fully_shard``: turn a module into an FSDP unit, innermost first, then the root.

    model = build_model(cfg)
    for layer in model.layers:
        fully_shard(layer, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    fully_shard(model, mp_policy=...)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)   # sharded fp32 main weights

The unit's registered parameters become 1-D views of this rank's fp32 main shard (what
``model.parameters()``, the optimizer and checkpoints see); during forward/backward they are
swapped for unsharded compute-dtype views of the gathered flat buffer.

HSDP (shard within a node, replicate across nodes)::

    mesh = init_device_mesh("cuda", (nodes, gpus_per_node), mesh_dim_names=("replicate", "shard"))
    fully_shard(layer, mesh=mesh)                            # optimizer sharded per node
    fully_shard(layer, mesh=mesh, optim_over_replicas=True)  # ... and across nodes (HFSDP)

Expert parallelism (experts.py): a layer's expert parameters sharded over the expert-data-
parallel group, its other parameters over the data-parallel group::

    fully_shard(layer, expert_mesh=init_expert_mesh("cuda", ep_size))
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from graph_fsdp.fsdp import offload
from graph_fsdp.fsdp.api import BufferPolicy, MixedPrecisionPolicy, placements_for
from graph_fsdp.fsdp.comm import CommContext
from graph_fsdp.fsdp.experts import (
    EXPERT_ATTR,
    ExpertGroups,
    ExpertLayout,
    is_expert,
    layout_of,
    resolve_expert_mesh,
)
from graph_fsdp.fsdp.grad_norm import clip_grad_norm_, install_torch_clip
from graph_fsdp.fsdp.param_group import FlatParamGroup
from graph_fsdp.fsdp.state import FSDPState, collect_states, refuse_offloaded
from graph_fsdp.fsdp.tensor_parallel import TP_ATTR, TPSpec, localize

_CLASS_CACHE: dict[type, type] = {}
_STEP_HOOK = None


def _mark_updated(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    """After any optimizer step: the FSDP groups it updated need a compute-weight refresh."""
    groups = getattr(optimizer, "_graph_fsdp_groups", None)
    if groups is None or optimizer._graph_fsdp_nparams != sum(
        len(g["params"]) for g in optimizer.param_groups
    ):
        params = [p for pg in optimizer.param_groups for p in pg["params"]]
        replaced = [p for p in params if getattr(p, "_graph_fsdp_sharded_as", None) is not None]
        if replaced:
            names = [
                f"{p._graph_fsdp_sharded_as._graph_fsdp_fqn} of {p._graph_fsdp_sharded_as._graph_fsdp_unit}"
                for p in replaced[:3]
            ]
            raise RuntimeError(
                f"{type(optimizer).__name__} holds {len(replaced)} parameter(s) that fully_shard "
                f"replaced by sharded ones ({', '.join(names)}{', ...' if len(replaced) > 3 else ''}): "
                "they no longer get gradients and this step trained nothing. Create the "
                "optimizer after fully_shard, from model.parameters()"
            )
        groups = {
            id(g): g for p in params if (g := getattr(p, "_graph_fsdp_group", None)) is not None
        }
        optimizer._graph_fsdp_groups = list(groups.values())
        optimizer._graph_fsdp_nparams = sum(len(g["params"]) for g in optimizer.param_groups)
    for group in optimizer._graph_fsdp_groups:
        group.dirty = True


class FSDPModule:
    """Mixin added to every ``fully_shard``-ed module's class."""

    _fsdp_state: FSDPState

    def unshard(self) -> None:
        """Gather this unit's compute weights now (and swap them in)."""
        state = self._fsdp_state
        if state.root is None:
            state.lazy_init()
        if "params" in state.root.offloaded:
            refuse_offloaded(state.root, "unshard")
        state.unshard()
        state.wait_for_unshard()

    def reshard(self) -> None:
        """Release this unit's gathered weights (ZeRO-3) and restore the sharded params."""
        if self._fsdp_state.root is not None:
            self._fsdp_state.reshard()

    def set_requires_gradient_sync(self, requires: bool) -> None:
        """False: backward keeps gradients local (accumulated in fp32) until a sync step."""
        for state in collect_states(self):
            state.requires_grad_sync = requires

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient accumulation: backward passes inside reduce nothing."""
        self.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.set_requires_gradient_sync(True)

    def synchronize_param_gather(self) -> None:
        """Bring every unit's compute weights up to date with the main weights now."""
        synchronize_param_gather([self])

    def finish_grad_sync(self) -> None:
        """Wait for pending gradient reductions and expose the sharded ``.grad`` views."""
        state = self._fsdp_state
        if state.root is None:
            return
        state.root.comm.wait_reductions()
        for s in state.root.states:
            if s.requires_grad_sync:
                for group in s.groups:
                    group.attach_sharded_grads()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the sharded gradients by the global norm (all ranks' shards together,
        grad_norm.py [Note: global gradient norm])."""
        params = [p for s in collect_states(self) for g in s.groups for p in g.sharded_params()]
        return clip_grad_norm_(params, max_norm, norm_type)

    def fsdp_memory_report(self) -> dict:
        """Bytes by kind: persistent FSDP tensors, the allocator's roles and peaks, and the
        CUDA graphs' private pools (``graph_pool_bytes``: reserved and allocated)."""
        states = collect_states(self)
        persistent: dict[str, int] = {}

        def add(name: str, t: torch.Tensor | None) -> None:
            if t is not None:  # storage bytes: a released main_grad holds none
                persistent[name] = persistent.get(name, 0) + t.untyped_storage().nbytes()

        for s in states:
            for g in s.groups:
                add("main_params", g.main_flat)
                add("main_grads", g.main_grad)
                add("compute_shard", g.compute_shard)
                add("compute_full_persistent", g.persistent_full)
                add("grad_accum", g.accum)
        root = states[0].root
        report = {"persistent_bytes": persistent}
        if root is not None:
            report.update(root.allocator.memory_report())
            report["allocator"] = type(root.allocator).__name__
        # The graphs' private pools, a role of their own: what replays use is reserved there,
        # never allocated (capture/pools.py). Each registered runner once.
        runners = {id(r): r for s in states for r in s.graph_runners}
        pools = {"reserved": 0, "allocated": 0}
        for runner in runners.values():
            for kind, nbytes in getattr(runner, "graph_pool_bytes", dict)().items():
                pools[kind] += nbytes
        report["graph_pool_bytes"] = pools
        return report

    # ------------------------------------------------------------------ lifecycle (RL)
    # See graph_fsdp/fsdp/offload.py (its functions also take a list of model chunks): each
    # returns the bytes it freed (or allocated) by kind.
    def offload_params(self) -> dict[str, int]:
        """Main weights to pinned CPU memory; frees compute buffers, slots and graph pools."""
        return offload.offload_params(self)

    def onload_params(self) -> dict[str, int]:
        """Main weights back on the device (graphs replay at once when addresses are kept,
        else they are recaptured at the next step)."""
        return offload.onload_params(self)

    def offload_grads(self) -> dict[str, int]:
        """Sharded main gradients (values kept) to pinned CPU memory."""
        return offload.offload_grads(self)

    def onload_grads(self) -> dict[str, int]:
        return offload.onload_grads(self)

    def offload_optimizer(self, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        """The optimizer's device state tensors to pinned CPU memory (step refused)."""
        return offload.offload_optimizer(self, optimizer)

    def onload_optimizer(self, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        return offload.onload_optimizer(self, optimizer)

    def iter_full_params(
        self, *, dtype: torch.dtype | None = None, device=None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """``(fqn, full tensor)`` per parameter, one unit gathered at a time (weight sync)."""
        return offload.iter_full_params(self, dtype=dtype, device=device)


def synchronize_param_gather(model_or_chunks: nn.Module | Iterable[nn.Module]) -> None:
    """Refresh compute weights of the model, or of *all* given model chunks (not just the
    first one)."""
    for module in offload.chunks_of(model_or_chunks, "synchronize_param_gather"):
        for state in collect_states(module):
            if state.root is None:
                state.lazy_init()
            if "params" in state.root.offloaded:
                refuse_offloaded(state.root, "synchronize_param_gather")
            for group in state.groups:
                if group.stale():
                    group.unshard(state.allocator)
                    group.wait_unshard()
                    if state.placements.params and state.training_state.value == "idle":
                        group.reshard(state.allocator)


def _managed_params(
    module: nn.Module,
) -> list[tuple[str, list[tuple[nn.Module, str]], nn.Parameter]]:
    """Parameters of ``module`` not owned by an already-sharded descendant, deduplicated."""
    found: dict[int, tuple[str, list, nn.Parameter]] = {}

    def visit(m: nn.Module, prefix: str) -> None:
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
            if child is not None and not isinstance(child, FSDPModule):
                visit(child, f"{prefix}{child_name}.")

    visit(module, "")
    return list(found.values())


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


def _full_tensor_loader(module: nn.Module, groups: list[FlatParamGroup]):
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


def _materialise(module: nn.Module, device: torch.device) -> None:
    """Meta-device init: allocate this unit's own params and run ``reset_parameters``."""

    def own(m: nn.Module) -> Iterator[nn.Module]:
        yield m
        for child in m.children():
            if not isinstance(child, FSDPModule):
                yield from own(child)

    mods = list(own(module))
    for m in mods:
        m.to_empty(device=device, recurse=False)
    for m in mods:
        if hasattr(m, "reset_parameters"):
            m.reset_parameters()


_SHARD_NAMES = ("shard", "dp_shard")
_REPLICATE_NAMES = ("replicate", "dp_replicate")


def _mesh_groups(
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


def _expert_layouts(
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


def _check_partitions(
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


def _refuse_tp_experts(
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


def _dense_ranks(mesh) -> list[int]:
    if mesh is None:
        return list(range(dist.get_world_size()))
    return mesh.mesh.flatten().tolist()


def _make_groups(
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


def _check_same_mesh(module: nn.Module, comm: CommContext) -> None:
    """Every already-sharded descendant must use this unit's (dense) mesh: one comm per root.
    Expert meshes may differ between units (experts.py [Note: expert groups])."""
    names = {id(m): name for name, m in module.named_modules()}
    for child in module.modules():
        if child is module or not isinstance(child, FSDPModule):
            continue
        other = child._fsdp_state.comm
        if not other.same_mesh(comm):
            raise ValueError(
                f"{type(module).__name__} is being sharded on a {comm.describe()}, but its "
                f"already-sharded submodule {names[id(child)]!r} was sharded on a "
                f"{other.describe()}: pass the same DeviceMesh object to every fully_shard call "
                "of one model"
            )


def fully_shard(
    module: nn.Module,
    *,
    mesh=None,
    strategy: str = "optim_grads_params",
    optim_over_replicas: bool = False,
    mp_policy: MixedPrecisionPolicy | None = None,
    buffer_policy: BufferPolicy | None = None,
    reshard_after_forward: bool = True,
    expert_mesh=None,
) -> nn.Module:
    """Shard ``module``'s parameters over the data-parallel group (see module docstring).

    Args:
        mesh: a 1-D ``DeviceMesh`` (or None: the default process group), or a 2-D
            (replicate, shard) ``DeviceMesh`` for HSDP: parameters and gradients sharded over
            dimension 1 (within a node), replicated over dimension 0 (across nodes).
        strategy: ``no_shard`` | ``optim`` | ``optim_grads`` | ``optim_grads_params``.
        optim_over_replicas: HSDP only: also shard the optimizer state, main weights and
            main gradients across the replicas (Megatron-FSDP's ``outer_dp_sharding_strategy
            ="optim"``); gradients are then reduce-scattered, not all-reduced, across replicas.
        mp_policy: dtypes; default keeps the parameters' dtype with fp32 main weights.
        buffer_policy: where unsharded buffers live; read from the root's call.
        reshard_after_forward: ZeRO-3 only; False keeps weights gathered until backward.
        expert_mesh: a 2-D ``(edp, ep)`` DeviceMesh (``graph_fsdp.init_expert_mesh``) over the
            data-parallel ranks: the unit's expert parameters (``mark_expert_params``, or
            Megatron's ``allreduce=False``) are sharded and their gradients reduced over its
            ``edp`` dimension, the rest over ``mesh`` (experts.py [Note: expert groups]).
            Required for a unit holding marked expert parameters; ignored by one without.
    """
    _install_step_hook()
    placements = placements_for(strategy, optim_over_replicas=optim_over_replicas)
    mp = mp_policy or MixedPrecisionPolicy()
    buffer_policy = buffer_policy or BufferPolicy()
    _check_shardable(module)
    owner = type(module).__name__
    group, replicate_group = _mesh_groups(mesh, owner, optim_over_replicas)
    entries = _managed_params(module)
    if not entries:
        raise ValueError(
            f"{owner} has no parameters of its own to shard (all belong to "
            "already-sharded children); skip fully_shard on it"
        )
    layouts = _expert_layouts(module, entries, expert_mesh, owner)
    device, broadcast, entries = _resolve_device(module, entries, mesh, group)

    originals = {ref_fqn: p for ref_fqn, _, p in entries}
    entries, tp_specs = localize(entries, group, owner)
    _refuse_tp_experts(tp_specs, layouts, owner)
    comm = CommContext(device, group, replicate_group)
    _check_same_mesh(module, comm)
    experts = None
    if expert_mesh is not None:
        experts = resolve_expert_mesh(expert_mesh, owner, _dense_ranks(mesh), device)
        _check_partitions(layouts, experts, owner)
    groups = _make_groups(
        module,
        entries,
        layouts,
        experts,
        comm,
        placements=placements,
        mp=mp,
        device=device,
        broadcast_from_rank0=broadcast,
    )
    _shard_params(module, groups, tp_specs, originals)
    _become_unit(
        module,
        groups,
        placements=placements,
        mp=mp,
        buffer_policy=buffer_policy,
        comm=comm,
        reshard_after_forward=reshard_after_forward and placements.params,
    )
    return module


def _install_step_hook() -> None:
    """Once per process: optimizer steps mark the groups they update (``_mark_updated``), and
    torch's gradient clipping is routed to the global-norm one for sharded parameters."""
    global _STEP_HOOK
    if _STEP_HOOK is None:
        _STEP_HOOK = register_optimizer_step_post_hook(_mark_updated)
        install_torch_clip()  # grad_norm.py [Note: global gradient norm]


def _check_shardable(module: nn.Module) -> None:
    if isinstance(module, FSDPModule):
        raise ValueError(
            f"fully_shard was already applied to {type(module).__name__}; apply it once per module"
        )
    if not dist.is_initialized():
        raise RuntimeError(
            "fully_shard needs torch.distributed: call dist.init_process_group('nccl' or 'gloo') "
            "first (torchrun sets the environment), even for a single process"
        )


def _resolve_device(
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
        entries = _managed_params(module)
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


def _shard_params(
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
            # is marked, and a later fully_shard that meets it refuses (_managed_params).
            ref.sharded._graph_fsdp_unit = type(module).__name__
            originals[ref.local_fqn]._graph_fsdp_sharded_as = ref.sharded
        g.use_sharded(initial=True)


def _become_unit(module: nn.Module, groups: list[FlatParamGroup], **state_kwargs) -> None:
    """Give ``module`` its FSDP state and hooks, and make it an ``FSDPModule``."""
    fqn = type(module).__name__  # renamed to the FQN under the root at lazy init
    state = FSDPState(module, fqn, groups, **state_kwargs)
    state.register_hooks()
    module.register_load_state_dict_pre_hook(_full_tensor_loader(module, groups))
    module._fsdp_state = state
    cls = module.__class__
    if cls not in _CLASS_CACHE:
        _CLASS_CACHE[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
    module.__class__ = _CLASS_CACHE[cls]
