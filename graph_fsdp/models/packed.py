"""Packed variable-length sequences: several documents in one fixed token budget, attending
only within their own document - the device side (attention, the per-token loss).

[Note: packed sequences under CUDA graphs]
A pack is a static ``[b, T]`` step whatever its documents: ``T`` tokens per row (the budget)
and at most ``D`` documents per row. Its boundaries are device tensors of fixed shape, which a
graph copies into its static inputs like the token ids, so every later pack replays the graph
captured for the first one:

* ``cu_seqlens`` - int32 ``[b * (D + 1) + 1]``: the start offsets of the documents over the
  flattened ``b * T`` tokens, then ``b * T``. Each row holds ``D`` document slots and, last, its
  *tail* - the tokens after its last document, a padding document of its own, so that every
  token belongs to exactly one document (a varlen kernel leaves tokens past ``cu_seqlens[-1]``
  uninitialised). Unused slots are zero-length (their offset repeats the next one).
* ``position_ids`` - int64 ``[b, T]``: positions restarting at 0 in every document.
* ``labels`` - ``-100`` (:data:`IGNORE_INDEX`) on the padding tail and on the last token of
  every document (its next token belongs to another document): those carry no loss.

Attention is causal within a document and never crosses one: on CUDA through
``torch.nn.attention.varlen.varlen_attn`` (its kernel reads ``cu_seqlens`` from device memory;
the maximum length it takes from the host is the budget ``T``, fixed at capture), on other
devices through scaled-dot-product attention with the block-diagonal causal mask built on the
device from ``cu_seqlens``. The varlen backward is deterministic only under
``torch.use_deterministic_algorithms(True)`` with ``warn_only=False`` (measured on an H200 with
torch 2.11: two eager backwards of one pack differ otherwise, and are bit-identical with it,
as is a graph replay after new ``cu_seqlens`` were copied in).

The loss of a packed step is Megatron's per-token loss: the *sum* over a microbatch's real
tokens (:func:`packed_loss_sum`), scaled by ``world / (real tokens of the step over all
microbatches and data-parallel ranks)`` - a device tensor the step passes in - so a microbatch
of 3 real tokens and one of 4000 weigh what their tokens weigh.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100
"""The label of a token that carries no loss (``F.cross_entropy``'s default ignore index)."""

try:  # torch >= 2.10
    from torch.nn.attention.varlen import varlen_attn as _varlen_attn
except ImportError:  # older torch: the masked path everywhere (slower on CUDA)
    _varlen_attn = None


class PackedBatch(NamedTuple):
    """One packed microbatch: ``[b, T]`` token ids, labels (-100: no loss) and positions, and
    ``cu_seqlens`` (int32 ``[b * (D + 1) + 1]``). A tuple, so a runner passes its tensors as
    the step function's arguments like an ``(input_ids, labels)`` batch's."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor

    def real_tokens(self) -> torch.Tensor:
        """The number of tokens that carry a loss (a device scalar)."""
        return (self.labels != IGNORE_INDEX).sum()


def document_ids(cu_seqlens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """int64 ``[num_tokens]``: the index of the document slot each flattened token is in
    (a token belongs to the last slot that starts at or before it; zero-length slots own no
    token). Device ops only - no host synchronization, so it captures."""
    positions = torch.arange(num_tokens, device=cu_seqlens.device)
    return torch.searchsorted(cu_seqlens[1:].long(), positions, right=True)


def padding_tail_mask(cu_seqlens: torch.Tensor, b: int, s: int) -> torch.Tensor:
    """Bool ``[b, s]``: True on each row's padding tail (the last of its ``D + 1`` slots in
    ``cu_seqlens``). Device ops only - no host synchronization, so it captures."""
    slots = (cu_seqlens.numel() - 1) // b
    return (document_ids(cu_seqlens, b * s) % slots == slots - 1).view(b, s)


def _within_documents(cu_seqlens: torch.Tensor, b: int, s: int) -> torch.Tensor:
    """Bool ``[b, 1, s, s]``: query ``i`` may attend key ``j`` (same document, ``j <= i``)."""
    docs = document_ids(cu_seqlens, b * s).view(b, s)
    causal = torch.ones(s, s, dtype=torch.bool, device=cu_seqlens.device).tril()
    return ((docs[:, :, None] == docs[:, None, :]) & causal)[:, None]


def document_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_len: int
) -> torch.Tensor:
    """Causal attention within documents. ``q``, ``k``, ``v``: ``[b, heads, s, head_dim]``;
    ``cu_seqlens`` over the flattened ``b * s`` tokens; returns ``[b, heads, s, head_dim]``."""
    b, heads, s, head_dim = q.shape
    if q.is_cuda and _varlen_attn is not None:
        # varlen takes [tokens, heads, head_dim]; window (-1, 0) is causal ((-1, -1) is not).
        flat = [t.transpose(1, 2).reshape(b * s, heads, head_dim) for t in (q, k, v)]
        out = _varlen_attn(*flat, cu_seqlens, cu_seqlens, max_len, max_len, window_size=(-1, 0))
        return out.view(b, s, heads, head_dim).transpose(1, 2)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=_within_documents(cu_seqlens, b, s))


def at_least_fp32(logits: torch.Tensor) -> torch.Tensor:
    """Logits for the loss: bf16/fp16 promoted to float32, float32 and float64 kept."""
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


def document_mask(cu_seqlens: torch.Tensor, b: int, s: int, dtype: torch.dtype) -> torch.Tensor:
    """The additive ``[b, 1, s, s]`` mask of causal attention within documents: 0 where a
    token may attend, the dtype's lowest value elsewhere - the 4-D ``attention_mask`` a
    HuggingFace decoder uses as it is (no data-dependent mask decisions, so eager and captured
    steps run the same kernels)."""
    mask = torch.zeros(b, 1, s, s, dtype=dtype, device=cu_seqlens.device)
    return mask.masked_fill(~_within_documents(cu_seqlens, b, s), torch.finfo(dtype).min)


def packed_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The sum (at least float32) of the cross entropy over tokens whose label is not
    :data:`IGNORE_INDEX` (0 when there is none)."""
    return F.cross_entropy(
        at_least_fp32(logits).flatten(0, 1),
        labels.flatten(),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )


def check_packed_inputs(
    input_ids: torch.Tensor,
    position_ids: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
) -> None:
    """Shapes and dtypes of a packed call (host metadata only, nothing read from the device)."""
    if position_ids is None:
        raise ValueError(
            "a packed call (cu_seqlens given) needs position_ids restarting at 0 in every "
            "document: build both with graph_fsdp.training.packing.pack_tensors"
        )
    if position_ids.shape != input_ids.shape:
        raise ValueError(
            f"position_ids shape {tuple(position_ids.shape)} != input_ids shape "
            f"{tuple(input_ids.shape)}: one position per token"
        )
    if cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1:
        raise ValueError(
            f"cu_seqlens must be a 1-D int32 tensor of document offsets, got "
            f"{cu_seqlens.dtype} of shape {tuple(cu_seqlens.shape)}"
        )
    if cu_seqlens.numel() < input_ids.shape[0] + 1:
        raise ValueError(
            f"cu_seqlens has {cu_seqlens.numel()} offsets for {input_ids.shape[0]} rows: every "
            "row needs at least its tail document (b * (max_documents + 1) + 1 offsets)"
        )
