"""Every validation rule of the CLI: bad flags exit 2 before any process starts, naming the flag.

These call ``main(argv)`` in-process; a rejected command never reaches the launcher.
"""

from __future__ import annotations

import pytest
import torch
from _cli_helpers import TINY
from graph_fsdp_testing import cli_error

from graph_fsdp.cli.main import main

MOE = ["--num-experts", "4"]
STATIC = ["--fsdp-double-buffer", "--fsdp-db-use-persist-buf-on-alloc-fail"]


error_of = cli_error
FP32_ACCUM = "--ddp-reduce-scatter-with-fp32-accumulation"


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        # graphs on CPU
        (
            ["--cuda-graph-impl", "torch", "--cuda-graph-scope", "full_iteration"],
            ["--cuda-graph-impl torch needs a CUDA device", "--cuda-graph-impl none"],
        ),
        (
            [
                "--cuda-graph-impl",
                "te",
                "--cuda-graph-scope",
                "attn",
                "--fsdp-buffer",
                "trace_pool",
                "--fsdp-db-use-persist-buf-on-alloc-fail",
            ],
            ["needs a CUDA device"],
        ),
        # scope given but no implementation
        (
            ["--cuda-graph-scope", "attn"],
            ["--cuda-graph-scope is given but --cuda-graph-impl is none", "--cuda-graph-impl te"],
        ),
        (["--cuda-graph-scope"], ["--cuda-graph-impl is none"]),
        # unknown / conflicting scopes
        (
            ["--cuda-graph-impl", "te", "--cuda-graph-scope", "attention", *STATIC],
            [
                "unknown scope 'attention'",
                "attn, mlp, moe, moe_router, moe_preprocess, full_iteration",
            ],
        ),
        (
            ["--cuda-graph-impl", "te", "--cuda-graph-scope", "attn", "attn", *STATIC],
            ["'attn' is given more than once"],
        ),
        (
            ["--cuda-graph-impl", "te", "--cuda-graph-scope", "moe_preprocess", *MOE, *STATIC],
            ["moe_preprocess requires moe_router", "moe_router moe_preprocess"],
        ),
        (
            ["--cuda-graph-impl", "te", "--cuda-graph-scope", "full_iteration", "attn", *STATIC],
            ["full_iteration", "cannot be combined with attn"],
        ),
        (
            ["--cuda-graph-impl", "te", "--cuda-graph-scope", "moe", "moe_router", *MOE, *STATIC],
            ["moe already captures the whole MoE layer"],
        ),
        # scopes vs the model
        (
            ["--cuda-graph-impl", "te", "--cuda-graph-scope", "moe_router", *STATIC],
            ["moe_router needs an MoE model", "add --num-experts"],
        ),
        (
            ["--cuda-graph-impl", "te", "--cuda-graph-scope", "attn", "moe", *STATIC],
            ["moe needs an MoE model", "--num-experts"],
        ),
        (
            ["--cuda-graph-impl", "te", "--cuda-graph-scope", "mlp", *MOE, *STATIC],
            ["every layer is MoE", "--moe-layer-freq"],
        ),
        # on a machine without CUDA that is said first, not the buffer flags graphs need
        (
            ["--cuda-graph-impl", "te", "--cuda-graph-scope", "attn"],
            ["--cuda-graph-impl te needs a CUDA device", "--cuda-graph-impl none"],
        ),
        (
            ["--cuda-graph-impl", "torch", *STATIC, "--recompute-activations"],
            ["--recompute-activations re-runs layer forwards", "(--cuda-graph-scope layer)"],
        ),
        (
            ["--fsdp-db-use-persist-buf-on-alloc-fail"],
            ["no effect with the dynamic allocator", "add --fsdp-double-buffer"],
        ),
        (
            ["--fsdp-double-buffer", "--fsdp-buffer", "trace_pool"],
            ["--fsdp-double-buffer and --fsdp-buffer trace_pool name two allocators"],
        ),
        (
            ["--fsdp-buffer", "dynamic", "--fsdp-db-use-persist-buf-on-alloc-fail"],
            ["no effect with the dynamic allocator"],
        ),
        (
            [
                "--cuda-graph-impl",
                "te",
                "--cuda-graph-scope",
                "attn",
                *STATIC,
                "--train-iters",
                "2",
            ],
            ["--train-iters 2 must exceed --cuda-graph-warmup-steps 2"],
        ),
        # model and batch shapes
        (
            ["--num-attention-heads", "5"],
            ["--num-attention-heads 5 does not divide --hidden-size 32", "e.g. 4"],
        ),
        (["--num-experts", "2", "--moe-router-topk", "3"], ["--moe-router-topk=3 exceeds"]),
        (["--num-experts", "1"], ["--num-experts=1 is invalid"]),
        (
            ["--global-batch-size", "6"],
            [
                "--global-batch-size 6 is not divisible by --micro-batch-size 2 x data-parallel size "
                "2 = 4",
                "e.g. 4 or 8",
            ],
        ),
        (["--micro-batch-size", "0"], ["--micro-batch-size 0 must be >= 1"]),
        (["--train-iters", "0"], ["--train-iters 0 must be >= 1"]),
        (["--nproc", "0"], ["--nproc 0 must be >= 1"]),
        # checkpointing and data
        (
            ["--cuda-graph-verify"],
            ["--cuda-graph-verify checks a graphed step, but --cuda-graph-impl is none"],
        ),
        # reduce-scatter with fp32 accumulation
        ([FP32_ACCUM], ["without --bf16 the gradients are fp32 already"]),
        (["--bf16", FP32_ACCUM, "--grad-comm-dtype", "bf16"], ["pick one"]),
        (
            ["--bf16", FP32_ACCUM, "--data-parallel-sharding-strategy", "optim"],
            ["--data-parallel-sharding-strategy optim all-reduces full gradients"],
        ),
        (
            ["--bf16", FP32_ACCUM, "--num-distributed-optimizer-instances", "2"],
            ["(HSDP) drop it"],
        ),
        # the vocab-parallel embedding
        (
            ["--vocab-parallel-embedding", "--num-distributed-optimizer-instances", "2"],
            ["--num-distributed-optimizer-instances 2", "drop one of them"],
        ),
        (
            ["--vocab-parallel-embedding", "--tensor-model-parallel-size", "2"],
            ["--tensor-model-parallel-size 2", "drop one of them"],
        ),
        (
            ["--vocab-parallel-embedding", "--vocab-size", "127"],
            ["--vocab-size 127 is not a multiple of the 2 ranks", "multiple of 2"],
        ),
        (["--save-interval", "2"], ["--save-interval is given without --save"]),
        (["--clip-grad", "-1"], ["--clip-grad -1.0 must be a finite norm >= 0"]),
        (["--clip-grad", "nan"], ["--clip-grad nan must be a finite norm >= 0"]),
        (["--load", "/nonexistent/ckpt"], ["--load /nonexistent/ckpt: no such checkpoint"]),
        (
            ["--data-path", "/nonexistent/tokens.bin"],
            ["--data-path /nonexistent/tokens.bin: no such file"],
        ),
    ],
)
def test_train_rejects(capsys: pytest.CaptureFixture, argv: list[str], expected: list[str]) -> None:
    err = error_of(capsys, "train", *TINY, *argv)
    for text in expected:
        assert text in err, f"{text!r} not in {err!r}"


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (
            ["--cuda-graph-impl", "te", "--cuda-graph-scope", "attn"],
            # the engine's check_static_buffers message: BufferPolicy fields and their flags
            [
                "unsharded buffers must be static",
                "(--fsdp-double-buffer) or",
                "(--fsdp-buffer trace_pool) and",
                "(--fsdp-db-use-persist-buf-on-alloc-fail)",
            ],
        ),
        (
            ["--cuda-graph-impl", "torch"],  # no scope: the whole layer, also layerwise
            ["layerwise CUDA graphs", "--fsdp-double-buffer"],
        ),
        (
            ["--cuda-graph-impl", "te", "--cuda-graph-scope", "attn", "--fsdp-double-buffer"],
            [
                "must be static: set BufferPolicy(persist_on_alloc_fail=True) "
                "(--fsdp-db-use-persist-buf-on-alloc-fail)"
            ],
        ),
    ],
)
def test_layerwise_graphs_need_static_buffers(argv: list[str], expected: list[str]) -> None:
    """The buffer-flag rule itself (on a CUDA machine the CLI applies it after the device
    check; a CPU-only machine is told first that graphs need a GPU, above)."""
    from graph_fsdp.cli.errors import CLIError
    from graph_fsdp.cli.graph_options import check_graph_buffers

    args = _args("train", *argv)
    scopes = args.cuda_graph_scope or []
    with pytest.raises(CLIError) as err:
        check_graph_buffers(args, scopes, flag="--cuda-graph-scope")
    for text in expected:
        assert text in str(err.value), str(err.value)


def test_data_path_must_hold_uint16_tokens(capsys: pytest.CaptureFixture, tmp_path) -> None:
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x01\x02\x03")
    assert "not a multiple of 2" in error_of(capsys, "train", *TINY, "--data-path", str(odd))
    short = tmp_path / "short.bin"
    short.write_bytes(b"\x00\x00" * 10)
    assert "shorter than one sample of --seq-length 16" in error_of(
        capsys, "train", *TINY, "--data-path", str(short)
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_device_cuda_without_cuda(capsys: pytest.CaptureFixture) -> None:
    tiny = [a for a in TINY if a != "cpu"]
    tiny[tiny.index("--device") + 1 :] = ["cuda", *tiny[tiny.index("--device") + 1 :]]
    assert "--device cuda was requested" in error_of(capsys, "train", *tiny)


def test_compare_needs_something_to_compare(capsys: pytest.CaptureFixture) -> None:
    err = error_of(capsys, "compare", *TINY)
    assert "nothing to compare" in err and "--reference-strategy" in err


def test_compare_graphs_on_cpu_point_to_strategy_mode(capsys: pytest.CaptureFixture) -> None:
    err = error_of(
        capsys, "compare", *TINY, "--cuda-graph-impl", "te", "--scopes", "full_iteration"
    )
    assert "needs a CUDA device" in err and "--reference-strategy no_shard" in err


def test_compare_scope_sets_are_validated(capsys: pytest.CaptureFixture) -> None:
    err = error_of(
        capsys,
        "compare",
        *TINY,
        "--cuda-graph-impl",
        "te",
        *STATIC,
        "--scopes",
        "",
        "--scopes",
        "moe_preprocess",
    )
    assert "--scopes: unknown" not in err and "moe_preprocess requires moe_router" in err
    err = error_of(capsys, "compare", *TINY, "--reference-strategy", "no_shard", "--scopes", "attn")
    assert "--scopes is given but --cuda-graph-impl is none" in err
    both = "--cuda-graph-impl te --scopes attn --cuda-graph-scope attn".split()
    err = error_of(capsys, "compare", *TINY, *both)
    assert "--scopes only" in err


def test_bench_refuses_clip_grad(capsys: pytest.CaptureFixture) -> None:
    for model in ("gpt", "mcore-gpt"):
        err = error_of(capsys, "bench", "--model", model, "--clip-grad", "1.0")
        assert "--clip-grad 1.0: bench times the same unclipped step in every row" in err


def test_bench_and_profile_check_capture_warmup(capsys: pytest.CaptureFixture) -> None:
    for command in ("bench", "profile"):
        err = error_of(
            capsys, command, *TINY, "--cuda-graph-impl", "torch", *STATIC, "--warmup-iters", "1"
        )
        assert "--warmup-iters 1 must exceed --cuda-graph-warmup-steps 2" in err


def test_bench_graph_impls_must_agree_with_cuda_graph_impl(capsys: pytest.CaptureFixture) -> None:
    err = error_of(
        capsys, "bench", *TINY, "--cuda-graph-impl", "torch", "--graph-impls", "te", "torch"
    )
    assert "--cuda-graph-impl torch and --graph-impls te torch disagree" in err


def test_bench_layerwise_rule_applies_even_where_rows_are_skipped(
    capsys: pytest.CaptureFixture,
) -> None:
    layerwise = "--cuda-graph-impl torch --scopes attn --cuda-graph-warmup-steps 0".split()
    err = error_of(capsys, "bench", *TINY, *layerwise)
    assert "--fsdp-double-buffer" in err


def test_every_flag_has_help(capsys: pytest.CaptureFixture) -> None:
    from graph_fsdp.cli.main import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    for name, p in sub.choices.items():
        for action in p._actions:
            if action.option_strings and action.dest not in ("help", "inject_difference"):
                assert action.help, f"graph-fsdp {name} {action.option_strings[0]} has no help"
        with pytest.raises(SystemExit):
            main([name, "--help"])
        assert "--num-layers" in capsys.readouterr().out


def test_profile_nsys_needs_cuda(capsys: pytest.CaptureFixture) -> None:
    err = error_of(capsys, "profile", *TINY, "--profiler", "nsys")
    assert "--profiler nsys traces CUDA work" in err and "--profiler torch" in err


def _args(command: str, *argv: str):
    from graph_fsdp.cli.main import build_parser

    return build_parser().parse_args([command, *TINY, *argv])


def test_transformer_impl_maps_to_gpt_config_and_is_checked(capsys: pytest.CaptureFixture) -> None:
    from graph_fsdp.cli.model_options import model_config

    assert model_config(_args("train")).transformer_impl == "local"
    te = model_config(_args("train", "--transformer-impl", "transformer_engine"))
    assert te.transformer_impl == "transformer_engine"
    err = error_of(capsys, "train", *TINY, "--transformer-impl", "transformer_engine", *MOE)
    assert "--transformer-impl transformer_engine" in err and "drop --num-experts" in err
    if not torch.cuda.is_available():
        err = error_of(capsys, "train", *TINY, "--transformer-impl", "transformer_engine")
        assert "--transformer-impl transformer_engine needs a CUDA device" in err
        assert "--transformer-impl local" in err
    with pytest.raises(SystemExit):
        main(["train", *TINY, "--transformer-impl", "te"])  # Megatron's spelling only
    assert "invalid choice: 'te'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "allocator"),
    [
        ([], "dynamic"),
        (["--fsdp-buffer", "dynamic"], "dynamic"),
        (["--fsdp-buffer", "double_buffer"], "double_buffer"),
        (["--fsdp-double-buffer"], "double_buffer"),  # Megatron's spelling
        (["--fsdp-double-buffer", "--fsdp-buffer", "double_buffer"], "double_buffer"),
        (["--fsdp-buffer", "trace_pool"], "trace_pool"),
    ],
)
def test_fsdp_buffer_sets_the_buffer_policy(argv: list[str], allocator: str) -> None:
    from graph_fsdp.cli.options import resolve

    for command in ("train", "compare", "bench", "profile"):
        assert resolve(_args(command, *argv)).cfg.allocator == allocator


def test_vocab_parallel_embedding_reaches_the_config() -> None:
    from graph_fsdp.cli.options import resolve
    from graph_fsdp.training.train import placement_label

    for command in ("train", "compare", "bench", "profile"):
        assert resolve(_args(command)).cfg.vocab_parallel_embedding is False
        flag = "--vocab-parallel-embedding"
        cfg = resolve(_args(command, flag)).cfg
        assert cfg.vocab_parallel_embedding is True
        assert placement_label(cfg) == "optim_grads_params, vocab-parallel embedding"


def test_deterministic_is_opt_in_for_train_and_default_for_compare() -> None:
    from graph_fsdp.cli.options import resolve

    assert resolve(_args("train")).cfg.deterministic is False
    assert resolve(_args("train", "--deterministic")).cfg.deterministic is True
    assert resolve(_args("profile", "--deterministic")).cfg.deterministic is True
    assert resolve(_args("compare")).cfg.deterministic is True
    assert resolve(_args("compare", "--no-deterministic")).cfg.deterministic is False


@pytest.mark.parametrize(
    "scopes",
    [
        ["attention"],
        ["attn", "attn"],
        ["full_iteration", "attn"],
        ["moe_preprocess"],
        ["moe", "moe_router"],
    ],
)
def test_scope_rules_are_the_engines(scopes: list[str]) -> None:
    """The CLI delegates model-independent scope rules to graph_fsdp.capture.scopes."""
    from graph_fsdp.capture import scopes as engine
    from graph_fsdp.cli import graph_options as options
    from graph_fsdp.cli.errors import CLIError
    from graph_fsdp.models import GPTConfig

    assert options.SCOPES is engine.SCOPES and options.GRAPH_IMPLS is engine.GRAPH_IMPLS
    with pytest.raises(engine.GraphConfigError) as engine_err:
        engine.check_scopes(scopes, flag="--scopes")
    with pytest.raises(CLIError) as cli_err:
        options.check_scopes(scopes, GPTConfig(num_experts=4), flag="--scopes")
    assert str(cli_err.value) == str(engine_err.value)


EXPERT_PARALLEL = ["--num-experts", "4", "--expert-model-parallel-size", "2"]


@pytest.mark.parametrize("flags", [[FP32_ACCUM], EXPERT_PARALLEL], ids=["fp32_accum", "ep2"])
@pytest.mark.parametrize(
    ("scopes", "given", "expected"),
    [
        (["full_iteration"], None, "0"),  # the graph captures the all-to-all: registration off
        (["full_iteration"], "1", "1"),  # the user's value is kept (refused at capture)
        ([], None, None),  # whole-layer graphs: the all-to-all runs eagerly, nothing set
    ],
)
def test_an_all_to_all_in_a_full_iteration_graph_sets_nccl_graph_register(
    monkeypatch, flags: list[str], scopes: list[str], given: str | None, expected: str | None
) -> None:
    """capture/step.py [Note: NCCL graph registration and the all-to-all]: the command sets
    NCCL_GRAPH_REGISTER=0 before its ranks make their groups, only where a graph captures an
    all-to-all (the gradients' with fp32 accumulation, the expert dispatch's with EP > 1), and
    never over a value the user exported."""
    import os

    from graph_fsdp.cli.main import build_parser
    from graph_fsdp.cli.options import resolve

    monkeypatch.delenv("NCCL_GRAPH_REGISTER", raising=False)
    if given is not None:
        monkeypatch.setenv("NCCL_GRAPH_REGISTER", given)
    args = build_parser().parse_args(
        ["compare", *TINY, "--bf16", *flags, "--cuda-graph-impl", "torch", *STATIC]
    )
    cfg = resolve(args, graph_scope_sets=[scopes], graphs_optional=True).cfg
    assert cfg.mp.reduce_scatter_fp32_accumulation == (flags == [FP32_ACCUM])
    assert cfg.expert_parallel == (2 if flags == EXPERT_PARALLEL else None)
    assert os.environ.get("NCCL_GRAPH_REGISTER") == expected
