"""HSDP flags: validation before any process starts, and a 2-rank CPU run end to end."""

from __future__ import annotations

import json

import pytest
from _cli_helpers import SETTINGS, TINY, run_cli, saved_meta
from graph_fsdp_testing import cli_error

FOUR = [a if a != "2" or TINY[i - 1] != "--nproc" else "4" for i, a in enumerate(TINY)]
"""TINY with --nproc 4."""


error_of = cli_error


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (
            ["--num-distributed-optimizer-instances", "3"],
            ["--num-distributed-optimizer-instances 3 does not divide", "size 4", "1, 2, 4"],
        ),
        (["--num-distributed-optimizer-instances", "0"], ["must be >= 1"]),
        (
            ["--outer-dp-sharding-strategy", "optim"],
            ["replicate size 1", "--num-distributed-optimizer-instances N with N > 1"],
        ),
        (
            [
                "--num-distributed-optimizer-instances",
                "2",
                "--outer-dp-sharding-strategy",
                "optim",
                "--data-parallel-sharding-strategy",
                "no_shard",
            ],
            ["no_shard does not shard it", "optim_grads_params"],
        ),
    ],
)
def test_hsdp_flags_rejected(capsys: pytest.CaptureFixture, argv, expected) -> None:
    err = error_of(capsys, "train", *FOUR, *argv)
    for fragment in expected:
        assert fragment in err, (fragment, err)


@pytest.mark.slow
def test_train_hsdp_then_resume_on_a_1d_mesh(tmp_path) -> None:
    """The flags end to end on 2 ranks (replicate 2 x shard 1, the optimizer sharded over the
    replicas), resumed on a 1-D mesh of the same ranks. The 2 x 2 meshes' numerics and their
    checkpoints across meshes are core/test_fully_shard_hsdp*.py's, on 4 ranks."""
    ckpt, log = tmp_path / "ckpt", tmp_path / "steps.jsonl"
    hsdp = ["--num-distributed-optimizer-instances", "2", "--outer-dp-sharding-strategy", "optim"]
    first = run_cli("train", *TINY, *hsdp, "--train-iters", "2", "--save", str(ckpt))
    assert first.returncode == 0, first.stderr
    assert "HSDP replicate 2 x shard 1, optimizer over replicas" in first.stdout
    assert saved_meta(ckpt, 2) == {"iteration": 2, "model": "gpt", "optimizer": SETTINGS}
    resumed = run_cli(
        "train", *TINY, "--train-iters", "3", "--load", str(ckpt), "--log-json", str(log)
    )
    assert resumed.returncode == 0, resumed.stderr
    assert "on 2 x cpu" in resumed.stdout and "HSDP" not in resumed.stdout
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["step"] for r in records] == [2]
