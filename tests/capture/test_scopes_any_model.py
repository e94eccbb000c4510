"""Scope presets per model family, user scope_modules, and the no-match error (CPU)."""

from __future__ import annotations

import argparse

import pytest
import torch
from torch import nn

from graph_fsdp.capture import (
    GraphConfigError,
    check_scopes,
    normalize_scope_modules,
    parse_scope_modules,
    select_targets,
)
from graph_fsdp.capture.torch_backend import CallSignature
from graph_fsdp.cli.errors import CLIError
from graph_fsdp.cli.graph_options import add_graph_args, scope_modules_of
from graph_fsdp.cli.graph_options import check_scopes as cli_check_scopes
from graph_fsdp.models import GPTConfig
from graph_fsdp.models.hf import hf_decoder_layers


class Leaf(nn.Linear):
    def __init__(self) -> None:
        super().__init__(4, 4)


class Box(nn.Module):
    """A module with named children (a stand-in for any family's attention/MLP class)."""

    def __init__(self, **children: nn.Module) -> None:
        super().__init__()
        for name, child in children.items():
            self.add_module(name, child)


def hf_llama_layer() -> nn.Module:
    """HuggingFace LlamaDecoderLayer's naming."""
    return Box(
        self_attn=Box(q_proj=Leaf(), k_proj=Leaf(), v_proj=Leaf(), o_proj=Leaf()),
        mlp=Box(gate_proj=Leaf(), up_proj=Leaf(), down_proj=Leaf()),
        input_layernorm=nn.LayerNorm(4),
        post_attention_layernorm=nn.LayerNorm(4),
    )


def hf_qwen_moe_layer() -> nn.Module:
    """Qwen2-MoE / Mixtral (transformers 5): ``mlp`` is the sparse MoE block with ``gate``."""
    return Box(
        self_attn=Box(q_proj=Leaf()),
        mlp=Box(gate=Leaf(), experts=Box(w=Leaf()), shared_expert=Box(up=Leaf())),
    )


def hf_old_mixtral_layer() -> nn.Module:
    return Box(self_attn=Box(q_proj=Leaf()), block_sparse_moe=Box(gate=Leaf(), experts=Leaf()))


def te_layer() -> nn.Module:
    """TransformerEngine TransformerLayer's naming."""
    return Box(self_attention=Box(qkv=Leaf()), layernorm_mlp=Leaf())


def mcore_layer(moe: bool) -> nn.Module:
    """Megatron-Core TransformerLayer: ``mlp`` is an MLP or a MoELayer."""
    mlp = (
        Box(router=Leaf(), token_dispatcher=Box(), experts=Leaf(), shared_experts=Leaf())
        if moe
        else Box(linear_fc1=Leaf(), linear_fc2=Leaf())
    )
    return Box(self_attention=Box(linear_qkv=Leaf()), pre_mlp_layernorm=nn.Identity(), mlp=mlp)


def units(make, n: int = 2) -> list[tuple[str, nn.Module]]:
    return [(f"layers.{i}", make()) for i in range(n)]


def names(targets) -> list[str]:
    return [t.name for t in targets]


def test_presets_for_every_family():
    hf = units(hf_llama_layer)
    assert names(select_targets(hf, ["attn", "mlp"])) == [
        "layers.0.self_attn",
        "layers.0.mlp",
        "layers.1.self_attn",
        "layers.1.mlp",
    ]
    te = units(te_layer, 1)
    assert names(select_targets(te, ["attn", "mlp"])) == [
        "layers.0.self_attention",
        "layers.0.layernorm_mlp",
    ]
    dense = units(lambda: mcore_layer(False), 1)
    assert names(select_targets(dense, ["attn", "mlp"])) == [
        "layers.0.self_attention",
        "layers.0.mlp",
    ]
    moe = units(lambda: mcore_layer(True), 1)
    moe_target = select_targets(moe, ["moe"])[0]
    assert moe_target.name == "layers.0.mlp" and moe_target.scope == "moe"
    assert names(select_targets(moe, ["attn", "moe_router"])) == [
        "layers.0.self_attention",
        "layers.0.mlp.router",
    ]
    qwen = units(hf_qwen_moe_layer, 1)
    assert names(select_targets(qwen, ["moe"])) == ["layers.0.mlp"]
    assert names(select_targets(qwen, ["moe_router"])) == ["layers.0.mlp.gate"]
    old = units(hf_old_mixtral_layer, 1)
    assert names(select_targets(old, ["moe"])) == ["layers.0.block_sparse_moe"]
    assert names(select_targets(old, ["moe_router"])) == ["layers.0.block_sparse_moe.gate"]


@pytest.mark.parametrize(
    ("family", "attn"),
    [
        ("GPT2", "attn"),
        ("GPTNeoX", "attention"),
        ("Falcon", "self_attention"),
        ("Phi", "self_attn"),
    ],
)
def test_presets_on_real_huggingface_decoders(family, attn):
    """Real HuggingFace layers (random init, no download): attn and mlp name their blocks."""
    transformers = pytest.importorskip("transformers")
    config = getattr(transformers, f"{family}Config")(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, vocab_size=64
    )
    model = getattr(
        transformers, f"{family}ForCausalLM" if family != "GPT2" else "GPT2LMHeadModel"
    )(config)
    layers = hf_decoder_layers(model)
    got = select_targets([(f"layers.{i}", m) for i, m in enumerate(layers)], ["attn", "mlp"])
    assert names(got) == [f"layers.{i}.{m}" for i in range(2) for m in (attn, "mlp")]
    assert [t.scope for t in got] == ["attn", "mlp"] * 2


def test_mlp_scope_skips_moe_blocks_and_moe_scopes_skip_dense_mlps():
    with pytest.raises(GraphConfigError, match="mlp: no module"):
        select_targets(units(lambda: mcore_layer(True), 1), ["mlp"])
    with pytest.raises(GraphConfigError) as err:  # HuggingFace Mixtral: mlp is the MoE block
        select_targets(units(hf_qwen_moe_layer, 1), ["mlp"])
    assert "mlp is an MoE block here and scope mlp takes dense MLPs only: use moe" in str(err.value)
    with pytest.raises(GraphConfigError, match="a dense model"):
        select_targets(units(hf_llama_layer, 1), ["moe"])


def test_mcore_moe_preprocess_is_not_a_module():
    moe = units(lambda: mcore_layer(True), 1)
    with pytest.raises(GraphConfigError) as err:
        select_targets(moe, ["moe_router", "moe_preprocess"])
    msg = str(err.value)
    assert "moe_preprocess: no module" in msg
    assert "Megatron-Core's MoELayer runs its preprocess in methods" in msg
    assert "self_attention (Box), pre_mlp_layernorm (Identity), mlp (Box)" in msg


def test_no_match_error_lists_the_units_children_and_scope_modules():
    layer = lambda: Box(mixer=Box(wq=Leaf()), feed_forward=Leaf(), norm=nn.LayerNorm(4))  # noqa: E731
    with pytest.raises(GraphConfigError) as err:
        select_targets(units(layer), ["attn"])
    msg = str(err.value)
    assert "mixer (Box), feed_forward (Leaf), norm (LayerNorm)" in msg
    assert "self_attention, self_attn, attn, attention" in msg  # what the presets looked for
    assert "scope_modules={'attn': 'mixer'}" in msg
    assert "--cuda-graph-scope-modules attn=mixer" in msg
    # the example names a child the scope plausibly means, never the norm
    with pytest.raises(GraphConfigError) as err:
        select_targets(units(layer), ["mlp"])
    assert "scope_modules={'mlp': 'feed_forward'}" in str(err.value)
    with pytest.raises(GraphConfigError) as err:
        select_targets(units(lambda: Box(norm=nn.LayerNorm(4), body=Leaf())), ["attn"])
    assert "scope_modules={'attn': 'PATH'}" in str(err.value)
    got = select_targets(
        units(layer),
        ["attn", "mlp"],
        scope_modules={"attn": "mixer", "mlp": ["ffn", "feed_forward"]},
    )
    assert names(got) == [
        "layers.0.mixer",
        "layers.0.feed_forward",
        "layers.1.mixer",
        "layers.1.feed_forward",
    ]


def test_user_scope_modules_override_presets_and_define_new_scopes():
    hf = units(hf_llama_layer, 1)
    got = select_targets(hf, ["attn"], scope_modules={"attn": "self_attn.q_proj"})
    assert names(got) == ["layers.0.self_attn.q_proj"]
    got = select_targets(hf, ["attn", "gates"], scope_modules={"gates": ["mlp.gate_proj"]})
    assert names(got) == ["layers.0.self_attn", "layers.0.mlp.gate_proj"]
    assert got[1].scope == "gates"
    with pytest.raises(GraphConfigError, match="unknown scope 'gates'"):
        select_targets(hf, ["gates"])
    with pytest.raises(GraphConfigError, match="lies inside layers.0.self_attn"):
        select_targets(hf, ["attn", "q"], scope_modules={"q": "self_attn.q_proj"})
    with pytest.raises(GraphConfigError, match="selected by scopes 'attn' and 'x'"):
        select_targets(hf, ["attn", "x"], scope_modules={"x": "self_attn"})


@pytest.mark.parametrize(
    "mapping, match",
    [
        ({"full_iteration": "x"}, "scope name 'full_iteration' is invalid"),
        ({"my-scope": "x"}, "scope name 'my-scope' is invalid"),
        ({"attn": []}, "non-empty list"),
        ({"attn": "self attn"}, "path 'self attn' is not a dotted submodule path"),
        ({"attn": ".x"}, "path '.x'"),
        (["attn"], "must be a mapping"),
    ],
)
def test_invalid_scope_modules(mapping, match):
    with pytest.raises(GraphConfigError, match=match):
        normalize_scope_modules(mapping)


def test_parse_scope_modules_flag():
    got = parse_scope_modules(["attn=self_attn", "mlp=mlp,feed_forward", "r=layers.0.gate"])
    assert got == {"attn": ("self_attn",), "mlp": ("mlp", "feed_forward"), "r": ("layers.0.gate",)}
    with pytest.raises(GraphConfigError, match="expected SCOPE=PATH"):
        parse_scope_modules(["attn"])
    with pytest.raises(GraphConfigError, match="given twice"):
        parse_scope_modules(["attn=a", "attn=b"])
    check_scopes(["attn", "router"], scope_modules=got | {"router": "gate"})


def test_cli_scope_modules_flag():
    parser = argparse.ArgumentParser()
    add_graph_args(parser)
    args = parser.parse_args(
        [
            "--cuda-graph-scope",
            "attn",
            "qkv",
            "--cuda-graph-scope-modules",
            "qkv=self_attention.qkv",
        ]
    )
    mapping = scope_modules_of(args)
    assert mapping == {"qkv": ["self_attention.qkv"]}
    dense = GPTConfig(num_layers=2, hidden_size=16, num_attention_heads=2)
    assert cli_check_scopes(
        ["attn", "qkv"], dense, flag="--cuda-graph-scope", scope_modules=mapping
    ) == ["attn"]
    with pytest.raises(CLIError, match="unknown scope 'qkv'"):
        cli_check_scopes(["qkv"], dense, flag="--cuda-graph-scope")
    bad = parser.parse_args(["--cuda-graph-scope-modules", "qkv"])
    with pytest.raises(CLIError, match="expected SCOPE=PATH"):
        scope_modules_of(bad)


def test_call_signature_rejects_stateful_objects_and_explains_mismatches():
    class DynamicCache:  # what HuggingFace passes as past_key_values with use_cache=True
        pass

    h = torch.randn(2, 3, 4)
    pe = (torch.randn(3, 4), torch.randn(3, 4))
    with pytest.raises(GraphConfigError, match=r"kwargs\['past_key_values'\] is a .*DynamicCache"):
        CallSignature((h,), {"past_key_values": DynamicCache()}, what="layers.0")
    sig = CallSignature(
        (h,), {"attention_mask": None, "position_embeddings": pe, "use_cache": False}
    )
    assert (
        sig.mismatch((h,), {"attention_mask": None, "position_embeddings": pe, "use_cache": False})
        is None
    )
    why = sig.mismatch(
        (h,),
        {"attention_mask": None, "position_embeddings": (pe[0], pe[1][:2]), "use_cache": False},
    )
    assert "kwargs['position_embeddings'][1] is (2, 4):float32" in why
    why = sig.mismatch((h,), {"attention_mask": None, "position_embeddings": pe, "use_cache": True})
    assert "kwargs['use_cache'] is True, captured as False" in why
    why = sig.mismatch((h,), {"attention_mask": None, "position_embeddings": pe})
    assert "structure differs" in why and "'use_cache'" in why
