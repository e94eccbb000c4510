"""Packed documents through Megatron-Core MoE layers: the pack's padding tail kept out of
expert capacity, so that drop-padding results of real tokens do not depend on the tail.

[Note: packed MoE routing]
A pack's rows end in a padding tail (models/packed.py [Note: packed sequences under CUDA
graphs]) whose tokens run through every layer like real ones. Dropless routing treats every
token on its own, so the tail changes no real token's result. Capacity routing
(``moe_expert_capacity_factor``, with or without ``moe_pad_expert_input_to_capacity``) does not:
Megatron's ``apply_router_token_dropping`` keeps, per expert, the ``capacity`` tokens of highest
probability (``drop_policy="probs"``) or the first routed ones (``"position"``) among all tokens,
the tail's included - a tail token can take an expert slot a real token needed.

Megatron-Core's own ``padding_mask`` (``GPTModel.forward(padding_mask=...)``, True on padding,
the shape of ``input_ids``) reaches every ``MoELayer`` and its router, but the router uses it
only for the auxiliary losses, the z-loss and the expert-bias counts (``TopKRouter.routing``
as read in megatron-core 0.16.1 and in a later main branch, whose ``GPTModel.forward`` takes the
same keyword: token dropping runs on the unmasked ``probs`` and ``routing_map``). So:

* :func:`~graph_fsdp.integrations.megatron.packed.packed_loss` passes the pack's tail as
  ``padding_mask`` to MoE models (:func:`~graph_fsdp.models.packed.padding_tail_mask`, device
  ops only): the aux losses and the z-loss then count real tokens only, as Megatron intends.
* :func:`mask_tail_in_routing` makes each capacity router a :class:`TailMaskedRouter`: Megatron's
  routing runs without capacity (the router alone sees a config copy without it), the tail's
  probabilities and routing-map rows are zeroed, and then Megatron's own
  ``apply_router_token_dropping`` applies the model's capacity, drop policy and padding. A
  zeroed row is never among an expert's routed tokens, so real tokens compete only with real
  tokens: per expert, the column the drop reads is the same whatever the tail holds. The
  capacity itself stays ``ceil(b * T * topk / experts * factor)`` - the budget's, a static
  count (it sets the padded expert shapes a graph holds). Differences from Megatron's
  order: the expert-bias token counts (``moe_router_enable_expert_bias``, which graph_fsdp's
  config does not set) count the routing before the drop instead of after it.

Dropless routers are left as they are (a tail token without experts would change the static
number of routed copies, tokens x top-k, that graph_fsdp's dropless layers rely on).
"""

from __future__ import annotations

import copy

import torch
from megatron.core.transformer.moe.moe_utils import apply_router_token_dropping
from megatron.core.transformer.moe.router import TopKRouter
from torch import nn


class TailMaskedRouter(TopKRouter):
    """Megatron's ``TopKRouter`` whose token dropping ignores padding tokens ([Note: packed MoE
    routing]). Made from a built router by :func:`mask_tail_in_routing` (its weights kept);
    ``capacity`` holds ``(factor, drop_policy, pad_to_capacity)`` of the model's config, which
    the router's own config copy has without."""

    capacity: tuple[float, str, bool]

    def routing(self, logits: torch.Tensor, *args, **kwargs):
        padding_mask = kwargs.get("padding_mask", args[0] if args else None)
        probs, routing_map = super().routing(logits, *args, **kwargs)  # no capacity here
        if padding_mask is not None:
            real = ~padding_mask.reshape(-1, 1).bool()
            probs = probs * real
            routing_map = routing_map & real
        factor, policy, pad = self.capacity
        return apply_router_token_dropping(
            probs,
            routing_map,
            router_topk=self.topk,
            capacity_factor=factor,
            drop_policy=policy,
            pad_to_capacity=pad,
        )


def mask_tail_in_routing(model: nn.Module) -> list[str]:
    """Make every capacity ``TopKRouter`` in ``model`` a :class:`TailMaskedRouter` (in place,
    idempotent; dropless routers stay); returns the names of the routers it changed."""
    changed = []
    for name, module in model.named_modules():
        if type(module) is not TopKRouter:
            continue
        config = module.config
        if config.moe_expert_capacity_factor is None:
            continue
        module.capacity = (
            config.moe_expert_capacity_factor,
            config.moe_token_drop_policy,
            config.moe_pad_expert_input_to_capacity,
        )
        own = copy.copy(config)  # the layer, dispatcher and experts keep the model's config
        own.moe_expert_capacity_factor = None
        own.moe_pad_expert_input_to_capacity = False
        module.config = own
        module.__class__ = TailMaskedRouter
        changed.append(name)
    return changed


__all__ = ["TailMaskedRouter", "mask_tail_in_routing"]
