"""Megatron-Core tensor parallelism (and sequence parallelism) under graph_fsdp.

    from graph_fsdp.integrations import megatron as gm

    gm.init_parallel_state(tensor_model_parallel_size=2)     # TP groups of 2 consecutive ranks
    cfg = gm.MCoreGPTConfig(tensor_model_parallel_size=2, sequence_parallel=True)
    lm = gm.shard_gpt(gm.build_gpt(cfg), mp_policy=...)      # each TP rank's pieces over DP

Imports nothing from megatron-core at module level (CI imports graph_fsdp without it).

[Note: Megatron-Core tensor parallelism]
- Parallel state: Megatron's ``initialize_model_parallel(tensor_model_parallel_size=N)`` over
  the default group (pipeline and expert parallel size 1). Its rank order makes a TP group of
  N consecutive ranks and a data-parallel (DP) group of the world / N ranks N apart holding
  the same TP rank's pieces.
- Model: Megatron's column- and row-parallel linears (local or TE spec), vocab-parallel
  embedding and output layer hold this TP rank's piece of each weight (``tensor_model_parallel``
  with its ``partition_dim``) and run the TP collectives themselves (and, with
  ``sequence_parallel``, the sequence all-gathers and reduce-scatters); ``use_cpu_initialization``
  draws every full weight and keeps the rank's slice, so the global model is the same at every
  TP size.
- Sharding (:func:`prepare`): every ``fully_shard`` of ``shard_gpt`` gets the 1-D mesh of
  Megatron's DP group, so each TP rank's local parameters are sharded over the ranks holding
  the same pieces - not the world. The tensor-parallel ones are described by
  ``graph_fsdp.fsdp.tensor_parallel.mark_tensor_parallel`` (TP group, partition dim): the global
  gradient norm sums them over TP as well (Megatron counts the duplicates of TP rank 0 only;
  the same sum), and checkpoints save them at their global shape, so a checkpoint loads at
  any TP and DP size.
- Gradients Megatron's ``finalize_model_grads`` still reduces over TP after the data-parallel
  reduction (``_allreduce_non_tensor_model_parallel_grads``): with ``sequence_parallel``, the
  parameters marked ``sequence_parallel`` (layer norms, row-parallel biases: they saw a slice
  of the sequence) are summed over TP, likewise ``q_layernorm`` / ``k_layernorm`` with
  ``qk_layernorm``; ``average_gradients_across_tp_domain`` ones are averaged. graph_fsdp does
  the same, in the same order - the data-parallel reduction, then the TP all-reduce of each
  rank's sharded piece (main gradients, fp32), one coalesced collective per unit - as a grad
  sync hook of the unit (state.py ``add_grad_sync_hook``): at the end of every synchronised
  backward, so in graph_fsdp's loop, Megatron's schedule and a full-iteration graph alike.
  The pieces line up across TP ranks because their flat layouts do (every TP rank's local
  shapes are equal; checked at ``shard_gpt``). With PP = 1 nothing else of it applies
  (embedding and position-embedding all-reduces are across pipeline stages).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from graph_fsdp.fsdp.state import FSDPState, state_of
from graph_fsdp.fsdp.tensor_parallel import mark_tensor_parallel

_OWNED_STATE: list = []
"""The TP group of the parallel state :func:`initialize` created (re-created only then)."""


def initialize(tensor_model_parallel_size: int) -> None:
    """Megatron's parallel state with TP = ``tensor_model_parallel_size`` (PP = EP = 1). A
    state this function created with another TP size is re-created (build models after the
    call); one initialised elsewhere with other sizes is refused."""
    from megatron.core import parallel_state as ps  # noqa: PLC0415 (optional dependency)

    if not dist.is_initialized():
        raise RuntimeError(
            "init_parallel_state needs torch.distributed: call dist.init_process_group first"
        )
    world = dist.get_world_size()
    tp = tensor_model_parallel_size
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1 or world % tp:
        divisors = [d for d in range(1, world + 1) if world % d == 0]
        raise ValueError(
            f"tensor_model_parallel_size={tp!r} must be a positive divisor of the world size "
            f"{world} (TP x DP = the ranks); use one of {divisors}"
        )
    wanted = {
        "tensor_model_parallel_size": tp,
        "pipeline_model_parallel_size": 1,
        "expert_model_parallel_size": 1,
    }
    if ps.model_parallel_is_initialized():
        have = {
            "tensor_model_parallel_size": ps.get_tensor_model_parallel_world_size(),
            "pipeline_model_parallel_size": ps.get_pipeline_model_parallel_world_size(),
            "expert_model_parallel_size": ps.get_expert_model_parallel_world_size(),
        }
        if have == wanted:
            return
        if not _owned(ps):
            raise ValueError(
                f"Megatron's parallel_state was initialised elsewhere with {have}, but "
                f"{wanted} was asked for: call megatron.core.parallel_state."
                "destroy_model_parallel() first, or ask for the sizes it has"
            )
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(**wanted)
    _OWNED_STATE[:] = [ps.get_tensor_model_parallel_group()]


def _owned(ps) -> bool:
    return bool(_OWNED_STATE) and _OWNED_STATE[0] is ps.get_tensor_model_parallel_group()


def release() -> None:
    """Destroy a parallel state :func:`initialize` created with TP > 1 (before another one is
    initialised with TP = 1); anything else is left alone."""
    from megatron.core import parallel_state as ps  # noqa: PLC0415 (optional dependency)

    if ps.model_parallel_is_initialized() and _owned(ps):
        if ps.get_tensor_model_parallel_world_size() > 1:
            ps.destroy_model_parallel()
        _OWNED_STATE.clear()


def tensor_parallel_size() -> int:
    """Megatron's initialised TP size (1 when Megatron's state is not initialised)."""
    from megatron.core import parallel_state as ps  # noqa: PLC0415 (optional dependency)

    if not ps.model_parallel_is_initialized():
        return 1
    return ps.get_tensor_model_parallel_world_size()


def data_parallel_rank(rank: int, world_size: int) -> tuple[int, int]:
    """(this rank's data-parallel rank, the data-parallel size): ``(rank, world_size)`` at
    TP = 1, Megatron's DP rank and size otherwise (TP ranks read the same batches)."""
    if tensor_parallel_size() == 1:
        return rank, world_size
    from megatron.core import parallel_state as ps  # noqa: PLC0415 (optional dependency)

    return ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()


def check_model(config) -> int:
    """The TP size of a built model's ``TransformerConfig``, which must match the state."""
    tp = getattr(config, "tensor_model_parallel_size", 1)
    state = tensor_parallel_size()
    if tp != state:
        raise ValueError(
            f"the model was built with tensor_model_parallel_size={tp}, but Megatron's parallel "
            f"state has {state}: call init_parallel_state(tensor_model_parallel_size={tp}) "
            "before build_gpt"
        )
    return tp


def data_parallel_mesh(device_type: str):
    """The 1-D DeviceMesh of Megatron's data-parallel group (graph_fsdp's sharding group)."""
    from megatron.core import parallel_state as ps  # noqa: PLC0415 (optional dependency)
    from torch.distributed.device_mesh import DeviceMesh  # noqa: PLC0415 (optional dependency)

    return DeviceMesh.from_group(ps.get_data_parallel_group(), device_type, mesh_dim_names=("dp",))


def mark_params(module: nn.Module) -> None:
    """Describe Megatron's tensor-parallel parameters (``tensor_model_parallel``,
    ``partition_dim``) of ``module`` for ``fully_shard`` (before it)."""
    from megatron.core import parallel_state as ps  # noqa: PLC0415 (optional dependency)

    marked = []
    for name, p in module.named_parameters():
        if not getattr(p, "tensor_model_parallel", False):
            continue
        stride = getattr(p, "partition_stride", 1)
        if isinstance(stride, bool) or not isinstance(stride, int) or stride < 1:
            raise ValueError(f"parameter {name} has partition_stride={stride!r}, not an int >= 1")
        if stride > 1 and p.shape[p.partition_dim] % stride:
            raise ValueError(
                f"parameter {name} of local shape {tuple(p.shape)} has partition_stride="
                f"{stride}, which does not divide its partition dim {p.partition_dim}: "
                "Megatron's strided layers hold equal blocks"
            )
        # Strided ones (the gated MLP's linear_fc1: [gate_r; up_r]): tensor_parallel.py
        # [Note: strided tensor-parallel pieces].
        marked.append((p, p.partition_dim, stride))
    mark_tensor_parallel(marked, ps.get_tensor_model_parallel_group())


def _tp_reduction(name: str, p: nn.Parameter, config) -> str | None:
    """What Megatron's ``_allreduce_non_tensor_model_parallel_grads`` does to ``p``'s
    gradient after the data-parallel reduction: "avg", "sum" or None."""
    if getattr(p, "average_gradients_across_tp_domain", False):
        return "avg"
    if config.sequence_parallel and getattr(p, "sequence_parallel", False):
        return "sum"
    if getattr(config, "qk_layernorm", False) and ("q_layernorm" in name or "k_layernorm" in name):
        return "sum"
    return None


def tp_reduced_params(module: nn.Module, config) -> dict[int, str]:
    """id(original parameter) -> "sum" / "avg" for those reduced over TP after DP."""
    out = {}
    for name, p in module.named_parameters():
        if p.requires_grad and (op := _tp_reduction(name, p, config)) is not None:
            out[id(p)] = op
    return out


def install_grad_sync(units: list[nn.Module], reduced: dict[int, str], originals: dict) -> None:
    """After ``fully_shard``: a grad sync hook on every unit holding parameters of
    ``reduced`` (``originals``: id -> the original parameter, which points at its sharded
    one) that all-reduces their sharded gradients over TP ([Note: Megatron-Core tensor
    parallelism])."""
    from megatron.core import parallel_state as ps  # noqa: PLC0415 (optional dependency)

    group = ps.get_tensor_model_parallel_group()
    by_sharded = {id(originals[i]._graph_fsdp_sharded_as): op for i, op in reduced.items()}
    for unit in units:
        state = state_of(unit)
        refs = {"sum": [], "avg": []}
        for g in state.groups:
            for ref in g.params:
                op = by_sharded.get(id(ref.sharded))
                if op is not None and ref.sharded.numel():
                    refs[op].append(ref)
        if refs["sum"] or refs["avg"]:
            _check_layouts_match(state, refs, group)
            state.add_grad_sync_hook(_TPGradReduction(refs, group))


def _check_layouts_match(state: FSDPState, refs: dict, group: dist.ProcessGroup) -> None:
    """Every TP rank holds the same pieces of these parameters (one collective, at setup)."""
    mine = [(r.local_fqn, r.global_offset, r.sharded.numel()) for rs in refs.values() for r in rs]
    every: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, mine, group=group)
    if any(other != mine for other in every):
        raise ValueError(
            f"{state.fqn}: the TP ranks shard the parameters Megatron reduces over TP "
            f"differently ({every}): their flat layouts differ (unequal local shapes?); "
            "graph_fsdp needs equal TP pieces (Megatron's even split)"
        )


class _TPGradReduction:
    """The unit's sharded gradients of sequence-parallel (and alike) parameters summed (or
    averaged) over TP, in one coalesced collective per kind."""

    def __init__(self, refs: dict, group: dist.ProcessGroup) -> None:
        self.refs, self.group = refs, group
        self.size = dist.get_world_size(group)

    def __call__(self) -> None:
        for op, refs in self.refs.items():
            if not refs:
                continue
            grads = [r.grad_view for r in refs]
            flat = torch.cat(grads)
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group)
            if op == "avg":  # SUM then divide: gloo has no AVG
                flat.div_(self.size)
            torch._foreach_copy_(grads, list(flat.split([g.numel() for g in grads])))


class TPSharding:
    """What ``shard_gpt`` does for a model with TP > 1: :func:`prepare` before its
    ``fully_shard`` calls, :meth:`install` after them."""

    def __init__(self, lm: nn.Module, config, device_type: str) -> None:
        self.mesh = data_parallel_mesh(device_type)
        """The data-parallel mesh every ``fully_shard`` of the model takes."""
        mark_params(lm)
        self.reduced = tp_reduced_params(lm, config)
        self.originals = {id(p): p for p in lm.parameters()}

    def install(self, units: list[nn.Module]) -> None:
        install_grad_sync(units, self.reduced, self.originals)


def prepare(lm: nn.Module, config, device_type: str) -> TPSharding | None:
    """None at TP = 1 (nothing to do), else the model's :class:`TPSharding`."""
    if check_model(config) == 1:
        return None
    return TPSharding(lm, config, device_type)
