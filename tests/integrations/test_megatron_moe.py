"""graph_fsdp.integrations.megatron.moe on CPU, where megatron-core imports (it needs Python
>= 3.12: these tests skip in CI and run on the GPU host, or locally with a megatron-core
checkout on PYTHONPATH).

The numerical check drives Megatron's ``MoELayer`` methods from a fixed routing (Megatron's
router moves its weights to CUDA in every forward, so the CPU run starts after it): the
dispatcher, experts, combine and shared expert of :class:`GroupedMMMoELayer` against Megatron's
own dropless path (allgather dispatcher + SequentialMLP) with the same weights. In fp32 on CPU
both compute the same sums in the same order, so they must be bit-identical.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from graph_fsdp_testing import MOE_EXPERTS, MOE_FFN, MOE_HIDDEN, MOE_TOPK, megatron_moe_config

from graph_fsdp.training.processes import spawn

try:
    from graph_fsdp.integrations.megatron import moe as mm
    from graph_fsdp.integrations.megatron import versions
except ImportError as err:  # megatron-core does not import here
    pytest.skip(f"megatron-core does not import ({err})", allow_module_level=True)

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.moe.experts import SequentialMLP

E, TOPK, H, FFN = MOE_EXPERTS, MOE_TOPK, MOE_HIDDEN, MOE_FFN
config = megatron_moe_config


def build_pair(cfg: TransformerConfig):
    """Megatron's dropless MoELayer (local spec) and GroupedMMMoELayer with its weights."""
    from graph_fsdp.integrations import megatron as gm

    gm.init_parallel_state()
    spec = get_gpt_layer_local_spec(num_experts=E, moe_grouped_gemm=False)
    torch.manual_seed(0)
    ref = versions.build_mlp(spec, cfg)
    ours = versions.build_mlp(mm.grouped_mm_moe_spec(spec), cfg)
    state = {k: v for k, v in ref.state_dict().items() if not k.startswith("experts.")}
    for lin in ("linear_fc1", "linear_fc2"):
        state[f"experts.{lin}.weight"] = torch.stack(
            [ref.state_dict()[f"experts.local_experts.{e}.{lin}.weight"] for e in range(E)]
        )
    ours.load_state_dict(state)
    return ref, ours


def moe_without_router(layer, x, probs, routing_map):
    """MoELayer.forward's steps after ``route`` (custom_forward in moe_layer.py)."""
    shared = layer.shared_experts_compute(x)
    hidden, p = layer.preprocess(x, probs, routing_map)
    hidden, p = layer.dispatch(hidden, p)
    out, _ = layer.routed_experts_compute(hidden, p)
    return layer.postprocess(layer.combine(out), shared)


def _compare(rank: int, world: int, gated: bool) -> dict:
    cfg = config(gated_linear_unit=gated, activation_func=F.silu if gated else F.gelu)
    ref, ours = build_pair(cfg)
    assert isinstance(ref.experts, SequentialMLP)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 2, H, generator=g)
    logits = torch.randn(16, E, generator=g)
    logits[:, 1] = -1e9  # expert 1 receives no token
    top = logits.topk(TOPK, dim=1).indices
    routing_map = torch.zeros(16, E, dtype=torch.bool).scatter(1, top, True)
    probs = torch.zeros(16, E).scatter(1, top, logits.gather(1, top).softmax(-1))
    grad = torch.randn(8, 2, H, generator=g)
    results = {}
    for name, layer in (("megatron", ref), ("grouped_mm", ours)):
        xi, pi = x.clone().requires_grad_(), probs.clone().requires_grad_()
        y = moe_without_router(layer, xi, pi, routing_map)
        y.backward(grad)
        experts = layer.experts
        if name == "megatron":
            fc1 = torch.stack([m.linear_fc1.weight.grad for m in experts.local_experts])
            fc2 = torch.stack([m.linear_fc2.weight.grad for m in experts.local_experts])
        else:
            fc1, fc2 = experts.linear_fc1.weight.grad, experts.linear_fc2.weight.grad
        shared = layer.shared_experts.linear_fc1.weight.grad
        results[name] = dict(y=y, x=xi.grad, probs=pi.grad, fc1=fc1, fc2=fc2, shared=shared)
    return results


@pytest.mark.parametrize("gated", [False, True], ids=["gelu", "swiglu"])
def test_grouped_mm_layer_is_megatrons_dropless_layer_in_fp32(gated: bool) -> None:
    out = spawn(_compare, 1, gated)[0]
    for key, ref in out["megatron"].items():
        got = out["grouped_mm"][key]
        assert torch.equal(got, ref), (key, (got - ref).abs().max())
    assert not out["grouped_mm"]["fc1"][1].any()  # the expert without tokens


def _layer_facts(rank: int, world: int) -> dict:
    cfg = config()
    _, ours = build_pair(cfg)
    return {
        "params": {n: tuple(p.shape) for n, p in ours.named_parameters()},
        "expert_allreduce": [p.allreduce for p in ours.experts.parameters()],
        "stacked": ours.experts.graph_fsdp_stacked_experts,
        "dispatcher": type(ours.token_dispatcher).__name__,
        "shared": type(ours.shared_experts).__name__,
    }


def test_layer_parameters_and_parts() -> None:
    facts = spawn(_layer_facts, 1)[0]
    assert facts["params"]["experts.linear_fc1.weight"] == (E, FFN, H)
    assert facts["params"]["experts.linear_fc2.weight"] == (E, H, FFN)
    assert facts["params"]["router.weight"] == (E, H)
    assert "shared_experts.linear_fc1.weight" in facts["params"]
    # Megatron marks expert parameters allreduce=False only when EP > 1 (so do these): EP = 1.
    assert facts["expert_allreduce"] == [True, True]
    assert facts["stacked"] is True
    assert facts["dispatcher"] == "DeviceCountDispatcher"
    assert facts["shared"] == "SharedExpertMLP"


def _mlp_class(layer_spec):
    return versions.mlp_spec_parts(layer_spec.submodules.mlp)[0]


def test_spec_swaps_only_the_moe_block() -> None:
    spec = versions.local_layer_spec(num_experts=E, moe_grouped_gemm=True)
    new = mm.grouped_mm_moe_spec(spec)
    mlp, old = new.submodules.mlp, spec.submodules.mlp
    assert type(mlp) is type(old)  # the kind this megatron-core's specs use
    cls, sub, _ = versions.mlp_spec_parts(mlp)
    old_cls, old_sub, _ = versions.mlp_spec_parts(old)
    assert cls is mm.GroupedMMMoELayer and sub.experts is mm.GroupedMMExperts
    assert sub.router is old_sub.router and sub.shared_experts is old_sub.shared_experts
    assert new.submodules.self_attention is spec.submodules.self_attention
    assert old_cls is not mm.GroupedMMMoELayer  # the input spec is left as it was
    with pytest.raises(ValueError, match="not Megatron-Core's MoELayer"):
        mm.grouped_mm_moe_spec(get_gpt_layer_local_spec())


def test_block_spec_swaps_moe_layers_and_keeps_dense_ones() -> None:
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    dense = get_gpt_layer_local_spec()
    moe = get_gpt_layer_local_spec(num_experts=E)
    block = mm.grouped_mm_moe_spec(TransformerBlockSubmodules(layer_specs=[dense, moe]))
    assert block.layer_specs[0] is dense
    assert _mlp_class(block.layer_specs[1]) is mm.GroupedMMMoELayer


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        (
            {"moe_expert_capacity_factor": 1.0, "moe_pad_expert_input_to_capacity": True},
            "moe_expert_capacity_factor=1.0: this layer is dropless",
        ),
        ({"moe_token_dispatcher_type": "flex"}, "moe_token_dispatcher_type='flex'"),
        ({"add_bias_linear": True}, "add_bias_linear=True"),
        ({"moe_shared_expert_overlap": True}, "moe_shared_expert_overlap=True"),
        ({"expert_tensor_parallel_size": 2}, "expert_tensor_parallel_size=2"),
        ({"delay_wgrad_compute": True}, "delay_wgrad_compute=True"),
        ({"moe_apply_probs_on_input": True}, "moe_apply_probs_on_input"),
        ({"hidden_size": 36}, "hidden_size=36 is not a multiple of 8"),
        ({"moe_ffn_hidden_size": 60}, "moe_ffn_hidden_size=60"),
    ],
)
def test_settings_the_layer_refuses(kwargs: dict, expected: str) -> None:
    cfg = config()
    for name, value in kwargs.items():  # past TransformerConfig's own cross-field checks
        setattr(cfg, name, value)
    problems = mm.grouped_mm_moe_problems(cfg)
    assert any(expected in p for p in problems), problems
    with pytest.raises(ValueError, match="GroupedMMMoELayer .* cannot run") as err:
        mm.GroupedMMMoELayer(cfg)  # refused before any process group is needed
    assert expected in str(err.value)


def test_the_default_config_has_no_problem() -> None:
    assert mm.grouped_mm_moe_problems(config()) == []
    assert mm.grouped_mm_moe_problems(config(gated_linear_unit=True, moe_aux_loss_coeff=1e-2)) == []
    # moe_act recompute is what the experts always do: accepted.
    act = config(
        recompute_granularity="selective", recompute_modules=["moe_act"], moe_grouped_gemm=True
    )
    assert mm.grouped_mm_moe_problems(act) == []


def _saved_and_kept(rank: int, world: int, gated: bool) -> dict:
    """Per layer: what autograd keeps for backward (parameters aside), and which dispatcher
    tensors with an autograd graph outlive the forward and backward."""
    from graph_fsdp_testing import saved_tensor_bytes

    from graph_fsdp.integrations.megatron.train import release_moe_dispatch_state

    cfg = config(gated_linear_unit=gated, activation_func=F.silu if gated else F.gelu)
    ref, ours = build_pair(cfg)
    g = torch.Generator().manual_seed(3)
    x0 = torch.randn(32, 2, H, generator=g)
    top = torch.randn(64, E, generator=g).topk(TOPK, dim=1).indices
    routing_map = torch.zeros(64, E, dtype=torch.bool).scatter(1, top, True)
    probs0 = torch.zeros(64, E).scatter(1, top, 0.5)
    out = {}
    for name, layer in (("megatron", ref), ("grouped_mm", ours)):
        x, probs = x0.clone().requires_grad_(), probs0.clone().requires_grad_()
        y, kept = saved_tensor_bytes(
            lambda layer=layer, x=x, probs=probs: moe_without_router(layer, x, probs, routing_map),
            exclude=tuple(layer.parameters()),
        )
        y.sum().backward()
        disp = layer.token_dispatcher
        graphs = sorted(k for k, v in vars(disp).items() if torch.is_tensor(v) and v.grad_fn)
        out[name] = {"kept": kept, "graphs": graphs, "released": release_moe_dispatch_state(layer)}
        out[name]["after"] = [k for k in graphs if getattr(disp, k) is not None]
    return out


@pytest.mark.parametrize("gated", [False, True], ids=["gelu", "swiglu"])
def test_layer_keeps_less_for_backward_than_megatrons_and_nothing_after(gated: bool) -> None:
    """The whole MoE layer (dispatch, experts, combine, shared expert) keeps less for backward
    than Megatron's dropless layer (here SequentialMLP, fp32): the experts recompute their
    activation (grouped_moe.py). Megatron's dispatcher keeps the routing weights with their
    autograd graph after the step (megatron/train.py [Note: MoE dispatchers keep the last
    routing]); release_moe_dispatch_state drops them, and graph_fsdp's keeps none."""
    out = spawn(_saved_and_kept, 1, gated)[0]
    rows, ffn1 = 64 * TOPK, FFN * (2 if gated else 1)
    # Megatron keeps act(h) and fc2's input (gated: also the gated product) on top; graph_fsdp
    # keeps two int64 indices a row more (at most 32 bytes a row of small tensors).
    saved = (FFN * (2 if gated else 1) + FFN) * 4 * rows
    assert out["grouped_mm"]["kept"] <= out["megatron"]["kept"] - saved + 32 * rows, out
    assert out["grouped_mm"]["kept"] >= (H + ffn1) * 4 * rows  # the rows and fc1's output
    assert out["megatron"]["graphs"] == ["local_probs"] and out["megatron"]["released"] == 1
    assert out["megatron"]["after"] == []
    assert out["grouped_mm"]["graphs"] == [] and out["grouped_mm"]["released"] == 0


def test_mcore_gpt_config_reaches_megatron() -> None:
    """MCoreGPTConfig's MoE fields land in TransformerConfig and the layer spec."""
    from graph_fsdp.integrations import megatron as gm

    drop_pad = gm.MCoreGPTConfig(
        num_experts=E,
        transformer_impl="local",
        moe_expert_capacity_factor=1.0,
        moe_pad_expert_input_to_capacity=True,
        moe_aux_loss_coeff=1e-2,
    )
    tc = gm.transformer_config(drop_pad, torch.device("cpu"))
    assert tc.moe_expert_capacity_factor == 1.0 and tc.moe_pad_expert_input_to_capacity
    assert tc.moe_aux_loss_coeff == 1e-2 and tc.moe_router_load_balancing_type == "aux_loss"
    assert _mlp_class(gm.layer_spec(drop_pad)) is not mm.GroupedMMMoELayer
    grouped = gm.MCoreGPTConfig(
        num_experts=E, transformer_impl="local", moe_experts_impl="grouped_mm"
    )
    assert _mlp_class(gm.layer_spec(grouped)) is mm.GroupedMMMoELayer
    assert mm.grouped_mm_moe_problems(gm.transformer_config(grouped, torch.device("cpu"))) == []
