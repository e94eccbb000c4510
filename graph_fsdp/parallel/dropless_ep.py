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
exchange's ``overflow`` flag (a device tensor) says so - a caller must not keep such a step
(:attr:`DroplessExchange.overflow`; [Note: dropless overflow reports]).

[Note: dropless overflow reports]
A layer whose exchange has a receive-buffer factor keeps an :class:`OverflowFlag` (its
factor, a device flag, and the largest factor any exchange needed) as its
``dropless_overflow`` attribute and records every exchange into it on the device, in place (a
CUDA graph replays the records). The count all-to-all's companion all-reduce carries the
largest block any rank of the EP group sends one peer, so every rank of a group agrees on the
flag. A step that overflowed is never kept; the training loop (training/loop.py with
training/overflow.py ``OverflowRepeats``) repeats it exactly:

1. eager optimizer (eager steps, layerwise graphs, ``full_iteration``): after the step's
   forward+backward and before the gradients reach the main weights,
   :func:`take_overflow_report` reads every bounded layer's flag (one all-reduce over all
   ranks - EP groups that did not overflow repeat too, so every data-parallel rank steps
   the same microbatches - and one host read; none at all when no layer has a factor). On
   overflow the step's gradients are dropped (``Trainer.drop_grads``: the sharded
   ``.grad`` views, so the next reduction overwrites the main gradients, and any pending
   ``no_sync`` accumulation), the random generators are put back to where the step began,
   and its microbatches run again eagerly with :func:`holding_every_copy` (every layer's
   buffer of every copy: the factor None path, which cannot overflow) - the runners'
   ``eagerly()`` keeps their graphs out of it (layerwise: the dispatchers call through, not
   counted as fallbacks; ``full_iteration``: the step function itself, with the weight
   refresh its graphs hold) and the graphs replay again at the next step;
2. the one-graph step (capture/whole_step.py): the step ORs :func:`overflow_in_step` (the
   flags, all-reduced over all ranks on the device) into the update's ``found_inf``, so an
   overflowed step leaves parameters and optimizer state untouched inside the graph (like an
   Inf/NaN skip, but reported apart: not a non-finite skipped step); the loop then runs the
   runner's eager step with every copy's buffer.

Either way the step the run keeps is the one a buffer of every copy computes, bit for bit
(the grouped GEMMs see the same rows per expert whatever the padding). The loop counts the
repeats (``overflow_steps`` in its result), writes them in the step log, and warns on rank 0
naming the layers and ``moe_receive_buffer_factor >= F``: the factor that would have held the
step, ``F = rows x EP / copies`` for the largest per-peer block it needed, rounded up to
hundredths. ``F`` is measured in the repeat (:func:`holding_every_copy` with ``measure``,
:func:`take_needed_factor`), not in the overflowed pass: there the layers after the first
that dropped rows saw inputs without them and routed otherwise (on 2 H200s the overflowed
pass's largest factor, 1.97, still overflowed one step of eight). Evaluation runs with every copy's buffer (nothing repeats it). Dropout stays
exact: the generators (CPU, CUDA, Megatron-Core's tracker) are restored before the repeat.
graph_fsdp's reference MoE (models/moe.py) and its Megatron-Core grouped_mm layer
(integrations/megatron/moe.py) both report this way.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
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
    needed_rows: torch.Tensor
    """Scalar int64: the largest block any rank of the EP group sends one peer (``B`` that
    would have held the exchange); with ``detect_overflow`` off, this rank's own."""
    num_copies: int
    """Copies this rank dispatches (``tokens x topk``)."""

    @property
    def needed_factor(self) -> torch.Tensor:
        """The receive-buffer factor that holds this exchange (float32 device scalar):
        :func:`receive_buffer_rows` of it is :attr:`needed_rows`."""
        return self.needed_rows.to(torch.float32) * self.ep / self.num_copies

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
    collectives (the counts; with ``detect_overflow``, the largest block any rank sends one
    peer, which decides the overflow - a buffer of every copy cannot overflow); no host
    sync."""
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
    needed = n.max()  # this rank's largest block; over the group: what every block needs
    if ep > 1 and detect_overflow:
        dist.all_reduce(needed, op=dist.ReduceOp.MAX, group=group)
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
        overflow=needed > b,
        needed_rows=needed,
        num_copies=num_copies,
    )


class OverflowFlag:
    """A layer's receive buffer: its factor (None: every copy) and the record of the exchanges
    that dropped rows since the last :meth:`take` ([Note: dropless overflow reports])."""

    def __init__(self, factor: float | None = None) -> None:
        check_receive_buffer_factor(factor, "receive_buffer_factor")
        self.factor = factor
        """Rows received from one peer as a multiple of the balanced load; None: every copy."""
        self.every_copy = False
        """While True (:func:`holding_every_copy`), exchanges hold every copy whatever the
        factor: an overflowed step's repeat and evaluation."""
        self.measuring = False
        """While True (an overflowed step's repeat: :func:`holding_every_copy` with
        ``measure``), exchanges holding every copy still record the factor they needed."""
        self.flag: torch.Tensor | None = None
        """Bool device scalar: an exchange overflowed (allocated at the first record)."""
        self.needed: torch.Tensor | None = None
        """Float32 device scalar: the largest factor an exchange needed since the last take."""

    @property
    def bounded(self) -> bool:
        """A factor is set: this layer's exchanges can overflow."""
        return self.factor is not None

    def buffer_factor(self) -> float | None:
        """The factor the next exchange sizes its buffer with (None: every copy)."""
        return None if self.every_copy else self.factor

    def record(self, exchange: DroplessExchange) -> None:
        """OR ``exchange``'s overflow into the flag and keep the largest factor needed, in
        place (allocated at the first call: an eager warmup step before any capture)."""
        if self.flag is None:
            device = exchange.overflow.device
            self.flag = torch.zeros((), dtype=torch.bool, device=device)
            self.needed = torch.zeros((), dtype=torch.float32, device=device)
        self.flag.logical_or_(exchange.overflow)
        torch.maximum(self.needed, exchange.needed_factor, out=self.needed)

    def take(self) -> bool:
        """Whether rows were dropped since the last call (one host read); clears the record."""
        if self.flag is None or not bool(self.flag.item()):
            return False
        self.clear()
        return True

    def clear(self) -> None:
        if self.flag is not None:
            self.flag.zero_()
            self.needed.zero_()


OVERFLOW_ATTR = "dropless_overflow"
"""Attribute of a module holding the :class:`OverflowFlag` of its dropless exchanges."""


def exchange_for(
    counts: torch.Tensor,
    group: dist.ProcessGroup,
    *,
    num_copies: int,
    overflow: OverflowFlag,
) -> DroplessExchange:
    """The exchange of one dispatch with the receive buffer ``overflow`` sizes
    (:meth:`OverflowFlag.buffer_factor`, :func:`receive_buffer_rows`): with a factor the
    overflow is detected and recorded into ``overflow``; without one the buffer holds every
    copy and cannot overflow."""
    ep = dist.get_world_size(group)
    factor = overflow.buffer_factor()
    exchange = plan_exchange(
        counts,
        group,
        num_copies=num_copies,
        rows_per_peer=receive_buffer_rows(num_copies, ep, factor),
        detect_overflow=factor is not None or overflow.measuring,
    )
    if factor is not None or overflow.measuring:  # measuring: the need only (cannot overflow)
        overflow.record(exchange)
    return exchange


def bounded_buffers(model: nn.Module) -> list[tuple[str, OverflowFlag]]:
    """``(name, flag)`` of the modules of ``model`` whose dropless exchange has a
    receive-buffer factor (the layers that can overflow), in module order."""
    return [
        (name, flag)
        for name, module in model.named_modules()
        if isinstance(flag := getattr(module, OVERFLOW_ATTR, None), OverflowFlag) and flag.bounded
    ]


def take_overflow(model: nn.Module) -> list[str]:
    """The modules of ``model`` whose dropless exchange dropped rows since the last call
    (clearing their flags; one host read per module that keeps a flag)."""
    dropped = []
    for name, module in model.named_modules():
        flag = getattr(module, OVERFLOW_ATTR, None)
        if isinstance(flag, OverflowFlag) and flag.take():
            dropped.append(name)
    return dropped


@dataclass(frozen=True)
class OverflowReport:
    """A step whose exchanges overflowed, over all ranks ([Note: dropless overflow reports])."""

    layers: list[str]
    """The layers whose exchange dropped rows on some rank."""
    factor: float
    """The receive-buffer factor that holds the step, rounded up to hundredths: the
    repeat's measure (:func:`take_needed_factor`); :func:`take_overflow_report` alone gives
    the overflowed pass's, which can fall short for the layers after the first that dropped
    rows (their inputs missed those rows)."""

    def describe(self) -> str:
        return (
            f"the dropless expert-parallel exchange of {', '.join(self.layers)} overflowed its "
            f"receive buffer; moe_receive_buffer_factor >= {self.factor:.2f} would have held it"
        )


def _global_max(values: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return values


def take_overflow_report(
    buffers: list[tuple[str, OverflowFlag]], device: torch.device
) -> OverflowReport | None:
    """Whether any rank's ``buffers`` (:func:`bounded_buffers`; the same layers on every rank)
    overflowed since the last call: one all-reduce over all ranks and one host read; clears
    the records. None: no overflow anywhere."""
    if not buffers:
        return None
    zero = torch.zeros((), device=device)
    flags = [zero if f.flag is None else f.flag.to(zero.dtype) for _, f in buffers]
    needed = [zero if f.needed is None else f.needed for _, f in buffers]
    values = _global_max(torch.stack([*flags, torch.stack(needed).max()]).to(device)).tolist()
    for _, f in buffers:
        f.clear()
    if not any(values[:-1]):
        return None
    layers = [name for (name, _), flag in zip(buffers, values) if flag]
    return OverflowReport(layers=layers, factor=_hundredths_up(values[-1]))


def take_needed_factor(buffers: list[tuple[str, OverflowFlag]], device: torch.device) -> float:
    """The largest factor any rank's ``buffers`` needed since their records were last cleared
    (rounded up to hundredths; one all-reduce and one host read); clears the records."""
    zero = torch.zeros((), device=device)
    needed = torch.stack([zero if f.needed is None else f.needed for _, f in buffers]).max()
    for _, f in buffers:
        f.clear()
    return _hundredths_up(_global_max(needed.reshape(1).to(device)).item())


def _hundredths_up(factor: float) -> float:
    """``factor`` rounded up to hundredths (a float32 value's last bits do not round it up)."""
    return math.ceil(round(factor * 100, 4)) / 100


def overflow_in_step(buffers: list[tuple[str, OverflowFlag]]) -> torch.Tensor | None:
    """Float32 device scalar, 1.0 when any rank's ``buffers`` overflowed since their records
    were last cleared (one all-reduce over all ranks, no host sync: a CUDA graph holds it);
    None when no buffer has recorded an exchange yet."""
    flags = [f.flag for _, f in buffers if f.flag is not None]
    if not flags:
        return None
    return _global_max(torch.stack(flags).any().to(torch.float32).reshape(1))[0]


@contextmanager
def holding_every_copy(
    buffers: list[tuple[str, OverflowFlag]], *, measure: bool = False
) -> Iterator[None]:
    """Every exchange of ``buffers`` sizes its receive buffer for every copy (cannot
    overflow) while inside: an overflowed step's repeat, evaluation. ``measure``: the
    exchanges still record the factor they needed (:func:`take_needed_factor`)."""
    saved = [(f.every_copy, f.measuring) for _, f in buffers]
    for _, f in buffers:
        f.every_copy, f.measuring = True, measure
    try:
        yield
    finally:
        for (_, f), (was, measuring) in zip(buffers, saved):
            f.every_copy, f.measuring = was, measuring


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
