"""``--cuda-graph-optimizer`` (Megatron's ``--optimizer-cuda-graph``): the whole step in one
graph, for ``full_iteration`` only, with a fused AdamW on the device; refused with the reason
before any rank starts, and the configs it builds (both model families)."""

from __future__ import annotations

import pytest
from _cli_helpers import TINY
from graph_fsdp_testing import cli_error

from graph_fsdp.cli import mcore as megatron_cli
from graph_fsdp.cli.main import build_parser

FULL = ["--cuda-graph-impl", "torch", "--cuda-graph-scope", "full_iteration"]
STATIC = ["--fsdp-double-buffer", "--fsdp-db-use-persist-buf-on-alloc-fail"]
MCORE = ["--model", "mcore-gpt", "--device", "cpu", "--nproc", "2"]


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["train", *TINY, "--cuda-graph-optimizer"], ["--cuda-graph-impl is none"]),
        (
            ["train", *TINY, "--optimizer-cuda-graph", "--cuda-graph-impl", "torch", *STATIC],
            ["scopes are layer", "use --cuda-graph-scope full_iteration"],
        ),
        (
            ["train", *TINY, "--cuda-graph-optimizer", "--cuda-graph-impl", "te", *STATIC]
            + ["--cuda-graph-scope", "attn"],
            ["scopes are attn"],
        ),
        (
            ["train", *TINY, "--cuda-graph-optimizer", *FULL, "--optimizer-cpu-offload"],
            ["--optimizer-cpu-offload steps part of it on the CPU"],
        ),
        (
            ["train", *TINY, "--cuda-graph-optimizer", *FULL, "--cuda-graph-verify"],
            ["--cuda-graph-verify checks", "drop one of them"],
        ),
        (
            ["bench", *TINY, "--cuda-graph-optimizer", "--no-fused-adamw"]
            + ["--graph-impls", "torch", "--scopes", "full_iteration", "--warmup-iters", "3"],
            ["needs AdamW(fused=True)", "--no-fused-adamw"],
        ),
        (
            ["bench", *TINY, "--cuda-graph-optimizer", "--graph-impls", "torch", *STATIC]
            + ["--scopes", "full_iteration", "--scopes", "attn", "--warmup-iters", "3"],
            ["scopes are attn"],
        ),
        (["train", *MCORE, "--cuda-graph-optimizer"], ["--cuda-graph-impl is none"]),
        (
            ["train", *MCORE, "--optimizer-cuda-graph", "--cuda-graph-impl", "torch", *STATIC],
            ["scopes are layer"],
        ),
        (
            ["train", *TINY, "--cuda-graph-overlap-next-gather", *FULL, *STATIC],
            ["--cuda-graph-overlap-next-gather", "add --cuda-graph-optimizer"],
        ),
        (
            ["train", *TINY, "--cuda-graph-norm-beside-last-reduction", *FULL, *STATIC],
            ["--cuda-graph-norm-beside-last-reduction", "add --cuda-graph-optimizer"],
        ),
        # Allowed by every rule: the environment is what remains on this CPU machine.
        (["train", *TINY, "--cuda-graph-optimizer", *FULL, *STATIC], ["needs a CUDA device"]),
    ],
)
def test_cuda_graph_optimizer_is_validated_before_launch(capsys, argv, expected) -> None:
    err = cli_error(capsys, *argv)
    for text in expected:
        assert text in err, (text, err)


def test_cuda_graph_optimizer_builds_fused_whole_step_configs(monkeypatch) -> None:
    from graph_fsdp.cli.options import resolve

    args = build_parser().parse_args(
        ["compare", *TINY, "--cuda-graph-impl", "torch", "--scopes", "full_iteration"]
        + ["--optimizer-cuda-graph", "--fsdp-double-buffer"]
    )
    cfg = resolve(args, graph_scope_sets=[["full_iteration"]], graphs_optional=True).cfg
    assert cfg.cuda_graph_optimizer and cfg.fused_optimizer
    assert cfg.graph_policy.optimizer and cfg.graph_policy.scopes == ("full_iteration",)

    monkeypatch.setattr(megatron_cli, "check_mcore_environment", lambda *a: None)
    args = build_parser().parse_args(
        ["bench", *MCORE, "--cuda-graph-optimizer", "--graph-impls", "torch", *STATIC]
        + ["--scopes", "full_iteration", "--warmup-iters", "3", "--train-iters", "2"]
    )
    job, _, _ = megatron_cli.build_bench_job(args)
    assert job.base.cuda_graph_optimizer and job.base.fused_optimizer
    names = [row.name for row in job.rows]
    assert "graph_fsdp torch [full_iteration + optimizer]" in names, names
    assert "graph_fsdp torch [full_iteration]" in names, names  # its eager-optimizer twin


def test_overlap_next_gather_reaches_the_runner_and_the_bench_rows() -> None:
    from graph_fsdp.bench.runner import BenchJob, BenchSpec, plan_rows
    from graph_fsdp.cli.options import resolve

    args = build_parser().parse_args(
        ["compare", *TINY, "--cuda-graph-impl", "torch", "--scopes", "full_iteration"]
        + ["--optimizer-cuda-graph", "--cuda-graph-overlap-next-gather", "--fsdp-double-buffer"]
    )
    cfg = resolve(args, graph_scope_sets=[["full_iteration"]], graphs_optional=True).cfg
    assert cfg.graphs.optimizer and cfg.graphs.overlap_next_gather
    job = BenchJob(
        spec=BenchSpec(cfg=cfg, warmup=3, steps=2),
        rows=("graph_fsdp", "graph_fsdp_graphed"),
        graph_impls=("torch",),
        scope_sets=[["full_iteration"]],
    )
    rows = {row.name: row.spec.cfg.graphs for row in plan_rows(job)}
    plain = rows["graph_fsdp torch [full_iteration]"]
    off = rows["graph_fsdp torch [full_iteration + optimizer]"]
    on = rows["graph_fsdp torch [full_iteration + optimizer], next gathers overlapped"]
    assert not plain.optimizer and not plain.overlap_next_gather
    assert off.optimizer and not off.overlap_next_gather
    assert on.optimizer and on.overlap_next_gather
    # The eager row is the one-graph step's eager twin, with the same switches.
    assert rows["graph_fsdp eager"].overlap_next_gather


def test_the_norm_beside_the_last_reduction_and_the_gathers_group_reach_the_run() -> None:
    from graph_fsdp.cli.options import resolve

    args = build_parser().parse_args(
        ["train", *TINY, "--cuda-graph-impl", "torch", "--cuda-graph-scope", "full_iteration"]
        + ["--optimizer-cuda-graph", "--cuda-graph-norm-beside-last-reduction"]
        + ["--create-all-gather-group", "--fsdp-double-buffer"]
    )
    cfg = resolve(args, graph_scope_sets=[["full_iteration"]], graphs_optional=True).cfg
    assert cfg.graphs.norm_beside_last_reduction and cfg.separate_all_gather_group
