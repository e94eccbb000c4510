"""The MoE flags of ``train`` / ``bench`` / ``compare`` (Megatron's spellings):
``--moe-expert-capacity-factor``, ``--moe-pad-expert-input-to-capacity``,
``--expert-model-parallel-size`` and ``--moe-experts-impl``; their validation before any rank
starts, the configs they build for both model families, the bench rows a Megatron-Core MoE gets
for dropless and drop-padding experts, and one expert-parallel ``graph-fsdp train`` on 2 gloo
ranks."""

from __future__ import annotations

import json
import re

import pytest
from _cli_helpers import TINY, run_cli
from graph_fsdp_testing import cli_error

from graph_fsdp.cli import mcore as megatron_cli
from graph_fsdp.cli.main import build_parser
from graph_fsdp.cli.options import resolve

MCORE_MOE = ["--model", "mcore-moe", "--device", "cpu", "--nproc", "2"]
STATIC = ["--fsdp-double-buffer", "--fsdp-db-use-persist-buf-on-alloc-fail"]
PADDED = ["--moe-expert-capacity-factor", "1.0", "--moe-pad-expert-input-to-capacity"]


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["train", *TINY, *PADDED], ["need(s) an MoE model", "--num-experts N"]),
        (
            ["train", *TINY, "--num-experts", "4", "--moe-expert-capacity-factor", "0"],
            ["--moe-expert-capacity-factor 0.0 must be > 0"],
        ),
        (
            ["train", *MCORE_MOE, "--moe-expert-capacity-factor", "-1"],
            ["--moe-expert-capacity-factor -1.0 must be > 0"],
        ),
        (
            ["bench", *MCORE_MOE, "--moe-pad-expert-input-to-capacity"],
            ["--moe-pad-expert-input-to-capacity pads", "add --moe-expert-capacity-factor 1.0"],
        ),
        (
            ["train", *TINY, "--num-experts", "4", "--expert-model-parallel-size", "4"],
            ["--expert-model-parallel-size 4 does not divide the 2 ranks", "use one of 1, 2"],
        ),
        (
            ["train", *TINY, "--num-experts", "3", "--expert-model-parallel-size", "2"],
            ["--expert-model-parallel-size 2 does not divide --num-experts 3"],
        ),
        (
            ["train", *MCORE_MOE, "--num-experts", "3", "--expert-model-parallel-size", "2"],
            ["--expert-model-parallel-size 2 does not divide --num-experts 3"],
        ),
        (["train", *TINY, "--moe-experts-impl", "grouped_mm"], ["Megatron-Core model flags"]),
        (
            [
                "train",
                "--model",
                "mcore-gpt",
                "--device",
                "cpu",
                "--moe-experts-impl",
                "grouped_mm",
            ],
            ["--moe-experts-impl grouped_mm needs an MoE model"],
        ),
        (
            ["train", *MCORE_MOE, "--moe-experts-impl", "grouped_mm", *PADDED],
            ["is the dropless path"],
        ),
        (
            ["train", *MCORE_MOE, "--moe-receive-buffer-factor", "1.5"]
            + ["--expert-model-parallel-size", "2"],
            ["--moe-receive-buffer-factor 1.5 sizes the grouped_mm experts' exchange"],
        ),
        (
            ["train", *MCORE_MOE, "--moe-experts-impl", "grouped_mm"]
            + ["--moe-receive-buffer-factor", "1.5"],
            ["add --moe-experts-impl grouped_mm and --expert-model-parallel-size N > 1"],
        ),
        (
            ["train", *MCORE_MOE, "--moe-experts-impl", "grouped_mm"]
            + ["--expert-model-parallel-size", "2", "--moe-receive-buffer-factor", "0"],
            ["--moe-receive-buffer-factor=0.0 is invalid"],
        ),
        # Megatron's dropless experts sync with the host: the whole layer is refused, naming
        # both settings that capture it.
        (
            ["train", *MCORE_MOE, "--cuda-graph-impl", "torch", *STATIC],
            ["--cuda-graph-scope the whole layer", "grouped_mm", "drop-padding"],
        ),
        (
            ["bench", *MCORE_MOE, "--graph-impls", "torch", "--scopes", "moe", *STATIC]
            + ["--moe-expert-capacity-factor", "1.0"],
            ["without moe_pad_expert_input_to_capacity", "a host sync"],
        ),
        (
            ["bench", *MCORE_MOE, "--graph-impls", "torch", *STATIC, *PADDED]
            + ["--scopes", "moe_router moe_preprocess"],
            ["moe_preprocess graphs the preprocess", "drop-padding"],
        ),
        (
            ["compare", *MCORE_MOE, "--cuda-graph-impl", "torch", *STATIC, "--scopes", "moe"],
            ["moe: MoE layers with Megatron's dropless", "grouped_mm", "drop-padding"],
        ),
        (
            ["compare", *MCORE_MOE, "--cuda-graph-impl", "torch", *STATIC, *PADDED]
            + ["--scopes", "moe", "--use-megatron-schedule"],
            ["drop --use-megatron-schedule"],
        ),
        (
            [
                "compare",
                *TINY,
                "--reference-strategy",
                "no_shard",
                "--moe-experts-impl",
                "grouped_mm",
            ],
            ["Megatron-Core model flags, but --model is gpt"],
        ),
        # Allowed by every rule above: what remains is the environment (no CUDA here).
        (
            ["compare", *MCORE_MOE, "--cuda-graph-impl", "torch", *STATIC, *PADDED]
            + ["--scopes", "", "--scopes", "moe", "--scopes", "full_iteration"],
            ["needs CUDA"],
        ),
        (
            ["train", *MCORE_MOE, "--cuda-graph-impl", "torch", *STATIC, *PADDED],
            ["needs CUDA"],
        ),
        (
            ["train", *MCORE_MOE, "--cuda-graph-impl", "torch", *STATIC]
            + ["--moe-experts-impl", "grouped_mm", "--cuda-graph-scope", "full_iteration"],
            ["needs CUDA"],
        ),
        (
            ["train", *MCORE_MOE, "--cuda-graph-impl", "torch", *STATIC, *PADDED]
            + ["--expert-model-parallel-size", "2", "--cuda-graph-scope", "moe"],
            ["needs CUDA"],
        ),
        # Dropless grouped_mm experts over EP 2 (fixed-size exchanges): captured whole.
        (
            ["train", *MCORE_MOE, "--cuda-graph-impl", "torch", *STATIC]
            + ["--moe-experts-impl", "grouped_mm", "--expert-model-parallel-size", "2"]
            + ["--moe-receive-buffer-factor", "1.5", "--cuda-graph-scope", "full_iteration"],
            ["needs CUDA"],
        ),
    ],
)
def test_moe_flags_are_validated_before_launch(capsys, argv, expected) -> None:
    err = cli_error(capsys, *argv)
    for text in expected:
        assert text in err, (text, err)


def test_moe_flags_build_both_families_configs() -> None:
    args = build_parser().parse_args(
        ["train", *TINY, "--num-experts", "4", "--moe-expert-capacity-factor", "1.5"]
        + ["--moe-pad-expert-input-to-capacity", "--expert-model-parallel-size", "2"]
    )
    cfg = resolve(args).cfg
    assert cfg.model.moe_capacity_factor == 1.5 and cfg.expert_parallel == 2
    assert resolve(build_parser().parse_args(["train", *TINY])).cfg.expert_parallel is None

    args = build_parser().parse_args(
        ["bench", *MCORE_MOE, *PADDED, "--expert-model-parallel-size", "2"]
    )
    model = megatron_cli.mcore_config(args, 2)
    assert model.moe_expert_capacity_factor == 1.0 and model.moe_pad_expert_input_to_capacity
    assert model.expert_model_parallel_size == 2 and model.moe_experts_impl == "megatron"
    label = megatron_cli.moe_label(model)
    assert "drop-padding (capacity factor 1)" in label and "expert parallel 2" in label
    args = build_parser().parse_args(["train", *MCORE_MOE, "--moe-experts-impl", "grouped_mm"])
    model = megatron_cli.mcore_config(args, 2)
    assert model.moe_experts_impl == "grouped_mm"
    assert "dropless (grouped_mm experts)" in megatron_cli.moe_label(model)
    args = build_parser().parse_args(
        ["train", *MCORE_MOE, "--moe-experts-impl", "grouped_mm"]
        + ["--expert-model-parallel-size", "2", "--moe-receive-buffer-factor", "1.5"]
    )
    model = megatron_cli.mcore_config(args, 2)
    assert model.expert_model_parallel_size == 2 and model.moe_receive_buffer_factor == 1.5
    label = megatron_cli.moe_label(model)
    assert "expert parallel 2" in label and "receive buffer 1.5x" in label


@pytest.mark.parametrize(
    ("experts", "scope_sets"),
    [
        # dropless: graph_fsdp's grouped_mm experts capture the whole layer, moe, full_iteration
        (["--moe-experts-impl", "grouped_mm"], ["", "moe", "attn moe_router", "full_iteration"]),
        # ... also over EP 2 (its fixed-size dropless exchange)
        (
            ["--moe-experts-impl", "grouped_mm", "--expert-model-parallel-size", "2"],
            ["", "moe", "full_iteration"],
        ),
        # drop-padding: Megatron's own experts capture whole
        (PADDED, ["", "moe", "attn moe_router", "full_iteration"]),
        # dropless Megatron experts: the parts before the dispatch
        ([], ["attn moe_router", "moe_router moe_preprocess"]),
    ],
)
def test_bench_plans_rows_for_dropless_and_drop_padding(monkeypatch, experts, scope_sets):
    """The rows ``graph-fsdp bench --model mcore-moe`` runs for each expert setting (the
    launch itself needs megatron-core and a GPU)."""
    monkeypatch.setattr(megatron_cli, "check_mcore_environment", lambda *a: None)
    argv = ["bench", *MCORE_MOE, *STATIC, *experts, "--graph-impls", "torch"]
    for scopes in scope_sets:
        argv += ["--scopes", scopes]
    job, _, setup = megatron_cli.build_bench_job(
        build_parser().parse_args([*argv, "--warmup-iters", "3", "--train-iters", "2"])
    )
    names = [row.name for row in job.rows]
    assert names[0] == "graph_fsdp eager" and names[-1] == "megatron_fsdp eager"
    assert names[1:-1] == [f"graph_fsdp torch [{s or 'layer'}]" for s in scope_sets], names
    assert megatron_cli.moe_label(job.base.model) in setup


@pytest.mark.slow
def test_train_expert_parallel_on_two_gloo_ranks() -> None:
    """--expert-model-parallel-size 2 and the capacity flags reach graph_fsdp's GPT: the
    experts are partitioned over the 2 ranks, and the run trains like the EP = 1 run (the same
    losses to fp32 rounding: the expert gradients take another reduction path)."""
    moe = ["--num-experts", "4", "--train-iters", "3", "--moe-expert-capacity-factor", "2.0"]
    ep = run_cli("train", *TINY, *moe, "--expert-model-parallel-size", "2", *PADDED[2:])
    assert ep.returncode == 0, ep.stdout + ep.stderr
    assert "expert parallel 2" in ep.stdout, ep.stdout
    plain = run_cli("train", *TINY, *moe)
    assert plain.returncode == 0, plain.stdout + plain.stderr
    assert "expert parallel" not in plain.stdout
    final = [float(re.search(r"final loss ([0-9.]+)", p.stdout).group(1)) for p in (ep, plain)]
    assert final[0] == pytest.approx(final[1], rel=1e-5), final


@pytest.mark.slow
def test_command_line_dropless_ep_trains(tmp_path):
    """graph-fsdp train --moe-dropless --expert-model-parallel-size 2 on 2 gloo ranks."""
    log = tmp_path / "log.jsonl"
    out = run_cli(
        "train", *TINY, "--num-experts", "4", "--moe-dropless",
        "--expert-model-parallel-size", "2", "--train-iters", "3", "--log-json", str(log),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert len(log.read_text().splitlines()) == 3
    assert "overflow steps" not in out.stdout


@pytest.mark.slow
def test_command_line_overflowing_receive_buffer_repeats_steps(tmp_path):
    """--moe-receive-buffer-factor 0.5 at EP 2: a block of a quarter of a rank's copies, but
    one of the two peers is sent at least half of them - every step overflows, is repeated with
    a buffer of every copy, counted in the summary and the step log, and the losses are those
    of the run without a factor."""
    logs = [tmp_path / "none.jsonl", tmp_path / "factor.jsonl"]
    dropless = [*TINY, "--num-experts", "4", "--moe-dropless", "--expert-model-parallel-size", "2"]
    runs = [
        run_cli("train", *dropless, "--train-iters", "3", "--log-json", str(logs[0])),
        run_cli(
            "train", *dropless, "--train-iters", "3", "--log-json", str(logs[1]),
            "--moe-receive-buffer-factor", "0.5",
        ),
    ]  # fmt: skip
    for out in runs:
        assert out.returncode == 0, out.stderr[-2000:]
    assert "overflow steps: 3 (" in runs[1].stdout, runs[1].stdout
    records = [[json.loads(line) for line in log.read_text().splitlines()] for log in logs]
    assert [r["loss"] for r in records[0]] == [r["loss"] for r in records[1]]
    for record in records[1]:
        assert record["overflow"]["layers"], record
        assert record["overflow"]["receive_buffer_factor_needed"] > 0.5, record
    assert all("overflow" not in r for r in records[0])


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--moe-dropless"], "need(s) an MoE model"),
        (
            ["--num-experts", "4", "--moe-dropless", "--moe-expert-capacity-factor", "1"],
            "a dropless layer has no capacity",
        ),
        (["--num-experts", "4", "--moe-receive-buffer-factor", "1.5"], "add --moe-dropless"),
        (
            ["--num-experts", "4", "--moe-dropless", "--model", "mcore-moe"],
            "--moe-dropless is graph_fsdp's GPT's",
        ),
    ],
)
def test_dropless_flags_are_refused_naming_the_flag(capsys, argv, match):
    assert match in cli_error(capsys, "train", *TINY, *argv)
