"""The reference Mixture-of-Experts blocks, split so that a caller may graph some pieces
(router, preprocess, experts) and run others eagerly; fixed per-expert capacity, dispatch and
combine as einsums (no atomics, no host sync)."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from graph_fsdp.models.config import GPTConfig, moe_capacity
from graph_fsdp.models.seeded import (
    _construction,
    _copy_full_,
    _rms_norm,
    _seeded_normal,
    _SeededInit,
    _SeededLinear,
)
from graph_fsdp.parallel.dropless_ep import OverflowFlag, exchange_for
from graph_fsdp.parallel.dropless_ep import take_overflow as take_overflow  # the loop's check
from graph_fsdp.parallel.ep_dispatch import dispatch_to_experts
from graph_fsdp.parallel.grouped_moe import ExpertSort, combine, dispatch, sort_by_expert

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
    dropless_overflow: OverflowFlag | None = None
    """Dropless EP (set by :meth:`partition`): the receive buffer of the exchanges, with
    ``GPTConfig.moe_receive_buffer_factor``, and the record of those that dropped rows, which
    the training loop reads (dropless_ep.py [Note: dropless overflow reports])."""

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

    def grouped(self, rows: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """Dropless: ``rows`` in (local) expert order with int32 ``offsets`` of the experts'
        ends -> the experts' outputs, rows past ``offsets[-1]`` zero. bf16/fp16/fp32 run
        ``torch._grouped_mm``; other dtypes (fp64 tests) a masked matmul per expert."""
        w1, w2 = self.w1.to(rows.dtype), self.w2.to(rows.dtype)
        h = F.gelu(_grouped_matmul(rows, w1, offsets), approximate="tanh")
        return _grouped_matmul(h, w2, offsets)

    def dropless(self, rows: torch.Tensor, sort: ExpertSort) -> torch.Tensor:
        """Dropless: every routed copy (``[tokens * topk, h]`` in global expert order) through
        its expert, also under expert parallelism; returns the outputs in the same order."""
        if self.ep_group is None:
            return self.grouped(rows, sort.offsets)
        exchange = exchange_for(
            sort.counts, self.ep_group, num_copies=rows.shape[0], overflow=self.dropless_overflow
        )
        out = self.grouped(exchange.dispatch(rows), exchange.local_offsets)
        return exchange.combine(out)

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
        self.dropless_overflow = OverflowFlag(self._init_config.moe_receive_buffer_factor)


def _grouped_matmul(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``out[rows of e] = x[rows of e] @ w[e]`` (``w`` ``[E, in, out]``), rows past the last
    offset zero. ``torch._grouped_mm`` where it runs (bf16, fp16, fp32); else one masked
    matmul per expert, the same math at E x the FLOPs (fp64 reference tests)."""
    expert = torch.searchsorted(
        offsets.long(), torch.arange(x.shape[0], device=x.device), right=True
    )
    if x.dtype in (torch.bfloat16, torch.float16, torch.float32):
        out = torch._grouped_mm(x, w, offs=offsets)
        return out.masked_fill((expert >= w.shape[0])[:, None], 0)
    out = x.new_zeros(x.shape[0], w.shape[2])
    for e in range(w.shape[0]):
        out = torch.where((expert == e)[:, None], x @ w[e], out)
    return out


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
            self.dropless = config.moe_dropless

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        x_flat = self.norm(x).reshape(b * s, h)
        probs, indices = self.router(x_flat)
        if self.dropless:
            sort = sort_by_expert(indices, self.preprocess.num_experts)
            rows = self.experts.dropless(dispatch(x_flat, sort), sort)
            weights = probs.reshape(-1).index_select(0, sort.order).to(rows.dtype)
            return combine(rows * weights[:, None], sort).view(b, s, h)
        dispatch_mask, combine_mask = self.preprocess(probs, indices, x_flat.dtype)
        expert_in = torch.einsum("tec,th->ech", dispatch_mask, x_flat)
        expert_out = self.experts(expert_in)
        y = torch.einsum("tec,ech->th", combine_mask, expert_out)
        return y.view(b, s, h)
