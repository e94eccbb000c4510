"""Dropless Megatron-Core MoE layers without a host sync: a layer-spec choice (any EP, TP = 1).

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    from graph_fsdp.integrations.megatron.moe import grouped_mm_moe_spec

    spec = grouped_mm_moe_spec(
        get_gpt_layer_with_transformer_engine_spec(num_experts=8, moe_grouped_gemm=True)
    )
    gpt = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=..., ...)

(``graph_fsdp.integrations.megatron.build_gpt`` does this for
``MCoreGPTConfig(moe_experts_impl="grouped_mm")``.) Needs megatron-core; import it only where
megatron-core imports.

Megatron-Core 0.19's dropless MoE copies ``tokens_per_expert`` to the host
(``MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize`` in token_dispatcher.py) because
its experts take host split sizes (TEGroupedMLP's ``m_splits``, SequentialMLP's
``torch.split``), and sorts tokens by local expert with host split sizes too
(``sort_chunks_by_idxs``). A CUDA graph cannot hold that, so the experts - most of an MoE
layer's kernels - ran eagerly. :class:`GroupedMMMoELayer` is Megatron's ``MoELayer`` (its
router, aux losses, shared expert and forward are unchanged) with two parts swapped:

- :class:`DeviceCountDispatcher`: a static-size sort of the ``tokens x topk`` routed copies by
  expert, the per-expert counts kept on the device, and the combine as the adjoint gather
  (grouped_moe.py [Note: static-size dropless routing]). At EP > 1 the copies cross
  Megatron's expert-parallel group through graph_fsdp's dropless exchange: fixed-size
  all-to-alls of the counts and of per-peer blocks, a bounded receive buffer with an overflow
  flag (parallel/dropless_ep.py [Note: dropless all-to-all with static shapes]).
- :class:`GroupedMMExperts`: the experts' FFN as two ``torch._grouped_mm`` calls that read
  int32 cumulative offsets from device memory (bf16 on sm90 / sm100 GPUs). For backward it
  keeps its input rows and fc1's output only, and recomputes the activation (what Megatron's
  ``moe_act`` recompute does; bit-identical to keeping it): per routed row
  ``2 x (hidden + ffn)`` bytes in bf16 (``2 x (hidden + 2 ffn)`` gated), less than half of what
  TEGroupedMLP with the unfused activation keeps (grouped_moe.py [Note: the experts recompute
  their activation]).

Parameters: router and shared expert keep Megatron's modules and names. The routed experts
hold ``experts.linear_fc1.weight`` ``[experts, ffn (x2 with a GLU), hidden]`` and
``experts.linear_fc2.weight`` ``[experts, hidden, ffn]``: TEGroupedMLP's
``linear_fc1.weight{e}`` / ``linear_fc2.weight{e}`` matrices, stacked
(grouped_moe.split_expert_weights / stack_expert_weights convert state dicts). Megatron's
``sharded_state_dict`` of these experts is the default one (no per-expert keys), valid at EP = 1;
graph_fsdp's DCP checkpoints save them under global expert rows at any EP (megatron/ep.py
[Note: Megatron-Core expert parallelism]).

Numerics against Megatron's experts: the same math (fc1, activation, routing weight applied
before fc2, sum of a token's copies) in other kernels - CUTLASS grouped GEMMs instead of TE's
cuBLAS grouped GEMM, a gather + reduction (fp32 accumulator, one rounding) instead of
Megatron's scatter-add into a bf16 buffer - so bf16 results differ in the last bits: a
different model of the same maths, not a failed check. Graphed and eager runs of *this* layer
are bit-identical.
"""

from __future__ import annotations

import dataclasses
import functools
from contextlib import nullcontext

import torch
from megatron.core import utils
from megatron.core.tensor_parallel.random import (
    get_cuda_rng_tracker,
    get_expert_parallel_rng_tracker_name,
)
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
from megatron.core.transformer.moe.token_dispatcher import MoETokenDispatcher
from megatron.core.transformer.spec_utils import ModuleSpec

from graph_fsdp.integrations.megatron.versions import mlp_spec, mlp_spec_parts, moe_layer_kwargs
from graph_fsdp.parallel.dropless_ep import (
    DroplessExchange,
    OverflowFlag,
    exchange_for,
    receive_buffer_rows,
)
from graph_fsdp.parallel.grouped_moe import (
    GROUPED_MM_ALIGN_BYTES,
    MAX_GROUPS,
    ExpertSort,
    GroupedLinear,
    combine,
    dispatch,
    expert_probs,
    grouped_mlp,
    sort_by_expert,
    top_experts_from_routing_map,
)

_OFFLOADED_EXPERT_MODULES = {"expert_fc1", "moe_act", "fused_group_mlp"}


def grouped_mm_moe_problems(config) -> list[str]:
    """The settings of a ``TransformerConfig`` :class:`GroupedMMMoELayer` does not run, each
    with the value that works (empty: it runs). Reads Megatron's field names only."""
    problems: list[str] = []

    def need(ok: bool, text: str) -> None:
        if not ok:
            problems.append(text)

    get = functools.partial(getattr, config)
    need(get("num_moe_experts") is not None, "num_moe_experts is None: it is an MoE layer")
    need(
        get("moe_expert_capacity_factor") is None,
        f"moe_expert_capacity_factor={get('moe_expert_capacity_factor')}: this layer is dropless "
        "(capacity None); drop-padding (moe_expert_capacity_factor + "
        "moe_pad_expert_input_to_capacity) needs no host sync with Megatron's own layer spec",
    )
    need(
        not (
            get("moe_router_padding_for_quantization", False)
            or get("moe_router_padding_for_fp8", False)
        ),
        "moe_router_padding_for_quantization pads the routing map beyond topk entries per token; "
        "set it False",
    )
    need(
        get("moe_token_dispatcher_type") in ("alltoall", "allgather"),
        f"moe_token_dispatcher_type={get('moe_token_dispatcher_type')!r}: the layer brings its "
        "own dispatcher in place of alltoall / allgather (flex's DeepEP/HybridEP is not it)",
    )
    etp = get("expert_tensor_parallel_size", 1) or 1
    need(
        get("tensor_model_parallel_size") == 1 and etp == 1,
        f"tensor_model_parallel_size={get('tensor_model_parallel_size')}, "
        f"expert_tensor_parallel_size={etp}: the layer runs without tensor parallelism (1)",
    )
    need(
        not get("moe_shared_expert_overlap", False),
        "moe_shared_expert_overlap=True overlaps the shared expert with Megatron's "
        "dispatcher's communication streams, which this layer's dispatcher does not use: set it "
        "False",
    )
    need(get("moe_latent_size", None) is None, "moe_latent_size is not supported: set None")
    need(
        not get("fp8", None) and not get("fp4", None),
        "fp8 / fp4 experts are not supported (torch._grouped_mm runs bf16): set fp8=fp4=None",
    )
    need(not get("add_bias_linear"), "add_bias_linear=True: the grouped experts have no bias")
    need(
        not get("moe_apply_probs_on_input", False),
        "moe_apply_probs_on_input=True is not supported: set False (probs apply before fc2)",
    )
    need(
        get("moe_mlp_glu_interleave_size", None) is None,
        "moe_mlp_glu_interleave_size is not supported: set None",
    )
    need(
        get("glu_linear_offset", 0.0) == 0.0 and get("activation_func_clamp_value", None) is None,
        "glu_linear_offset / activation_func_clamp_value are not supported: 0.0 and None",
    )
    need(
        not get("use_te_activation_func", False),
        "use_te_activation_func=True is not supported: the experts apply "
        "config.activation_func; set it False",
    )
    # recompute_modules 'moe_act' is what GroupedMMExperts always does (grouped_moe.py
    # [Note: the experts recompute their activation]): accepted, nothing to switch on.
    offload = set(get("offload_modules", None) or [])
    need(
        not (
            get("fine_grained_activation_offloading", False) and offload & _OFFLOADED_EXPERT_MODULES
        ),
        f"offload_modules {sorted(offload & _OFFLOADED_EXPERT_MODULES)} offload TEGroupedMLP's "
        "activations, which GroupedMMExperts does not have: drop them",
    )
    for flag in (
        "delay_wgrad_compute",
        "overlap_dispatch_backward_with_experts_wgrad",
        "overlap_moe_expert_parallel_comm",
    ):
        need(not get(flag, False), f"{flag}=True is not supported: weight gradients are "
             "computed in the backward itself; set it False")  # fmt: skip
    need(
        get("transformer_impl", "transformer_engine") != "inference_optimized",
        "transformer_impl='inference_optimized' brings its own experts: use transformer_engine "
        "or local",
    )
    experts = get("num_moe_experts") or 0
    need(
        experts < MAX_GROUPS,
        f"num_moe_experts={experts}: torch._grouped_mm takes fewer than {MAX_GROUPS} groups",
    )
    align = GROUPED_MM_ALIGN_BYTES // 2  # bf16 rows
    for field in ("hidden_size", "moe_ffn_hidden_size"):
        size = get(field)
        need(
            size is not None and size % align == 0,
            f"{field}={size} is not a multiple of {align}: torch._grouped_mm reads "
            f"{GROUPED_MM_ALIGN_BYTES}-byte aligned bf16 rows",
        )
    return problems


class DeviceCountDispatcher(MoETokenDispatcher):
    """Megatron's token-dispatcher interface with the routed copies sorted on the device.

    ``dispatch_preprocess`` turns the router's ``[tokens, experts]`` map into the global expert
    order of the ``tokens x topk`` copies (grouped_moe.sort_by_expert) and gathers their rows
    and routing weights; ``dispatch_postprocess`` hands the experts the per-expert counts as a
    *device* tensor; ``combine_postprocess`` sums each token's copies back.

    At EP = 1 the all-to-all steps are identities. At EP > 1 ``token_dispatch`` sends the
    copies (rows and routing weights) to the ranks of their experts over Megatron's
    expert-parallel group through graph_fsdp's dropless exchange (parallel/dropless_ep.py
    [Note: dropless all-to-all with static shapes]): the counts through a fixed-size
    all-to-all, the rows in fixed-size per-peer blocks of ``receive_buffer_rows`` rows, the
    local layout's offsets computed on the device; ``token_combine`` is the reverse exchange.
    With ``receive_buffer_factor`` set, copies past a peer's block are not exchanged and
    ``overflow`` (the layer's :class:`OverflowFlag`, which holds the factor) records it, so the
    training loop repeats the step with every copy's buffer ([Note: dropless overflow
    reports]).
    """

    def __init__(
        self,
        num_local_experts: int,
        config,
        pg_collection=None,
        *,
        receive_buffer_factor: float | None = None,
        overflow: OverflowFlag | None = None,
    ) -> None:
        super().__init__(config=config, pg_collection=pg_collection)
        tp_ep = utils.get_pg_size(self.tp_ep_group)
        if self.tp_size != 1 or tp_ep != self.ep_size:
            raise ValueError(
                f"DeviceCountDispatcher runs without tensor parallelism, but the expert "
                f"tensor-parallel group has {self.tp_size} ranks and the expert tensor x "
                f"expert-parallel group {tp_ep} (expert-parallel: {self.ep_size}): use "
                "tensor_model_parallel_size=expert_tensor_parallel_size=1"
            )
        self.num_local_experts = num_local_experts
        self.num_experts = num_local_experts * self.ep_size
        self.topk = config.moe_router_topk
        if overflow is not None and overflow.factor != receive_buffer_factor:
            raise ValueError(
                f"DeviceCountDispatcher: receive_buffer_factor={receive_buffer_factor!r} but the "
                f"OverflowFlag given holds factor={overflow.factor!r}: pass one of them"
            )
        self.overflow = overflow if overflow is not None else OverflowFlag(receive_buffer_factor)
        self.hidden_shape: torch.Size | None = None
        self._sort: ExpertSort | None = None
        self._exchange: DroplessExchange | None = None

    def dispatch_preprocess(
        self, hidden_states: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor
    ):
        """Global-expert-ordered rows and routing weights of the routed copies."""
        self.hidden_shape = hidden_states.shape
        tokens = hidden_states.reshape(-1, self.hidden_shape[-1])
        top = top_experts_from_routing_map(routing_map, self.topk)
        self._sort = sort_by_expert(top, self.num_experts)
        return dispatch(tokens, self._sort), expert_probs(probs, self._sort)

    def token_dispatch(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        """EP > 1: the copies and their weights to their experts' ranks, in local expert
        order (``ep x B`` rows, the blocks' padding last); EP = 1: no communication."""
        if self.ep_size == 1:
            return hidden_states, probs
        self._exchange = exchange_for(
            self._current_sort().counts,
            self.ep_group,
            num_copies=hidden_states.shape[0],
            overflow=self.overflow,
        )
        return self._exchange.dispatch(hidden_states), self._exchange.dispatch(probs)

    def dispatch_postprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        """``(rows, tokens_per_expert on the device, probs)`` for the (local) experts."""
        counts = self._current_sort().counts if self.ep_size == 1 else self._exchange.local_counts
        return hidden_states, counts, probs

    def combine_preprocess(self, hidden_states: torch.Tensor):
        """EP > 1: the padding rows after the last local expert's (which the grouped GEMMs
        leave as allocated) set to zero, so the exchange carries defined values."""
        if self.ep_size == 1:
            return hidden_states
        offsets = self._exchange.local_offsets
        rows = torch.arange(hidden_states.shape[0], device=hidden_states.device)
        return hidden_states.masked_fill((rows >= offsets[-1])[:, None], 0)

    def token_combine(self, hidden_states: torch.Tensor):
        """EP > 1: the experts' outputs back to the copies' ranks, in global expert order."""
        if self.ep_size == 1:
            return hidden_states
        out = self._exchange.combine(hidden_states)
        self._exchange = None
        return out

    def combine_postprocess(self, hidden_states: torch.Tensor):
        """Each token's copies summed back, in the input's ``[seq, batch, hidden]`` shape."""
        out = combine(hidden_states, self._current_sort())
        self._sort = None
        return out.view(self.hidden_shape)

    def _current_sort(self) -> ExpertSort:
        if self._sort is None:
            raise RuntimeError(
                "DeviceCountDispatcher: token_dispatch / dispatch_postprocess / "
                "combine_postprocess ran without dispatch_preprocess (MoELayer.forward calls "
                "them in that order)"
            )
        return self._sort


class GroupedMMExperts(MegatronModule):
    """The routed experts as grouped GEMMs with device offsets (Megatron's ExpertsInterface).

    ``forward(rows, tokens_per_expert, probs)`` computes TEGroupedMLP's math -
    ``fc2(act(fc1(x)) * prob)`` per expert - with ``torch._grouped_mm`` reading the cumulative
    offsets of ``tokens_per_expert`` from device memory: no host sync when the counts are a
    device tensor (:class:`DeviceCountDispatcher`'s); a host tensor from Megatron's own
    dispatchers is copied to the device first.

    Parameters stack the local experts along dimension 0 (``linear_fc1.weight[e]`` is local
    expert e's matrix, global expert ``ep_rank * num_local_experts + e``):
    :data:`~graph_fsdp.integrations.megatron.ep.STACKED_EXPERTS_ATTR` says so to graph_fsdp's
    expert groups and checkpoints.
    """

    graph_fsdp_stacked_experts = True

    def __init__(
        self,
        num_local_experts: int,
        config,
        pg_collection=None,
        name: str | None = None,
    ) -> None:
        super().__init__(config=config)
        del pg_collection, name  # the dispatcher communicates; the experts compute only
        ffn = config.moe_ffn_hidden_size
        hidden = config.hidden_size
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        fc1_out = 2 * ffn if config.gated_linear_unit else ffn
        kw = dict(device=device, dtype=config.params_dtype)
        self.num_local_experts = num_local_experts
        self.linear_fc1 = GroupedLinear(num_local_experts, hidden, fc1_out, **kw)
        self.linear_fc2 = GroupedLinear(num_local_experts, ffn, hidden, **kw)
        self.activation_func = config.activation_func
        self.gated = config.gated_linear_unit
        self._init_weights()
        ep = getattr(config, "expert_model_parallel_size", 1) or 1
        for param in self.parameters():
            # Megatron's marker of expert-*parallel* parameters, as its own experts set it:
            # allreduce=False when EP > 1 (reduced over the expert-data-parallel group only);
            # at EP = 1 they reduce over the data-parallel group like every other parameter
            # (shard_gpt(expert_groups=True) gives them their own groups, over the same ranks).
            param.allreduce = ep == 1

    def _init_weights(self) -> None:
        """Each expert's matrix from an fp32 master, as Megatron initialises linear layers:
        ``init_method`` for fc1, ``output_layer_init_method`` for fc2, experts in order: the
        distributions of TEGroupedMLP's weights (the same draws are not promised)."""
        cfg = self.config
        if not cfg.perform_initialization:
            return
        rng = (
            nullcontext()
            if cfg.use_cpu_initialization
            else get_cuda_rng_tracker().fork(get_expert_parallel_rng_tracker_name())
        )
        with torch.no_grad(), rng:
            for linear, init in (
                (self.linear_fc1, cfg.init_method),
                (self.linear_fc2, cfg.output_layer_init_method),
            ):
                w = linear.weight
                for e in range(w.shape[0]):
                    master = torch.empty(w.shape[1:], dtype=torch.float32, device=w.device)
                    init(master)
                    w[e].copy_(master)

    def forward(
        self,
        permuted_local_hidden_states: torch.Tensor,
        tokens_per_expert: torch.Tensor,
        permuted_probs: torch.Tensor,
    ) -> tuple[torch.Tensor, None]:
        x = permuted_local_hidden_states
        counts = torch.as_tensor(tokens_per_expert, device=x.device)
        offsets = counts.cumsum(0).to(torch.int32)
        out = grouped_mlp(
            x,
            permuted_probs,
            self.linear_fc1.weight,
            self.linear_fc2.weight,
            offsets,
            activation=self.activation_func,
            gated=self.gated,
        )
        return out, None

    def backward_dw(self) -> None:
        """Megatron's delayed-wgrad hook: nothing is deferred here (the weight gradients are
        computed in the backward itself; delay_wgrad_compute is refused)."""


class GroupedMMMoELayer(MoELayer):
    """Megatron-Core's ``MoELayer`` with :class:`DeviceCountDispatcher` in place of its token
    dispatcher: dropless, no host sync, at any expert-parallel size (TP = 1). Its experts are
    the spec's (:func:`grouped_mm_moe_spec` gives :class:`GroupedMMExperts`).

    ``receive_buffer_factor`` (EP > 1): rows each rank receives from one peer, as a multiple
    of the balanced load; None holds every copy (never drops). With a factor the layer's
    ``dropless_overflow`` flag records exchanges that dropped rows, which the training loop
    reads after each step's backward to repeat the step with every copy's buffer
    (parallel/dropless_ep.py [Note: dropless overflow reports]).
    """

    def __init__(
        self,
        config,
        submodules: MoESubmodules | None = None,
        layer_number: int | None = None,
        pg_collection=None,
        is_mtp_layer: bool = False,
        name: str | None = None,
        receive_buffer_factor: float | None = None,
    ) -> None:
        problems = grouped_mm_moe_problems(config)
        if receive_buffer_factor is not None:
            receive_buffer_rows(1, 1, receive_buffer_factor)  # > 0, else a ValueError
        if problems:
            raise ValueError(
                "GroupedMMMoELayer (graph_fsdp's dropless MoE without a host sync) cannot run "
                "this TransformerConfig:\n- " + "\n- ".join(problems)
            )
        pg_collection = pg_collection if pg_collection is not None else get_default_pg_collection()
        super().__init__(
            config,
            submodules=submodules,
            layer_number=layer_number,
            pg_collection=pg_collection,
            **moe_layer_kwargs(is_mtp_layer=is_mtp_layer, name=name),
        )
        # MoELayer built the dispatcher config.moe_token_dispatcher_type names; replace it.
        # OVERFLOW_ATTR: the loop's overflow check reads it.
        self.dropless_overflow = OverflowFlag(receive_buffer_factor)
        self.token_dispatcher = DeviceCountDispatcher(
            self.num_local_experts,
            config=config,
            pg_collection=pg_collection,
            receive_buffer_factor=receive_buffer_factor,
            overflow=self.dropless_overflow,
        )


def _moe_submodules(mlp) -> tuple[type, MoESubmodules, dict]:
    module, submodules, params = mlp_spec_parts(mlp)
    if _is_moe_class(module):
        return module, submodules, params
    raise ValueError(
        f"the layer spec's mlp is {mlp!r}, not Megatron-Core's MoELayer; build the spec with "
        "num_experts=N (e.g. get_gpt_layer_local_spec(num_experts=8))"
    )


def _is_moe_class(obj) -> bool:
    return isinstance(obj, type) and issubclass(obj, MoELayer)


def _map_moe_layer_spec(layer_spec: ModuleSpec, edit, layer_class, params) -> ModuleSpec:
    like = layer_spec.submodules.mlp
    cls, submodules, kwargs = _moe_submodules(like)
    mlp = mlp_spec(like, layer_class or cls, edit(submodules), {**kwargs, **params})
    return dataclasses.replace(
        layer_spec, submodules=dataclasses.replace(layer_spec.submodules, mlp=mlp)
    )


def map_moe_layer_specs(spec, edit, layer_class: type | None = None, params: dict | None = None):
    """A copy of a GPT layer spec (``get_gpt_layer_with_transformer_engine_spec`` /
    ``get_gpt_layer_local_spec`` with ``num_experts``) whose MoE block is built from
    ``edit(its MoESubmodules)`` (and as ``layer_class`` when given, with ``params`` added to
    its keyword arguments). A block spec
    (``TransformerBlockSubmodules``) gets every MoE layer spec in its ``layer_specs`` mapped,
    dense ones kept. The input spec is left as it was."""
    layer_specs = getattr(spec, "layer_specs", None)
    if layer_specs is not None:
        return dataclasses.replace(
            spec,
            layer_specs=[
                _map_moe_layer_spec(s, edit, layer_class, params or {})
                if _is_moe_layer_spec(s)
                else s
                for s in layer_specs
            ],
        )
    return _map_moe_layer_spec(spec, edit, layer_class, params or {})


def grouped_mm_moe_spec(spec, *, receive_buffer_factor: float | None = None):
    """A copy of a GPT layer spec (``get_gpt_layer_with_transformer_engine_spec`` /
    ``get_gpt_layer_local_spec`` with ``num_experts``) whose MoE block is
    :class:`GroupedMMMoELayer` with :class:`GroupedMMExperts`; the router and the shared
    expert stay the spec's. A block spec (``TransformerBlockSubmodules``) gets every MoE layer
    spec in its ``layer_specs`` replaced, dense ones kept. ``receive_buffer_factor``: the
    layers' receive buffer at EP > 1 (:class:`GroupedMMMoELayer`)."""
    params = (
        {} if receive_buffer_factor is None else {"receive_buffer_factor": receive_buffer_factor}
    )
    try:
        return map_moe_layer_specs(
            spec,
            lambda sub: MoESubmodules(
                experts=GroupedMMExperts,
                shared_experts=sub.shared_experts,
                router=sub.router,
            ),
            layer_class=GroupedMMMoELayer,
            params=params,
        )
    except ValueError as err:
        raise ValueError(f"grouped_mm_moe_spec: {err}") from None


def _is_moe_layer_spec(spec) -> bool:
    mlp = getattr(getattr(spec, "submodules", None), "mlp", None)
    return _is_moe_class(mlp_spec_parts(mlp)[0])
