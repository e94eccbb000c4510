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

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from graph_fsdp.fsdp.experts import mark_expert_params
from graph_fsdp.models.config import (
    _NORM_EPS,
    GPTConfig,
    _is_int,
)
from graph_fsdp.models.moe import MoEExperts, MoELayer
from graph_fsdp.models.packed import (
    at_least_fp32,
    check_packed_inputs,
    document_attention,
    packed_loss_sum,
)
from graph_fsdp.models.seeded import (
    _construction,
    _rms_norm,
    _SeededEmbedding,
    _SeededLinear,
    _stable_seed,
)

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
        import transformer_engine.pytorch as te  # noqa: PLC0415 (optional dependency)
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
