"""Megatron-Core ``GPTModel`` (dense and MoE) and hybrid models (``HybridModel``, a layer per
character of ``hybrid_layer_pattern``: :func:`build_hybrid`, megatron/hybrid.py) under
graph_fsdp, with Megatron's conventions.

    from graph_fsdp.integrations import megatron as gm

    gm.init_parallel_state()                          # TP = PP = EP = 1 on the default group
    lm = gm.build_gpt(gm.MCoreGPTConfig(num_experts=4, moe_shared_expert_intermediate_size=512))
    gm.shard_gpt(lm, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))

    # expert parallelism: init_parallel_state(expert_model_parallel_size=2) and
    # MCoreGPTConfig(..., expert_model_parallel_size=2) (megatron/ep.py)
    loss = lm(tokens, labels)                         # mean per-token loss (fp32 scalar)

Needs megatron-core (``pip install -e ".[megatron]"``); importing this module without it
works, every entry point raises an ImportError that says what to install.

What the integration maps (facts from megatron-core 0.19's source):

- Parallel state: Megatron's ``parallel_state`` is initialised with tensor and pipeline
  parallel size 1 on the existing process group, so graph_fsdp's data-parallel group is the
  whole world. With expert-model-parallel size N > 1 each rank holds num_experts / N experts;
  their parameters are sharded over Megatron's expert-data-parallel group (world / N ranks),
  the dense ones over the world (megatron/ep.py [Note: Megatron-Core expert parallelism]).
  Tensor parallelism (``init_parallel_state(tensor_model_parallel_size=N)``, dense GPTs,
  optionally ``sequence_parallel``): each TP rank's pieces are sharded over Megatron's
  data-parallel group (megatron/tp.py [Note: Megatron-Core tensor parallelism]).
- Units: ``fully_shard`` per ``TransformerLayer`` (``gpt.decoder.layers``), then the root
  (:class:`MCoreLM`, which owns the embedding, final norm and output layer).
- Gradients: autograd's ``.grad`` of each unsharded parameter - in eager steps collected
  into a flat gradient buffer after the unit's backward, under CUDA graphs preset to views of
  that buffer which autograd accumulates into (param_group.py [Note: gradients autograd
  creates]). Megatron's ``gradient_accumulation_fusion`` makes TE's wgrad GEMM write into
  an fp32 ``param.main_grad`` instead, so it must stay off (Megatron's default);
  :class:`MCoreGPTConfig` rejects it.
- Schedules: ``get_forward_backward_func()`` with PP = 1 runs
  ``forward_backward_no_pipelining``, which wraps all but the last microbatch in
  ``config.no_sync_func()`` and calls ``config.finalize_model_grads_func`` at the end.
  :func:`shard_gpt` sets them to ``lm.no_sync`` and :func:`finalize_model_grads` (graph_fsdp's
  ``finish_grad_sync``); :func:`forward_step` is a ``forward_step_func`` for it.
- ``--cuda-graph-scope`` with Megatron's meaning, as modules of a ``TransformerLayer``:
  see :data:`MCORE_SCOPE_MODULES` (graph_fsdp's scope presets) and :func:`check_mcore_scopes`.
- MoE experts under capture (docs/megatron_moe.md): Megatron's drop-padding
  (``moe_expert_capacity_factor`` + ``moe_pad_expert_input_to_capacity``, alltoall dispatcher)
  has static expert shapes; dropless, ``moe_experts_impl="grouped_mm"`` swaps in
  graph_fsdp's experts with device token counts (graph_fsdp.integrations.megatron.moe). Either
  captures the whole layer, ``moe`` and ``full_iteration``; Megatron's dropless experts copy
  their token counts to the host, so only ``attn`` / ``moe_router`` [``moe_preprocess``].
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from graph_fsdp.capture.policy import GraphPolicy
from graph_fsdp.fsdp.api import BufferPolicy, MixedPrecisionPolicy
from graph_fsdp.fsdp.fully_shard import FSDPModule, fully_shard
from graph_fsdp.integrations.megatron import ep as megatron_ep
from graph_fsdp.integrations.megatron import tp as megatron_tp
from graph_fsdp.integrations.megatron.config import ATTENTION_BACKENDS as ATTENTION_BACKENDS
from graph_fsdp.integrations.megatron.config import INSTALL_HINT as INSTALL_HINT
from graph_fsdp.integrations.megatron.config import MOE_DISPATCHERS as MOE_DISPATCHERS
from graph_fsdp.integrations.megatron.config import MOE_EXPERTS_IMPLS as MOE_EXPERTS_IMPLS
from graph_fsdp.integrations.megatron.config import NORMALIZATIONS as NORMALIZATIONS
from graph_fsdp.integrations.megatron.config import TRANSFORMER_IMPLS as TRANSFORMER_IMPLS
from graph_fsdp.integrations.megatron.config import MCoreGPTConfig as MCoreGPTConfig
from graph_fsdp.integrations.megatron.config import require_megatron as require_megatron
from graph_fsdp.integrations.megatron.mcore_checkpoint import (
    load_megatron_checkpoint as load_megatron_checkpoint,
)
from graph_fsdp.integrations.megatron.mcore_checkpoint import (
    save_megatron_checkpoint as save_megatron_checkpoint,
)
from graph_fsdp.integrations.megatron.packed import check_packed_config as check_packed_config
from graph_fsdp.integrations.megatron.packed import packed_loss
from graph_fsdp.integrations.megatron.packed import packed_model_config as packed_model_config
from graph_fsdp.integrations.megatron.packed import packed_seq_params as packed_seq_params
from graph_fsdp.integrations.megatron.scopes import MCORE_SCOPE_MODULES as MCORE_SCOPE_MODULES
from graph_fsdp.integrations.megatron.scopes import PREPROCESS_CONSTS as PREPROCESS_CONSTS
from graph_fsdp.integrations.megatron.scopes import PREPROCESS_TENSORS as PREPROCESS_TENSORS
from graph_fsdp.integrations.megatron.scopes import MoEPreprocess as MoEPreprocess
from graph_fsdp.integrations.megatron.scopes import (
    check_mcore_attention_capture,
    check_mcore_scopes,
    install_moe_preprocess,
)
from graph_fsdp.integrations.megatron.scopes import (
    moe_expert_capture_refusal as moe_expert_capture_refusal,
)


def init_parallel_state(
    *, expert_model_parallel_size: int | None = None, tensor_model_parallel_size: int = 1
) -> None:
    """Megatron's parallel_state over the default process group: pipeline parallel size 1,
    expert-model-parallel size ``expert_model_parallel_size`` (a divisor of the world size;
    None keeps an initialised state's, else 1), tensor parallel size
    ``tensor_model_parallel_size`` (dense GPTs, EP = 1). A state these functions created with
    other sizes is re-created (build models after the call); one initialised elsewhere with
    other sizes is refused. [Note: Megatron-Core expert parallelism] (megatron/ep.py),
    [Note: Megatron-Core tensor parallelism] (megatron/tp.py)"""
    require_megatron()
    if tensor_model_parallel_size != 1:
        if expert_model_parallel_size not in (None, 1):
            raise ValueError(
                f"tensor_model_parallel_size={tensor_model_parallel_size} with "
                f"expert_model_parallel_size={expert_model_parallel_size}: graph_fsdp runs "
                "Megatron's TP for dense GPTs (EP = 1)"
            )
        megatron_tp.initialize(tensor_model_parallel_size)
        return
    megatron_tp.release()  # a TP state megatron_tp created
    megatron_ep.initialize(expert_model_parallel_size)


def transformer_config(cfg: MCoreGPTConfig, device: torch.device):
    """The Megatron ``TransformerConfig`` of ``cfg`` (dropout off: runs are reproducible)."""
    require_megatron()
    from megatron.core.transformer import TransformerConfig  # noqa: PLC0415 (optional dependency)
    from megatron.core.transformer.enums import AttnBackend  # noqa: PLC0415 (optional dependency)

    moe = {}
    if cfg.is_moe:
        moe = dict(
            num_moe_experts=cfg.num_experts,
            moe_router_topk=cfg.moe_router_topk,
            moe_token_dispatcher_type=cfg.moe_token_dispatcher_type,
            moe_grouped_gemm=cfg.moe_grouped_gemm,
            moe_shared_expert_intermediate_size=cfg.moe_shared_expert_intermediate_size,
            moe_ffn_hidden_size=cfg.ffn_hidden_size or 4 * cfg.hidden_size,
            moe_expert_capacity_factor=cfg.moe_expert_capacity_factor,
            moe_pad_expert_input_to_capacity=cfg.moe_pad_expert_input_to_capacity,
            moe_aux_loss_coeff=cfg.moe_aux_loss_coeff,
        )
    return TransformerConfig(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_query_groups,
        ffn_hidden_size=cfg.ffn_hidden_size or 4 * cfg.hidden_size,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        add_bias_linear=False,
        bf16=cfg.bf16,
        params_dtype=torch.float32,  # fp32 init = graph_fsdp's fp32 main weights
        gradient_accumulation_fusion=cfg.gradient_accumulation_fusion,
        # CPU init (torch's CPU RNG, no Megatron RNG tracker yet): identical weights on every
        # rank, and TE attention is built without the tracker (see build_gpt).
        use_cpu_initialization=True,
        tensor_model_parallel_size=cfg.tensor_model_parallel_size,
        sequence_parallel=cfg.sequence_parallel,
        pipeline_model_parallel_size=1,
        expert_model_parallel_size=cfg.expert_model_parallel_size,
        attention_backend=AttnBackend[cfg.attention_backend],
        apply_rope_fusion=cfg.apply_rope_fusion,
        normalization=cfg.normalization,
        **_swiglu(cfg),
        **moe,
    )


def _swiglu(cfg: MCoreGPTConfig) -> dict:
    """What Megatron's ``--swiglu`` sets (megatron/training/arguments.py)."""
    if not cfg.swiglu:
        return {}
    return dict(gated_linear_unit=True, activation_func=torch.nn.functional.silu)


def layer_spec(cfg: MCoreGPTConfig, *, dense: bool = False):
    """The GPT layer spec of ``cfg`` (TE or local; graph_fsdp's grouped_mm experts when asked);
    ``dense``: without experts whatever ``cfg.num_experts`` (a hybrid model's ``-`` layers)."""
    require_megatron()
    from megatron.core.models.gpt.gpt_layer_specs import (  # noqa: PLC0415 (optional dependency)
        get_gpt_layer_with_transformer_engine_spec,
    )

    from graph_fsdp.integrations.megatron.versions import local_layer_spec  # noqa: PLC0415 (imports megatron-core: optional dependency)

    experts = None if dense else cfg.num_experts
    grouped = cfg.moe_grouped_gemm if experts is not None else False
    if cfg.transformer_impl == "transformer_engine":
        spec = get_gpt_layer_with_transformer_engine_spec(
            num_experts=experts, moe_grouped_gemm=grouped
        )
    else:
        spec = local_layer_spec(num_experts=experts, moe_grouped_gemm=grouped)
    if experts is not None and cfg.moe_experts_impl == "grouped_mm":
        from graph_fsdp.integrations.megatron.moe import grouped_mm_moe_spec  # noqa: PLC0415 (imports megatron-core: optional dependency)

        spec = grouped_mm_moe_spec(spec, receive_buffer_factor=cfg.moe_receive_buffer_factor)
    return spec


class MCoreLM(nn.Module):
    """The FSDP root around a ``GPTModel``: ``lm(tokens, labels)`` -> mean per-token loss.

    ``GPTModel.forward(input_ids, position_ids, attention_mask, labels=...)`` returns the
    per-token loss ``[b, s]``; this reduces it to an fp32 mean, the ``model(x, y)`` call
    graph_fsdp's training loops and ``FullIterationGraphs`` make. A packed call
    (``position_ids`` and ``cu_seqlens`` given, a PackedBatch's) returns the loss summed over
    the pack's real tokens (megatron/packed.py [Note: Megatron-Core packed sequences]). Megatron's helpers reach the
    GPTModel through ``.module`` (``get_model_config``, ``get_attr_wrapped_model``).
    """

    def __init__(self, gpt: nn.Module, seq_length: int) -> None:
        super().__init__()
        self.module = gpt
        self.seq_length = seq_length

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        *,
        position_ids: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
    ):
        if cu_seqlens is not None:  # a pack: the loss summed over its real tokens
            return packed_loss(self.module, input_ids, labels, position_ids, cu_seqlens)
        b, s = input_ids.shape
        position_ids = torch.arange(s, device=input_ids.device).unsqueeze(0).expand(b, s)
        mask = None  # causal attention (TE / flash: mask type causal)
        if input_ids.device.type == "cpu":  # local attention builds its default mask on CUDA
            mask = torch.ones(s, s, dtype=torch.bool).triu(1)[None, None]
        out = self.module(input_ids, position_ids, mask, labels=labels)
        return out.float().mean() if labels is not None else out


def build_gpt(cfg: MCoreGPTConfig, device: torch.device | str | None = None) -> MCoreLM:
    """A seeded Megatron-Core GPTModel (TE or local spec), wrapped in :class:`MCoreLM`; with
    ``cfg.hybrid_layer_pattern``, the hybrid model of :func:`build_hybrid`.

    Call :func:`init_parallel_state` first. ``device`` defaults to the current CUDA device.
    """
    if cfg.is_hybrid:
        return build_hybrid(cfg, device)
    require_megatron()
    from megatron.core.models.gpt import GPTModel  # noqa: PLC0415 (optional dependency)

    device = _prepare_build(cfg, device, "build_gpt")
    spec = layer_spec(cfg)
    if cfg.is_moe:  # the same global experts at every EP size (megatron_ep.GlobalExpertInit)
        spec = megatron_ep.with_global_expert_init(spec, cfg.seed)
    gpt = GPTModel(
        config=transformer_config(cfg, device),
        transformer_layer_spec=spec,
        vocab_size=cfg.vocab_size,
        max_sequence_length=cfg.seq_length,
        position_embedding_type=cfg.position_embedding_type,
        share_embeddings_and_output_weights=False,
    )
    return _finish_build(gpt, cfg, device)


def skew_router(model: nn.Module, bias: float, expert: int = 0) -> int:
    """Add the constant ``bias`` to ``expert``'s gating logit in every router of ``model``
    (Megatron-Core's ``TopKRouter``: its ``gating`` output, before the top-k and the aux
    losses); returns how many routers. A routing load for tests and benchmarks of uneven
    expert-parallel exchanges (``graph-fsdp bench --moe-router-skew``): with a large bias
    nearly every token sends one of its top-k copies to ``expert``, so the EP rank holding it
    receives more than the balanced load. Call before sharding; the bias lives on the device
    of each router's weight."""
    from megatron.core.transformer.moe.router import TopKRouter  # noqa: PLC0415 (optional dependency)

    if not math.isfinite(bias):
        raise ValueError(f"skew_router: bias={bias!r} must be a finite number")
    routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
    for router in routers:
        experts = router.config.num_moe_experts
        if not 0 <= expert < experts:
            raise ValueError(f"skew_router: expert={expert} is not one of the {experts} experts")
        shift = torch.zeros(experts, device=router.weight.device)
        shift[expert] = bias
        gating = router.gating
        router.gating = lambda x, gating=gating, shift=shift: gating(x) + shift.to(x.dtype)
    return len(routers)


def build_hybrid(cfg: MCoreGPTConfig, device: torch.device | str | None = None) -> MCoreLM:
    """A seeded Megatron-Core hybrid model of ``cfg.hybrid_layer_pattern`` (``HybridModel``
    in megatron-core 0.19, ``MambaModel`` in 0.16; TE or local spec), wrapped in
    :class:`MCoreLM`: ``lm(tokens, labels)`` -> mean per-token loss, as for a GPTModel.
    A pattern with Mamba layers ('M') is refused here when Megatron's Mamba kernels do not
    import. [Note: Megatron-Core hybrid models] (megatron/hybrid.py)"""
    if not cfg.is_hybrid:
        raise ValueError(
            "build_hybrid: MCoreGPTConfig.hybrid_layer_pattern is None; give a pattern (e.g. "
            "'*-E-') or build a GPTModel with build_gpt"
        )
    require_megatron()
    from graph_fsdp.integrations.megatron.hybrid import (  # noqa: PLC0415 (imports megatron-core: optional dependency)
        build_hybrid_model,
        check_mamba_kernels,
    )

    check_mamba_kernels(cfg)
    device = _prepare_build(cfg, device, "build_hybrid")
    moe_spec = None
    if cfg.is_moe:  # the same global experts at every EP size (megatron_ep.GlobalExpertInit)
        moe_spec = megatron_ep.with_global_expert_init(layer_spec(cfg), cfg.seed)
    model = build_hybrid_model(
        cfg, transformer_config(cfg, device), layer_spec(cfg, dense=True), moe_spec
    )
    return _finish_build(model, cfg, device)


def _prepare_build(cfg: MCoreGPTConfig, device, what: str) -> torch.device:
    """The device, the checks against it and Megatron's parallel state, the seed and the RNG
    tracker, before a model is built."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if cfg.transformer_impl == "transformer_engine" and device.type != "cuda":
        raise ValueError(
            "MCoreGPTConfig.transformer_impl='transformer_engine' needs a CUDA device; use "
            "transformer_impl='local' on CPU"
        )
    if cfg.is_moe and cfg.moe_token_dispatcher_type == "alltoall" and device.type != "cuda":
        from megatron.core.transformer.moe.token_dispatcher import (  # noqa: PLC0415 (optional dependency)
            MoEAlltoAllTokenDispatcher,
        )

        # Its first construction creates the (class-wide) stream of its dropless host copies.
        if MoEAlltoAllTokenDispatcher.cuda_dtoh_stream is None:
            raise ValueError(
                "moe_token_dispatcher_type='alltoall' creates a CUDA stream: use a CUDA device, "
                "or moe_token_dispatcher_type='allgather' on CPU"
            )
    if megatron_tp.check_model(cfg) == 1:  # TP > 1: over Megatron's data-parallel group
        megatron_ep.check_model_ep(cfg, what)
    torch.manual_seed(cfg.seed)
    # Built before Megatron's CUDA RNG tracker exists, so TransformerEngine's attention gets
    # no tracker to fork in every forward: the default tracker's fork sets the CUDA
    # generator's state, which torch refuses during graph capture, and TE's capture-safe
    # tracker is only registered by TE's own capture (not torch.cuda.graph).
    from megatron.core.tensor_parallel.random import initialize_rng_tracker  # noqa: PLC0415 (optional dependency)

    # no states yet; graph-safe on CUDA (a CPU build of torch lacks the graph-safe API)
    initialize_rng_tracker(use_cudagraphable_rng=device.type == "cuda", force_reset=True)
    return device


def _finish_build(model: nn.Module, cfg: MCoreGPTConfig, device: torch.device) -> MCoreLM:
    model = model.to(device)
    if device.type == "cuda":
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed  # noqa: PLC0415 (optional dependency)

        # The local spec's attention forks the tracker in every forward: a graph-safe one.
        model_parallel_cuda_manual_seed(cfg.seed, use_cudagraphable_rng=True, force_reset_rng=True)
    return MCoreLM(model, cfg.seq_length)


def transformer_layers(lm: MCoreLM) -> list[nn.Module]:
    return list(lm.module.decoder.layers)


def shard_gpt(
    lm: MCoreLM,
    *,
    strategy: str = "optim_grads_params",
    mp_policy: MixedPrecisionPolicy | None = None,
    buffer_policy: BufferPolicy | None = None,
    expert_groups: bool | None = None,
    separate_all_gather_group: bool = False,
) -> MCoreLM:
    """``fully_shard`` every TransformerLayer, then the root; install Megatron's schedule
    hooks (``config.no_sync_func`` / ``config.finalize_model_grads_func``).

    ``expert_groups``: the routed experts' parameters in their own groups, sharded and reduced
    over Megatron's expert-data-parallel group (the ``(edp, ep)`` mesh of its groups goes to
    every layer's ``fully_shard``). None (default): when expert_model_parallel_size > 1 (where
    it is required); at EP = 1 they stay in the layers' dense groups (the same ranks, one
    collective fewer). True at EP = 1 runs the EP path over one EP rank. [Note: Megatron-Core
    expert parallelism] (megatron/ep.py). ``separate_all_gather_group``: ``fully_shard``'s
    (Megatron's ``--create-all-gather-group``).
    """
    require_megatron()
    config = lm.module.config
    # TP > 1: over Megatron's data-parallel group (megatron/tp.py); dense GPTs only
    tp = megatron_tp.prepare(lm, config, next(lm.parameters()).device.type)
    ep = 1 if tp is not None else megatron_ep.check_model_ep(config, "shard_gpt")
    if getattr(config, "gradient_accumulation_fusion", False):
        raise ValueError(
            "TransformerConfig.gradient_accumulation_fusion=True: TE would accumulate wgrads "
            "into param.main_grad, which graph_fsdp does not provide; set it to False"
        )
    layers = transformer_layers(lm)
    device = next(lm.parameters()).device
    mesh = None
    if tp is None:
        mesh = megatron_ep.expert_mesh_for(layers, ep, expert_groups, device.type)
    elif megatron_ep.moe_layers(layers):
        raise ValueError(
            f"shard_gpt: tensor_model_parallel_size={config.tensor_model_parallel_size} with "
            "MoE layers: graph_fsdp runs Megatron's TP for dense GPTs; use TP = 1 for MoE models"
        )
    placement = dict(
        mesh=None if tp is None else tp.mesh,
        strategy=strategy,
        mp_policy=mp_policy,
        buffer_policy=buffer_policy,
        separate_all_gather_group=separate_all_gather_group,
    )
    for layer in layers:
        fully_shard(layer, expert_mesh=mesh, **placement)
    fully_shard(lm, **placement)
    if tp is not None:
        tp.install([*layers, lm])
    config.no_sync_func = lm.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    return lm


# --------------------------------------------------------------------------------------------
# Megatron's schedule (get_forward_backward_func)
# --------------------------------------------------------------------------------------------


def finalize_model_grads(
    model: list[nn.Module],
    num_tokens: torch.Tensor | None = None,
    pg_collection=None,
    force_all_reduce: bool | None = False,
) -> None:
    """``config.finalize_model_grads_func`` for graph_fsdp models.

    Megatron's version calls ``finish_grad_sync`` on its DDP/FSDP wrapper and all-reduces
    embedding and layernorm gradients across TP/PP ranks; with PP = 1 only the first part and
    the TP all-reduce of sequence-parallel gradients apply. This waits for graph_fsdp's
    reduce-scatters and exposes the sharded ``.grad``; the TP all-reduce already ran at the end
    of the backward (a grad sync hook, megatron/tp.py).
    ``num_tokens`` (``calculate_per_token_loss``): graph_fsdp averages gradients over the
    data-parallel ranks, so they are scaled by ``world / total tokens``.
    """
    for chunk in model:
        if not isinstance(chunk, FSDPModule):
            raise TypeError(
                f"finalize_model_grads: {type(chunk).__name__} is not fully_shard-ed; pass the "
                "model shard_gpt() returned"
            )
        chunk.finish_grad_sync()
    if num_tokens is not None:
        total = num_tokens.detach().clone().float()
        dist.all_reduce(total)
        scale = dist.get_world_size() / total.clamp(min=1)
        for chunk in model:
            for p in chunk.parameters():
                if p.grad is not None:
                    p.grad.mul_(scale.to(p.grad.dtype))


def forward_step(data_iterator, model: nn.Module):
    """A ``forward_step_func`` for Megatron's schedules: batches are ``(tokens, labels)``.

    Returns the loss and the two-output ``loss_func`` (the schedule divides by the number of
    microbatches; graph_fsdp's reduction averages over data-parallel ranks).
    """
    tokens, labels = next(data_iterator)
    loss = model(tokens, labels)

    def loss_func(output: torch.Tensor):
        return output, {"lm loss": output.detach().clone()}  # the schedule divides output in place

    return loss, loss_func


def make_graphs(
    lm: MCoreLM,
    cfg: MCoreGPTConfig,
    *,
    impl: str,
    scopes,
    warmup_steps: int = 2,
    verify: bool | str = False,
):
    """Layerwise or full-iteration CUDA graphs for a sharded Megatron-Core GPT (None: eager);
    ``verify`` checks the first graphed step against an eager run (capture/verify.py)."""
    policy = GraphPolicy(impl=impl, scopes=tuple(scopes), warmup_steps=warmup_steps, verify=verify)
    return build_graphs(lm, cfg, policy)


def build_graphs(
    lm: MCoreLM,
    cfg: MCoreGPTConfig,
    policy: GraphPolicy,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    clip_grad: float = 0.0,
):
    """``policy``'s runner over a sharded Megatron-Core GPT (None: eager), after the rules of
    Megatron-Core models: the scopes this model can capture, TE attention under capture, and
    ``MoELayer.preprocess`` made a module for the moe_preprocess scope. The whole-step runner
    (``policy.optimizer``) steps ``optimizer`` and clips to ``clip_grad``."""
    if not policy.enabled:
        return policy.build(lm, optimizer=optimizer, clip_grad=clip_grad)
    scopes = check_mcore_scopes(cfg, policy.scopes)
    check_mcore_attention_capture(cfg, policy.impl, scopes)
    if "moe_preprocess" in scopes:
        install_moe_preprocess(lm)
    # The scopes resolve through graph_fsdp's presets (SCOPE_PRESETS' Megatron-Core entries).
    return policy.build(lm, optimizer=optimizer, clip_grad=clip_grad)
