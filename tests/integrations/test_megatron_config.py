"""Megatron integration on CPU: the import guard, config validation (Megatron-Bridge rules),
Megatron-Core scope rules and the CLI's --model / Bridge flags. Pure logic: no megatron-core
needed, though CI has it (0.16 on Python 3.11); the GPU tests in
tests/integrations/test_megatron_gpu.py run the models on 0.19."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
import warnings

import pytest
from graph_fsdp_testing import cli_error, megatron_imports

from graph_fsdp.capture.scopes import GraphConfigError
from graph_fsdp.fsdp.api import BufferPolicy
from graph_fsdp.integrations import megatron as gm
from graph_fsdp.integrations.bridge_config import FSDPConfigError, validate_fsdp_config

STATIC = BufferPolicy(allocator="double_buffer", persist_on_alloc_fail=True)


# ------------------------------------------------------------------ import guard
def test_importing_graph_fsdp_and_the_integration_needs_no_megatron() -> None:
    import graph_fsdp.integrations.megatron
    import graph_fsdp.integrations.megatron.train  # noqa: F401

    assert gm.INSTALL_HINT == 'pip install -e ".[megatron]"'


def test_require_megatron_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    # megatron.core as if not installed (a None entry makes its import raise ImportError).
    monkeypatch.setitem(sys.modules, "megatron.core", None)
    with pytest.raises(ImportError, match=r'pip install -e "\.\[megatron\]"'):
        gm.require_megatron()
    with pytest.raises(ImportError, match=r"megatron-core \(0.16 on Python 3.11, 0.19 on"):
        gm.build_gpt(gm.MCoreGPTConfig(transformer_impl="local"), "cpu")


def test_megatron_core_imports_when_installed() -> None:
    if importlib.util.find_spec("megatron") is None or not megatron_imports():
        pytest.skip(
            "megatron.core does not import here (pip install -e '.[megatron]'); "
            "the GPU tests cover the integration"
        )
    core = gm.require_megatron()
    assert hasattr(core, "parallel_state")


# ------------------------------------------------------------------ validate_fsdp_config
def test_valid_config_passes() -> None:
    validate_fsdp_config(ckpt_format="fsdp_dtensor", save="/tmp/x")
    validate_fsdp_config(cpu_offload=True, pipeline_model_parallel_size=1)
    validate_fsdp_config(cuda_graph_impl="te", cuda_graph_scope=["attn"], buffer_policy=STATIC)
    validate_fsdp_config(use_graph_fsdp=False, use_torch_fsdp2=True)  # not ours to judge


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"use_torch_fsdp2": True}, ["use_torch_fsdp2", "exclude each other"]),
        ({"use_megatron_fsdp": True}, ["use_megatron_fsdp", "exclude each other"]),
        ({"use_tp_pp_dp_mapping": True}, ["use_tp_pp_dp_mapping=True is not supported"]),
        ({"ckpt_format": "torch_dist"}, ["ckpt_format='torch_dist'", "fsdp_dtensor"]),
        ({"ckpt_format": "zarr", "save": "d"}, ["ckpt_format='zarr'", "DCP"]),
        ({"ckpt_format": None, "load": "d"}, ["without ckpt_format", "fsdp_dtensor"]),
        (
            {"cpu_offload": True, "pipeline_model_parallel_size": 2},
            ["pipeline_model_parallel_size=1, got 2"],
        ),
        (
            {"cpu_offload": True, "recompute_granularity": "full"},
            ["activation recompute", "recompute_granularity='full'"],
        ),
        (
            {"cuda_graph_impl": "te", "cuda_graph_scope": ["attn"]},
            ["--fsdp-double-buffer", "persist_on_alloc_fail"],
        ),
        ({"cuda_graph_impl": "te", "cuda_graph_scope": ["bogus"]}, ["unknown scope 'bogus'"]),
    ],
)
def test_each_rule_has_a_clear_error(kwargs: dict, expected: list[str]) -> None:
    with pytest.raises(FSDPConfigError) as exc:
        validate_fsdp_config(**kwargs)
    for text in expected:
        assert text in str(exc.value), (text, str(exc.value))


def test_all_problems_are_reported_at_once() -> None:
    with pytest.raises(FSDPConfigError) as exc:
        validate_fsdp_config(use_torch_fsdp2=True, use_tp_pp_dp_mapping=True, ckpt_format="torch")
    assert str(exc.value).count("\n  - ") == 3


def test_full_iteration_needs_no_layerwise_buffer_flags() -> None:
    """full_iteration needs static buffers (no persist flag): the same rule as the engine's
    check before a capture (capture/scopes.py check_static_buffers)."""
    validate_fsdp_config(
        cuda_graph_impl="torch",
        cuda_graph_scope=["full_iteration"],
        buffer_policy=BufferPolicy(allocator="double_buffer"),
    )
    with pytest.raises(FSDPConfigError, match="full_iteration replays FSDP's buffer hand-offs"):
        validate_fsdp_config(cuda_graph_impl="torch", cuda_graph_scope=["full_iteration"])


# ------------------------------------------------------------------ MCoreGPTConfig and scopes
@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"gradient_accumulation_fusion": True}, "gradient_accumulation_fusion=False"),
        ({"expert_model_parallel_size": 2}, "expert_model_parallel_size=2 needs an MoE model"),
        ({"num_experts": 4, "expert_model_parallel_size": 0}, "must be a positive integer"),
        ({"num_experts": 4, "expert_model_parallel_size": True}, "must be a positive integer"),
        (
            {"num_experts": 6, "expert_model_parallel_size": 4},
            "expert_model_parallel_size=4 does not divide num_experts=6",
        ),
        (
            {"num_experts": 4, "moe_experts_impl": "grouped_mm", "moe_receive_buffer_factor": 0},
            "moe_receive_buffer_factor=0 is invalid: expected a float > 0 or None",
        ),
        (
            {"num_experts": 4, "expert_model_parallel_size": 2, "moe_receive_buffer_factor": 1.5},
            "use moe_experts_impl='grouped_mm'",
        ),
        ({"moe_receive_buffer_factor": 1.5}, "moe_receive_buffer_factor=1.5 needs an MoE model"),
        ({"num_attention_heads": 3}, "does not divide"),
        ({"num_experts": 1}, "num_experts=1 must be >= 2"),
        ({"num_experts": 4, "moe_router_topk": 5}, "moe_router_topk=5"),
        ({"transformer_impl": "te"}, "transformer_impl='te'"),
        ({"attention_backend": "cudnn"}, "attention_backend='cudnn'; choose one of auto"),
        ({"attention_backend": "local"}, "the local layer spec's attention"),
        ({"moe_expert_capacity_factor": 1.0}, "moe_expert_capacity_factor=1.0 needs an MoE"),
        ({"moe_experts_impl": "grouped_mm"}, "needs an MoE model: set num_experts"),
        ({"num_experts": 4, "moe_experts_impl": "te"}, "moe_experts_impl='te'; choose one of"),
        ({"num_experts": 4, "moe_token_dispatcher_type": "a2a"}, "choose one of alltoall"),
        ({"num_experts": 4, "moe_aux_loss_coeff": -1.0}, "moe_aux_loss_coeff=-1.0 must be >= 0"),
        ({"num_experts": 4, "moe_expert_capacity_factor": 0.0}, "must be > 0"),
        ({"num_experts": 4, "moe_expert_capacity_factor": -1.0}, "say None"),
        (
            {"num_experts": 4, "moe_pad_expert_input_to_capacity": True},
            "moe_expert_capacity_factor sets: give a factor",
        ),
        (
            {
                "num_experts": 4,
                "moe_expert_capacity_factor": 2.5,
                "moe_pad_expert_input_to_capacity": True,
            },
            "use a factor <= num_experts / moe_router_topk = 2",
        ),
        (
            {"num_experts": 4, "moe_experts_impl": "grouped_mm", "moe_expert_capacity_factor": 1.0},
            "is the dropless path",
        ),
        (
            {
                "num_experts": 4,
                "moe_experts_impl": "grouped_mm",
                "moe_token_dispatcher_type": "flex",
            },
            "is not replaced: use alltoall",
        ),
        (
            {"num_experts": 4, "moe_experts_impl": "grouped_mm", "ffn_hidden_size": 100},
            "ffn_hidden_size=100 is not a multiple of 8",
        ),
    ],
)
def test_mcore_config_rejects(kwargs: dict, expected: str) -> None:
    with pytest.raises(ValueError, match=expected):
        gm.MCoreGPTConfig(**kwargs)


DENSE = gm.MCoreGPTConfig()
MOE = gm.MCoreGPTConfig(num_experts=4, moe_shared_expert_intermediate_size=64)
DROP_PAD = dataclasses.replace(
    MOE, moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True
)
DROP_ONLY = dataclasses.replace(MOE, moe_expert_capacity_factor=1.0)
DROP_PAD_ALLGATHER = dataclasses.replace(DROP_PAD, moe_token_dispatcher_type="allgather")
GROUPED = dataclasses.replace(MOE, moe_experts_impl="grouped_mm", moe_aux_loss_coeff=1e-2)


@pytest.mark.parametrize(
    ("cfg", "scopes"),
    [
        (DENSE, []),
        (DENSE, ["attn"]),
        (DENSE, ["attn", "mlp"]),
        (DENSE, ["full_iteration"]),
        (MOE, ["attn"]),
        (MOE, ["moe_router"]),
        (MOE, ["attn", "moe_router"]),
        (MOE, ["moe_router", "moe_preprocess"]),
        (MOE, ["attn", "moe_router", "moe_preprocess"]),
        (DROP_PAD, []),
        (DROP_PAD, ["moe"]),
        (DROP_PAD, ["attn", "moe"]),
        (DROP_PAD, ["full_iteration"]),
        (DROP_PAD, ["attn", "moe_router"]),
        (GROUPED, []),
        (GROUPED, ["moe"]),
        (GROUPED, ["attn", "moe"]),
        (GROUPED, ["full_iteration"]),
        (GROUPED, ["attn", "moe_router"]),
    ],
)
def test_capturable_scopes(cfg: gm.MCoreGPTConfig, scopes: list[str]) -> None:
    assert gm.check_mcore_scopes(cfg, scopes) == scopes


@pytest.mark.parametrize(
    ("cfg", "scopes", "expected"),
    [
        (DENSE, ["moe_router"], "needs an MoE model"),
        (MOE, [], "the whole layer"),
        (MOE, ["moe"], "host sync"),
        (MOE, ["full_iteration"], "full_iteration"),
        (MOE, ["mlp"], "no dense MLP"),
        (MOE, ["moe_preprocess"], "requires moe_router"),
        (DROP_ONLY, [], "set moe_pad_expert_input_to_capacity=True"),
        (DROP_PAD_ALLGATHER, ["moe"], "use moe_token_dispatcher_type='alltoall'"),
        (GROUPED, ["moe_router", "moe_preprocess"], "no host sync to split off"),
        (DROP_PAD, ["moe_router", "moe_preprocess"], "capture moe or the whole layer with drop"),
        (GROUPED, ["mlp"], "no dense MLP"),
    ],
)
def test_scopes_the_model_cannot_capture(cfg, scopes, expected: str) -> None:
    with pytest.raises(GraphConfigError, match=expected):
        gm.check_mcore_scopes(cfg, scopes)


@pytest.mark.parametrize("scopes", [[], ["moe"], ["full_iteration"]])
def test_dropless_refusal_names_the_sync_and_both_ways_out(scopes: list[str]) -> None:
    with pytest.raises(GraphConfigError) as err:
        gm.check_mcore_scopes(MOE, scopes)
    text = str(err.value)
    for part in (
        "MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize",
        "moe_experts_impl='grouped_mm'",
        "moe_expert_capacity_factor=1.0 and moe_pad_expert_input_to_capacity=True",
        "--cuda-graph-scope attn moe_router",
    ):
        assert part in text, (part, text)
    allgather = dataclasses.replace(MOE, moe_token_dispatcher_type="allgather")
    assert "MoEAllGatherTokenDispatcher.dispatch_postprocess" in gm.moe_expert_capture_refusal(
        allgather
    )


# ------------------------------------------------------------------ CLI
def error_of(capsys: pytest.CaptureFixture, *argv: str) -> str:
    return cli_error(capsys, "train", "--device", "cpu", *argv)


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--ckpt-format", "torch_dist", "--save", "ck"], ["torch_dist", "fsdp_dtensor"]),
        (["--model", "mcore-moe", "--cuda-graph-impl", "te"], ["the whole layer", "moe_router"]),
        (
            ["--model", "mcore-moe", "--cuda-graph-impl", "te", "--cuda-graph-scope", "moe"],
            ["host sync", "attn moe_router"],
        ),
        (
            ["--model", "mcore-gpt", "--cuda-graph-impl", "te", "--cuda-graph-scope", "attn"],
            ["--fsdp-double-buffer"],
        ),
        (
            ["--model", "mcore-gpt", "--moe-shared-expert-intermediate-size", "64"],
            ["needs an MoE model"],
        ),
        (["--model", "mcore-gpt", "--cuda-graph-scope", "attn"], ["--cuda-graph-impl is none"]),
        (["--model", "mcore-gpt", "--num-attention-heads", "3"], ["does not divide"]),
        (
            [
                "--model",
                "mcore-gpt",
                "--cuda-graph-impl",
                "torch",
                "--cuda-graph-scope",
                "full_iteration",
            ],
            ["full_iteration replays FSDP's buffer", "--fsdp-double-buffer"],
        ),
        (
            [
                "--model",
                "mcore-gpt",
                "--use-megatron-schedule",
                "--cuda-graph-impl",
                "torch",
                "--cuda-graph-scope",
                "full_iteration",
                "--fsdp-double-buffer",
            ],
            ["--use-megatron-schedule with --cuda-graph-scope full_iteration"],
        ),
        (["--model", "mcore-gpt", "--moe-layer-freq", "2", "--num-experts", "4"], ["freq 1"]),
        (
            ["--model", "mcore-gpt", "--transformer-impl", "transformer_engine"]
            + ["--attention-backend", "local"],
            ["--attention-backend='local' is the local layer spec's attention"],
        ),
        (["--attention-backend", "unfused"], ["--attention-backend: Megatron-Core model flags"]),
        (
            ["--use-megatron-schedule", "--moe-shared-expert-intermediate-size", "8"],
            ["--use-megatron-schedule, --moe-shared-expert-intermediate-size: Megatron-Core"],
        ),
        (
            ["--model", "mcore-gpt", "--transformer-impl", "transformer_engine"],
            ["needs CUDA", "cpu"],
        ),
    ],
)
def test_cli_rejects(capsys, argv: list[str], expected: list[str]) -> None:
    err = error_of(capsys, *argv)
    for text in expected:
        assert text in err, (text, err)


def test_cli_model_flag_parses() -> None:
    from graph_fsdp.cli.main import build_parser

    args = build_parser().parse_args(
        ["train", "--model", "mcore-moe", "--moe-shared-expert-intermediate-size", "64"]
    )
    assert args.model == "mcore-moe" and args.moe_shared_expert_intermediate_size == 64
    assert args.ckpt_format == "fsdp_dtensor"
    from graph_fsdp.cli.mcore import mcore_config

    cfg = mcore_config(args)
    assert cfg.num_experts == 4 and cfg.moe_shared_expert_intermediate_size == 64
    assert cfg.attention_backend == "auto"
    args = build_parser().parse_args(
        ["train", "--model", "mcore-gpt", "--attention-backend", "unfused"]
    )
    assert mcore_config(args).attention_backend == "unfused"


# ------------------------------------------------------------------ TE attention under capture
TE_GPT = gm.MCoreGPTConfig(seq_length=64)
OLD_CUDNN, NEW_CUDNN = (9, 10, 2), (9, 15, 1)


@pytest.fixture
def te_cudnn(monkeypatch):
    """Set the cuDNN TransformerEngine reports (TE is not installed here)."""
    from graph_fsdp.capture import te_backend

    def use(version):
        monkeypatch.setattr(te_backend, "te_cudnn_version", lambda: version)
        monkeypatch.setattr(te_backend, "_warned", set())  # warnings come once per process

    return use


@pytest.mark.parametrize("scopes", [["attn"], [], ["attn", "mlp"]])
def test_torch_graphs_of_te_attention_that_would_fault_are_refused(te_cudnn, scopes) -> None:
    """cuDNN <= 9.15.0, seq 64: a torch capture records cuDNN's faulting backward."""
    te_cudnn(OLD_CUDNN)
    with pytest.raises(GraphConfigError) as err:
        gm.check_mcore_attention_capture(TE_GPT, "torch", scopes)
    text = str(err.value)
    for part in ("cuDNN 9.10.2", "sequence length 64", "illegal memory access"):
        assert part in text, text
    assert "--attention-backend unfused" in text and "multiple of 128" in text, text


def test_full_iteration_is_a_torch_capture_too(te_cudnn) -> None:
    te_cudnn(OLD_CUDNN)
    with pytest.raises(GraphConfigError, match="Torch graphs would record it"):
        gm.check_mcore_attention_capture(TE_GPT, "te", ["full_iteration"])


def test_te_graphs_of_that_attention_warn_that_they_are_not_bit_exact(te_cudnn) -> None:
    te_cudnn(OLD_CUDNN)
    with pytest.warns(UserWarning, match="will not be bit-identical to eager ones"):
        gm.check_mcore_attention_capture(TE_GPT, "te", ["attn"])
    pinned = dataclasses.replace(TE_GPT, attention_backend="fused")
    with pytest.raises(GraphConfigError, match="pinned to fused, so TE's capture finds no"):
        gm.check_mcore_attention_capture(pinned, "te", ["attn"])


@pytest.mark.parametrize(
    ("cfg", "impl", "scopes", "cudnn"),
    [
        (dataclasses.replace(TE_GPT, seq_length=128), "torch", ["attn"], OLD_CUDNN),
        (TE_GPT, "torch", ["attn"], NEW_CUDNN),
        (TE_GPT, "torch", ["attn"], None),  # no TransformerEngine
        (TE_GPT, "torch", ["mlp"], OLD_CUDNN),  # attention stays eager
        (dataclasses.replace(TE_GPT, attention_backend="unfused"), "torch", [], OLD_CUDNN),
        (dataclasses.replace(TE_GPT, transformer_impl="local"), "torch", [], OLD_CUDNN),
    ],
)
def test_attention_capture_that_is_safe_passes(te_cudnn, cfg, impl, scopes, cudnn) -> None:
    te_cudnn(cudnn)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gm.check_mcore_attention_capture(cfg, impl, scopes)
