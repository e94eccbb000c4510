"""``--tensor-model-parallel-size`` and ``--sequence-parallel`` (Megatron's spellings):
validated before any rank starts for both model families, and one ``graph-fsdp train`` of
graph_fsdp's GPT with DTensor TP + sequence parallel on 2 gloo ranks against the same run on
one rank (the same data: the TP ranks of a data-parallel rank read the same batches)."""

from __future__ import annotations

import json
import re

import pytest
from _cli_helpers import TINY, run_cli
from graph_fsdp_testing import cli_error

from graph_fsdp.cli import mcore as megatron_cli
from graph_fsdp.cli.main import build_parser
from graph_fsdp.cli.options import resolve

MCORE = ["--model", "mcore-gpt", "--device", "cpu", "--nproc", "2"]
FOUR = [*TINY[:-1], "4"]  # TINY on 4 ranks (validation only: nothing is launched)


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (
            ["train", *TINY, "--tensor-model-parallel-size", "4"],
            ["--tensor-model-parallel-size 4 does not divide the 2 ranks", "use one of 1, 2"],
        ),
        (["train", *TINY, "--sequence-parallel"], ["--tensor-model-parallel-size is 1"]),
        (
            ["train", *FOUR, "--tensor-model-parallel-size", "2"]
            + ["--num-distributed-optimizer-instances", "2"],
            ["a 3-D mesh", "--num-distributed-optimizer-instances 2"],
        ),
        (
            ["train", *TINY, "--tensor-model-parallel-size", "2", "--num-experts", "4"]
            + ["--expert-model-parallel-size", "2"],
            ["a 3-D mesh", "--expert-model-parallel-size 2"],
        ),
        (
            ["train", *TINY, "--tensor-model-parallel-size", "2", "--num-experts", "4"],
            ["the plan covers the dense torch layers", "expert parallelism instead"],
        ),
        (
            ["train", *FOUR, "--tensor-model-parallel-size", "4", "--num-attention-heads", "2"],
            ["a tensor-parallel size of 4 must divide {'num_attention_heads': 2}"],
        ),
        (
            ["train", *TINY, "--tensor-model-parallel-size", "2", "--sequence-parallel"]
            + ["--seq-length", "15"],
            ["must divide {'seq_length': 15}"],
        ),
        (
            ["train", *MCORE, "--tensor-model-parallel-size", "2", "--vocab-size", "1023"],
            ["--tensor-model-parallel-size=2 must divide {'vocab-size': 1023}"],
        ),
        (
            ["train", *MCORE, "--tensor-model-parallel-size", "2", "--num-experts", "4"],
            ["use TP = 1 for MoE models"],
        ),
        (["bench", *MCORE, "--sequence-parallel"], ["--tensor-model-parallel-size is 1"]),
        (
            ["bench", *MCORE, "--tensor-model-parallel-size", "2", "--rows", "megatron_fsdp"],
            ["--rows megatron_fsdp compares data-parallel runs"],
        ),
    ],
)
def test_tensor_parallel_flags_are_validated_before_launch(capsys, argv, expected) -> None:
    err = cli_error(capsys, *argv)
    for text in expected:
        assert text in err, (text, err)


def test_tensor_parallel_flags_build_both_families_configs(monkeypatch) -> None:
    args = build_parser().parse_args(
        ["train", *FOUR, "--tensor-model-parallel-size", "2", "--sequence-parallel"]
        + ["--global-batch-size", "8"]
    )
    res = resolve(args)
    assert res.cfg.tensor_parallel == 2 and res.cfg.sequence_parallel
    # 8 sequences over 2 data-parallel ranks x micro batch 2: 2 microbatches per step
    assert res.data_parallel_size == 2 and res.cfg.grad_accum == 2
    assert res.tokens_per_step == 8 * 16

    monkeypatch.setattr(megatron_cli, "check_mcore_environment", lambda *a: None)
    args = build_parser().parse_args(
        ["bench", *MCORE, "--tensor-model-parallel-size", "2", "--sequence-parallel"]
    )
    job, _, setup = megatron_cli.build_bench_job(args)
    model = job.base.model
    assert model.tensor_model_parallel_size == 2 and model.sequence_parallel
    assert [row.name for row in job.rows] == ["graph_fsdp eager"]  # no megatron_fsdp row
    assert "tensor parallel 2 with sequence parallel" in setup


@pytest.mark.slow
def test_train_tensor_parallel_on_two_gloo_ranks() -> None:
    """TP 2 with sequence parallelism (dp 1 x tp 2) trains like the one-rank run on the same
    batches, to fp32 rounding (TP splits the GEMMs and sums their pieces in another order)."""
    steps = ["--train-iters", "3", "--ffn-hidden-size", "64"]
    tp = run_cli("train", *TINY, *steps, "--tensor-model-parallel-size", "2", "--sequence-parallel")
    assert tp.returncode == 0, tp.stdout + tp.stderr
    assert "tensor parallel 2 with sequence parallel" in tp.stdout, tp.stdout
    one = run_cli("train", *TINY[:-1], "1", *steps)
    assert one.returncode == 0, one.stdout + one.stderr
    final = [float(re.search(r"final loss ([0-9.]+)", p.stdout).group(1)) for p in (tp, one)]
    assert final[0] == pytest.approx(final[1], rel=1e-5), final


@pytest.mark.slow
def test_bench_tensor_parallel_runs_graph_fsdps_rows(tmp_path, capsys) -> None:
    """bench with TP: graph_fsdp's own rows (the peers train the data-parallel model only);
    tokens per step count the data-parallel ranks."""
    out = tmp_path / "bench"
    proc = run_cli(
        "bench",
        *TINY,
        "--ffn-hidden-size",
        "64",
        "--tensor-model-parallel-size",
        "2",
        "--train-iters",
        "2",
        "--warmup-iters",
        "1",
        "--output-dir",
        str(out),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((out / "results.json").read_text())
    assert [r["name"] for r in report["rows"]] == ["graph_fsdp eager"], report["rows"]
    row = report["rows"][0]
    assert row["status"] == "ok"
    tokens = 2 * 16  # micro batch 2 x seq 16 on one data-parallel rank
    assert row["tokens_per_s"] == pytest.approx(tokens / (row["median_step_ms"] / 1e3))
    err = cli_error(capsys, "bench", *TINY, "--tensor-model-parallel-size", "2", "--rows", "fsdp2")
    assert "--rows fsdp2 with --tensor-model-parallel-size 2" in err
