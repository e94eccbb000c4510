"""Packed variable-length documents for Megatron-Core GPTs: graph_fsdp's
:class:`~graph_fsdp.models.packed.PackedBatch` run through ``GPTModel`` with Megatron's
``PackedSeqParams(qkv_format="thd")`` and TransformerEngine's THD attention.

    lm = gm.build_gpt(gm.packed_model_config(gm.MCoreGPTConfig(...)))   # TE layer spec
    loss_sum = lm(input_ids, labels, position_ids=position_ids, cu_seqlens=cu_seqlens)

[Note: Megatron-Core packed sequences]
A pack (models/packed.py [Note: packed sequences under CUDA graphs]) is ``[b, T]`` tokens with
``cu_seqlens`` int32 ``[b * (D + 1) + 1]`` over the flattened ``b * T`` tokens: ``D`` document
slots per row (unused ones zero-length) and the row's padding tail. Facts from megatron-core
0.19.2 and TransformerEngine 2.20 that decide how it enters ``GPTModel``:

* THD means batch 1. ``Attention.forward`` squeezes dim 1 of ``[s, b, heads, dim]`` for
  ``qkv_format == "thd"`` and reshapes the core attention's output to ``(t, 1, -1)``
  (transformer/attention.py:1468-1471, 1597-1602). So the pack is flattened to ``[1, b * T]``
  - ``cu_seqlens`` already counts over the flattened rows - and the loss reads the labels
  flattened the same way.
* ``cu_seqlens`` goes in as it is, the same tensor (no copy, no cast): a graph copies each new
  pack into its static ``cu_seqlens`` input, and the ``PackedSeqParams`` built inside the
  captured step (full_iteration, the one graph) must read that static tensor.
  ``max_seqlen_q/kv`` are the budget ``T``, a host constant: TE deduces them from
  ``cu_seqlens`` with a device-to-host copy when they are None
  (attention/dot_product_attention/dot_product_attention.py:2465-2476), and Megatron sizes
  the RoPE table with them (rotary_pos_embedding.py:238-241). ``cu_seqlens_q/kv_padded``
  stay None: TE then sets ``pad_between_seqs = False`` without reading a device tensor
  (dot_product_attention.py:2716-2728), which keeps its unfused attention eligible and the
  backend choice the same in eager and captured steps; graph_fsdp's packs have no padding
  between documents (the tail is a document of its own). ``total_tokens`` stays None: with
  it, ``PackedSeqParams.__post_init__`` runs ``repeat_interleave`` (a host sync,
  packed_seq_params.py). Zero-length slots are harmless: TE's THD kernels and the fused RoPE
  (fused_rope.cu ``fused_rope_forward_kernel``: ``if (t_id >= end) return``) skip them.
* TE's THD attention takes only padding mask types; Megatron's ``TEDotProductAttention``
  turns ``causal`` into ``padding_causal`` for THD (extensions/transformer_engine.py:
  2035-2042), so ``attention_mask`` stays None. Megatron's local ``DotProductAttention``
  asserts ``packed_seq_params is None`` (transformer/dot_product_attention.py:153): packing
  needs the TE layer spec, and a local-spec model is refused here naming it.
* RoPE: with ``packed_seq_params`` GPTModel builds one ``[T, 1, 1, dim]`` table and the
  attention applies it per document from ``cu_seqlens`` (attention.py:1483-1525). Megatron's
  unfused THD RoPE reads ``cu_seqlens`` on the host (``.tolist()``, ``.item()``:
  models/common/embeddings/rope_utils.py:222-239) - no capture; with ``apply_rope_fusion``
  it calls TE's fused THD kernel (rope_utils.py:319-327), which reads ``cu_seqlens`` on the
  device only (TE apply_rope.cpp: grid from ``cu_seqlens.size(0)`` and ``freqs.size(0)``,
  host metadata). :func:`packed_model_config` sets ``apply_rope_fusion``. The kernel's
  positions are each token's offset in its document: ``position_ids`` exactly.
  ``learned_absolute`` embeddings read ``position_ids`` (restarting per document) instead.
* Layerwise graphs receive ``packed_seq_params`` as an argument of every captured layer or
  attention module. graph_fsdp's call signatures flatten arguments with torch's pytree and
  refuse an object that holds tensors (capture/torch_backend.py ``check_constants``), so
  ``PackedSeqParams`` is registered as a pytree node (:func:`register_packed_seq_params`):
  its tensors become graph inputs, copied in at every replay like the hidden states, and its
  other fields constants of the call.
* Determinism: TE's attention is deterministic when ``NVTE_ALLOW_NONDETERMINISTIC_ALGO=0``
  or ``torch.are_deterministic_algorithms_enabled()`` when the module is built
  (dot_product_attention.py:949-952); ``LoopConfig.deterministic`` sets both before the
  model is built (training/loop.py ``use_deterministic_kernels``).

MoE layers: the pack's padding tail goes in as Megatron's ``padding_mask`` and is kept out of
expert capacity (megatron/packed_moe.py [Note: packed MoE routing]).

The loss is graph_fsdp's per-token sum (:func:`~graph_fsdp.models.packed.packed_loss_sum`)
over the logits GPTModel returns without labels - Megatron's own loss has no ignore index -
scaled by the loop's step token scale (training/loop.py ``with_token_scale``) like every
packed model's. Under tensor parallelism the logits are split over the vocabulary, so
:func:`token_loss_sum` takes each token's loss from Megatron's vocabulary-parallel cross entropy
(``GPTModel`` given labels; ignored labels set to 0, their losses zeroed) - no gather of the
logits. With sequence parallelism the flattened ``b * T`` tokens are split over the TP ranks
between the blocks (the attention's QKV projection gathers them back, so THD attention and
RoPE see the whole pack): ``b * T`` must divide by the TP size. The token scale's all-reduce
over every rank counts each pack once per TP rank, which its ``world`` numerator matches:
``world / (TP x data-parallel tokens)`` = ``data-parallel world / data-parallel tokens``.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from torch.utils import _pytree as pytree

from graph_fsdp.integrations.megatron.config import MCoreGPTConfig, require_megatron
from graph_fsdp.models.packed import (
    IGNORE_INDEX,
    at_least_fp32,
    check_packed_inputs,
    packed_loss_sum,
    padding_tail_mask,
)

TE_SPEC_FIX = (
    "use the TransformerEngine layer spec: --transformer-impl transformer_engine "
    "(MCoreGPTConfig(transformer_impl='transformer_engine'))"
)


def check_packed_config(cfg: MCoreGPTConfig) -> None:
    """What a packed Megatron-Core GPT needs of its shape (no megatron-core import)."""
    if cfg.transformer_impl != "transformer_engine":
        raise ValueError(
            f"packed sequences with MCoreGPTConfig.transformer_impl={cfg.transformer_impl!r}: "
            "Megatron-Core's packed attention is TransformerEngine's THD attention "
            "(PackedSeqParams(qkv_format='thd')), and the local spec's DotProductAttention "
            f"refuses packed sequences: {TE_SPEC_FIX}"
        )
    if cfg.is_hybrid:
        raise ValueError(
            f"packed sequences with MCoreGPTConfig.hybrid_layer_pattern="
            f"{cfg.hybrid_layer_pattern!r}: packs run through GPTModels only; drop the pattern "
            "or --packed-sequences"
        )


def packed_model_config(cfg: MCoreGPTConfig) -> MCoreGPTConfig:
    """``cfg`` checked for packing and with what packing needs: TE's fused RoPE
    (``apply_rope_fusion``; [Note: Megatron-Core packed sequences])."""
    check_packed_config(cfg)
    if cfg.position_embedding_type == "rope" and not cfg.apply_rope_fusion:
        return dataclasses.replace(cfg, apply_rope_fusion=True)
    return cfg


def _flatten(params) -> tuple[list, tuple]:
    names = [f.name for f in dataclasses.fields(params)]
    tensors = tuple(n for n in names if isinstance(getattr(params, n), torch.Tensor))
    others = tuple((n, getattr(params, n)) for n in names if n not in tensors)
    return [getattr(params, n) for n in tensors], (tensors, others)


def _unflatten(children, context):
    tensors, others = context
    from megatron.core.packed_seq_params import PackedSeqParams  # noqa: PLC0415 (optional dependency)

    return PackedSeqParams(**dict(zip(tensors, children)), **dict(others))


def _flatten_with_keys(params):
    children, context = _flatten(params)
    return [(pytree.GetAttrKey(n), c) for n, c in zip(context[0], children)], context


def register_packed_seq_params() -> None:
    """Make Megatron's ``PackedSeqParams`` a pytree node whose children are its tensor fields
    (the other fields are its context): graph_fsdp's captured calls then take its tensors as
    graph inputs ([Note: Megatron-Core packed sequences]). Idempotent."""
    require_megatron()
    from megatron.core.packed_seq_params import PackedSeqParams  # noqa: PLC0415 (optional dependency)

    if PackedSeqParams in pytree.SUPPORTED_NODES:
        return
    pytree.register_pytree_node(
        PackedSeqParams,
        _flatten,
        _unflatten,
        serialized_type_name="megatron.core.packed_seq_params.PackedSeqParams",
        flatten_with_keys_fn=_flatten_with_keys,
    )


def packed_seq_params(cu_seqlens: torch.Tensor, max_seqlen: int):
    """Megatron's THD ``PackedSeqParams`` over ``cu_seqlens`` (int32, used as it is: the same
    tensor for queries and keys) with ``max_seqlen`` (the budget, a host int) for both."""
    register_packed_seq_params()
    from megatron.core.packed_seq_params import PackedSeqParams  # noqa: PLC0415 (optional dependency)

    if cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1:
        raise ValueError(
            f"cu_seqlens must be a 1-D int32 tensor (TransformerEngine's THD attention reads "
            f"int32 offsets), got {cu_seqlens.dtype} of shape {tuple(cu_seqlens.shape)}"
        )
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu_seqlens,
        cu_seqlens_kv=cu_seqlens,
        max_seqlen_q=int(max_seqlen),
        max_seqlen_kv=int(max_seqlen),
    )


def check_packed_model(gpt: nn.Module) -> None:
    """Refuse a built GPTModel that cannot run THD packs (host metadata only)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention  # noqa: PLC0415 (optional dependency)

    local = [n for n, m in gpt.named_modules() if isinstance(m, DotProductAttention)]
    if local:
        raise ValueError(
            f"packed sequences (cu_seqlens given) with Megatron's local DotProductAttention "
            f"({local[0]}): it refuses PackedSeqParams; {TE_SPEC_FIX}"
        )
    config = gpt.config
    if getattr(gpt, "position_embedding_type", None) == "rope" and not config.apply_rope_fusion:
        raise ValueError(
            "packed sequences with RoPE and TransformerConfig.apply_rope_fusion=False: "
            "Megatron's unfused THD RoPE copies cu_seqlens to the host (no CUDA graph can hold "
            "it); build the model from gm.packed_model_config(cfg), which sets "
            "apply_rope_fusion=True (TransformerEngine's fused RoPE reads cu_seqlens on the "
            "device)"
        )


def packed_loss(
    gpt: nn.Module,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    position_ids: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
) -> torch.Tensor:
    """The loss of a pack summed over its real tokens (at least fp32): ``GPTModel`` on the
    flattened ``[1, b * T]`` pack with THD ``PackedSeqParams`` ([Note: Megatron-Core packed
    sequences]); no host synchronization, no shape that depends on the pack."""
    check_packed_inputs(input_ids, position_ids, cu_seqlens)
    check_packed_model(gpt)
    b, s = input_ids.shape
    config = gpt.config
    tp = config.tensor_model_parallel_size
    if config.sequence_parallel and (b * s) % tp:
        raise ValueError(
            f"packed sequences with sequence_parallel: the pack's {b} x {s} = {b * s} tokens "
            f"(one THD sequence) must divide by tensor_model_parallel_size={tp}, which splits "
            f"them; use a budget (seq_length) that is a multiple of {tp}"
        )
    extra = {"packed_seq_params": packed_seq_params(cu_seqlens, s)}
    if getattr(config, "num_moe_experts", None):  # [Note: packed MoE routing]
        from graph_fsdp.integrations.megatron.packed_moe import mask_tail_in_routing  # noqa: PLC0415 (imports megatron-core's MoE modules)

        mask_tail_in_routing(gpt)
        extra["padding_mask"] = padding_tail_mask(cu_seqlens, b, s).reshape(1, b * s)
    return token_loss_sum(
        gpt,
        input_ids.reshape(1, b * s),
        position_ids.reshape(1, b * s),
        None,  # THD attention masks by cu_seqlens (padding_causal)
        labels.reshape(1, b * s),
        **extra,
    )


def token_loss_sum(
    gpt: nn.Module,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    labels: torch.Tensor,
    **kwargs,
) -> torch.Tensor:
    """``GPTModel``'s cross entropy summed (at least fp32) over the tokens whose label is not
    ``IGNORE_INDEX``. At TP 1 over the whole-vocabulary logits (``packed_loss_sum``); at TP > 1
    the logits are split over the vocabulary, so Megatron's vocabulary-parallel cross entropy
    (``GPTModel`` given labels) computes each token's loss - the ignored tokens' labels set to 0,
    their losses zeroed after - without gathering the logits. ``kwargs`` go to ``GPTModel``."""
    if gpt.config.tensor_model_parallel_size == 1:
        logits = gpt(input_ids, position_ids, attention_mask, **kwargs)
        return packed_loss_sum(logits, labels)
    real = labels != IGNORE_INDEX
    losses = gpt(
        input_ids, position_ids, attention_mask, labels=torch.where(real, labels, 0), **kwargs
    )
    return at_least_fp32(losses).masked_fill(~real, 0).sum()


__all__ = [
    "TE_SPEC_FIX",
    "check_packed_config",
    "check_packed_model",
    "packed_loss",
    "packed_model_config",
    "packed_seq_params",
    "register_packed_seq_params",
    "token_loss_sum",
]
