"""Megatron-Core's --cuda-graph-scope through graph_fsdp's generic scope presets (CPU).

These tests need no megatron-core: they run the integration's own logic on a small module tree with Megatron-Core's attribute names
(TransformerLayer: ``self_attention``, ``mlp``; MoELayer: ``router``, ``experts``,
``token_dispatcher``, a ``preprocess`` *method*). The real model is covered by
tests/integrations/test_megatron_gpu.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from graph_fsdp.capture.scopes import GraphConfigError, select_targets
from graph_fsdp.integrations import megatron as gm


class AlltoAllDispatcher:
    """The attributes MoEAlltoAllTokenDispatcher's preprocess sets (a plain object in mcore)."""

    def __init__(self) -> None:
        self.cuda_dtoh_point = "before_permutation_1"


class FakeMoELayer(nn.Module):
    def __init__(self, dispatcher=None, ep: int = 1) -> None:
        super().__init__()
        self.ep = ep
        self.router = nn.Linear(4, 2)
        self.experts = nn.Linear(4, 4)
        self.shared_experts = nn.Linear(4, 4)
        self.token_dispatcher = dispatcher or AlltoAllDispatcher()

    def preprocess(self, hidden_states, probs, routing_map):
        d = self.token_dispatcher
        d.hidden_shape = hidden_states.shape
        d.hidden_shape_before_permute = hidden_states.shape
        d.num_out_tokens = int(routing_map.sum())
        d.tokens_per_expert = routing_map.sum(0)
        d.num_global_tokens_per_local_expert = routing_map.sum(0, keepdim=True)
        d.reversed_local_input_permutation_mapping = torch.arange(hidden_states.shape[0])
        if self.ep > 1:  # the all-to-all's split sizes, as at expert_model_parallel_size > 1
            d.input_splits = routing_map.sum(0).reshape(self.ep, -1).sum(1)
            d.output_splits = d.input_splits.flip(0)
            d.output_splits_tp = d.input_splits.sum(0, keepdim=True)
        return hidden_states * 2, probs * 3

    def forward(self, x):
        probs = self.router(x).softmax(-1)
        routing_map = probs > 0.4
        h, p = self.preprocess(x, probs, routing_map)  # MoELayer.forward's call
        return self.experts(h) * p.sum(-1, keepdim=True) + self.shared_experts(x)


class FakeMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear_fc1, self.linear_fc2 = nn.Linear(4, 8), nn.Linear(8, 4)

    def forward(self, x):
        return self.linear_fc2(self.linear_fc1(x))


class FakeLayer(nn.Module):
    """TransformerLayer's attribute names."""

    def __init__(self, moe: bool, dispatcher=None, ep: int = 1) -> None:
        super().__init__()
        self.self_attention = nn.Linear(4, 4)
        self.pre_mlp_layernorm = nn.LayerNorm(4)
        self.mlp = FakeMoELayer(dispatcher, ep) if moe else FakeMLP()

    def forward(self, x):
        x = x + self.self_attention(x)
        return x + self.mlp(self.pre_mlp_layernorm(x))


class Box(nn.Module):
    def __init__(self, **children: nn.Module) -> None:
        super().__init__()
        for name, child in children.items():
            self.add_module(name, child)


def fake_lm(moe: bool, n: int = 2, dispatcher=None, ep: int = 1) -> nn.Module:
    """MCoreLM's layout: ``lm.module.decoder.layers``."""
    layers = nn.ModuleList(FakeLayer(moe, dispatcher, ep) for _ in range(n))
    return Box(module=Box(decoder=Box(layers=layers)))


def units_of(lm) -> list[tuple[str, nn.Module]]:
    return [(f"module.decoder.layers.{i}", m) for i, m in enumerate(gm.transformer_layers(lm))]


def names(targets) -> list[str]:
    return [t.name for t in targets]


def test_megatron_scope_names_are_the_generic_presets():
    assert gm.MCORE_SCOPE_MODULES == {
        "attn": "self_attention",
        "mlp": "mlp",
        "moe": "mlp",
        "moe_router": "mlp.router",
        "moe_preprocess": "mlp.preprocess",
    }
    dense, moe = fake_lm(False, 1), fake_lm(True, 1)
    gm.install_moe_preprocess(moe)
    for scope, path in gm.MCORE_SCOPE_MODULES.items():
        lm = dense if scope in ("attn", "mlp") else moe
        scopes = ["moe_router", scope] if scope == "moe_preprocess" else [scope]
        targets = [t for t in select_targets(units_of(lm), scopes) if t.scope == scope]
        assert names(targets) == [f"module.decoder.layers.0.{path}"], scope


def test_moe_scopes_resolve_without_aliases_on_the_model():
    lm = fake_lm(True)
    targets = select_targets(units_of(lm), ["attn", "moe_router"])
    assert names(targets) == [
        "module.decoder.layers.0.self_attention",
        "module.decoder.layers.0.mlp.router",
        "module.decoder.layers.1.self_attention",
        "module.decoder.layers.1.mlp.router",
    ]
    layer = gm.transformer_layers(lm)[0]
    assert targets[1].module is layer.mlp.router and not hasattr(layer, "moe")


def test_moe_preprocess_needs_the_module_make_graphs_installs():
    lm = fake_lm(True)
    with pytest.raises(GraphConfigError) as err:
        select_targets(units_of(lm), ["moe_router", "moe_preprocess"])
    assert "install_moe_preprocess" in str(err.value)
    before = [n for n, _ in lm.named_parameters()]
    assert gm.install_moe_preprocess(lm) == 2
    assert gm.install_moe_preprocess(lm) == 0  # idempotent
    targets = select_targets(units_of(lm), ["attn", "moe_router", "moe_preprocess"])
    assert names(targets)[:3] == [
        "module.decoder.layers.0.self_attention",
        "module.decoder.layers.0.mlp.router",
        "module.decoder.layers.0.mlp.preprocess",
    ]
    assert isinstance(targets[2].module, gm.MoEPreprocess)
    # Not a registered submodule: parameter names and state dicts keep Megatron's names.
    assert [n for n, _ in lm.named_parameters()] == before
    assert not any("preprocess" in n for n, _ in lm.named_modules())
    disp = gm.transformer_layers(lm)[0].mlp.token_dispatcher
    assert disp.cuda_dtoh_point == "before_ep_alltoall"


@pytest.mark.parametrize("ep", [1, 2])
def test_moe_preprocess_module_computes_what_the_method_did(ep: int):
    torch.manual_seed(0)
    ref, lm = fake_lm(True, 1, ep=ep), fake_lm(True, 1, ep=ep)
    lm.load_state_dict(ref.state_dict())
    gm.install_moe_preprocess(lm)
    x = torch.randn(6, 4)
    layer_ref, layer = gm.transformer_layers(ref)[0], gm.transformer_layers(lm)[0]
    assert torch.equal(layer(x), layer_ref(x))
    d, d_ref = layer.mlp.token_dispatcher, layer_ref.mlp.token_dispatcher
    for name in (*gm.PREPROCESS_TENSORS, *gm.PREPROCESS_CONSTS):
        a, b = getattr(d, name, None), getattr(d_ref, name, None)
        assert torch.equal(a, b) if torch.is_tensor(a) else a == b, name
    assert (getattr(d, "input_splits", None) is not None) == (ep > 1)


def test_a_replay_puts_back_the_tensors_its_capture_returned():
    """Our own bookkeeping, with the replay simulated: the Python preprocess does not run, the
    graph's outputs come back, and the dispatcher gets them under the names (the EP split
    sizes among them) and the constants recorded when it was captured."""
    lm = fake_lm(True, 1, ep=2)
    gm.install_moe_preprocess(lm)
    moe = gm.transformer_layers(lm)[0].mlp
    pre, disp = moe.preprocess, moe.token_dispatcher
    x, probs = torch.randn(6, 4), torch.rand(6, 2)
    routing_map = probs > 0.4
    pre(x, probs, routing_map)  # eager: records the names it returned
    assert pre._tensor_names == gm.PREPROCESS_TENSORS
    pre._capture_consts = {a: getattr(disp, a) for a in gm.PREPROCESS_CONSTS}  # as a capture
    outputs = tuple(torch.full((2,), float(i)) for i in range(len(gm.PREPROCESS_TENSORS)))
    pre.forward = lambda *args: (x * 2, probs * 3, outputs)  # a replay: no Python preprocess
    disp.input_splits = "host copy of the last step"  # what the eager dispatch left there
    disp.hidden_shape = None
    out, out_probs = pre(x, probs, routing_map)
    assert torch.equal(out, x * 2) and torch.equal(out_probs, probs * 3)
    for name, t in zip(gm.PREPROCESS_TENSORS, outputs):
        assert getattr(disp, name) is t, name
    assert disp.hidden_shape == x.shape and disp.routing_map is routing_map
    pre.forward = lambda *args: (x, probs, outputs[:2])
    with pytest.raises(RuntimeError, match="recorded at capture"):
        pre(x, probs, routing_map)


def test_dense_models_and_other_dispatchers():
    assert gm.install_moe_preprocess(fake_lm(False)) == 0

    class AllGatherDispatcher:  # no cuda_dtoh_point: not the alltoall dispatcher
        pass

    with pytest.raises(GraphConfigError, match="alltoall token dispatcher, not AllGather"):
        gm.install_moe_preprocess(fake_lm(True, dispatcher=AllGatherDispatcher()))
