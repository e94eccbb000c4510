"""A pack's padding tail through Megatron-Core MoE layers on CPU (gloo, one rank; Megatron's
CUDA-only details bridged by graph_fsdp_testing.megatron_on_cpu): with capacity (drop-padding
and plain dropping, both drop policies) the real tokens' outputs, and their gradients, are the
same bits whatever the tail holds once the router is a TailMaskedRouter, and differ with
Megatron's router given the same padding mask (the tail takes expert slots); dropless routers
are left as they are; without a padding mask a TailMaskedRouter routes as Megatron's. megatron/packed_moe.py [Note: packed MoE routing]."""

from __future__ import annotations

import pytest
import torch
from graph_fsdp_testing import MOE_EXPERTS, MOE_HIDDEN, megatron_moe_config, megatron_on_cpu

from graph_fsdp.models.packed import padding_tail_mask
from graph_fsdp.training.packing import PackingPolicy, pack_tensors
from graph_fsdp.training.processes import spawn

try:
    from graph_fsdp.integrations.megatron import packed_moe, versions
except ImportError as err:  # megatron-core does not import here
    pytest.skip(f"megatron-core does not import ({err})", allow_module_level=True)

E, H, TOKENS = MOE_EXPERTS, MOE_HIDDEN, 64
TAIL = slice(16, 28)
TAILS = ((2, 1.0), (3, 30.0))  # (seed, scale): two tails of other experts and weights
CAPACITY = {
    "drop_padding_probs": dict(
        moe_expert_capacity_factor=0.5, moe_pad_expert_input_to_capacity=True
    ),
    # Dropping without padding: the allgather dispatcher (alltoall's copies the counts to the
    # host on a CUDA stream).
    "drop_probs": dict(moe_expert_capacity_factor=0.5, moe_token_dispatcher_type="allgather"),
    "drop_padding_position": dict(
        moe_expert_capacity_factor=0.5,
        moe_pad_expert_input_to_capacity=True,
        moe_token_drop_policy="position",
    ),
}


def _layer(**kw):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    config = megatron_moe_config(
        moe_shared_expert_intermediate_size=None,
        moe_aux_loss_coeff=1e-2,
        **{"moe_token_dispatcher_type": "alltoall", **kw},
    )
    torch.manual_seed(0)
    return versions.build_mlp(get_gpt_layer_local_spec(num_experts=E), config)


def _real_outputs(layer, tail_seed: int, tail_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The real tokens' outputs and input gradients for one tail (the same real tokens). The
    tail sits between real tokens, as a row's tail does before the next row's documents in a
    flattened ``[1, b * T]`` pack."""
    padding = torch.zeros(TOKENS, dtype=torch.bool)
    padding[TAIL] = True
    real = ~padding
    hidden = torch.randn(TOKENS, 1, H, generator=torch.Generator().manual_seed(1))
    tail = torch.randn(TOKENS, 1, H, generator=torch.Generator().manual_seed(tail_seed))
    hidden = torch.where(padding[:, None, None], tail_scale * tail, hidden).requires_grad_(True)
    out, _ = layer(hidden, padding_mask=padding[None])  # [b=1, s], True on the tail
    out[real].square().sum().backward()
    return out[real].detach(), hidden.grad[real]


def _routes(rank: int, world: int) -> dict:
    from graph_fsdp.integrations import megatron as gm

    megatron_on_cpu()
    gm.init_parallel_state()
    out = {}
    for name, kw in CAPACITY.items():
        plain, masked = _layer(**kw), _layer(**kw)
        changed = packed_moe.mask_tail_in_routing(masked)
        again = packed_moe.mask_tail_in_routing(masked)
        runs = {
            k: [_real_outputs(m, *s) for s in TAILS]
            for k, m in (("plain", plain), ("masked", masked))
        }
        hidden = torch.randn(TOKENS, 1, H, generator=torch.Generator().manual_seed(4))
        same = torch.equal(plain(hidden)[0], masked(hidden)[0])  # no padding mask: Megatron's
        out[name] = {
            "unpacked_same": same,
            "changed": changed,
            "again": again,
            **{k: [torch.equal(a[i], b[i]) for i in range(2)] for k, (a, b) in runs.items()},
        }
    dropless = _layer()
    out["dropless_changed"] = packed_moe.mask_tail_in_routing(dropless)
    return out


def test_tail_kept_out_of_expert_capacity() -> None:
    out = spawn(_routes, 1, backend="gloo", timeout=300)[0]
    assert out.pop("dropless_changed") == []
    for name, got in out.items():
        assert got["changed"] == ["router"] and got["again"] == [], (name, got)
        assert got["unpacked_same"], (name, got)
        # [outputs equal, input gradients equal] across the two tails
        assert got["masked"] == [True, True], (name, got)
        assert got["plain"] != [True, True], (name, got)  # the check can fail: the tail mattered


def test_padding_tail_mask_marks_each_rows_tail() -> None:
    policy = PackingPolicy(budget=16, max_documents=3)
    docs = [[torch.arange(5), torch.arange(4)], [torch.arange(16)], [torch.arange(2)]]
    pack = pack_tensors(docs, policy, "cpu")
    mask = padding_tail_mask(pack.cu_seqlens, 3, 16)
    want = torch.zeros(3, 16, dtype=torch.bool)
    want[0, 9:] = True
    want[2, 2:] = True
    assert torch.equal(mask, want), mask
