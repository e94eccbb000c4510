"""Expert-parallel token dispatch for the reference MoE: an all-to-all with static splits.

Every EP rank computes, for its own tokens, the dense ``[E, C, h]`` expert inputs of all E
global experts (MoEPreprocess's fixed capacity C); the all-to-all sends rows
``[r * L, (r + 1) * L)`` (EP rank r's L = E / EP experts) to rank r, which runs its experts on
every rank's tokens at once, and a second all-to-all brings the outputs back. The splits are
equal and depend on the config only, so nothing syncs with the host and a CUDA graph can
hold both collectives (drop-padding EP, as Megatron's capacity-padded dispatch).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist


class _AllToAll(torch.autograd.Function):
    """Equal-split ``all_to_all_single`` over ``group`` along dimension 0; its backward is the
    same all-to-all of the gradients (the exchange is its own transpose)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        x = x.contiguous()
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


def dispatch_to_experts(
    expert_in: torch.Tensor,
    local_experts: Callable[[torch.Tensor], torch.Tensor],
    group: dist.ProcessGroup,
) -> torch.Tensor:
    """``expert_in`` [E, C, h] (this rank's tokens for every global expert) -> [E, C, h], the
    experts' outputs, where ``local_experts`` maps [L, EP * C, h] -> [L, EP * C, h] for this
    EP rank's L = E / EP experts."""
    ep = dist.get_world_size(group)
    num_experts, capacity, hidden = expert_in.shape
    local = num_experts // ep
    # Row block s of the received tensor: EP rank s's tokens for this rank's experts.
    recv = _AllToAll.apply(expert_in, group).view(ep, local, capacity, hidden)
    out = local_experts(recv.transpose(0, 1).reshape(local, ep * capacity, hidden))
    back = out.view(local, ep, capacity, hidden).transpose(0, 1).reshape(expert_in.shape)
    return _AllToAll.apply(back, group)
