"""The shape of a Megatron-Core GPT (:class:`MCoreGPTConfig`) and its validation.

Pure Python: importing this module (and building, validating a config) needs no
megatron-core; :func:`require_megatron` says what to install where the model is built
(graph_fsdp.integrations.megatron, which re-exports everything here).
"""

from __future__ import annotations

from dataclasses import dataclass

from graph_fsdp.parallel.dropless_ep import check_receive_buffer_factor

INSTALL_HINT = 'pip install -e ".[megatron]"'
TRANSFORMER_IMPLS = ("transformer_engine", "local")
NORMALIZATIONS = ("LayerNorm", "RMSNorm")
"""TransformerConfig.normalization values graph_fsdp's configs build."""
ATTENTION_BACKENDS = ("auto", "flash", "fused", "unfused", "local")
"""Megatron's AttnBackend names (TransformerConfig.attention_backend)."""
MOE_DISPATCHERS = ("alltoall", "allgather", "flex")
"""Megatron's token dispatchers (TransformerConfig.moe_token_dispatcher_type)."""
MOE_EXPERTS_IMPLS = ("megatron", "grouped_mm")
"""megatron: the layer spec's experts and dispatcher; grouped_mm: graph_fsdp's dropless experts
with device token counts (megatron_moe.GroupedMMMoELayer)."""
HYBRID_LAYERS = {"*": "attention", "-": "MLP", "E": "MoE", "M": "Mamba"}
"""The characters of a ``hybrid_layer_pattern`` graph_fsdp builds (megatron-core 0.16's whole
vocabulary; 0.19 adds G, D and + layers, ``|`` pipeline stages and ``/`` MTP depths)."""


def require_megatron():
    """Import megatron.core, or raise an ImportError that says what to install."""
    try:
        import megatron.core  # noqa: PLC0415 (optional dependency)
        from megatron.core import parallel_state  # noqa: F401, PLC0415
    except ImportError as err:
        raise ImportError(
            f"graph_fsdp.integrations.megatron needs megatron-core (0.16 on Python 3.11, 0.19 "
            f"on Python >= 3.12), which does not import here ({type(err).__name__}: {err}); "
            f"install it with {INSTALL_HINT}"
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
    num_query_groups: int | None = None
    """Key/value heads (grouped-query attention); must divide num_attention_heads. None: one
    per attention head."""
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
    with device token counts and torch._grouped_mm (megatron_moe.GroupedMMMoELayer; at EP > 1
    graph_fsdp's fixed-size dropless exchange; bf16 on sm90 / sm100 under capture), captured
    whole."""
    moe_receive_buffer_factor: float | None = None
    """grouped_mm at expert_model_parallel_size > 1: rows each EP rank receives from one peer,
    as a multiple of the balanced load (tokens x topk / EP). None: every copy a rank has -
    nothing is ever dropped, at EP x a balanced exchange's rows. A smaller factor can
    overflow: the training loop then repeats the step exactly with every copy's buffer,
    counts it (``overflow_steps``) and warns, naming the layers and the factor that would
    have held it (parallel/dropless_ep.py [Note: dropless overflow reports]). Unused at EP = 1
    (no exchange), so one config moves between EP sizes."""
    moe_aux_loss_coeff: float = 0.0
    """Coefficient of Megatron's load-balancing loss (moe_router_load_balancing_type aux_loss);
    0 = off, Megatron's default."""
    swiglu: bool = False
    """Megatron's ``--swiglu``: a gated MLP (``gated_linear_unit``, SiLU) as Llama and Qwen use;
    ``linear_fc1`` then holds ``[gate; up]`` (2 x ffn_hidden_size rows), each TP rank its
    slice of both (``partition_stride=2``: fsdp/tensor_parallel.py [Note: strided
    tensor-parallel pieces])."""
    normalization: str = "LayerNorm"
    """TransformerConfig.normalization: LayerNorm or RMSNorm."""
    transformer_impl: str = "transformer_engine"
    """transformer_engine: get_gpt_layer_with_transformer_engine_spec; local:
    get_gpt_layer_local_spec (no TransformerEngine)."""
    position_embedding_type: str = "rope"
    """rope or learned_absolute."""
    apply_rope_fusion: bool = False
    """TransformerConfig.apply_rope_fusion: TransformerEngine's fused RoPE kernel. Packed
    sequences need it (megatron/packed.py [Note: Megatron-Core packed sequences]);
    packed_model_config sets it."""
    bf16: bool = False
    """TransformerConfig.bf16 (the compute dtype comes from graph_fsdp's MixedPrecisionPolicy)."""
    gradient_accumulation_fusion: bool = False
    """Must stay False under graph_fsdp (see the module docstring)."""
    expert_model_parallel_size: int = 1
    """Megatron's EP size N: each rank holds num_experts / N experts and the token dispatcher
    exchanges tokens over the EP group (N consecutive ranks); expert parameters are sharded
    over the expert-data-parallel group (world / N ranks), dense ones over every rank. Must
    divide num_experts and the world size; init_parallel_state(expert_model_parallel_size=N)
    sets up Megatron's groups (megatron/ep.py)."""
    tensor_model_parallel_size: int = 1
    """Megatron's TP size N (dense GPTs): each rank holds its TP piece of the parallel linears,
    embedding and output layer; graph_fsdp shards those local pieces over the data-parallel
    group (world / N ranks). init_parallel_state(tensor_model_parallel_size=N) first
    (megatron/tp.py [Note: Megatron-Core tensor parallelism])."""
    sequence_parallel: bool = False
    """Megatron's sequence parallelism (TP > 1): activations between the TP blocks split over
    the sequence; the norms' gradients are summed over TP after the data-parallel reduction."""
    seed: int = 1234
    """Seed of the weights (torch and Megatron's model-parallel RNG tracker)."""
    attention_backend: str = "auto"
    """TransformerConfig.attention_backend (Megatron's --attention-backend): auto lets TE pick
    per call; flash, fused or unfused pin one for eager and graphed steps alike (see
    te_backend.py [Note: TE attention under capture]); local needs transformer_impl local."""
    hybrid_layer_pattern: str | None = None
    """Megatron's --hybrid-layer-pattern: the model is a HybridModel (megatron-core 0.19;
    MambaModel's hybrid_override_pattern in 0.16) with one layer per character - ``*``
    attention, ``-`` MLP, ``E`` MoE (needs num_experts), ``M`` Mamba (needs the mamba_ssm,
    causal_conv1d and einops packages, the TE spec) - instead of a GPTModel. num_layers is
    set to the pattern's length, as Megatron derives it. None: a GPTModel
    (megatron/hybrid.py [Note: Megatron-Core hybrid models])."""

    def __post_init__(self) -> None:
        if self.hybrid_layer_pattern is not None:
            _check_hybrid(self)
            self.num_layers = len(self.hybrid_layer_pattern)
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"MCoreGPTConfig: num_attention_heads={self.num_attention_heads} does not divide "
                f"hidden_size={self.hidden_size}; pick a head count that divides it"
            )
        groups = self.num_query_groups
        if groups is not None and (groups < 1 or self.num_attention_heads % groups):
            raise ValueError(
                f"MCoreGPTConfig: num_query_groups={groups} does not divide "
                f"num_attention_heads={self.num_attention_heads}; pick a divisor (or None)"
            )
        if self.normalization not in NORMALIZATIONS:
            raise ValueError(
                f"MCoreGPTConfig.normalization={self.normalization!r}; choose one of "
                f"{', '.join(NORMALIZATIONS)}"
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
        _check_tensor_parallel(self)
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

    def _check_moe(self) -> None:
        """The MoE fields (Megatron's rules, plus what graph_fsdp's grouped_mm experts need)."""
        name = "MCoreGPTConfig"
        ep = self.expert_model_parallel_size
        if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
            raise ValueError(
                f"{name}.expert_model_parallel_size={ep!r} must be a positive integer (1: no "
                "expert parallelism)"
            )
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
        if self.num_experts % ep:
            raise ValueError(
                f"{name}.expert_model_parallel_size={ep} does not divide num_experts="
                f"{self.num_experts}: each EP rank holds num_experts / EP experts; use an EP "
                f"that divides {self.num_experts}"
            )
        _check_capacity(self)
        if self.moe_experts_impl == "grouped_mm":
            _check_grouped_mm(self)
        _check_receive_buffer(self)

    @property
    def is_moe(self) -> bool:
        return self.num_experts is not None

    @property
    def is_hybrid(self) -> bool:
        """A HybridModel of ``hybrid_layer_pattern`` (else a GPTModel)."""
        return self.hybrid_layer_pattern is not None

    def has_layers(self, symbol: str) -> bool:
        """Whether the model has layers of kind ``symbol`` (a :data:`HYBRID_LAYERS` key); a
        GPTModel's layers are attention plus MLP (``*``, ``-``) or attention plus MoE."""
        if self.is_hybrid:
            return symbol in self.hybrid_layer_pattern
        return symbol == "*" or symbol == ("E" if self.is_moe else "-")


_MOE_ONLY_DEFAULTS = {
    "expert_model_parallel_size": 1,
    "moe_expert_capacity_factor": None,
    "moe_pad_expert_input_to_capacity": False,
    "moe_experts_impl": "megatron",
    "moe_receive_buffer_factor": None,
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
    ffn = cfg.ffn_hidden_size or 4 * cfg.hidden_size
    for field, size in (("hidden_size", cfg.hidden_size), ("ffn_hidden_size", ffn)):
        if size % 8:
            raise ValueError(
                f"{name}: {field}={size} is not a multiple of 8; torch._grouped_mm reads "
                "16-byte aligned bf16 rows"
            )


def _check_receive_buffer(cfg: MCoreGPTConfig) -> None:
    """moe_receive_buffer_factor sizes graph_fsdp's dropless exchange (grouped_mm, EP > 1)."""
    buffer, name = cfg.moe_receive_buffer_factor, "MCoreGPTConfig.moe_receive_buffer_factor"
    if buffer is None:
        return
    check_receive_buffer_factor(buffer, name)
    if cfg.moe_experts_impl != "grouped_mm":
        raise ValueError(
            f"{name}={buffer} sizes the receive buffer of the grouped_mm experts' exchange over "
            f"the expert-parallel group, but moe_experts_impl={cfg.moe_experts_impl!r}: use "
            "moe_experts_impl='grouped_mm', or leave it None"
        )


def _check_hybrid(cfg: MCoreGPTConfig) -> None:
    """A ``hybrid_layer_pattern`` graph_fsdp can build (megatron/hybrid.py)."""
    pattern, name = cfg.hybrid_layer_pattern, "MCoreGPTConfig.hybrid_layer_pattern"
    if not isinstance(pattern, str) or not pattern:
        raise ValueError(
            f"{name}={pattern!r}: give one character per layer, e.g. '*-E-' (* attention, "
            "- MLP, E MoE, M Mamba)"
        )
    bad = sorted({c for c in pattern if c not in HYBRID_LAYERS})
    if bad:
        why = {
            "|": "'|' splits the pattern into pipeline stages (graph_fsdp runs PP = 1)",
            "/": "'/' starts multi-token-prediction depths, which graph_fsdp does not build",
        }
        reasons = [why[c] for c in bad if c in why]
        raise ValueError(
            f"{name}={pattern!r} has {', '.join(repr(c) for c in bad)}: graph_fsdp builds "
            f"{', '.join(f'{c!r} ({k})' for c, k in HYBRID_LAYERS.items())}"
            + "".join(f"; {r}" for r in reasons)
        )
    if "E" in pattern and cfg.num_experts is None:
        raise ValueError(
            f"{name}={pattern!r} has MoE layers ('E'), but num_experts is None: set num_experts "
            "(--num-experts N)"
        )
    if "E" not in pattern and cfg.num_experts is not None:
        raise ValueError(
            f"{name}={pattern!r} has no MoE layer ('E'), but num_experts={cfg.num_experts}: add "
            "'E' layers to the pattern or set num_experts=None"
        )
    if "M" in pattern and cfg.transformer_impl != "transformer_engine":
        raise ValueError(
            f"{name}={pattern!r}: Megatron-Core's Mamba layer ('M') comes with its "
            "TransformerEngine spec only; set transformer_impl='transformer_engine' or drop 'M'"
        )
    if cfg.tensor_model_parallel_size != 1:
        raise ValueError(
            f"{name}={pattern!r} with tensor_model_parallel_size="
            f"{cfg.tensor_model_parallel_size}: graph_fsdp runs Megatron's TP for GPTModels; "
            "use TP = 1 for hybrid models"
        )


def _check_tensor_parallel(cfg: MCoreGPTConfig) -> None:
    """The TP / SP fields against the model's shape (megatron/tp.py)."""
    tp, name = cfg.tensor_model_parallel_size, "MCoreGPTConfig"
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"{name}.tensor_model_parallel_size={tp!r} must be a positive integer")
    if cfg.sequence_parallel and tp == 1:
        raise ValueError(
            f"{name}.sequence_parallel=True splits the sequence over the TP group, but "
            "tensor_model_parallel_size=1: set tensor_model_parallel_size > 1 or "
            "sequence_parallel=False"
        )
    if tp == 1:
        return
    ffn = cfg.ffn_hidden_size or 4 * cfg.hidden_size
    sizes = {
        "num_attention_heads": cfg.num_attention_heads,
        "ffn_hidden_size": ffn,
        "vocab_size": cfg.vocab_size,
    }
    if cfg.num_query_groups is not None:
        sizes["num_query_groups"] = cfg.num_query_groups
    if cfg.sequence_parallel:
        sizes["seq_length"] = cfg.seq_length
    bad = {k: v for k, v in sizes.items() if v % tp}
    if bad:
        raise ValueError(
            f"{name}.tensor_model_parallel_size={tp} must divide {bad}: each TP rank holds "
            "whole heads (and key/value groups), an equal share of the MLP and vocabulary "
            "(and of the sequence with sequence_parallel); pick a TP size that divides them"
        )
    if cfg.num_experts is not None:
        raise ValueError(
            f"{name}: tensor_model_parallel_size={tp} with num_experts={cfg.num_experts}: "
            "graph_fsdp runs Megatron's tensor parallelism for dense GPTs; use TP = 1 for MoE "
            "models (expert parallelism: expert_model_parallel_size)"
        )


# --------------------------------------------------------------------------------------------
# Parallel state and model
# --------------------------------------------------------------------------------------------
