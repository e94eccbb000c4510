"""Reference GPT models (dense and Mixture-of-Experts) for graph_fsdp tests and benchmarks.

The models are written so that a CUDA-graph FSDP engine can capture them:

* every shape is a function of the config and the micro-batch shape only, never of the data
  (MoE uses a fixed per-expert capacity and drops overflow tokens instead of resizing);
* nothing syncs with the host in forward or backward (no ``.item()``, ``nonzero`` or boolean
  indexing), so a captured graph replays the same kernels as eager execution;
* MoE dispatch and combine are matmuls/einsums, never ``scatter_add``/``index_add``, whose CUDA
  kernels use atomics and would make eager-vs-graph comparisons non bit-exact;
* parameter initialisation depends only on ``config.seed`` and each parameter's qualified name,
  so a model built directly, built on ``meta`` and materialised, or (re)initialised shard by
  shard always ends up with the same weights on every device.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from graph_fsdp.fsdp.experts import mark_expert_params
from graph_fsdp.models.packed import (
    at_least_fp32,
    check_packed_inputs,
    document_attention,
    packed_loss_sum,
)
from graph_fsdp.parallel.ep_dispatch import dispatch_to_experts

__all__ = [
    "MLP",
    "GPTConfig",
    "GPTModel",
    "MoEExperts",
    "MoELayer",
    "MoEPreprocess",
    "MoERouter",
    "SelfAttention",
    "TransformerLayer",
    "build_model",
    "init_weights",
    "model_flops_per_token",
    "moe_capacity",
    "partition_experts",
    "synthetic_batch",
    "transformer_layers",
]

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


# --------------------------------------------------------------------------------------------
# Deterministic, construction-order-independent initialisation
# --------------------------------------------------------------------------------------------


def _stable_seed(*parts: object) -> int:
    """A 63-bit seed from ``parts``; unlike ``hash()`` it is stable across processes."""
    digest = hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _seeded_normal(shape: tuple[int, ...], std: float, seed: int, fqn: str) -> torch.Tensor:
    """Normal(0, std) values for parameter ``fqn``, generated on CPU in float32.

    Generating on CPU with a private generator makes the values independent of the target
    device, of the global RNG state and of the order in which parameters are initialised.
    """
    gen = torch.Generator(device="cpu")
    gen.manual_seed(_stable_seed(seed, "param", fqn))
    out = torch.empty(shape, dtype=torch.float32, device="cpu")
    return out.normal_(0.0, std, generator=gen)


def _copy_full_(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy a full (unsharded) CPU tensor into ``param``, which may be a DTensor shard."""
    with torch.no_grad():
        if not _is_dtensor(param):
            param.copy_(full)
            return
        # torch.distributed.tensor exists only where torch.distributed does (_is_dtensor)
        from torch.distributed.tensor import DTensor, distribute_tensor  # noqa: PLC0415

        assert isinstance(param, DTensor)
        # Every rank generated the same full tensor, so each cuts out its own shard locally
        # (src_data_rank=None) instead of receiving it from one rank: no communication.
        mesh = param.device_mesh
        full = full.to(device=mesh.device_type, dtype=param.dtype)
        param.copy_(distribute_tensor(full, mesh, param.placements, src_data_rank=None))


def _is_dtensor(tensor: torch.Tensor) -> bool:
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor  # noqa: PLC0415 (needs torch.distributed)

    return isinstance(tensor, DTensor)


class _SeededInit:
    """Mixin for modules that own parameters and initialise them from their qualified name.

    ``_init_fqn`` is the module's name relative to the construction root (set once, when the
    outermost module finishes construction), so re-running ``reset_parameters`` later -- e.g.
    after ``to_empty`` -- regenerates exactly the same values.
    """

    _init_fqn: str | None = None
    _init_config: GPTConfig
    _init_residual_out: bool = False

    def _init_std(self) -> float:
        std = self._init_config.init_std
        if self._init_residual_out:
            std /= math.sqrt(2.0 * self._init_config.num_layers)
        return std

    def _seeded_normal_init_(self, name: str, param: torch.Tensor, std: float) -> None:
        if self._init_fqn is None or param.is_meta:
            return  # still under construction, or nothing to write into yet
        fqn = f"{self._init_fqn}.{name}" if self._init_fqn else name
        full = _seeded_normal(tuple(param.shape), std, self._init_config.seed, fqn)
        _copy_full_(param, full)


_BUILD_STATE = threading.local()


@contextlib.contextmanager
def _construction(module: nn.Module) -> Iterator[None]:
    """Defer initialisation to the outermost module under construction.

    Nested modules skip their own init; the root names every parameter relative to itself and
    initialises each once. This keeps init cost O(params) and makes a standalone submodule
    (e.g. a bare ``SelfAttention``) deterministic too.
    """
    depth = getattr(_BUILD_STATE, "depth", 0)
    _BUILD_STATE.depth = depth + 1
    try:
        yield
    finally:
        _BUILD_STATE.depth = depth
    if depth == 0:
        for name, sub in module.named_modules():
            if isinstance(sub, _SeededInit):
                sub._init_fqn = name
        init_weights(module)


def init_weights(module: nn.Module, config: GPTConfig | None = None) -> nn.Module:
    """(Re)initialise ``module`` and all submodules deterministically; returns ``module``.

    Calls ``reset_parameters`` on every submodule that has one, which is what a meta-device
    build needs after ``to_empty``. With ``config``, its ``seed``/``init_std``/``num_layers``
    replace the ones the modules were built with (shapes must still match).
    """
    for sub in module.modules():
        if config is not None and isinstance(sub, _SeededInit):
            sub._init_config = config
        reset = getattr(sub, "reset_parameters", None)
        if callable(reset):
            reset()
    return module


class _SeededLinear(_SeededInit, nn.Linear):
    """Bias-free ``nn.Linear`` whose ``reset_parameters`` is seeded by the weight's name."""

    def __init__(
        self, in_features: int, out_features: int, config: GPTConfig, *, residual_out: bool = False
    ) -> None:
        with _construction(self):
            super().__init__(in_features, out_features, bias=False)
            self._init_config = config
            self._init_residual_out = residual_out

    def reset_parameters(self) -> None:
        if self._init_fqn is not None:
            self._seeded_normal_init_("weight", self.weight, self._init_std())


class _SeededEmbedding(_SeededInit, nn.Embedding):
    """``nn.Embedding`` whose ``reset_parameters`` is seeded by the weight's name."""

    def __init__(self, num_embeddings: int, embedding_dim: int, config: GPTConfig) -> None:
        with _construction(self):
            super().__init__(num_embeddings, embedding_dim)
            self._init_config = config

    def reset_parameters(self) -> None:
        if self._init_fqn is not None:
            self._seeded_normal_init_("weight", self.weight, self._init_std())


def _rms_norm(config: GPTConfig) -> nn.RMSNorm:
    # RMSNorm.reset_parameters fills ones, which is already deterministic.
    return nn.RMSNorm(config.hidden_size, eps=_NORM_EPS)


# --------------------------------------------------------------------------------------------
# Dense blocks
# --------------------------------------------------------------------------------------------


class SelfAttention(nn.Module):
    """Pre-norm causal self-attention; the caller adds the residual.

    ``qkv``'s output rows are grouped per head - head 0's query, key and value, then head 1's,
    ... (Megatron's ``linear_qkv`` layout) - so a contiguous split of them over tensor-parallel
    ranks gives each rank whole heads; the forward reads the number of heads from ``qkv``'s
    output, so the same code runs the full layer or a TP rank's heads (models/tp_plans.py).
    """

    def __init__(self, config: GPTConfig) -> None:
        with _construction(self):
            super().__init__()
            h = config.hidden_size
            self.num_heads = config.num_attention_heads
            self.head_dim = config.head_dim
            self.norm = _rms_norm(config)
            self.qkv = _SeededLinear(h, 3 * h, config)
            self.proj = _SeededLinear(h, h, config, residual_out=True)

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        """``cu_seqlens``: a packed call - attend within documents only (models/packed.py
        [Note: packed sequences under CUDA graphs])."""
        qkv = self.qkv(self.norm(x))
        # Under sequence parallelism ``x`` holds this rank's slice of the sequence and ``qkv``
        # (gathered by the plan) all of it: shapes come from ``qkv``.
        b, s = qkv.shape[:2]
        qkv = qkv.view(b, s, -1, 3, self.head_dim)  # [b, s, heads, (q, k, v), head_dim]
        q, k, v = qkv.permute(3, 0, 2, 1, 4).unbind(0)  # each [b, heads, s, head_dim]
        if cu_seqlens is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            y = document_attention(q, k, v, cu_seqlens, s)
        return self.proj(y.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    """Pre-norm GELU(tanh) MLP; the caller adds the residual."""

    def __init__(self, config: GPTConfig) -> None:
        with _construction(self):
            super().__init__()
            ffn = config.ffn_hidden_size
            assert ffn is not None  # resolved by GPTConfig.__post_init__
            self.norm = _rms_norm(config)
            self.fc1 = _SeededLinear(config.hidden_size, ffn, config)
            self.fc2 = _SeededLinear(ffn, config.hidden_size, config, residual_out=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(self.norm(x)), approximate="tanh"))


# --------------------------------------------------------------------------------------------
# Mixture of Experts, split so that a caller may graph some pieces and run others eagerly
# --------------------------------------------------------------------------------------------


def _require_moe(config: GPTConfig, what: str) -> int:
    if config.num_experts is None:
        raise ValueError(f"{what} needs GPTConfig.num_experts to be set (got None)")
    return config.num_experts


class MoERouter(nn.Module):
    """Top-k softmax router.

    Scores are taken in float32 so that routing decisions do not flip with the parameter
    dtype; the top-k weights are renormalised to sum to 1 (with topk=1 the weight is exactly
    1 and the gate gets no gradient, as in Mixtral).
    """

    def __init__(self, config: GPTConfig) -> None:
        with _construction(self):
            super().__init__()
            self.topk = config.moe_router_topk
            self.gate = _SeededLinear(config.hidden_size, _require_moe(config, "MoERouter"), config)

    def forward(self, x_flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x_flat [T, h] -> (probs [T, topk] float32, indices [T, topk] int64)."""
        scores = torch.softmax(self.gate(x_flat).float(), dim=-1)
        probs, indices = torch.topk(scores, self.topk, dim=-1)
        return probs / probs.sum(dim=-1, keepdim=True), indices


class MoEPreprocess(nn.Module):
    """Routing decisions -> dense dispatch/combine tensors of static shape [T, E, C].

    A token's slot within an expert is its rank among the tokens routed there, in token order
    (a cumsum of the routing mask); slots >= C match no column and are thereby dropped. All
    ops are elementwise, cumsum over integers and reductions with one non-zero term, so the
    result is exact, sync-free and graph-capturable.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.num_experts = _require_moe(config, "MoEPreprocess")

    def capacity(self, num_tokens: int) -> int:
        """Per-expert capacity C for ``num_tokens`` tokens (see :func:`moe_capacity`)."""
        return moe_capacity(self.config, num_tokens)

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, capacity_factor={self.config.moe_capacity_factor}"

    def forward(
        self, probs: torch.Tensor, indices: torch.Tensor, dtype: torch.dtype | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(probs, indices) [T, topk] -> (dispatch, combine) [T, E, C] in ``dtype``.

        ``dtype`` defaults to ``probs.dtype``; pass the activation dtype so that the dispatch
        and combine einsums run in it. dispatch is 0/1; combine carries the router gradient.
        """
        dtype = probs.dtype if dtype is None else dtype
        num_tokens = indices.shape[0]
        capacity = self.capacity(num_tokens)
        experts = torch.arange(self.num_experts, device=indices.device)
        choice = indices.unsqueeze(-1) == experts  # [T, k, E]; top-k experts are distinct
        routed = choice.any(dim=1)  # [T, E]
        gates = (probs.unsqueeze(-1) * choice.to(probs.dtype)).sum(dim=1)  # [T, E]
        slot = torch.cumsum(routed.to(torch.int64), dim=0) - 1  # [T, E], in token order
        slots = torch.arange(capacity, device=indices.device)
        keep = (slot.unsqueeze(-1) == slots) & routed.unsqueeze(-1)  # [T, E, C]
        dispatch = keep.to(dtype)
        combine = (gates.unsqueeze(-1) * keep.to(gates.dtype)).to(dtype)
        return dispatch, combine


class MoEExperts(_SeededInit, nn.Module):
    """E GELU(tanh) experts as two stacked weights, applied with one bmm each.

    After :func:`partition_experts` the module holds only its expert-parallel rank's E / EP
    experts - rows ``[ep_rank * L, (ep_rank + 1) * L)`` of the weights above, initialised to
    the same values - and reaches the other ranks' experts through an all-to-all
    (ep_dispatch.py).
    """

    ep_group: dist.ProcessGroup | None = None
    ep_rank: int = 0

    def __init__(self, config: GPTConfig) -> None:
        with _construction(self):
            super().__init__()
            num_experts = _require_moe(config, "MoEExperts")
            ffn = config.ffn_hidden_size
            assert ffn is not None  # resolved by GPTConfig.__post_init__
            h = config.hidden_size
            self._init_config = config
            self.w1 = nn.Parameter(torch.empty(num_experts, h, ffn))
            self.w2 = nn.Parameter(torch.empty(num_experts, ffn, h))

    def reset_parameters(self) -> None:
        std = self._init_config.init_std
        self._init_local_("w1", self.w1, std)
        out_std = std / math.sqrt(2.0 * self._init_config.num_layers)
        self._init_local_("w2", self.w2, out_std)

    def _init_local_(self, name: str, param: torch.Tensor, std: float) -> None:
        """This EP rank's rows of the global (all-expert) seeded weights."""
        if self._init_fqn is None or param.is_meta:
            return
        fqn = f"{self._init_fqn}.{name}" if self._init_fqn else name
        num_experts = self._init_config.num_experts
        full = _seeded_normal((num_experts, *param.shape[1:]), std, self._init_config.seed, fqn)
        lo = self.ep_rank * param.shape[0]
        _copy_full_(param, full[lo : lo + param.shape[0]])

    def extra_repr(self) -> str:
        num_experts, h, ffn = self.w1.shape
        ep = "" if self.ep_group is None else f", ep_rank={self.ep_rank} (local experts)"
        return f"num_experts={num_experts}, hidden_size={h}, ffn_hidden_size={ffn}{ep}"

    def _experts(self, x: torch.Tensor) -> torch.Tensor:
        return torch.bmm(F.gelu(torch.bmm(x, self.w1), approximate="tanh"), self.w2)

    def forward(self, expert_in: torch.Tensor) -> torch.Tensor:
        """expert_in [E, C, h] -> [E, C, h] (every global expert's rows, also under EP)."""
        if self.ep_group is None:
            return self._experts(expert_in)
        return dispatch_to_experts(expert_in, self._experts, self.ep_group)

    def partition(self, ep_group: dist.ProcessGroup) -> None:
        """Keep only this rank's experts of ``ep_group`` (see the class docstring)."""
        ep, rank = dist.get_world_size(ep_group), dist.get_rank(ep_group)
        num_experts = self.w1.shape[0]
        if self.ep_group is not None or num_experts % ep:
            raise ValueError(
                f"partition_experts: {num_experts} experts cannot be split over an "
                f"expert-parallel group of {ep} ranks"
                + (" (already partitioned)" if self.ep_group is not None else "")
                + "; num_experts must be a multiple of the EP size"
            )
        local = num_experts // ep
        rows = slice(rank * local, (rank + 1) * local)
        with torch.no_grad():
            self.w1 = nn.Parameter(self.w1[rows].clone(), requires_grad=self.w1.requires_grad)
            self.w2 = nn.Parameter(self.w2[rows].clone(), requires_grad=self.w2.requires_grad)
        self.ep_group, self.ep_rank = ep_group, rank


class MoELayer(nn.Module):
    """Pre-norm MoE feed-forward block; the caller adds the residual.

    Dropped tokens (over capacity) get a zero MoE output, so only the residual carries them.
    No auxiliary load-balancing loss is computed: the reference models exist to exercise the
    engine, not to train good routers.
    """

    def __init__(self, config: GPTConfig) -> None:
        with _construction(self):
            super().__init__()
            self.norm = _rms_norm(config)
            self.router = MoERouter(config)
            self.preprocess = MoEPreprocess(config)
            self.experts = MoEExperts(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        x_flat = self.norm(x).reshape(b * s, h)
        probs, indices = self.router(x_flat)
        dispatch, combine = self.preprocess(probs, indices, x_flat.dtype)
        expert_in = torch.einsum("tec,th->ech", dispatch, x_flat)
        expert_out = self.experts(expert_in)
        y = torch.einsum("tec,ech->th", combine, expert_out)
        return y.view(b, s, h)


# --------------------------------------------------------------------------------------------
# Full model
# --------------------------------------------------------------------------------------------


class TransformerLayer(nn.Module):
    """Attention + (MLP or MoE) with residuals; the unit for per-layer sharding.

    ``layer_number`` is 0-based; the layer holds ``moe`` when ``config.is_moe_layer`` says so
    and ``mlp`` otherwise (exactly one of the two attributes exists).
    """

    def __init__(self, config: GPTConfig, layer_number: int) -> None:
        if not 0 <= layer_number < config.num_layers:
            raise ValueError(
                f"layer_number={layer_number} is out of range: expected 0 <= layer_number < "
                f"num_layers={config.num_layers} (layer numbers are 0-based)"
            )
        with _construction(self):
            super().__init__()
            self.layer_number = layer_number
            self.is_moe = config.is_moe_layer(layer_number)
            self.self_attention = SelfAttention(config)
            if self.is_moe:
                self.moe = MoELayer(config)
            else:
                self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        if cu_seqlens is None:
            x = x + self.self_attention(x)
        else:
            x = x + self.self_attention(x, cu_seqlens)
        ffn = self.moe if self.is_moe else self.mlp
        return x + ffn(x)


def _te_layer(config: GPTConfig, layer_number: int) -> nn.Module:
    """A TransformerEngine layer of the same shape: pre-RMSNorm, causal attention, GELU MLP."""
    try:
        import transformer_engine.pytorch as te  # noqa: PLC0415
    except ImportError as err:
        raise ImportError(
            "GPTConfig.transformer_impl='transformer_engine' needs TransformerEngine: pip "
            "install graph-fsdp[te], or use transformer_impl='local'"
        ) from err
    return te.TransformerLayer(
        config.hidden_size,
        config.ffn_hidden_size,
        config.num_attention_heads,
        layernorm_epsilon=_NORM_EPS,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        layer_number=layer_number + 1,
        self_attn_mask_type="causal",
        normalization="RMSNorm",
        bias=False,
        attn_input_format="bshd",
        seq_length=config.seq_length,
        params_dtype=torch.float32,
        device=torch.get_default_device(),
    )


class GPTModel(nn.Module):
    """Decoder-only GPT with learned absolute positions and an untied output projection."""

    def __init__(self, config: GPTConfig) -> None:
        with _construction(self):
            super().__init__()
            self.config = config
            h = config.hidden_size
            self.embedding = _SeededEmbedding(config.vocab_size, h, config)
            self.position_embedding = _SeededEmbedding(config.seq_length, h, config)
            layer = TransformerLayer if config.transformer_impl == "local" else _te_layer
            self.layers = nn.ModuleList(layer(config, i) for i in range(config.num_layers))
            self.final_norm = _rms_norm(config)
            self.output = _SeededLinear(h, config.vocab_size, config)

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        *,
        position_ids: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids [b, s] int64 -> logits [b, s, vocab], or the mean CE loss if labels.

        Packed documents (``cu_seqlens`` and ``position_ids`` given, models/packed.py [Note:
        packed sequences under CUDA graphs]): attention within each document, positions
        restarting per document, and with labels the *sum* of the loss over the tokens whose
        label is not -100 (the caller scales it by the step's token count).
        """
        s = input_ids.shape[1]
        if s > self.config.seq_length:
            raise ValueError(
                f"input sequence length {s} exceeds GPTConfig.seq_length="
                f"{self.config.seq_length}; raise seq_length or shorten the batch"
            )
        if cu_seqlens is None:
            positions = torch.arange(s, device=input_ids.device)
            x = self.embedding(input_ids) + self.position_embedding(positions)
            for layer in self.layers:
                x = layer(x)
        else:
            if self.config.transformer_impl != "local":
                raise ValueError(
                    "packed sequences (cu_seqlens) need GPTConfig.transformer_impl='local': "
                    f"the {self.config.transformer_impl!r} layers take no document boundaries"
                )
            check_packed_inputs(input_ids, position_ids, cu_seqlens)
            x = self.embedding(input_ids) + self.position_embedding(position_ids)
            for layer in self.layers:
                x = layer(x, cu_seqlens)
        logits = self.output(self.final_norm(x))
        if labels is None:
            return logits
        if cu_seqlens is not None:
            return packed_loss_sum(logits, labels)
        return F.cross_entropy(at_least_fp32(logits).flatten(0, 1), labels.flatten())


def build_model(
    config: GPTConfig,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> GPTModel:
    """Build a GPTModel whose weights depend only on ``config`` (not device, not global RNG).

    ``device="meta"`` allocates nothing; materialise later with ``to_empty`` followed by
    :func:`init_weights` (or ``reset_parameters`` on every submodule that has it). Values are
    generated in float32 and then cast, so ``dtype`` rounds the same weights.
    """
    with torch.device(device if device is not None else "cpu"):
        model = GPTModel(config)
    if dtype is not None:
        model = model.to(dtype=dtype)
    return model


def partition_experts(model: nn.Module, ep_group: dist.ProcessGroup) -> nn.Module:
    """Expert parallelism: every ``MoEExperts`` of ``model`` keeps only its rank's experts of
    ``ep_group`` (an all-to-all reaches the others) and is marked for ``fully_shard``'s
    ``expert_mesh`` (graph_fsdp.fsdp.experts). Before ``fully_shard``; returns ``model``."""
    found = [m for m in model.modules() if isinstance(m, MoEExperts)]
    if not found:
        raise ValueError(
            f"partition_experts: {type(model).__name__} has no MoEExperts (GPTConfig."
            "num_experts is None?): expert parallelism needs an MoE model"
        )
    for experts in found:
        experts.partition(ep_group)
        mark_expert_params(experts)
    return model


def transformer_layers(model: nn.Module) -> list[nn.Module]:
    """The per-layer units of ``model`` (the natural granularity for per-layer sharding)."""
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise TypeError(
            f"transformer_layers expects a GPTModel with a `layers` ModuleList, got "
            f"{type(model).__name__}"
        )
    return list(layers)


def sharding_units(model: nn.Module) -> list[tuple[nn.Module, bool]]:
    """``(module, reshard_after_forward)`` to ``fully_shard`` below the root, in forward order.

    Every transformer layer, then the output projection when the model has one: it runs last
    in forward and first in backward, so as its own unit its all-gather is prefetched behind
    the last layer and its (vocab-sized) gradient reduction overlaps the layers' backward,
    instead of both sitting exposed in the root unit; it stays gathered from its forward to
    its backward, which follows at once (torchtitan wraps its output layer the same way).
    """
    units = [(layer, True) for layer in transformer_layers(model)]
    head = getattr(model, "output", None)
    if isinstance(head, nn.Module):
        units.append((head, False))
    return units


def synthetic_batch(
    config: GPTConfig,
    micro_batch_size: int,
    step: int,
    rank: int = 0,
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic (input_ids, labels), each [micro_batch_size, seq_length] int64.

    A uniform random token stream of length seq_length + 1 per row, seeded by (seed, step,
    rank) only, so every run and every parallel layout sees the same data; labels are the
    stream shifted by one (next-token prediction).
    """
    if not _is_int(micro_batch_size) or micro_batch_size < 1:
        raise ValueError(f"micro_batch_size={micro_batch_size!r} must be an int >= 1")
    if not _is_int(step) or step < 0 or not _is_int(rank) or rank < 0:
        raise ValueError(f"step={step!r} and rank={rank!r} must be ints >= 0")
    gen = torch.Generator(device="cpu")
    gen.manual_seed(_stable_seed(config.seed, "batch", step, rank))
    stream = torch.randint(
        0,
        config.vocab_size,
        (micro_batch_size, config.seq_length + 1),
        generator=gen,
        dtype=torch.int64,
        device="cpu",
    )
    input_ids = stream[:, :-1].contiguous()
    labels = stream[:, 1:].contiguous()
    if device is not None:
        input_ids, labels = input_ids.to(device), labels.to(device)
    return input_ids, labels


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
