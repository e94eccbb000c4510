"""Megatron-Core ``GPTModel`` (dense and MoE) under graph_fsdp, with Megatron's conventions.

    from graph_fsdp.integrations import megatron as gm

    gm.init_parallel_state()                          # TP = PP = EP = 1 on the default group
    lm = gm.build_gpt(gm.MCoreGPTConfig(num_experts=4, moe_shared_expert_intermediate_size=512))
    gm.shard_gpt(lm, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    loss = lm(tokens, labels)                         # mean per-token loss (fp32 scalar)

Needs megatron-core (``pip install -e ".[megatron]"``); importing this module without it
works, every entry point raises an ImportError that says what to install.

What the integration maps (facts from megatron-core 0.19's source):

- Parallel state: Megatron's ``parallel_state`` is initialised with tensor and pipeline
  parallel size 1 on the existing process group, so graph_fsdp's data-parallel group is the
  whole world. Expert parameters are sharded over the expert-data-parallel group, which with
  expert-model-parallel size 1 *is* the data-parallel group (checked at ``shard_gpt``);
  EP > 1 is rejected (graph_fsdp shards a unit over one group).
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
  graph_fsdp's experts with device token counts (graph_fsdp.integrations.megatron_moe). Either
  captures the whole layer, ``moe`` and ``full_iteration``; Megatron's dropless experts copy
  their token counts to the host, so only ``attn`` / ``moe_router`` [``moe_preprocess``].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from graph_fsdp.api import BufferPolicy, MixedPrecisionPolicy
from graph_fsdp.capture.scopes import SCOPE_PRESETS, GraphConfigError, check_scopes
from graph_fsdp.cuda_streams import stream_capturing
from graph_fsdp.fully_shard import FSDPModule, fully_shard

INSTALL_HINT = 'pip install -e ".[megatron]"'
TRANSFORMER_IMPLS = ("transformer_engine", "local")
ATTENTION_BACKENDS = ("auto", "flash", "fused", "unfused", "local")
"""Megatron's AttnBackend names (TransformerConfig.attention_backend)."""
MOE_DISPATCHERS = ("alltoall", "allgather", "flex")
"""Megatron's token dispatchers (TransformerConfig.moe_token_dispatcher_type)."""
MOE_EXPERTS_IMPLS = ("megatron", "grouped_mm")
"""megatron: the layer spec's experts and dispatcher; grouped_mm: graph_fsdp's dropless experts
with device token counts (megatron_moe.GroupedMMMoELayer)."""

MCORE_SCOPE_MODULES: dict[str, str] = {
    scope: next(p.path for p in paths if "Megatron-Core" in p.family)
    for scope, paths in SCOPE_PRESETS.items()
}
"""Scope -> submodule of a Megatron-Core ``TransformerLayer``: the Megatron-Core entries of
graph_fsdp's generic :data:`~graph_fsdp.capture.scopes.SCOPE_PRESETS` (``attn`` = the
attention block ``SelfAttention``; ``mlp`` = a dense ``MLP``; ``moe`` = the ``MoELayer``;
``moe_router`` = its ``TopKRouter``; ``moe_preprocess`` = ``MoELayer.preprocess``, a method,
made a module by :class:`MoEPreprocess` - :func:`install_moe_preprocess`)."""


def require_megatron():
    """Import megatron.core, or raise an ImportError that says what to install."""
    try:
        import megatron.core  # noqa: PLC0415
        from megatron.core import parallel_state  # noqa: F401, PLC0415
    except ImportError as err:
        raise ImportError(
            f"graph_fsdp.integrations.megatron needs megatron-core >= 0.19, which does not "
            f"import here ({type(err).__name__}: {err}); install it with {INSTALL_HINT} "
            "(megatron-core 0.19 wheels need Python >= 3.12)"
        ) from err
    return megatron.core


@dataclass(kw_only=True)
class MCoreGPTConfig:
    """Shape of a Megatron-Core GPT (field names are Megatron's ``TransformerConfig``'s)."""

    num_layers: int = 4
    """Transformer layers (``model.decoder.layers``)."""
    hidden_size: int = 256
    """Model width."""
    num_attention_heads: int = 4
    """Attention heads; must divide hidden_size."""
    ffn_hidden_size: int | None = None
    """MLP / expert inner size (None: 4 x hidden_size)."""
    seq_length: int = 128
    """Tokens per sequence (max_sequence_length)."""
    vocab_size: int = 1024
    """Vocabulary size."""
    num_experts: int | None = None
    """num_moe_experts: every layer is an MoELayer with this many experts; None = dense."""
    moe_router_topk: int = 2
    """Experts per token."""
    moe_shared_expert_intermediate_size: int | None = None
    """Inner size of the shared expert (None: no shared expert)."""
    moe_grouped_gemm: bool = True
    """Grouped GEMM experts (TEGroupedMLP with the TE spec)."""
    moe_token_dispatcher_type: str = "alltoall"
    """Megatron's token dispatcher (alltoall needs CUDA)."""
    moe_expert_capacity_factor: float | None = None
    """Token copies each expert takes: ceil(tokens x topk / experts x factor), the rest dropped;
    None = dropless (Megatron's default)."""
    moe_pad_expert_input_to_capacity: bool = False
    """Pad every expert's input to its capacity (needs moe_expert_capacity_factor): drop-padding,
    static expert shapes, so Megatron's own experts capture (whole layer, moe, full_iteration)."""
    moe_experts_impl: str = "megatron"
    """megatron: the layer spec's experts and token dispatcher (TEGroupedMLP / SequentialMLP;
    dropless, they copy the token counts to the host). grouped_mm: graph_fsdp's dropless experts
    with device token counts and torch._grouped_mm (megatron_moe.GroupedMMMoELayer; EP = 1,
    bf16 on sm90 / sm100 under capture), captured whole."""
    moe_aux_loss_coeff: float = 0.0
    """Coefficient of Megatron's load-balancing loss (moe_router_load_balancing_type aux_loss);
    0 = off, Megatron's default."""
    transformer_impl: str = "transformer_engine"
    """transformer_engine: get_gpt_layer_with_transformer_engine_spec; local:
    get_gpt_layer_local_spec (no TransformerEngine)."""
    position_embedding_type: str = "rope"
    """rope or learned_absolute."""
    bf16: bool = False
    """TransformerConfig.bf16 (the compute dtype comes from graph_fsdp's MixedPrecisionPolicy)."""
    gradient_accumulation_fusion: bool = False
    """Must stay False under graph_fsdp (see the module docstring)."""
    expert_model_parallel_size: int = 1
    """Only 1: experts are sharded over the data-parallel group."""
    seed: int = 1234
    """Seed of the weights (torch and Megatron's model-parallel RNG tracker)."""
    attention_backend: str = "auto"
    """TransformerConfig.attention_backend (Megatron's --attention-backend): auto lets TE pick
    per call; flash, fused or unfused pin one for eager and graphed steps alike (see
    te_backend.py [Note: TE attention under capture]); local needs transformer_impl local."""

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"MCoreGPTConfig: num_attention_heads={self.num_attention_heads} does not divide "
                f"hidden_size={self.hidden_size}; pick a head count that divides it"
            )
        if self.transformer_impl not in TRANSFORMER_IMPLS:
            raise ValueError(
                f"MCoreGPTConfig.transformer_impl={self.transformer_impl!r}; choose one of "
                f"{', '.join(TRANSFORMER_IMPLS)}"
            )
        if self.num_experts is not None:
            if self.num_experts < 2:
                raise ValueError(
                    f"MCoreGPTConfig.num_experts={self.num_experts} must be >= 2 (or None for "
                    "a dense model)"
                )
            if not 1 <= self.moe_router_topk <= self.num_experts:
                raise ValueError(
                    f"MCoreGPTConfig.moe_router_topk={self.moe_router_topk} must be between 1 "
                    f"and num_experts={self.num_experts}"
                )
        self._check_moe()
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"MCoreGPTConfig.attention_backend={self.attention_backend!r}; choose one of "
                f"{', '.join(ATTENTION_BACKENDS)}"
            )
        if self.attention_backend == "local" and self.transformer_impl != "local":
            raise ValueError(
                "MCoreGPTConfig.attention_backend='local' is the local layer spec's attention "
                "(transformer_impl='local'); TransformerEngine layers take auto, flash, fused "
                "or unfused"
            )
        if self.gradient_accumulation_fusion:
            raise ValueError(
                "MCoreGPTConfig.gradient_accumulation_fusion=True makes TransformerEngine's wgrad "
                "GEMM accumulate into an fp32 param.main_grad, but graph_fsdp gives each "
                "unsharded parameter a .grad view of its flat gradient buffer (static address, "
                "reduce-scattered after backward): set gradient_accumulation_fusion=False "
                "(Megatron's default; --no-gradient-accumulation-fusion)"
            )
        if self.expert_model_parallel_size != 1:
            raise ValueError(
                f"MCoreGPTConfig.expert_model_parallel_size={self.expert_model_parallel_size}: "
                "graph_fsdp shards expert parameters over the expert-data-parallel group, which "
                "must be the data-parallel group (EP = 1); set expert_model_parallel_size=1"
            )

    def _check_moe(self) -> None:
        """The MoE fields (Megatron's rules, plus what graph_fsdp's grouped_mm experts need)."""
        name = "MCoreGPTConfig"
        if not self.is_moe:
            set_ = [f for f, default in _MOE_ONLY_DEFAULTS.items() if getattr(self, f) != default]
            if set_:
                raise ValueError(
                    f"{name}.{set_[0]}={getattr(self, set_[0])!r} needs an MoE model: set "
                    "num_experts (or leave it at its default)"
                )
            return
        if self.moe_token_dispatcher_type not in MOE_DISPATCHERS:
            raise ValueError(
                f"{name}.moe_token_dispatcher_type={self.moe_token_dispatcher_type!r}; choose one "
                f"of {', '.join(MOE_DISPATCHERS)}"
            )
        if self.moe_experts_impl not in MOE_EXPERTS_IMPLS:
            raise ValueError(
                f"{name}.moe_experts_impl={self.moe_experts_impl!r}; choose one of "
                f"{', '.join(MOE_EXPERTS_IMPLS)}"
            )
        if self.moe_aux_loss_coeff < 0:
            raise ValueError(f"{name}.moe_aux_loss_coeff={self.moe_aux_loss_coeff} must be >= 0")
        _check_capacity(self)
        if self.moe_experts_impl == "grouped_mm":
            _check_grouped_mm(self)

    @property
    def is_moe(self) -> bool:
        return self.num_experts is not None


_MOE_ONLY_DEFAULTS = {
    "moe_expert_capacity_factor": None,
    "moe_pad_expert_input_to_capacity": False,
    "moe_experts_impl": "megatron",
    "moe_aux_loss_coeff": 0.0,
}


def _check_capacity(cfg: MCoreGPTConfig) -> None:
    """Megatron's drop / drop-padding settings, with the values its code can run."""
    factor = cfg.moe_expert_capacity_factor
    if factor is not None and not factor > 0:
        raise ValueError(
            f"MCoreGPTConfig.moe_expert_capacity_factor={factor} must be > 0 (None = dropless; "
            "Megatron reads a negative factor as None: say None)"
        )
    if cfg.moe_pad_expert_input_to_capacity and factor is None:
        raise ValueError(
            "MCoreGPTConfig.moe_pad_expert_input_to_capacity=True pads each expert's input to its "
            "capacity, which moe_expert_capacity_factor sets: give a factor (e.g. 1.0) or set "
            "moe_pad_expert_input_to_capacity=False"
        )
    limit = cfg.num_experts / cfg.moe_router_topk
    if cfg.moe_pad_expert_input_to_capacity and factor > limit:
        raise ValueError(
            f"MCoreGPTConfig.moe_expert_capacity_factor={factor} with "
            f"moe_pad_expert_input_to_capacity: the capacity ceil(tokens x topk / experts x "
            f"factor) would exceed the tokens, which Megatron's padded permutation "
            f"(moe_utils.permute, drop_and_pad) cannot slice; use a factor <= num_experts / "
            f"moe_router_topk = {limit:g} ({limit:g} already gives every expert every token)"
        )


def _check_grouped_mm(cfg: MCoreGPTConfig) -> None:
    """What graph_fsdp's grouped_mm experts (megatron_moe.GroupedMMMoELayer) run."""
    name = "MCoreGPTConfig.moe_experts_impl='grouped_mm'"
    if cfg.moe_expert_capacity_factor is not None:
        raise ValueError(
            f"{name} is the dropless path, but moe_expert_capacity_factor="
            f"{cfg.moe_expert_capacity_factor}: drop-padding captures with Megatron's own experts "
            "(moe_experts_impl='megatron'); or set moe_expert_capacity_factor=None"
        )
    if cfg.moe_token_dispatcher_type == "flex":
        raise ValueError(
            f"{name} brings its own token dispatcher in place of alltoall / allgather; "
            "moe_token_dispatcher_type='flex' (DeepEP / HybridEP) is not replaced: use alltoall"
        )
    if cfg.expert_model_parallel_size != 1:
        raise ValueError(
            f"{name} runs at expert_model_parallel_size=1: a dropless all-to-all over EP > 1 needs "
            "its split sizes on the host (MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize);"
            " for EP > 1 use drop-padding (moe_experts_impl='megatron' with "
            "moe_expert_capacity_factor and moe_pad_expert_input_to_capacity)"
        )
    ffn = cfg.ffn_hidden_size or 4 * cfg.hidden_size
    for field, size in (("hidden_size", cfg.hidden_size), ("ffn_hidden_size", ffn)):
        if size % 8:
            raise ValueError(
                f"{name}: {field}={size} is not a multiple of 8; torch._grouped_mm reads "
                "16-byte aligned bf16 rows"
            )


# --------------------------------------------------------------------------------------------
# Parallel state and model
# --------------------------------------------------------------------------------------------


def init_parallel_state(*, expert_model_parallel_size: int = 1) -> None:
    """Megatron's parallel_state with TP = PP = EP = 1 over the default process group."""
    require_megatron()
    from megatron.core import parallel_state as ps  # noqa: PLC0415

    if not dist.is_initialized():
        raise RuntimeError(
            "init_parallel_state needs torch.distributed: call dist.init_process_group first"
        )
    if expert_model_parallel_size != 1:
        raise ValueError(
            f"expert_model_parallel_size={expert_model_parallel_size}: graph_fsdp supports "
            "EP = 1 only (experts sharded over the data-parallel group)"
        )
    if ps.model_parallel_is_initialized():
        sizes = {
            "tensor_model_parallel_size": ps.get_tensor_model_parallel_world_size(),
            "pipeline_model_parallel_size": ps.get_pipeline_model_parallel_world_size(),
            "expert_model_parallel_size": ps.get_expert_model_parallel_world_size(),
        }
        wrong = {k: v for k, v in sizes.items() if v != 1}
        if wrong:
            raise ValueError(
                f"Megatron's parallel_state is already initialised with {wrong}; graph_fsdp "
                "needs every one of them to be 1 (data parallelism only)"
            )
    else:
        ps.initialize_model_parallel(
            tensor_model_parallel_size=1,
            pipeline_model_parallel_size=1,
            expert_model_parallel_size=1,
        )


def transformer_config(cfg: MCoreGPTConfig, device: torch.device):
    """The Megatron ``TransformerConfig`` of ``cfg`` (dropout off: runs are reproducible)."""
    require_megatron()
    from megatron.core.transformer import TransformerConfig  # noqa: PLC0415
    from megatron.core.transformer.enums import AttnBackend  # noqa: PLC0415

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
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        expert_model_parallel_size=cfg.expert_model_parallel_size,
        attention_backend=AttnBackend[cfg.attention_backend],
        **moe,
    )


def layer_spec(cfg: MCoreGPTConfig):
    require_megatron()
    from megatron.core.models.gpt.gpt_layer_specs import (  # noqa: PLC0415
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    grouped = cfg.moe_grouped_gemm if cfg.is_moe else False
    if cfg.transformer_impl == "transformer_engine":
        spec = get_gpt_layer_with_transformer_engine_spec(
            num_experts=cfg.num_experts, moe_grouped_gemm=grouped
        )
    else:
        spec = get_gpt_layer_local_spec(num_experts=cfg.num_experts, moe_grouped_gemm=grouped)
    if cfg.is_moe and cfg.moe_experts_impl == "grouped_mm":
        from graph_fsdp.integrations.megatron_moe import grouped_mm_moe_spec  # noqa: PLC0415

        spec = grouped_mm_moe_spec(spec)
    return spec


class MCoreLM(nn.Module):
    """The FSDP root around a ``GPTModel``: ``lm(tokens, labels)`` -> mean per-token loss.

    ``GPTModel.forward(input_ids, position_ids, attention_mask, labels=...)`` returns the
    per-token loss ``[b, s]``; this reduces it to an fp32 mean, the ``model(x, y)`` call
    graph_fsdp's training loops and ``FullIterationGraphs`` make. Megatron's helpers reach the
    GPTModel through ``.module`` (``get_model_config``, ``get_attr_wrapped_model``).
    """

    def __init__(self, gpt: nn.Module, seq_length: int) -> None:
        super().__init__()
        self.module = gpt
        self.seq_length = seq_length

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None):
        b, s = input_ids.shape
        position_ids = torch.arange(s, device=input_ids.device).unsqueeze(0).expand(b, s)
        mask = None  # causal attention (TE / flash: mask type causal)
        if input_ids.device.type == "cpu":  # local attention builds its default mask on CUDA
            mask = torch.ones(s, s, dtype=torch.bool).triu(1)[None, None]
        out = self.module(input_ids, position_ids, mask, labels=labels)
        return out.float().mean() if labels is not None else out


def build_gpt(cfg: MCoreGPTConfig, device: torch.device | str | None = None) -> MCoreLM:
    """A seeded Megatron-Core GPTModel (TE or local spec), wrapped in :class:`MCoreLM`.

    Call :func:`init_parallel_state` first. ``device`` defaults to the current CUDA device.
    """
    require_megatron()
    from megatron.core.models.gpt import GPTModel  # noqa: PLC0415

    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if cfg.transformer_impl == "transformer_engine" and device.type != "cuda":
        raise ValueError(
            "MCoreGPTConfig.transformer_impl='transformer_engine' needs a CUDA device; use "
            "transformer_impl='local' on CPU"
        )
    if cfg.is_moe and cfg.moe_token_dispatcher_type == "alltoall" and device.type != "cuda":
        raise ValueError(
            "moe_token_dispatcher_type='alltoall' creates CUDA streams: use a CUDA device, or "
            "moe_token_dispatcher_type='allgather' on CPU"
        )
    torch.manual_seed(cfg.seed)
    # Built before Megatron's CUDA RNG tracker exists, so TransformerEngine's attention gets
    # no tracker to fork in every forward: the default tracker's fork sets the CUDA
    # generator's state, which torch refuses during graph capture, and TE's capture-safe
    # tracker is only registered by TE's own capture (not torch.cuda.graph).
    from megatron.core.tensor_parallel.random import initialize_rng_tracker  # noqa: PLC0415

    # no states yet; graph-safe on CUDA (a CPU build of torch lacks the graph-safe API)
    initialize_rng_tracker(use_cudagraphable_rng=device.type == "cuda", force_reset=True)
    gpt = GPTModel(
        config=transformer_config(cfg, device),
        transformer_layer_spec=layer_spec(cfg),
        vocab_size=cfg.vocab_size,
        max_sequence_length=cfg.seq_length,
        position_embedding_type=cfg.position_embedding_type,
        share_embeddings_and_output_weights=False,
    )
    gpt = gpt.to(device)
    if device.type == "cuda":
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed  # noqa: PLC0415

        # The local spec's attention forks the tracker in every forward: a graph-safe one.
        model_parallel_cuda_manual_seed(cfg.seed, use_cudagraphable_rng=True, force_reset_rng=True)
    return MCoreLM(gpt, cfg.seq_length)


def transformer_layers(lm: MCoreLM) -> list[nn.Module]:
    return list(lm.module.decoder.layers)


def _check_expert_group() -> None:
    """Expert parameters are sharded over the expert-data-parallel group: it must be the
    data-parallel group graph_fsdp shards over (true when EP = 1)."""
    from megatron.core import parallel_state as ps  # noqa: PLC0415

    if not ps.model_parallel_is_initialized():
        raise RuntimeError("call init_parallel_state() before shard_gpt()")
    dp = dist.get_process_group_ranks(ps.get_data_parallel_group())
    edp = dist.get_process_group_ranks(ps.get_expert_data_parallel_group())
    world = list(range(dist.get_world_size()))
    if sorted(dp) != world or sorted(edp) != world:
        raise ValueError(
            f"graph_fsdp shards every parameter over the default group (ranks {world}), but "
            f"Megatron's data-parallel group is {dp} and its expert-data-parallel group is "
            f"{edp}: use tensor, pipeline and expert model parallel size 1"
        )


def shard_gpt(
    lm: MCoreLM,
    *,
    strategy: str = "optim_grads_params",
    mp_policy: MixedPrecisionPolicy | None = None,
    buffer_policy: BufferPolicy | None = None,
) -> MCoreLM:
    """``fully_shard`` every TransformerLayer, then the root; install Megatron's schedule
    hooks (``config.no_sync_func`` / ``config.finalize_model_grads_func``)."""
    require_megatron()
    _check_expert_group()
    config = lm.module.config
    if getattr(config, "gradient_accumulation_fusion", False):
        raise ValueError(
            "TransformerConfig.gradient_accumulation_fusion=True: TE would accumulate wgrads "
            "into param.main_grad, which graph_fsdp does not provide; set it to False"
        )
    for layer in transformer_layers(lm):
        fully_shard(layer, strategy=strategy, mp_policy=mp_policy, buffer_policy=buffer_policy)
    fully_shard(lm, strategy=strategy, mp_policy=mp_policy, buffer_policy=buffer_policy)
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
    embedding and layernorm gradients across TP/PP ranks; with TP = PP = 1 only the first
    part applies: wait for graph_fsdp's reduce-scatters and expose the sharded ``.grad``.
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


# --------------------------------------------------------------------------------------------
# --cuda-graph-scope
# --------------------------------------------------------------------------------------------


def _is_moe_layer(layer: nn.Module) -> bool:
    return hasattr(getattr(layer, "mlp", None), "router")


def check_mcore_scopes(cfg: MCoreGPTConfig, scopes: list[str] | tuple[str, ...]) -> list[str]:
    """Megatron's scopes this model can capture; clear errors for the others.

    The expert part of an MoE layer (captured by the whole layer, ``moe`` and
    ``full_iteration``) needs no host sync with drop-padding through the alltoall dispatcher
    (static expert shapes) or with graph_fsdp's ``grouped_mm`` experts (device token counts);
    Megatron's dropless experts copy their token counts to the host, so there
    :func:`moe_expert_capture_refusal` refuses, and ``attn`` / ``moe_router`` are the
    capturable parts, as in Megatron.
    """
    scopes = list(scopes)
    check_scopes(scopes)
    if not cfg.is_moe:
        moe = [s for s in scopes if s in ("moe", "moe_router", "moe_preprocess")]
        if moe:
            raise GraphConfigError(
                f"--cuda-graph-scope {' '.join(moe)} needs an MoE model (--num-experts N), but "
                "this GPT is dense; use attn, mlp, the whole layer or full_iteration"
            )
        return scopes
    if not scopes or "moe" in scopes or "full_iteration" in scopes:
        refusal = moe_expert_capture_refusal(cfg)
        if refusal:
            what = (
                "the whole layer" if not scopes else "moe" if "moe" in scopes else "full_iteration"
            )
            raise GraphConfigError(f"--cuda-graph-scope {what}: {refusal}")
    if "mlp" in scopes:
        raise GraphConfigError(
            "--cuda-graph-scope mlp: every layer of this Megatron-Core MoE GPT is an MoELayer, "
            "so there is no dense MLP to capture; use moe_router"
        )
    if "moe_preprocess" in scopes and (
        cfg.moe_experts_impl == "grouped_mm" or cfg.moe_expert_capacity_factor is not None
    ):
        why = (
            "the grouped_mm experts' dispatch has no host sync to split off: capture moe or the "
            "whole layer instead"
            if cfg.moe_experts_impl == "grouped_mm"
            else "with a capacity factor, capture moe or the whole layer with drop-padding "
            "(moe_pad_expert_input_to_capacity=True) instead"
        )
        raise GraphConfigError(
            "--cuda-graph-scope moe_preprocess graphs the preprocess of Megatron's dropless "
            f"alltoall dispatcher apart from its host-syncing dispatch; {why}"
        )
    return scopes


_DROPLESS_SYNC = {
    "alltoall": "MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize, token_dispatcher.py",
    "allgather": "MoEAllGatherTokenDispatcher.dispatch_postprocess: tokens_per_expert.cpu()",
    "flex": "MoEFlexTokenDispatcher and its DeepEP / HybridEP buffers",
}


def moe_expert_capture_refusal(cfg: MCoreGPTConfig) -> str | None:
    """Why a CUDA graph cannot hold the expert part of ``cfg``'s MoE layers (None: it can),
    naming the Megatron module that syncs and the settings that avoid it."""
    if cfg.moe_experts_impl == "grouped_mm":
        return None  # device token counts: megatron_moe.GroupedMMMoELayer (EP = 1)
    factor, dispatcher = cfg.moe_expert_capacity_factor, cfg.moe_token_dispatcher_type
    if factor is None:
        return (
            f"MoE layers with Megatron's dropless {dispatcher} dispatcher copy tokens_per_expert "
            f"to the host for the experts' split sizes ({_DROPLESS_SYNC[dispatcher]}): a host "
            "sync with data-dependent shapes, which a CUDA graph cannot hold. Capture the experts "
            "with graph_fsdp's dropless experts (moe_experts_impl='grouped_mm': device token "
            "counts, torch._grouped_mm) or with drop-padding (moe_expert_capacity_factor=1.0 and "
            "moe_pad_expert_input_to_capacity=True; drops the tokens over capacity), or capture "
            "the parts before the dispatch instead: --cuda-graph-scope attn moe_router"
        )
    if not cfg.moe_pad_expert_input_to_capacity:
        return (
            f"moe_expert_capacity_factor={factor} without moe_pad_expert_input_to_capacity drops "
            "tokens to a data-dependent count, which MoEAlltoAllTokenDispatcher.preprocess sums "
            "on the device and the permutation waits for on the host (_maybe_dtoh_and_synchronize,"
            " a host sync): set moe_pad_expert_input_to_capacity=True (static expert inputs)"
        )
    if dispatcher != "alltoall":
        return (
            f"the {dispatcher} token dispatcher syncs with the host even with drop-padding "
            f"({_DROPLESS_SYNC[dispatcher]}, .item()): use moe_token_dispatcher_type='alltoall'"
        )
    return None


class MoEPreprocess(nn.Module):
    """``MoELayer.preprocess`` as a module: the ``moe_preprocess`` scope's graph target.

    The alltoall dispatcher's preprocess (token counts, the permutation map, the permuted
    tokens and probs) keeps its results as Python attributes of the dispatcher, read later
    by the eager dispatch/combine - a replayed graph would leave them stale. As Megatron does
    for its own moe_preprocess graphs, the tensors among them are graph *outputs*
    (:data:`PREPROCESS_TENSORS`) put back on the dispatcher after every call, and the
    non-tensor ones (shapes, the dropless output size) are restored from the capture (a
    replay only runs for calls with the captured shapes). The host copy of the token counts
    moves from the preprocess to the (eager) dispatch: ``cuda_dtoh_point =
    "before_ep_alltoall"``, Megatron's setting when moe_preprocess is graphed.
    """

    def __init__(self, moe: nn.Module) -> None:
        super().__init__()
        self._moe = [moe]  # a list: not a submodule (no second path to its parameters)
        self._ran = False
        self._capture_consts: dict | None = None

    def forward(self, hidden_states, probs, routing_map):
        moe = self._moe[0]
        self._ran = True
        hidden_states, probs = type(moe).preprocess(moe, hidden_states, probs, routing_map)
        disp = moe.token_dispatcher
        if stream_capturing():
            self._capture_consts = {a: getattr(disp, a) for a in PREPROCESS_CONSTS}
        return hidden_states, probs, tuple(getattr(disp, a) for a in PREPROCESS_TENSORS)

    def __call__(self, hidden_states, probs, routing_map):
        self._ran = False
        out, out_probs, tensors = super().__call__(hidden_states, probs, routing_map)
        disp = self._moe[0].token_dispatcher
        for name, t in zip(PREPROCESS_TENSORS, tensors):
            setattr(disp, name, t)
        if not self._ran:  # replayed: the Python side of the preprocess did not run
            if self._capture_consts is None:
                raise RuntimeError("MoEPreprocess replayed before it was captured")
            for name, value in self._capture_consts.items():
                setattr(disp, name, value)
            disp.probs, disp.routing_map = probs, routing_map
        return out, out_probs


PREPROCESS_TENSORS = (
    "tokens_per_expert",
    "num_global_tokens_per_local_expert",
    "reversed_local_input_permutation_mapping",
)
"""Tensor attributes the alltoall dispatcher's preprocess sets and dispatch/combine read."""
PREPROCESS_CONSTS = ("hidden_shape", "hidden_shape_before_permute", "num_out_tokens")
"""Non-tensor attributes it sets (fixed for the captured shapes)."""


def install_moe_preprocess(lm: MCoreLM) -> int:
    """Put a :class:`MoEPreprocess` in place of every MoELayer's ``preprocess`` method, so that
    the ``moe_preprocess`` scope's preset (``mlp.preprocess``) finds a module to capture, and
    make the alltoall dispatcher copy its token counts to the host at the (eager) dispatch
    (``cuda_dtoh_point = "before_ep_alltoall"``). Returns the number of layers changed.

    An instance attribute (``object.__setattr__``), not a registered submodule: MoELayer's
    forward calls ``self.preprocess(...)``, which now reaches the module, while parameter names,
    state dicts and checkpoints keep Megatron's (``decoder.layers.N.mlp.*``). Idempotent.
    """
    changed = 0
    for layer in transformer_layers(lm):
        if not _is_moe_layer(layer):
            continue
        moe = layer.mlp
        if isinstance(moe.__dict__.get("preprocess"), MoEPreprocess):
            continue
        disp = moe.token_dispatcher
        if not hasattr(disp, "cuda_dtoh_point"):
            raise GraphConfigError(
                f"--cuda-graph-scope moe_preprocess supports the alltoall token dispatcher, "
                f"not {type(disp).__name__}; use moe_token_dispatcher_type='alltoall'"
            )
        disp.cuda_dtoh_point = "before_ep_alltoall"
        object.__setattr__(moe, "preprocess", MoEPreprocess(moe))
        changed += 1
    return changed


def check_mcore_attention_capture(cfg: MCoreGPTConfig, impl: str, scopes: list[str]) -> None:
    """TE attention in the captured scopes at a sequence length TE's cuDNN attention cannot
    be captured at (te_backend.py [Note: TE attention under capture])."""
    from graph_fsdp.capture.te_backend import check_attention_capture  # noqa: PLC0415

    if cfg.transformer_impl == "transformer_engine":
        check_attention_capture(
            seq_length=cfg.seq_length,
            impl=impl,
            scopes=scopes,
            backend=cfg.attention_backend,
            fix="--attention-backend unfused (attention_backend='unfused'; or flash, with "
            "flash-attn installed)",
        )


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
    if impl == "none":
        return None
    from graph_fsdp.capture import FullIterationGraphs, LayerwiseGraphs  # noqa: PLC0415

    scopes = check_mcore_scopes(cfg, scopes)
    check_mcore_attention_capture(cfg, impl, scopes)
    if "full_iteration" in scopes:
        if impl != "torch":
            raise GraphConfigError(
                "--cuda-graph-scope full_iteration is captured with torch.cuda graphs: use "
                "--cuda-graph-impl torch"
            )
        return FullIterationGraphs(lm, warmup_steps=warmup_steps, verify=verify)
    if "moe_preprocess" in scopes:
        install_moe_preprocess(lm)
    # The scopes resolve through graph_fsdp's presets (SCOPE_PRESETS' Megatron-Core entries).
    return LayerwiseGraphs(lm, impl=impl, scopes=scopes, warmup_steps=warmup_steps, verify=verify)
