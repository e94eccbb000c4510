"""Tests for the reference GPT models: determinism, static MoE shapes, config validation."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from graph_fsdp.models import (
    MLP,
    GPTConfig,
    GPTModel,
    MoELayer,
    MoEPreprocess,
    MoERouter,
    SelfAttention,
    build_model,
    init_weights,
    model_flops_per_token,
    moe_capacity,
    synthetic_batch,
    transformer_layers,
)


def tiny_config(**overrides: object) -> GPTConfig:
    """A config small enough that every test runs in milliseconds on CPU."""
    base: dict[str, object] = {
        "vocab_size": 64,
        "num_layers": 2,
        "hidden_size": 32,
        "num_attention_heads": 4,
        "seq_length": 16,
    }
    base.update(overrides)
    return GPTConfig(**base)  # type: ignore[arg-type]


def moe_config(**overrides: object) -> GPTConfig:
    """Mixed model: layer 0 MoE, layer 1 dense (moe_layer_freq=2)."""
    return tiny_config(**{"num_experts": 4, "moe_router_topk": 2, "moe_layer_freq": 2, **overrides})


def assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name


# ------------------------------------------------------------------------------ determinism


@pytest.mark.parametrize("make_config", [tiny_config, moe_config])
def test_same_config_builds_identical_weights(make_config) -> None:
    config = make_config()
    torch.manual_seed(0)
    first = build_model(config)
    torch.manual_seed(1)  # the global RNG must not matter
    assert_same_weights(first, build_model(config))


def test_different_seed_gives_different_weights() -> None:
    a = build_model(tiny_config(seed=1))
    b = build_model(tiny_config(seed=2))
    assert not torch.equal(
        a.layers[0].self_attention.qkv.weight, b.layers[0].self_attention.qkv.weight
    )


@pytest.mark.parametrize("make_config", [tiny_config, moe_config])
def test_meta_build_materialised_matches_direct_build(make_config) -> None:
    config = make_config()
    direct = build_model(config)
    meta = build_model(config, device="meta")
    assert all(p.is_meta for p in meta.parameters())
    meta.to_empty(device="cpu")
    for module in meta.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    assert_same_weights(direct, meta)


def test_init_weights_restores_and_reseeds() -> None:
    config = moe_config()
    model = build_model(config)
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    init_weights(model)
    for name, value in model.state_dict().items():
        assert torch.equal(value, reference[name]), name
    # Re-initialising a single layer regenerates that layer's weights in place.
    with torch.no_grad():
        model.layers[1].mlp.fc1.weight.zero_()
    init_weights(model.layers[1])
    assert torch.equal(model.layers[1].mlp.fc1.weight, reference["layers.1.mlp.fc1.weight"])
    # A config with another seed reseeds every parameter.
    init_weights(model, dataclasses.replace(config, seed=config.seed + 1))
    assert not torch.equal(model.output.weight, reference["output.weight"])


def test_dtype_build_is_cast_of_float32_build() -> None:
    config = tiny_config()
    bf16 = build_model(config, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in bf16.parameters())
    assert_same_weights(bf16, build_model(config).to(torch.bfloat16))


def test_init_statistics() -> None:
    config = tiny_config(num_layers=8, hidden_size=64, num_attention_heads=4)
    model = build_model(config)
    attn = model.layers[0].self_attention
    assert torch.equal(attn.norm.weight, torch.ones_like(attn.norm.weight))
    assert attn.qkv.weight.std().item() == pytest.approx(config.init_std, rel=0.1)
    scaled = config.init_std / math.sqrt(2 * config.num_layers)
    assert attn.proj.weight.std().item() == pytest.approx(scaled, rel=0.1)
    # Parameters are seeded by name, so same-shaped weights in different layers differ.
    assert not torch.equal(attn.qkv.weight, model.layers[1].self_attention.qkv.weight)


def test_standalone_submodule_is_deterministic() -> None:
    config = tiny_config()
    torch.manual_seed(0)
    a = SelfAttention(config)
    torch.manual_seed(1)
    assert_same_weights(a, SelfAttention(config))
    assert a.qkv.weight.abs().sum() > 0


# ------------------------------------------------------------------------------ forward/backward


@pytest.mark.parametrize("make_config", [tiny_config, moe_config])
def test_forward_backward_shapes_and_finite_loss(make_config) -> None:
    config = make_config()
    model = build_model(config)
    input_ids, labels = synthetic_batch(config, micro_batch_size=2, step=0)
    logits = model(input_ids)
    assert logits.shape == (2, config.seq_length, config.vocab_size)
    loss = model(input_ids, labels)
    assert loss.shape == ()
    assert loss.dtype == torch.float32
    assert torch.isfinite(loss)
    # Initial loss of a small-init model is close to uniform prediction.
    assert loss.item() == pytest.approx(math.log(config.vocab_size), rel=0.1)
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert p.grad.shape == p.shape, name
        assert torch.isfinite(p.grad).all(), name


def test_mixed_dense_and_moe_layers() -> None:
    config = moe_config(num_layers=4)
    layers = transformer_layers(build_model(config))
    assert [layer.is_moe for layer in layers] == [True, False, True, False]
    assert isinstance(layers[0].moe, MoELayer)
    assert not hasattr(layers[0], "mlp")
    assert isinstance(layers[1].mlp, MLP)
    assert not hasattr(layers[1], "moe")
    assert not any(layer.is_moe for layer in transformer_layers(build_model(tiny_config())))


def test_bf16_forward_backward() -> None:
    config = moe_config()
    model = build_model(config, dtype=torch.bfloat16)
    input_ids, labels = synthetic_batch(config, micro_batch_size=1, step=3)
    loss = model(input_ids, labels)
    assert loss.dtype == torch.float32
    assert torch.isfinite(loss)
    loss.backward()


# ------------------------------------------------------------------------------ MoE


def test_router_outputs() -> None:
    config = moe_config()
    router = MoERouter(config)
    probs, indices = router(torch.randn(10, config.hidden_size))
    assert probs.shape == indices.shape == (10, config.moe_router_topk)
    assert probs.dtype == torch.float32
    assert indices.dtype == torch.int64
    torch.testing.assert_close(probs.sum(-1), torch.ones(10))


def test_moe_capacity_drops_tokens_with_static_shapes() -> None:
    config = moe_config(moe_capacity_factor=0.25)
    num_tokens, num_experts, topk = 32, 4, 2
    capacity = moe_capacity(config, num_tokens)
    assert capacity == math.ceil(0.25 * num_tokens * topk / num_experts) == 4
    preprocess = MoEPreprocess(config)
    router = MoERouter(config)

    shapes = set()
    for x in (torch.randn(num_tokens, config.hidden_size), torch.zeros(num_tokens, 32)):
        probs, indices = router(x)
        dispatch, combine = preprocess(probs, indices, torch.bfloat16)
        shapes.add((dispatch.shape, combine.shape))
        assert dispatch.dtype == combine.dtype == torch.bfloat16
        assert dispatch.shape == (num_tokens, num_experts, capacity)
        assert (dispatch.sum(dim=(1, 2)) <= topk).all()  # per token: at most topk slots
        assert (dispatch.sum(dim=0) <= 1).all()  # per (expert, slot): at most one token
        # Only num_experts * capacity slots exist for num_tokens * topk choices: drops happen.
        assert dispatch.sum() <= num_experts * capacity < num_tokens * topk
    assert len(shapes) == 1  # shapes do not depend on the routing decisions


def test_moe_preprocess_slots_follow_token_order() -> None:
    config = moe_config(moe_router_topk=1, moe_capacity_factor=1.0)
    # All 4 tokens pick expert 2; capacity is ceil(4 * 1 / 4) = 1, so only token 0 fits.
    indices = torch.full((4, 1), 2, dtype=torch.int64)
    probs = torch.ones(4, 1)
    dispatch, combine = MoEPreprocess(config)(probs, indices)
    assert dispatch.shape == (4, 4, 1)
    expected = torch.zeros(4, 4, 1)
    expected[0, 2, 0] = 1
    assert torch.equal(dispatch, expected)
    assert torch.equal(combine, expected)


def test_moe_layer_matches_per_token_reference_without_drops() -> None:
    # Capacity factor num_experts / topk gives every expert room for all tokens: no drops.
    config = moe_config(moe_capacity_factor=2.0)
    layer = MoELayer(config)
    x = torch.randn(2, 5, config.hidden_size)
    y = layer(x)

    x_flat = layer.norm(x).reshape(10, -1)
    probs, indices = layer.router(x_flat)
    expected = torch.zeros_like(x_flat)
    for t in range(10):
        for weight, e in zip(probs[t], indices[t], strict=True):
            hidden = F.gelu(x_flat[t] @ layer.experts.w1[e], approximate="tanh")
            expected[t] += weight * (hidden @ layer.experts.w2[e])
    torch.testing.assert_close(y, expected.view(2, 5, -1))
    y.sum().backward()
    assert layer.router.gate.weight.grad.abs().sum() > 0  # combine carries router gradient


# ------------------------------------------------------------------------------ data and FLOPs


def test_synthetic_batch_is_deterministic_and_shifted() -> None:
    config = tiny_config()
    input_ids, labels = synthetic_batch(config, micro_batch_size=3, step=5, rank=1)
    assert input_ids.shape == labels.shape == (3, config.seq_length)
    assert input_ids.dtype == labels.dtype == torch.int64
    assert torch.equal(input_ids[:, 1:], labels[:, :-1])
    assert int(input_ids.min()) >= 0
    assert int(input_ids.max()) < config.vocab_size
    again = synthetic_batch(config, micro_batch_size=3, step=5, rank=1)
    assert torch.equal(input_ids, again[0])
    assert torch.equal(labels, again[1])
    assert not torch.equal(input_ids, synthetic_batch(config, 3, step=6, rank=1)[0])
    assert not torch.equal(input_ids, synthetic_batch(config, 3, step=5, rank=0)[0])


def test_model_flops_per_token() -> None:
    config = GPTConfig()  # defaults: h=1024, 16 layers, 32000 vocab, seq 1024
    h, layers, vocab, seq = 1024, 16, 32000, 1024
    dense_params = layers * (4 * h * h + 8 * h * h) + vocab * h
    assert model_flops_per_token(config) == 6 * dense_params + 12 * layers * h * seq
    # Top-2 MoE on every layer: router plus two experts' worth of FFN per token.
    moe = dataclasses.replace(config, num_experts=8, moe_router_topk=2)
    moe_params = layers * (4 * h * h + 8 * h + 2 * 8 * h * h) + vocab * h
    assert model_flops_per_token(moe) == 6 * moe_params + 12 * layers * h * seq


# ------------------------------------------------------------------------------ validation


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"hidden_size": 30, "num_attention_heads": 4}, "num_attention_heads"),
        ({"num_experts": 4, "moe_router_topk": 5}, "moe_router_topk"),
        ({"num_experts": 1}, "num_experts"),
        ({"moe_capacity_factor": 0.0}, "moe_capacity_factor"),
        ({"moe_layer_freq": 0}, "moe_layer_freq"),
        ({"num_layers": 0}, "num_layers"),
        ({"init_std": -1.0}, "init_std"),
        ({"ffn_hidden_size": 0}, "ffn_hidden_size"),
    ],
)
def test_config_validation_names_the_field(overrides: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=f"GPTConfig.{field}="):
        tiny_config(**overrides)


def test_config_defaults() -> None:
    config = GPTConfig()
    assert config.ffn_hidden_size == 4 * config.hidden_size
    assert config.head_dim == 64
    assert not config.is_moe_layer(0)
    with pytest.raises(TypeError):
        GPTConfig(1000)  # type: ignore[misc]  # kw_only


def test_sequence_longer_than_config_is_rejected() -> None:
    config = tiny_config()
    model = GPTModel(config)
    with pytest.raises(ValueError, match="seq_length"):
        model(torch.zeros(1, config.seq_length + 1, dtype=torch.int64))


# ------------------------------------------------------------------------------ DTensor init


def test_reset_parameters_into_dtensor(tmp_path) -> None:
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or not dist.is_gloo_available() or dist.is_initialized():
        pytest.skip("needs an uninitialised torch.distributed with gloo")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        config = tiny_config()
        reference = MLP(config)
        sharded = MLP(config)
        mesh = init_device_mesh("cpu", (1,))
        for name, param in list(sharded.fc1.named_parameters()):
            dtensor = distribute_tensor(torch.zeros_like(param), mesh, [Shard(0)])
            setattr(sharded.fc1, name, torch.nn.Parameter(dtensor))
        sharded.fc1.reset_parameters()
        torch.testing.assert_close(
            sharded.fc1.weight.full_tensor(), reference.fc1.weight, rtol=0, atol=0
        )
    finally:
        dist.destroy_process_group()
