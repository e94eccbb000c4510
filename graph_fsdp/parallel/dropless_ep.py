"""Dropless expert parallelism a CUDA graph can hold: device-side split sizes, fixed-size
per-peer blocks and a bounded receive buffer (grouped_moe.py's dropless layer over EP ranks).

[Note: dropless all-to-all with static shapes]
A dropless dispatch sends each EP rank the token copies routed to its experts; how many go
to each peer is data, and NCCL's all-to-all with host split sizes cannot be captured. Here
every exchange has a fixed size and all offsets stay on the device:

1. the copies, in global expert order (``sort_by_expert``), are gathered into ``[EP, B, h]``:
   block ``p`` holds the first ``min(n_p, B)`` copies for peer ``p``'s experts (``n_p`` their
   number), the rest of the block zeros;
2. the per-expert counts ``[EP, L]`` go through a fixed-size all-to-all, then the blocks
   (``B`` rows per peer) through another;
3. the received rows are permuted into local-expert order (expert, then source rank, then
   the source's order) - the layout ``torch._grouped_mm`` reads, with the offsets computed
   from the received counts on the device; rows past the last offset are the blocks' padding;
4. the experts' outputs take the same way back (inverse permutation, all-to-all) and are
   gathered into the source's expert order; every gather's backward is the opposite gather,
   so no atomics run and eager and graphed steps are bit-identical.

``B`` is the receive buffer per peer. The default holds every copy a rank has (``tokens x
topk``: one peer can be sent all of them), so no token is ever dropped, whatever the routing,
at ``EP x`` the rows of a balanced exchange. A smaller buffer (``buffer_factor`` times the
balanced load) saves memory and bandwidth; copies past it are not exchanged and the
exchange's ``overflow`` flag (a device tensor) says so - a caller must treat an overflowed
step as not exact (:attr:`DroplessExchange.overflow`).

[Note: dropless overflow reports]
A layer whose exchange can overflow (a receive-buffer factor is set) keeps an
:class:`OverflowFlag` as its ``dropless_overflow`` attribute and ORs every exchange's flag
into it on the device (in place: a CUDA graph replays the OR). After a step the training loop
calls :func:`take_overflow` on the model: one host read per such layer, which names the
layers that dropped rows and clears their flags; the loop then stops
(training/loop.py ``check_dropless_exchanges``). graph_fsdp's reference MoE
(models/moe.py) and its Megatron-Core grouped_mm layer (integrations/megatron/moe.py) both
report this way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from graph_fsdp.parallel.ep_dispatch import _AllToAll


class _Gather(torch.autograd.Function):
    """``out[i] = x[index[i]]`` with ``index == len(x)`` meaning a zero row; backward:
    ``grad_x[j] = grad[back[j]]`` (``back[j] == len(out)``: zero) - a gather both ways for a
    one-to-one mapping (no scatter, no atomics)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, index: torch.Tensor, back: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(back)
        return torch.cat([x, x.new_zeros(1, *x.shape[1:])]).index_select(0, index)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (back,) = ctx.saved_tensors
        padded = torch.cat([grad, grad.new_zeros(1, *grad.shape[1:])])
        return padded.index_select(0, back), None, None


def check_receive_buffer_factor(value, name: str) -> None:
    """A receive-buffer factor setting (``name`` spells it for the message): a float > 0, or
    None (room for every copy)."""
    if value is not None and (
        not isinstance(value, int | float) or isinstance(value, bool) or not value > 0
    ):
        raise ValueError(
            f"{name}={value!r} is invalid: expected a float > 0 or None (room for every copy: "
            "nothing is ever dropped)"
        )


def receive_buffer_rows(copies: int, ep: int, buffer_factor: float | None) -> int:
    """``B``: rows per peer block. None: every copy (never drops); else ``ceil(factor x
    copies / ep)`` (the balanced load times the factor), at most ``copies``."""
    if buffer_factor is None:
        return copies
    if not buffer_factor > 0:
        raise ValueError(f"buffer_factor={buffer_factor!r} must be > 0 (or None: never drop)")
    return max(1, min(copies, math.ceil(buffer_factor * copies / ep)))


@dataclass(frozen=True)
class DroplessExchange:
    """One dispatch's plan: where every copy goes and comes back (all device tensors)."""

    group: dist.ProcessGroup
    ep: int
    rows_per_peer: int
    send_index: torch.Tensor
    """[ep * B]: the source copy of each send slot (``copies``: a zero row)."""
    send_back: torch.Tensor
    """[copies]: the send slot of each copy (``ep * B``: not sent, overflow)."""
    to_expert: torch.Tensor
    """[ep * B]: the received row at each local-expert-ordered position."""
    from_expert: torch.Tensor
    """[ep * B]: the local-expert-ordered position of each received row."""
    local_counts: torch.Tensor
    """[L] int64: rows received for each local expert (every source rank's)."""
    local_offsets: torch.Tensor
    """[L] int32: cumulative ends of the local experts' rows (``torch._grouped_mm`` offs);
    rows past the last are the blocks' padding."""
    overflow: torch.Tensor
    """Scalar bool: some copy of this rank's did not fit a peer's block, or some peer's did not
    fit this rank's (the exchange dropped rows)."""

    def dispatch(self, rows: torch.Tensor) -> torch.Tensor:
        """``[copies, ...]`` in global expert order -> ``[ep * B, ...]`` in local expert order
        (hidden rows, or a ``[copies]`` vector such as the routing weights)."""
        send = _Gather.apply(rows, self.send_index, self.send_back)
        recv = _AllToAll.apply(send, self.group)
        return _Gather.apply(recv, self.to_expert, self.from_expert)

    def combine(self, expert_rows: torch.Tensor) -> torch.Tensor:
        """The experts' ``[ep * B, h]`` outputs -> ``[copies, h]`` back in the source's global
        expert order (copies that were not sent: zeros)."""
        back = _Gather.apply(expert_rows, self.from_expert, self.to_expert)
        recv = _AllToAll.apply(back, self.group)
        return _Gather.apply(recv, self.send_back, self.send_index)


def plan_exchange(
    counts: torch.Tensor,
    group: dist.ProcessGroup,
    *,
    num_copies: int,
    rows_per_peer: int,
    detect_overflow: bool = True,
) -> DroplessExchange:
    """The exchange of a dispatch whose ``num_copies`` copies (``tokens x topk``, static) are
    in global expert order with ``counts`` ``[E]`` per expert (``ExpertSort.counts``) over the
    EP ``group`` (rank ``p`` holds experts ``[p * L, (p + 1) * L)``). Two small fixed-size
    collectives (the counts; with ``detect_overflow``, the overflow flag - a buffer of every
    copy cannot overflow); no host sync."""
    ep = dist.get_world_size(group)
    num_experts = counts.numel()
    if num_experts % ep:
        raise ValueError(f"{num_experts} experts cannot be split over {ep} EP ranks")
    local, b = num_experts // ep, rows_per_peer
    device = counts.device
    per_peer = counts.view(ep, local)
    # 1. Send slots: block p takes copies [start_p, start_p + min(n_p, B)).
    n = per_peer.sum(1)
    start = torch.cumsum(n, 0) - n
    j = torch.arange(b, device=device)
    valid = j[None, :] < n[:, None]
    send_index = torch.where(valid, start[:, None] + j[None, :], num_copies).reshape(-1)
    copy_ids = torch.arange(num_copies, device=device)
    peer_of_copy = torch.searchsorted(torch.cumsum(n, 0), copy_ids, right=True)
    slot = copy_ids - start.index_select(0, peer_of_copy)
    send_back = torch.where(slot < b, peer_of_copy * b + slot, ep * b)
    # 2. recv_counts[s, l]: the copies rank s sends for this rank's expert l, as many as fit
    # rank s's block for this rank (its experts fill it in order).
    recv_counts = _AllToAllCounts.apply(_fit(per_peer, b), group)
    # 3. Local expert order: expert l, then source s, then the source's order; the blocks'
    # padding rows after all of them, in order.
    total = recv_counts.sum(0)  # [L]
    expert_start = torch.cumsum(total, 0) - total
    before = torch.cumsum(recv_counts, 0) - recv_counts  # [ep, L]: earlier sources' rows of l
    ends = torch.cumsum(recv_counts, 1)  # [ep, L]
    rows = j[None, :].expand(ep, b).contiguous()
    ell = torch.searchsorted(ends, rows, right=True).clamp(max=local - 1)
    within = rows - (ends.gather(1, ell) - recv_counts.gather(1, ell))
    position = expert_start.index_select(0, ell.reshape(-1)).view(ep, b)
    position = position + before.gather(1, ell) + within
    real = (rows < recv_counts.sum(1)[:, None]).reshape(-1)
    padding_rank = torch.cumsum((~real).long(), 0) - 1
    from_expert = torch.where(real, position.reshape(-1), total.sum() + padding_rank)
    flag = (n > b).any().to(torch.int32)  # this rank's copies that did not fit a block
    if ep > 1 and detect_overflow:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return DroplessExchange(
        group=group,
        ep=ep,
        rows_per_peer=b,
        send_index=send_index,
        send_back=send_back,
        to_expert=torch.argsort(from_expert),
        from_expert=from_expert,
        local_counts=total,
        local_offsets=torch.cumsum(total, 0).to(torch.int32),
        overflow=flag.bool(),
    )


class OverflowFlag:
    """A layer's record of dropped rows: a device flag, set by any exchange since the last
    :meth:`take` ([Note: dropless overflow reports])."""

    def __init__(self) -> None:
        self.flag: torch.Tensor | None = None

    def record(self, exchange: DroplessExchange) -> None:
        """OR ``exchange``'s overflow into the flag, in place (allocated at the first call: an
        eager warmup step before any capture)."""
        if self.flag is None:
            self.flag = torch.zeros((), dtype=torch.bool, device=exchange.overflow.device)
        self.flag.logical_or_(exchange.overflow)

    def take(self) -> bool:
        """Whether rows were dropped since the last call (one host read); clears the flag."""
        if self.flag is None or not bool(self.flag.item()):
            return False
        self.flag.zero_()
        return True


OVERFLOW_ATTR = "dropless_overflow"
"""Attribute of a module holding the :class:`OverflowFlag` of its dropless exchanges."""


def exchange_for(
    counts: torch.Tensor,
    group: dist.ProcessGroup,
    *,
    num_copies: int,
    buffer_factor: float | None,
    overflow: OverflowFlag,
) -> DroplessExchange:
    """The exchange of one dispatch with the receive buffer ``buffer_factor`` sizes
    (:func:`receive_buffer_rows`): with a factor the overflow is detected and recorded into
    ``overflow``; without one the buffer holds every copy and cannot overflow."""
    ep = dist.get_world_size(group)
    exchange = plan_exchange(
        counts,
        group,
        num_copies=num_copies,
        rows_per_peer=receive_buffer_rows(num_copies, ep, buffer_factor),
        detect_overflow=buffer_factor is not None,
    )
    if buffer_factor is not None:
        overflow.record(exchange)
    return exchange


def take_overflow(model: nn.Module) -> list[str]:
    """The modules of ``model`` whose dropless exchange dropped rows since the last call
    (clearing their flags; one host read per module that keeps a flag)."""
    dropped = []
    for name, module in model.named_modules():
        flag = getattr(module, OVERFLOW_ATTR, None)
        if isinstance(flag, OverflowFlag) and flag.take():
            dropped.append(name)
    return dropped


def _fit(per_peer: torch.Tensor, b: int) -> torch.Tensor:
    """Per-expert counts cut to a block of ``b`` rows (the experts in order fill it)."""
    ends = torch.cumsum(per_peer, 1).clamp(max=b)
    return torch.diff(ends, dim=1, prepend=ends.new_zeros(ends.shape[0], 1))


class _AllToAllCounts(torch.autograd.Function):
    """The counts' all-to-all (integers: no gradient)."""

    @staticmethod
    def forward(ctx, counts: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        out = torch.empty_like(counts)
        if dist.get_world_size(group) == 1:
            out.copy_(counts)
        else:
            dist.all_to_all_single(out, counts.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):  # pragma: no cover - integer input
        return None, None
