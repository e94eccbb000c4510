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
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from graph_fsdp.fsdp import offload
from graph_fsdp.fsdp.api import BufferPolicy, MixedPrecisionPolicy, placements_for
from graph_fsdp.fsdp.comm import CommContext
from graph_fsdp.fsdp.experts import resolve_expert_mesh
from graph_fsdp.fsdp.grad_norm import clip_grad_norm_, install_torch_clip
from graph_fsdp.fsdp.param_group import FlatParamGroup
from graph_fsdp.fsdp.state import FSDPState, collect_states, refuse_offloaded
from graph_fsdp.fsdp.tensor_parallel import localize
from graph_fsdp.fsdp.unit_init import (
    check_partitions,
    check_same_mesh,
    check_shardable,
    dense_ranks,
    expert_layouts,
    full_tensor_loader,
    make_groups,
    managed_params,
    mesh_groups,
    refuse_tp_experts,
    resolve_device,
    shard_params,
)

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
    separate_all_gather_group: bool = False,
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
        separate_all_gather_group: the units' all-gathers run on a process group of their
            own over the shard group's ranks, so they overlap the gradients' reduce-scatters
            instead of queueing behind them on one NCCL communicator (Megatron's
            ``--create-all-gather-group``; comm.py [Note: a communicator for the
            all-gathers]); read from the root's call.
    """
    _install_step_hook()
    placements = placements_for(strategy, optim_over_replicas=optim_over_replicas)
    mp = mp_policy or MixedPrecisionPolicy()
    buffer_policy = buffer_policy or BufferPolicy()
    check_shardable(module)
    owner = type(module).__name__
    group, replicate_group = mesh_groups(mesh, owner, optim_over_replicas)
    entries = managed_params(module)
    if not entries:
        raise ValueError(
            f"{owner} has no parameters of its own to shard (all belong to "
            "already-sharded children); skip fully_shard on it"
        )
    layouts = expert_layouts(module, entries, expert_mesh, owner)
    device, broadcast, entries = resolve_device(module, entries, mesh, group)

    originals = {ref_fqn: p for ref_fqn, _, p in entries}
    entries, tp_specs = localize(entries, group, owner)
    refuse_tp_experts(tp_specs, layouts, owner)
    comm = CommContext(
        device, group, replicate_group, separate_all_gather_group=separate_all_gather_group
    )
    check_same_mesh(module, comm)
    experts = None
    if expert_mesh is not None:
        experts = resolve_expert_mesh(expert_mesh, owner, dense_ranks(mesh), device)
        check_partitions(layouts, experts, owner)
    groups = make_groups(
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
    shard_params(module, groups, tp_specs, originals)
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


def _become_unit(module: nn.Module, groups: list[FlatParamGroup], **state_kwargs) -> None:
    """Give ``module`` its FSDP state and hooks, and make it an ``FSDPModule``."""
    fqn = type(module).__name__  # renamed to the FQN under the root at lazy init
    state = FSDPState(module, fqn, groups, **state_kwargs)
    state.register_hooks()
    module.register_load_state_dict_pre_hook(full_tensor_loader(module, groups))
    module._fsdp_state = state
    cls = module.__class__
    if cls not in _CLASS_CACHE:
        _CLASS_CACHE[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
    module.__class__ = _CLASS_CACHE[cls]
