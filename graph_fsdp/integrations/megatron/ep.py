"""Expert parallelism (EP > 1) for Megatron-Core GPTs under graph_fsdp.

    from graph_fsdp.integrations import megatron as gm

    gm.init_parallel_state(expert_model_parallel_size=2)      # EP groups of 2 consecutive ranks
    cfg = gm.MCoreGPTConfig(num_experts=8, expert_model_parallel_size=2,
                            moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True)
    lm = gm.shard_gpt(gm.build_gpt(cfg), mp_policy=...)       # dense over DP, experts over EDP

Imports nothing from megatron-core at module level (CI imports graph_fsdp without it).

[Note: Megatron-Core expert parallelism]
- Parallel state: Megatron's ``initialize_model_parallel`` with TP = PP = 1 and EP = N over
  the default group. Its rank order ("tp-cp-ep-dp-pp") makes an EP group of N consecutive
  ranks and an expert-data-parallel (EDP) group of the world / N ranks N apart holding the
  same experts - the layout of ``graph_fsdp.init_expert_mesh``. The dense data-parallel group
  stays the whole world.
- Model: every MoELayer holds ``num_experts / N`` experts; local expert i of EP rank r is
  global expert ``r * n + i`` (``MoELayer.local_expert_indices``). Megatron marks their
  parameters ``allreduce=False`` when N > 1, and its token dispatcher moves tokens over the
  EP group (alltoall: an all-to-all; allgather: an all-gather and a reduce-scatter).
- Sharding (:func:`expert_mesh_for`): ``shard_gpt`` gives every layer's ``fully_shard`` the
  ``(edp, ep)`` mesh of Megatron's own groups (``expert_mesh_from_groups``) and marks each
  routed-expert parameter with its layout (``SequentialMLP``'s ``local_experts.<i>``, TE
  ``GroupedLinear``'s ``weight<i>``, graph_fsdp's stacked ``GroupedMMExperts``): experts are
  sharded and reduced over EDP, the rest over DP (experts.py [Note: expert groups]). At
  EP = 1 the experts stay in the layers' dense groups (EDP = DP, one collective fewer) unless
  ``shard_gpt(..., expert_groups=True)``.
- Weights (:class:`GlobalExpertInit`): ``build_gpt`` builds each MoELayer's experts outside
  the global RNG stream and draws each expert's weights from a generator keyed by (seed,
  layer, *global* expert, fc1 / fc2), so a seeded model is the same global model at every EP
  size, dense weights included: EP runs compare with EP = 1 runs, and a checkpoint of one is
  the other's starting point.
- Checkpoints: graph_fsdp.fsdp.checkpoint saves expert parameters under their global names
  (``local_experts.<r * n + i>``, ``weight<r * n + i>``, stacked rows), so DCP checkpoints
  move between EP sizes and world sizes; at EP = 1 Megatron's names are the global ones.
- Capture: drop-padding (``moe_expert_capacity_factor`` + ``moe_pad_expert_input_to_capacity``,
  alltoall) exchanges equal, capacity-sized splits with no host sync, so the whole layer,
  ``moe`` and ``full_iteration`` capture at any EP. Megatron's dropless EP needs the
  all-to-all's split sizes on the host (``_maybe_dtoh_and_synchronize``): ``attn``,
  ``moe_router`` and ``moe_preprocess`` capture, the expert part stays eager (scopes.py
  ``moe_expert_capture_refusal``). graph_fsdp's dropless grouped_mm experts exchange fixed-size
  blocks with device offsets (moe.py ``DeviceCountDispatcher``): captured whole at any EP.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import replace

import torch
import torch.distributed as dist
from torch import nn

from graph_fsdp.fsdp.experts import EXPERT_ATTR, ExpertLayout, expert_mesh_from_groups, layout_of

STACKED_EXPERTS_ATTR = "graph_fsdp_stacked_experts"
"""Class attribute of an experts module whose parameters stack the local experts along
dimension 0 (graph_fsdp's ``GroupedMMExperts``)."""

_OWNED_STATE: list = []
"""The EP group of the parallel state :func:`initialize` created (re-initialised only then)."""


def check_expert_parallel_size(ep: object, world: int) -> int:
    """``ep`` as the expert-model-parallel size of a ``world``-rank job, or a clear error."""
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
        raise ValueError(
            f"expert_model_parallel_size={ep!r} must be a positive integer (1: no expert "
            "parallelism)"
        )
    if world % ep:
        divisors = [d for d in range(1, world + 1) if world % d == 0]
        raise ValueError(
            f"expert_model_parallel_size={ep} does not divide the world size {world}: "
            f"graph_fsdp runs tensor and pipeline parallel size 1, so EP x EDP must be the "
            f"{world} ranks; use one of {divisors} or launch a multiple of {ep} ranks"
        )
    return ep


def initialize(expert_model_parallel_size: int | None) -> None:
    """Megatron's parallel_state over the default group, TP = PP = 1 and EP as asked.

    None keeps an initialised state's EP (else 1). A state this function created with another
    EP is destroyed and re-created (models built under it keep its groups: build new ones); a
    state initialised elsewhere with another EP is refused.
    """
    from megatron.core import parallel_state as ps  # noqa: PLC0415 (optional dependency)

    if not dist.is_initialized():
        raise RuntimeError(
            "init_parallel_state needs torch.distributed: call dist.init_process_group first"
        )
    world = dist.get_world_size()
    ep = expert_model_parallel_size
    if ep is not None:
        check_expert_parallel_size(ep, world)
    if ps.model_parallel_is_initialized():
        sizes = {
            "tensor_model_parallel_size": ps.get_tensor_model_parallel_world_size(),
            "pipeline_model_parallel_size": ps.get_pipeline_model_parallel_world_size(),
        }
        wrong = {k: v for k, v in sizes.items() if v != 1}
        if wrong:
            raise ValueError(
                f"Megatron's parallel_state is already initialised with {wrong}; graph_fsdp "
                "needs tensor and pipeline parallel size 1 (data and expert parallelism only)"
            )
        current = ps.get_expert_model_parallel_world_size()
        if ep is None or ep == current:
            return
        if not _OWNED_STATE or _OWNED_STATE[0] is not ps.get_expert_model_parallel_group():
            raise ValueError(
                f"Megatron's parallel_state was initialised elsewhere with "
                f"expert_model_parallel_size={current}, not {ep}: call "
                "megatron.core.parallel_state.destroy_model_parallel() first, or use "
                f"expert_model_parallel_size={current}"
            )
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        expert_model_parallel_size=1 if ep is None else ep,
    )
    _OWNED_STATE[:] = [ps.get_expert_model_parallel_group()]


def parallel_state_ep(what: str) -> int:
    """Megatron's initialised expert-model-parallel size, after checking that its dense
    data-parallel group is the whole world (``what`` names the caller in errors)."""
    from megatron.core import parallel_state as ps  # noqa: PLC0415 (optional dependency)

    if not ps.model_parallel_is_initialized():
        raise RuntimeError(f"call init_parallel_state() before {what}")
    dp = dist.get_process_group_ranks(ps.get_data_parallel_group())
    world = list(range(dist.get_world_size()))
    if sorted(dp) != world:
        raise ValueError(
            f"{what}: graph_fsdp shards dense parameters over the default group (ranks "
            f"{world}), but Megatron's data-parallel group is {dp}: use tensor and pipeline "
            "parallel size 1 (gm.init_parallel_state)"
        )
    return ps.get_expert_model_parallel_world_size()


def check_model_ep(config, what: str) -> int:
    """The EP size ``config`` (a TransformerConfig or MCoreGPTConfig) was built for, which
    must be Megatron's initialised one."""
    ep = parallel_state_ep(what)
    built = getattr(config, "expert_model_parallel_size", 1) or 1
    if built != ep:
        raise ValueError(
            f"{what}: the model is configured for expert_model_parallel_size={built}, but "
            f"Megatron's parallel state has {ep}: call gm.init_parallel_state("
            f"expert_model_parallel_size={built}) before building the model"
        )
    return ep


# --------------------------------------------------------------------------------------------
# Sharding: the expert mesh and the experts' layouts
# --------------------------------------------------------------------------------------------


def moe_layers(layers: list[nn.Module]) -> list[nn.Module]:
    """The TransformerLayers whose ``mlp`` is an MoE block (it has a router and experts)."""
    return [
        layer
        for layer in layers
        if hasattr(getattr(layer, "mlp", None), "router") and hasattr(layer.mlp, "experts")
    ]


def expert_layouts(layer: nn.Module) -> dict[str, ExpertLayout]:
    """``{fqn in layer: layout}`` of an MoE TransformerLayer's routed-expert parameters.

    Megatron's ``SequentialMLP`` (``local_experts.<i>.``) and TE ``GroupedLinear``
    (``weight<i>``) are recognised by name (experts.py ``layout_of``), graph_fsdp's stacked
    experts by :data:`STACKED_EXPERTS_ATTR`; any other layout is refused here, before
    anything is sharded, rather than when a checkpoint is saved.
    """
    experts = layer.mlp.experts
    stacked = bool(getattr(experts, STACKED_EXPERTS_ATTR, False))
    out: dict[str, ExpertLayout] = {}
    for name, p in experts.named_parameters():
        fqn = f"mlp.experts.{name}"
        owner = experts.get_submodule(name.rpartition(".")[0])
        layout = ExpertLayout() if stacked else layout_of(layer, fqn, p, owner)
        if layout is None:
            raise ValueError(
                f"expert parameter {fqn} of {type(experts).__name__}: graph_fsdp knows the "
                "expert layouts of SequentialMLP (local_experts.<i>), TEGroupedMLP (TE "
                "GroupedLinear weight<i>; moe_single_grouped_weight=False) and GroupedMMExperts;"
                " mark it with graph_fsdp.mark_expert_params before shard_gpt"
            )
        out[fqn] = layout
    return out


def expert_mesh_for(layers: list[nn.Module], ep: int, expert_groups: bool | None, device_type):
    """The ``(edp, ep)`` mesh of Megatron's groups for ``fully_shard(layer, expert_mesh=...)``
    (None: the experts stay in the layers' dense groups), with every routed-expert parameter
    of ``layers`` marked with its layout. [Note: Megatron-Core expert parallelism]"""
    if expert_groups is None:
        expert_groups = ep > 1
    if ep > 1 and not expert_groups:
        raise ValueError(
            f"shard_gpt(expert_groups=False) at expert_model_parallel_size={ep}: the ranks of "
            "an EP group hold different experts, which reduced over the data-parallel group "
            "would be summed together; leave expert_groups at None (or True)"
        )
    moe = moe_layers(layers)
    if not expert_groups or not moe:
        return None
    for layer in moe:
        params = dict(layer.named_parameters())
        for fqn, layout in expert_layouts(layer).items():
            setattr(params[fqn], EXPERT_ATTR, layout)
    from megatron.core import parallel_state as ps  # noqa: PLC0415 (optional dependency)

    return expert_mesh_from_groups(
        device_type,
        ep_group=ps.get_expert_model_parallel_group(),
        edp_group=ps.get_expert_data_parallel_group(),
    )


# --------------------------------------------------------------------------------------------
# Weights: the same global model at every EP size
# --------------------------------------------------------------------------------------------

_SEQUENTIAL = re.compile(r"local_experts\.(\d+)\.(linear_fc[12])\.weight")
_GROUPED = re.compile(r"(linear_fc[12])\.weight(\d+)")
_STACKED = re.compile(r"(linear_fc[12])\.weight")


def expert_weights(experts: nn.Module) -> list[tuple[int, str, torch.Tensor]]:
    """``(local expert, "linear_fc1" | "linear_fc2", its weight matrix)`` of every routed
    expert's weight; biases are not listed (Megatron initialises them to zero)."""
    stacked = bool(getattr(experts, STACKED_EXPERTS_ATTR, False))
    out: list[tuple[int, str, torch.Tensor]] = []
    for name, p in experts.named_parameters():
        if name.rsplit(".", 1)[-1].startswith("bias"):
            continue
        if stacked and (m := _STACKED.fullmatch(name)):
            out.extend((i, m.group(1), p[i]) for i in range(p.shape[0]))
        elif m := _SEQUENTIAL.fullmatch(name):
            out.append((int(m.group(1)), m.group(2), p))
        elif m := _GROUPED.fullmatch(name):
            out.append((int(m.group(2)), m.group(1), p))
        else:
            raise ValueError(
                f"{type(experts).__name__}.{name}: not an expert weight graph_fsdp can draw per "
                "global expert (SequentialMLP local_experts.<i>.linear_fc1/2.weight, TE "
                "linear_fc1/2.weight<i>, GroupedMMExperts' stacked linear_fc1/2.weight)"
            )
    return out


def expert_seed(seed: int, layer: int, expert: int, fc: str) -> int:
    """The generator seed of one global expert's weight (the same at every EP size)."""
    return (seed * 1_000_003 + layer * 65_537 + expert * 2 + (fc == "linear_fc2")) % 2**63


class GlobalExpertInit:
    """An MoE spec's experts builder, wrapped: the experts are built outside the global RNG
    stream (so the dense weights drawn after them do not depend on how many experts this rank
    holds), then each local expert's weights are drawn from a generator keyed by its *global*
    index (``init_method`` for fc1, ``output_layer_init_method`` for fc2, as Megatron's expert
    linears do). ``layers`` numbers the MoE layers of one model in construction order (one
    counter for every MoE layer spec of a model). [Note: Megatron-Core expert parallelism]"""

    def __init__(self, inner, seed: int, layers: itertools.count) -> None:
        self.inner, self.seed, self.layers = inner, seed, layers

    def __call__(self, num_local_experts: int, config, pg_collection=None, name=None):
        from graph_fsdp.integrations.megatron.versions import build  # noqa: PLC0415 (imports megatron-core: optional dependency)

        with torch.random.fork_rng(devices=[]):
            experts = build(
                self.inner, num_local_experts, config, pg_collection=pg_collection, name=name
            )
        layer = next(self.layers)
        if not config.perform_initialization:
            return experts
        ep_group = getattr(pg_collection, "ep", None)
        if ep_group is None:
            from megatron.core import parallel_state as ps  # noqa: PLC0415 (optional dependency)

            ep_group = ps.get_expert_model_parallel_group()
        first = dist.get_rank(ep_group) * num_local_experts
        inits = {"linear_fc1": config.init_method, "linear_fc2": config.output_layer_init_method}
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            for local, fc, weight in expert_weights(experts):
                # The CPU generator only (torch.manual_seed would reseed CUDA's as well).
                torch.random.default_generator.manual_seed(
                    expert_seed(self.seed, layer, first + local, fc)
                )
                master = torch.empty(weight.shape, dtype=torch.float32)
                inits[fc](master)
                weight.copy_(master)
        return experts


def with_global_expert_init(spec, seed: int):
    """A copy of a GPT layer (or block) spec whose MoE layers build their experts through
    :class:`GlobalExpertInit` (one layer counter per call: call it once per model built);
    dense layer specs are kept."""
    from graph_fsdp.integrations.megatron.moe import map_moe_layer_specs  # noqa: PLC0415 (imports megatron-core: optional dependency)
    from graph_fsdp.integrations.megatron.versions import builder_spec  # noqa: PLC0415 (imports megatron-core: optional dependency)

    layers = itertools.count()
    return map_moe_layer_specs(
        spec,
        lambda sub: replace(sub, experts=builder_spec(GlobalExpertInit(sub.experts, seed, layers))),
    )
