"""Dropless mixture-of-experts pieces that never synchronise with the host (pure PyTorch).

    top = top_experts_from_routing_map(routing_map, topk)       # [tokens, topk] expert ids
    sort = sort_by_expert(top, num_experts)                       # static size: tokens x topk
    rows = dispatch(x, sort)                                      # copies in expert order
    probs = expert_probs(routing_probs, sort)                     # their routing weights
    out = grouped_mlp(rows, probs, fc1_weight, fc2_weight, sort.offsets, activation=F.gelu)
    y = combine(out, sort)                                        # [tokens, hidden]

The Megatron-Core layer built on these is graph_fsdp.integrations.megatron.moe; these functions
need no megatron-core and run on CPU (``torch._grouped_mm``'s fallback) as on CUDA.

[Note: static-size dropless routing]
A dropless MoE layer sends every token to exactly ``topk`` experts, so the number of routed
token copies, ``tokens x topk``, is known from shapes alone; only how the copies split across
experts is data. Everything here keeps that split on the device: the copies are put in expert
order by a stable sort of fixed size, the per-expert counts and the int32 cumulative offsets
come from a ``searchsorted`` over the sorted ids, and ``torch._grouped_mm`` reads the offsets
from device memory. No ``.item()``, ``.tolist()``, ``nonzero`` or boolean-mask indexing, so a
CUDA graph can hold the whole layer and a replay follows new routing exactly. The one
precondition: each token names ``topk`` experts (a routing map with exactly ``topk`` True
entries per row) - true for top-k routing without capacity dropping, which is why capacity
factors (drop-padding) take Megatron's own experts instead.

Numerics: the copies of one token are summed in the output dtype's accumulator (fp32 for bf16)
and rounded once; dispatch and combine are gathers whose backward is the opposite gather, so
no atomics run and eager and graphed steps are bit-identical.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

GROUPED_MM_ALIGN_BYTES = 16
"""torch._grouped_mm reads rows with 16-byte aligned strides (TMA on sm90): the inner sizes
(hidden size, expert FFN size) must be multiples of 16 bytes / element size."""
MAX_GROUPS = 1024
"""torch._grouped_mm's CUTLASS kernel handles fewer than 1024 groups (experts)."""


@dataclass(frozen=True)
class ExpertSort:
    """The routed token copies of one call, in expert order (see the module's Note).

    A copy is named in token-major order as ``t * topk + s`` (token ``t``, its ``s``-th expert,
    experts ascending). Row ``j`` of the expert-ordered layout holds copy ``order[j]``.
    """

    order: torch.Tensor
    """[tokens * topk] int64: the token-major copy at each expert-ordered row."""
    inverse: torch.Tensor
    """[tokens * topk] int64: the expert-ordered row of each token-major copy."""
    token: torch.Tensor
    """[tokens * topk] int64: the token of each expert-ordered row (``order // topk``)."""
    expert: torch.Tensor
    """[tokens * topk] int64: the expert of each expert-ordered row (ascending)."""
    counts: torch.Tensor
    """[num_experts] int64: copies per expert, on the device."""
    offsets: torch.Tensor
    """[num_experts] int32: cumulative ends of the experts' rows (``torch._grouped_mm`` offs)."""
    num_tokens: int
    topk: int


def top_experts_from_routing_map(routing_map: torch.Tensor, topk: int) -> torch.Tensor:
    """``[tokens, experts]`` bool map with ``topk`` True entries per row -> ``[tokens, topk]``
    expert ids, ascending per token (a stable row sort: static shape, no host sync)."""
    if routing_map.dim() != 2 or routing_map.dtype != torch.bool:
        raise ValueError(
            f"routing_map must be a 2-D bool [tokens, experts] map, got {routing_map.dim()}-D "
            f"{routing_map.dtype}"
        )
    if not 1 <= topk <= routing_map.shape[1]:
        raise ValueError(f"topk={topk} must be between 1 and experts={routing_map.shape[1]}")
    order = routing_map.to(torch.int8).argsort(dim=1, descending=True, stable=True)
    return order[:, :topk]


def sort_by_expert(top_experts: torch.Tensor, num_experts: int) -> ExpertSort:
    """Put the ``tokens x topk`` copies in expert order (stable: tokens ascending per expert,
    the order Megatron-Core's permutation uses) with device-side counts and offsets."""
    if top_experts.dim() != 2:
        raise ValueError(
            f"top_experts must be [tokens, topk], got shape {tuple(top_experts.shape)}"
        )
    if not 1 <= num_experts < MAX_GROUPS:
        raise ValueError(
            f"num_experts={num_experts}: torch._grouped_mm takes 1 to {MAX_GROUPS - 1} experts"
        )
    num_tokens, topk = top_experts.shape
    ids = top_experts.reshape(-1).long()
    order = torch.argsort(ids, stable=True)
    expert = ids.index_select(0, order)
    bounds = torch.arange(num_experts, device=ids.device, dtype=ids.dtype)
    ends = torch.searchsorted(expert, bounds, right=True)
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    return ExpertSort(
        order=order,
        inverse=torch.argsort(order),
        token=torch.div(order, topk, rounding_mode="floor"),
        expert=expert,
        counts=counts,
        offsets=ends.to(torch.int32),
        num_tokens=num_tokens,
        topk=topk,
    )


class _Dispatch(torch.autograd.Function):
    """Rows of the token copies in expert order; backward: gather back, sum a token's copies."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, token: torch.Tensor, inverse: torch.Tensor, topk: int):
        ctx.save_for_backward(inverse)
        ctx.topk = topk
        return x.index_select(0, token)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (inverse,) = ctx.saved_tensors
        per_copy = grad.index_select(0, inverse)
        return per_copy.view(-1, ctx.topk, grad.shape[-1]).sum(1), None, None, None


class _Combine(torch.autograd.Function):
    """A token's copies summed back in token order; backward: each copy gets its token's grad."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, token: torch.Tensor, inverse: torch.Tensor, topk: int):
        ctx.save_for_backward(token)
        per_copy = rows.index_select(0, inverse)
        return per_copy.view(-1, topk, rows.shape[-1]).sum(1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (token,) = ctx.saved_tensors
        return grad.index_select(0, token), None, None, None


def dispatch(x: torch.Tensor, sort: ExpertSort) -> torch.Tensor:
    """``[tokens, hidden]`` -> ``[tokens * topk, hidden]``: every token's copies, expert order."""
    _check_rows(x, sort.num_tokens, "x")
    return _Dispatch.apply(x, sort.token, sort.inverse, sort.topk)


def combine(rows: torch.Tensor, sort: ExpertSort) -> torch.Tensor:
    """``[tokens * topk, hidden]`` (expert order) -> ``[tokens, hidden]``: the sum of each
    token's copies (in the accumulator of its dtype, rounded once)."""
    _check_rows(rows, sort.num_tokens * sort.topk, "rows")
    return _Combine.apply(rows, sort.token, sort.inverse, sort.topk)


def expert_probs(routing_probs: torch.Tensor, sort: ExpertSort) -> torch.Tensor:
    """Routing weight of each expert-ordered copy: ``routing_probs[token, expert]`` from the
    router's ``[tokens, experts]`` probabilities (one flat gather; its gradient lands on the
    routed entries only)."""
    if routing_probs.dim() != 2 or routing_probs.shape[0] != sort.num_tokens:
        raise ValueError(
            f"routing_probs must be [tokens={sort.num_tokens}, experts], got "
            f"{tuple(routing_probs.shape)}"
        )
    flat = sort.token * routing_probs.shape[1] + sort.expert
    return routing_probs.reshape(-1)[flat]


def _check_rows(t: torch.Tensor, rows: int, name: str) -> None:
    if t.dim() != 2 or t.shape[0] != rows:
        raise ValueError(f"{name} must be [{rows}, hidden], got shape {tuple(t.shape)}")


# --------------------------------------------------------------------------------------------
# Grouped GEMM with device offsets
# --------------------------------------------------------------------------------------------


def _fast_path_device(t: torch.Tensor) -> bool:
    """CUDA devices where ``torch._grouped_mm`` runs its CUTLASS kernel (bf16, sm90 / sm100)
    instead of the fallback that copies the offsets to the host."""
    return t.is_cuda and torch.cuda.get_device_capability(t.device)[0] in (9, 10)


def _check_capturable(x: torch.Tensor) -> None:
    if not (x.is_cuda and torch.cuda.is_current_stream_capturing()):
        return
    if x.dtype != torch.bfloat16 or not _fast_path_device(x):
        cap = torch.cuda.get_device_capability(x.device)
        raise RuntimeError(
            f"grouped_linear is being captured in a CUDA graph with {x.dtype} on a GPU of compute "
            f"capability {cap[0]}.{cap[1]}, where torch._grouped_mm copies its offsets to the host "
            "(its fallback), which a graph cannot hold. Its sync-free kernel needs bfloat16 "
            "inputs on sm90 / sm100 (H100, H200, B200): train in bf16 "
            "(MixedPrecisionPolicy(param_dtype=torch.bfloat16)) on such a GPU, or keep the "
            "experts out of the captured scopes (--cuda-graph-scope attn moe_router)"
        )


def _zero_empty_groups(grad_weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """[Note: empty experts' weight gradient] An expert that received no rows has a zero weight
    gradient. On sm90 the grouped wgrad GEMM writes zeros for such groups; Blackwell (sm100)
    CUTLASS builds have left them unwritten (pytorch/pytorch#172439), so there they are masked
    on the device (no host sync)."""
    counts = torch.diff(offsets, prepend=offsets.new_zeros(1))
    return grad_weight.masked_fill((counts == 0).view(-1, 1, 1), 0)


class _GroupedLinear(torch.autograd.Function):
    """``out[rows of e] = x[rows of e] @ weight[e].T`` for every expert ``e`` (offsets on the
    device). Backward: dgrad and wgrad are grouped GEMMs over the same offsets, written in the
    layouts of ``x`` and ``weight`` (no transposed copies)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor):
        ctx.save_for_backward(x, weight, offsets)
        return torch._grouped_mm(x, weight.transpose(-2, -1), offs=offsets)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, offsets = ctx.saved_tensors
        grad = grad.contiguous()
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = torch._grouped_mm(grad, weight, offs=offsets)
        if ctx.needs_input_grad[1]:
            grad_w = torch._grouped_mm(grad.transpose(-2, -1), x, offs=offsets)
            if grad_w.is_cuda and torch.cuda.get_device_capability(grad_w.device)[0] >= 10:
                grad_w = _zero_empty_groups(grad_w, offsets)
        return grad_x, grad_w, None


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Per-expert linear layers over expert-ordered rows: ``x`` ``[rows, in]``, ``weight``
    ``[experts, out, in]`` (each expert a ``torch.nn.Linear`` weight), ``offsets`` int32
    ``[experts]`` cumulative row ends (:attr:`ExpertSort.offsets`). Returns ``[rows, out]``.

    Rows after ``offsets[-1]`` are not computed (left as allocated): pass offsets whose last
    entry is ``rows`` - :func:`sort_by_expert` does.
    """
    _check_grouped_linear(x, weight, offsets)
    return _GroupedLinear.apply(x.contiguous(), weight, offsets)


def _check_grouped_linear(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> None:
    if x.dim() != 2 or weight.dim() != 3 or x.shape[1] != weight.shape[2]:
        raise ValueError(
            f"grouped_linear: x [rows, in] and weight [experts, out, in] do not fit: "
            f"x {tuple(x.shape)}, weight {tuple(weight.shape)}"
        )
    if x.dtype != weight.dtype:
        raise ValueError(
            f"grouped_linear: x is {x.dtype} but weight is {weight.dtype}; torch._grouped_mm "
            "takes one dtype (cast the input to the weights' compute dtype)"
        )
    if offsets.dtype != torch.int32 or offsets.shape != (weight.shape[0],):
        raise ValueError(
            f"grouped_linear: offsets must be int32 [{weight.shape[0]}] (one end per expert), "
            f"got {offsets.dtype} {tuple(offsets.shape)}"
        )
    align = GROUPED_MM_ALIGN_BYTES // x.element_size()
    for name, size in (("in", weight.shape[2]), ("out", weight.shape[1])):
        if size % align:
            raise ValueError(
                f"grouped_linear: {name} features = {size} is not a multiple of {align}: "
                f"torch._grouped_mm needs {GROUPED_MM_ALIGN_BYTES}-byte aligned rows for "
                f"{x.dtype}; pick hidden and expert FFN sizes that are multiples of {align}"
            )
    _check_capturable(x)


def weighted_activation(
    h: torch.Tensor,
    probs: torch.Tensor,
    *,
    activation: Callable[[torch.Tensor], torch.Tensor],
    gated: bool,
    dtype: torch.dtype,
) -> torch.Tensor:
    """``act(h) * prob`` (``act(a) * b`` over the halves of ``h`` when ``gated``), cast to
    ``dtype``: what the experts feed fc2, TEGroupedMLP's ``activation_func_with_probs``."""
    if gated:
        gate, linear = torch.chunk(h, 2, dim=-1)
        a = activation(gate) * linear
    else:
        a = activation(h)
    return (a * probs.unsqueeze(-1)).to(dtype)


class _WeightedActivationLinear(torch.autograd.Function):
    """``grouped_linear(weighted_activation(h, probs), weight, offsets)``, saving ``h`` and
    ``probs`` only (see [Note: the experts recompute their activation])."""

    @staticmethod
    def forward(ctx, h, probs, weight, offsets, activation, gated, dtype):
        a = weighted_activation(h, probs, activation=activation, gated=gated, dtype=dtype)
        ctx.save_for_backward(h, probs, weight, offsets)
        ctx.activation, ctx.gated, ctx.dtype = activation, gated, dtype
        return torch._grouped_mm(a, weight.transpose(-2, -1), offs=offsets)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        h, probs, weight, offsets = ctx.saved_tensors
        need_h, need_p, need_w = ctx.needs_input_grad[:3]
        with torch.enable_grad():
            h_in = h.detach().requires_grad_(need_h)
            p_in = probs.detach().requires_grad_(need_p)
            a = weighted_activation(
                h_in, p_in, activation=ctx.activation, gated=ctx.gated, dtype=ctx.dtype
            )
        grad = grad.contiguous()
        grad_h = grad_p = grad_w = None
        if need_w:  # _GroupedLinear's wgrad, on the recomputed input
            grad_w = torch._grouped_mm(grad.transpose(-2, -1), a.detach(), offs=offsets)
            if grad_w.is_cuda and torch.cuda.get_device_capability(grad_w.device)[0] >= 10:
                grad_w = _zero_empty_groups(grad_w, offsets)
        if need_h or need_p:  # _GroupedLinear's dgrad, then autograd through the activation
            grad_a = torch._grouped_mm(grad, weight, offs=offsets)
            inputs = [t for t, need in ((h_in, need_h), (p_in, need_p)) if need]
            grads = iter(torch.autograd.grad(a, inputs, grad_a))
            grad_h = next(grads) if need_h else None
            grad_p = next(grads) if need_p else None
        return grad_h, grad_p, grad_w, None, None, None, None


def grouped_mlp(
    x: torch.Tensor,
    probs: torch.Tensor,
    fc1_weight: torch.Tensor,
    fc2_weight: torch.Tensor,
    offsets: torch.Tensor,
    *,
    activation: Callable[[torch.Tensor], torch.Tensor],
    gated: bool = False,
) -> torch.Tensor:
    """The experts' FFN over expert-ordered rows, Megatron's TEGroupedMLP math:
    ``fc2(act(fc1(x)) * prob)``, with ``act(a) * b`` over the two halves of fc1's output when
    ``gated`` (a gated linear unit), the routing weight applied before fc2 and the product cast
    back to ``x``'s dtype. ``fc1_weight`` ``[experts, ffn (x2 gated), hidden]``, ``fc2_weight``
    ``[experts, hidden, ffn]``, ``probs`` ``[rows]``.

    [Note: the experts recompute their activation]
    For backward autograd keeps ``x`` and fc1's output ``h`` (and the routing weights) - not
    ``act(h)``, the gated product or fc2's input, each as large as ``h`` (or half of it,
    gated): backward computes ``weighted_activation`` again from ``h`` and differentiates
    through it with autograd (what Megatron-Core's ``moe_act`` recompute does for
    TEGroupedMLP). The recomputation runs the same kernels on the same inputs, so forward
    values and every gradient are bit-identical to keeping the intermediates; the cost is
    the activation's elementwise kernels run once more, in backward.
    """
    if probs.shape != (x.shape[0],):
        raise ValueError(f"probs must be [rows={x.shape[0]}], got {tuple(probs.shape)}")
    h = grouped_linear(x, fc1_weight, offsets)
    ffn = h.shape[1] // 2 if gated else h.shape[1]
    if fc2_weight.dim() != 3 or fc2_weight.shape[2] != ffn:
        raise ValueError(
            f"grouped_mlp: fc2_weight must be [experts, hidden, ffn={ffn}] (fc1 gives "
            f"{h.shape[1]} features{', gated' if gated else ''}), got {tuple(fc2_weight.shape)}"
        )
    _check_grouped_linear(h[:, :ffn], fc2_weight, offsets)  # fc2's input: h's rows and dtype
    return _WeightedActivationLinear.apply(
        h, probs, fc2_weight, offsets, activation, gated, x.dtype
    )


def dropless_moe(
    x: torch.Tensor,
    routing_probs: torch.Tensor,
    top_experts: torch.Tensor,
    fc1_weight: torch.Tensor,
    fc2_weight: torch.Tensor,
    *,
    activation: Callable[[torch.Tensor], torch.Tensor],
    gated: bool = False,
) -> torch.Tensor:
    """The routed part of a dropless MoE layer: ``[tokens, hidden]`` -> ``[tokens, hidden]``,
    with ``routing_probs`` ``[tokens, experts]`` and ``top_experts`` ``[tokens, topk]``."""
    sort = sort_by_expert(top_experts, fc1_weight.shape[0])
    rows = grouped_mlp(
        dispatch(x, sort),
        expert_probs(routing_probs, sort),
        fc1_weight,
        fc2_weight,
        sort.offsets,
        activation=activation,
        gated=gated,
    )
    return combine(rows, sort)


class GroupedLinear(nn.Module):
    """``num_experts`` linear layers without bias in one ``[experts, out, in]`` parameter:
    ``weight[e]`` is expert ``e``'s ``torch.nn.Linear`` weight (Megatron's TEGroupedMLP holds the
    same matrix as ``weight{e}``: :func:`split_expert_weights` maps the two)."""

    def __init__(
        self,
        num_experts: int,
        in_features: int,
        out_features: int,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(num_experts, out_features, in_features, device=device, dtype=dtype)
        )

    def forward(self, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return grouped_linear(x, self.weight, offsets)

    def extra_repr(self) -> str:
        e, out, inp = self.weight.shape
        return f"num_experts={e}, in_features={inp}, out_features={out}, bias=False"


# --------------------------------------------------------------------------------------------
# State dicts: stacked [experts, out, in] <-> one matrix per expert (TEGroupedMLP's weight{e})
# --------------------------------------------------------------------------------------------

STACKED_SUFFIXES = ("experts.linear_fc1.weight", "experts.linear_fc2.weight")
"""Keys of the stacked expert weights graph_fsdp's Megatron experts register."""


def split_expert_weights(
    state_dict: dict[str, torch.Tensor], suffixes: tuple[str, ...] = STACKED_SUFFIXES
) -> dict[str, torch.Tensor]:
    """A copy of ``state_dict`` with every ``...<suffix>`` ``[experts, out, in]`` tensor split
    into ``...<suffix>{e}`` ``[out, in]`` entries - TEGroupedMLP's keys and layout."""
    out: dict[str, torch.Tensor] = {}
    for key, value in state_dict.items():
        if _is_stacked_key(key, suffixes):
            if value.dim() != 3:
                raise ValueError(f"{key}: expected [experts, out, in], got {tuple(value.shape)}")
            for e in range(value.shape[0]):
                out[f"{key}{e}"] = value[e]
        else:
            out[key] = value
    return out


def stack_expert_weights(
    state_dict: dict[str, torch.Tensor], suffixes: tuple[str, ...] = STACKED_SUFFIXES
) -> dict[str, torch.Tensor]:
    """The inverse of :func:`split_expert_weights`: ``...<suffix>0 .. {E-1}`` entries stacked
    into one ``...<suffix>`` ``[experts, out, in]`` tensor each."""
    out: dict[str, torch.Tensor] = {}
    groups: dict[str, dict[int, torch.Tensor]] = {}
    for key, value in state_dict.items():
        head, _, index = _split_index(key)
        if index is not None and _is_stacked_key(head, suffixes):
            groups.setdefault(head, {})[index] = value
        else:
            out[key] = value
    for head, parts in groups.items():
        missing = sorted(set(range(len(parts))) - set(parts))
        if missing or max(parts) != len(parts) - 1:
            raise ValueError(
                f"{head}: expert matrices {sorted(parts)} are not numbered 0..{len(parts) - 1}"
            )
        out[head] = torch.stack([parts[e] for e in range(len(parts))])
    return out


def _is_stacked_key(key: str, suffixes: tuple[str, ...]) -> bool:
    """``key`` is ``suffix`` or ends with ``.suffix`` (``shared_experts.linear_fc1.weight`` does
    not end with ``.experts.linear_fc1.weight``)."""
    return any(key == s or key.endswith("." + s) for s in suffixes)


def _split_index(key: str) -> tuple[str, str, int | None]:
    digits = len(key) - len(key.rstrip("0123456789"))
    if digits == 0:
        return key, "", None
    return key[:-digits], key[-digits:], int(key[-digits:])
