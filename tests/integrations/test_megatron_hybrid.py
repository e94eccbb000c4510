"""Megatron-Core hybrid models' configuration, scopes and Mamba refusal (CPU, one process).

The config and scope rules need no megatron-core; the release facts and the Mamba refusal
import it (0.16 on Python 3.11, as CI installs it, or 0.19). Sharded training, checkpoints and
scope resolution on a built model: test_megatron_hybrid_gloo.py; CUDA graphs:
test_megatron_hybrid_gpu.py.
"""

from __future__ import annotations

import sys

import pytest
from graph_fsdp_testing import TINY_MCORE_SHAPE, error_of, megatron_imports

from graph_fsdp.capture.scopes import GraphConfigError
from graph_fsdp.integrations import megatron as gm


def _cfg(pattern: str, **kw) -> gm.MCoreGPTConfig:
    base = dict(TINY_MCORE_SHAPE, transformer_impl="local", hybrid_layer_pattern=pattern)
    if "E" in pattern:
        base.update(num_experts=4, moe_token_dispatcher_type="allgather")
    return gm.MCoreGPTConfig(**{**base, **kw})


needs_megatron = pytest.mark.skipif(
    not megatron_imports(), reason="megatron-core does not import here"
)


# ----------------------------------------------------------------------------- config rules
def test_the_pattern_sets_the_layer_count_as_megatron_derives_it():
    cfg = _cfg("*-E-*-")
    assert cfg.num_layers == 6 and cfg.is_hybrid and cfg.is_moe
    assert [cfg.has_layers(c) for c in "*-EM"] == [True, True, True, False]
    gpt = gm.MCoreGPTConfig(**TINY_MCORE_SHAPE)
    assert not gpt.is_hybrid and [gpt.has_layers(c) for c in "*-EM"] == [True, True, False, False]


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        (dict(hybrid_layer_pattern=""), "give one character per layer"),
        (dict(hybrid_layer_pattern="*-G"), "has 'G': graph_fsdp builds '*' (attention)"),
        (dict(hybrid_layer_pattern="*-|*-"), "'|' splits the pattern into pipeline stages"),
        (dict(hybrid_layer_pattern="*-/*-"), "'/' starts multi-token-prediction depths"),
        (dict(hybrid_layer_pattern="*E"), "has MoE layers ('E'), but num_experts is None"),
        (dict(hybrid_layer_pattern="*-", num_experts=4), "has no MoE layer ('E')"),
        (dict(hybrid_layer_pattern="*M"), "Mamba layer ('M') comes with its TransformerEngine"),
        (
            dict(hybrid_layer_pattern="*-", tensor_model_parallel_size=2),
            "use TP = 1 for hybrid models",
        ),
    ],
)
def test_config_refuses_patterns_it_cannot_build(fields, words):
    base = dict(TINY_MCORE_SHAPE, transformer_impl="local")
    assert words in error_of(lambda: gm.MCoreGPTConfig(**{**base, **fields}))


def test_packed_sequences_refuse_hybrid_models():
    assert "packs run through GPTModels only" in error_of(
        lambda: gm.check_packed_config(_cfg("*-", transformer_impl="transformer_engine"))
    )


# ----------------------------------------------------------------------------- scopes
@pytest.mark.parametrize(
    ("pattern", "scopes", "ok"),
    [
        ("*-E-", ["attn", "mlp", "moe_router"], True),
        ("*-E-", ["attn", "mlp"], True),
        ("*-*-", ["attn", "mlp"], True),
        ("*-*-", [], True),
        ("*-*-", ["full_iteration"], True),
        ("*E*E", ["attn", "moe_router"], True),
    ],
)
def test_scopes_a_hybrid_model_has(pattern, scopes, ok):
    assert gm.check_mcore_scopes(_cfg(pattern), scopes) == scopes


@pytest.mark.parametrize(
    ("pattern", "scopes", "words"),
    [
        ("*-*-", ["moe_router"], "has no such layer (moe_router needs 'E' layers)"),
        ("*E*E", ["mlp"], "has no such layer (mlp needs '-' layers)"),
        ("-E-E", ["attn", "moe_router"], "has no such layer (attn needs '*' layers)"),
        # Megatron's dropless experts sync with the host: the whole layer is refused as for GPTs.
        ("*-E-", [], "--cuda-graph-scope the whole layer: MoE layers with Megatron's dropless"),
    ],
)
def test_scopes_a_hybrid_model_lacks(pattern, scopes, words):
    with pytest.raises(GraphConfigError) as err:
        gm.check_mcore_scopes(_cfg(pattern), scopes)
    assert words in str(err.value)


def test_gpt_scope_messages_are_unchanged():
    dense = gm.MCoreGPTConfig(**TINY_MCORE_SHAPE, transformer_impl="local")
    moe = gm.MCoreGPTConfig(**TINY_MCORE_SHAPE, transformer_impl="local", num_experts=4)
    assert "needs an MoE model (--num-experts N), but this GPT is dense" in error_of(
        lambda: gm.check_mcore_scopes(dense, ["moe_router"])
    )
    assert "every layer of this Megatron-Core MoE GPT is an MoELayer" in error_of(
        lambda: gm.check_mcore_scopes(moe, ["mlp"])
    )


# ----------------------------------------------------------------------------- megatron-core
@needs_megatron
def test_both_releases_have_the_moe_character():
    from graph_fsdp.integrations.megatron import versions

    assert {"*", "-", "E", "M"} <= versions.hybrid_symbols()
    assert set(versions.hybrid_pattern_kwargs("*-")) == {
        "hybrid_layer_pattern" if versions.MCORE_VERSION >= (0, 17) else "hybrid_override_pattern"
    }


@needs_megatron
def test_mamba_layers_are_refused_where_their_kernels_do_not_import(monkeypatch):
    for package in ("mamba_ssm", "causal_conv1d"):
        monkeypatch.setitem(sys.modules, package, None)  # import raises ImportError
    cfg = _cfg("*M-", transformer_impl="transformer_engine")
    with pytest.raises(ImportError) as err:  # refused before the device check
        gm.build_hybrid(cfg, "cpu")
    msg = str(err.value)
    assert "hybrid_layer_pattern='*M-' has Mamba layers ('M')" in msg
    assert "mamba_ssm does not import" in msg and "causal_conv1d does not import" in msg
    assert "or drop 'M' from the pattern" in msg


@needs_megatron
def test_build_hybrid_needs_a_pattern():
    assert "hybrid_layer_pattern is None" in error_of(
        lambda: gm.build_hybrid(gm.MCoreGPTConfig(**TINY_MCORE_SHAPE), "cpu")
    )


# ----------------------------------------------------------------------------- command line
HYBRID = ["train", "--model", "mcore-hybrid", "--device", "cpu", "--nproc", "2"]
SHAPE = ["--seq-length", "16", "--vocab-size", "128", "--micro-batch-size", "2"]


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (HYBRID, "--model mcore-hybrid builds its layers from --hybrid-layer-pattern"),
        (
            ["train", "--model", "mcore-gpt", "--hybrid-layer-pattern", "*-"],
            "builds a hybrid model, but --model is mcore-gpt: use --model mcore-hybrid",
        ),
        (
            ["train", "--hybrid-layer-pattern", "*-"],
            "--hybrid-layer-pattern: Megatron-Core model flags, but --model is gpt",
        ),
        ([*HYBRID, "--hybrid-layer-pattern", "*-G"], "has 'G': graph-fsdp builds"),
        (
            [*HYBRID, "--hybrid-layer-pattern", "*-*-", "--cuda-graph-impl", "torch"]
            + ["--cuda-graph-scope", "moe_router", "--fsdp-double-buffer"]
            + ["--fsdp-db-use-persist-buf-on-alloc-fail"],
            "the hybrid pattern '*-*-' has no such layer (moe_router needs 'E' layers)",
        ),
    ],
)
def test_cli_refusals(capsys, argv, expected):
    from graph_fsdp_testing import cli_error

    assert expected in cli_error(capsys, *argv, *SHAPE)


@pytest.mark.parametrize(("pattern", "experts"), [("*-*-*-", None), ("*-E-", 4)])
def test_cli_pattern_reaches_the_train_config(monkeypatch, pattern, experts):
    from graph_fsdp.cli import mcore as megatron_cli
    from graph_fsdp.cli.main import main

    seen = {}
    monkeypatch.setattr(megatron_cli, "check_mcore_environment", lambda *a: None)
    monkeypatch.setattr(megatron_cli, "launch", lambda plan, fn, cfg: seen.update(cfg=cfg))
    argv = [*HYBRID, *SHAPE, "--hybrid-layer-pattern", pattern, "--transformer-impl", "local"]
    assert main([*argv, "--train-iters", "2"]) == 0
    model = seen["cfg"].model
    assert model.hybrid_layer_pattern == pattern and model.num_layers == len(pattern)
    assert model.num_experts == experts and seen["cfg"].model_name == "mcore-hybrid"
