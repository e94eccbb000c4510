"""The reference GPT's configuration: every tensor shape derives from :class:`GPTConfig`."""

from __future__ import annotations

import math
from dataclasses import dataclass

from graph_fsdp.parallel.dropless_ep import check_receive_buffer_factor

_NORM_EPS = 1e-5


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _require_positive_int(name: str, value: object, fix: str) -> None:
    if not _is_int(value) or value < 1:  # type: ignore[operator]
        raise ValueError(f"GPTConfig.{name}={value!r} is invalid: expected an int >= 1; {fix}")


@dataclass(kw_only=True)
class GPTConfig:
    """Shape and initialisation of a reference GPT; every tensor shape derives from it."""

    vocab_size: int = 32000
    """Number of token ids; sizes the input embedding and the (untied) output projection."""

    num_layers: int = 16
    """Number of transformer layers; also scales the init of residual output projections."""

    hidden_size: int = 1024
    """Model width h (residual stream size)."""

    num_attention_heads: int = 16
    """Attention heads; must divide hidden_size so every head has the same static size."""

    ffn_hidden_size: int | None = None
    """MLP / expert inner size. None resolves to 4 * hidden_size in __post_init__ (note that
    dataclasses.replace keeps the resolved value, so pass ffn_hidden_size=None explicitly when
    replacing hidden_size)."""

    seq_length: int = 1024
    """Maximum sequence length; sizes the learned position embedding and the attention FLOPs."""

    num_experts: int | None = None
    """None builds a dense GPT; an int >= 2 makes the layers selected by moe_layer_freq MoE."""

    moe_layer_freq: int = 1
    """Layer i (0-based) is MoE when i % moe_layer_freq == 0 (Megatron convention): 1 makes
    every layer MoE, 2 alternates MoE/dense starting with MoE, so mixed models exist."""

    moe_router_topk: int = 2
    """Experts each token is routed to; 1 <= topk <= num_experts."""

    moe_capacity_factor: float = 1.0
    """Per-expert capacity C = ceil(factor * tokens * topk / num_experts), from static shapes
    only, so MoE tensors never change shape; tokens past an expert's capacity are dropped."""
    moe_dropless: bool = False
    """Dropless routing: every token reaches its topk experts (no capacity), the experts run
    as grouped GEMMs over device-side counts (parallel/grouped_moe.py), under expert
    parallelism through fixed-size exchanges (parallel/dropless_ep.py). The capacity factor
    is not used."""
    moe_receive_buffer_factor: float | None = None
    """Dropless expert parallelism: rows each EP rank can receive from one peer, as a multiple
    of the balanced load (``tokens x topk / EP``). None: every copy a rank has - nothing is
    ever dropped, at EP x a balanced exchange's rows. A smaller factor can overflow: the
    training loop then repeats the step exactly with every copy's buffer, counts it
    (``overflow_steps``) and warns, naming the layers and the factor that would have held it
    (parallel/dropless_ep.py [Note: dropless overflow reports])."""

    init_std: float = 0.02
    """Std of the normal init of linear and embedding weights."""

    seed: int = 1234
    """Root of every random stream (weights and synthetic batches)."""

    transformer_impl: str = "local"
    """Megatron's --transformer-impl: ``local`` builds the torch layers of this file,
    ``transformer_engine`` builds ``te.pytorch.TransformerLayer`` layers (dense only, CUDA;
    initialised from the global RNG, which ``train.run`` seeds)."""

    def __post_init__(self) -> None:
        _require_positive_int("vocab_size", self.vocab_size, "use the tokenizer's vocab size")
        _require_positive_int("num_layers", self.num_layers, "use at least one layer")
        _require_positive_int("hidden_size", self.hidden_size, "use a positive width")
        _require_positive_int(
            "num_attention_heads", self.num_attention_heads, "use at least one head"
        )
        if self.hidden_size % self.num_attention_heads != 0:
            divisors = [d for d in range(1, self.hidden_size + 1) if self.hidden_size % d == 0]
            nearest = min(divisors, key=lambda d: abs(d - self.num_attention_heads))
            raise ValueError(
                f"GPTConfig.num_attention_heads={self.num_attention_heads} does not divide "
                f"hidden_size={self.hidden_size}; choose a head count that divides hidden_size "
                f"(e.g. {nearest})"
            )
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        _require_positive_int(
            "ffn_hidden_size", self.ffn_hidden_size, "or pass None for 4 * hidden_size"
        )
        _require_positive_int("seq_length", self.seq_length, "use the training sequence length")
        self._validate_moe()
        if not isinstance(self.init_std, int | float) or not self.init_std > 0:
            raise ValueError(
                f"GPTConfig.init_std={self.init_std!r} is invalid: expected a float > 0 (e.g. 0.02)"
            )
        if not _is_int(self.seed) or self.seed < 0:
            raise ValueError(
                f"GPTConfig.seed={self.seed!r} is invalid: expected an int >= 0 (e.g. 1234)"
            )

    def _validate_moe(self) -> None:
        if self.num_experts is not None and (not _is_int(self.num_experts) or self.num_experts < 2):
            raise ValueError(
                f"GPTConfig.num_experts={self.num_experts!r} is invalid: expected None for a "
                "dense model or an int >= 2 for MoE"
            )
        _require_positive_int("moe_layer_freq", self.moe_layer_freq, "1 makes every layer MoE")
        _require_positive_int("moe_router_topk", self.moe_router_topk, "e.g. 2")
        if self.num_experts is not None and self.moe_router_topk > self.num_experts:
            raise ValueError(
                f"GPTConfig.moe_router_topk={self.moe_router_topk} exceeds "
                f"num_experts={self.num_experts}; use moe_router_topk <= num_experts"
            )
        check_receive_buffer_factor(
            self.moe_receive_buffer_factor, "GPTConfig.moe_receive_buffer_factor"
        )
        factor = self.moe_capacity_factor
        if not isinstance(factor, int | float) or isinstance(factor, bool) or not factor > 0:
            raise ValueError(
                f"GPTConfig.moe_capacity_factor={factor!r} is invalid: expected a float > 0 "
                "(1.0 gives each expert its fair share of tokens)"
            )

        if self.transformer_impl not in ("local", "transformer_engine"):
            raise ValueError(
                f"GPTConfig.transformer_impl={self.transformer_impl!r} is invalid: expected "
                "'local' or 'transformer_engine'"
            )
        if self.transformer_impl == "transformer_engine" and self.num_experts is not None:
            raise ValueError(
                "GPTConfig.transformer_impl='transformer_engine' builds dense TE layers, but "
                f"num_experts={self.num_experts}: use transformer_impl='local' for MoE models"
            )

    @property
    def head_dim(self) -> int:
        """Per-head size; exact because __post_init__ checks divisibility."""
        return self.hidden_size // self.num_attention_heads

    def is_moe_layer(self, layer_number: int) -> bool:
        """Whether 0-based layer ``layer_number`` is MoE (i % moe_layer_freq == 0)."""
        return self.num_experts is not None and layer_number % self.moe_layer_freq == 0


def moe_capacity(config: GPTConfig, num_tokens: int) -> int:
    """Per-expert capacity for a micro-batch of ``num_tokens`` tokens.

    Computed from Python ints only, so it is the same at capture and replay time and never
    needs a device sync; at least 1 so that the expert tensors are never empty.
    """
    if config.num_experts is None:
        raise ValueError("moe_capacity needs GPTConfig.num_experts to be set (got None)")
    raw = config.moe_capacity_factor * num_tokens * config.moe_router_topk / config.num_experts
    return max(1, math.ceil(raw))


def model_flops_per_token(config: GPTConfig) -> float:
    """Training (forward + backward) model FLOPs per token, for TFLOP/s and MFU reporting.

    6 * (matmul parameters a token touches) + 12 * num_layers * hidden * seq_length for the
    attention score/value products (PaLM/Megatron convention: causal masking is not halved).
    MoE layers count the router plus topk experts; the dispatch/combine einsums and compute on
    capacity padding are implementation overhead and are deliberately not counted.
    """
    h, ffn = config.hidden_size, config.ffn_hidden_size
    assert ffn is not None  # resolved by GPTConfig.__post_init__
    attn_params = 4 * h * h
    matmul_params = config.vocab_size * h
    for i in range(config.num_layers):
        if config.is_moe_layer(i):
            assert config.num_experts is not None
            ffn_params = h * config.num_experts + config.moe_router_topk * 2 * h * ffn
        else:
            ffn_params = 2 * h * ffn
        matmul_params += attn_params + ffn_params
    attention = 12 * config.num_layers * h * config.seq_length
    return float(6 * matmul_params + attention)
