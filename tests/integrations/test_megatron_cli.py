"""``graph-fsdp train --model mcore-*``: --save / --load / --data-path / offload flags (CPU).

Every rule here runs before a process starts, so it is testable without megatron-core (which
needs Python >= 3.12); the GPU round trip is tests/integrations/test_megatron_gpu.py's
``test_cli_mcore_save_load_data_path``.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from graph_fsdp_testing import cli_error

from graph_fsdp.cli import mcore as megatron_cli
from graph_fsdp.cli.errors import CLIError
from graph_fsdp.cli.main import main

# A dense local-spec Megatron-Core GPT: the one --model mcore-* shape that passes every check
# on a CPU-only machine up to the environment checks (megatron-core importable).
MCORE = ["train", "--model", "mcore-gpt", "--device", "cpu", "--nproc", "2"]
SHAPE = ["--seq-length", "16", "--vocab-size", "128", "--micro-batch-size", "2"]


error_of = cli_error


def dcp_dir(tmp_path, meta: dict | None = None):
    """A completed DCP checkpoint directory (one tensor, written without a process group;
    the CLI reads its metadata before any rank starts) with our meta file."""
    import torch
    import torch.distributed.checkpoint as dcp

    d = tmp_path / "ckpt"
    dcp.save({"model.w": torch.zeros(4)}, checkpoint_id=str(d), no_dist=True)
    if meta is not None:
        (d / "graph_fsdp_cli.json").write_text(json.dumps(meta))
    return d


def token_file(tmp_path, tokens: np.ndarray) -> str:
    path = tmp_path / "tokens.bin"
    tokens.astype(np.uint16).tofile(path)
    return str(path)


# ------------------------------------------------------------------ --load / --save
def test_load_of_a_missing_directory(capsys) -> None:
    err = error_of(capsys, *MCORE, "--load", "/nonexistent/ckpt")
    assert "--load /nonexistent/ckpt: no such checkpoint directory" in err
    assert "--save DIR" in err


def test_load_of_a_directory_without_a_dcp_checkpoint(capsys, tmp_path) -> None:
    (tmp_path / "half").mkdir()
    err = error_of(capsys, *MCORE, "--load", str(tmp_path / "half"))
    assert "not a DCP checkpoint" in err and ".metadata is missing" in err


def test_load_of_another_models_checkpoint(capsys, tmp_path) -> None:
    ckpt = dcp_dir(tmp_path, {"iteration": 3, "model": "gpt"})
    err = error_of(capsys, *MCORE, "--load", str(ckpt))
    assert "holds a --model gpt checkpoint, but this run trains --model mcore-gpt" in err


def test_load_that_already_reached_train_iters(capsys, tmp_path) -> None:
    ckpt = dcp_dir(tmp_path, {"iteration": 10, "model": "mcore-gpt"})
    err = error_of(capsys, *MCORE, "--load", str(ckpt), "--train-iters", "10")
    assert "holds iteration 10, which already reaches --train-iters 10" in err


def test_save_interval_without_save(capsys) -> None:
    assert "--save-interval is given without --save" in error_of(
        capsys, *MCORE, "--save-interval", "2"
    )


# ------------------------------------------------------------------ --data-path
def test_data_path_with_ids_beyond_the_vocabulary(capsys, tmp_path) -> None:
    tokens = np.arange(40 * 16 + 1) % 128
    tokens[5] = 2000
    path = token_file(tmp_path, tokens)
    err = error_of(capsys, *MCORE, *SHAPE, "--data-path", path)
    assert f"--data-path {path}: token 5 (sample 0) has id 2000" in err
    assert ">= --vocab-size 128" in err and "set --vocab-size" in err


def test_data_path_shorter_than_one_sequence(capsys, tmp_path) -> None:
    path = token_file(tmp_path, np.arange(10))
    err = error_of(capsys, *MCORE, *SHAPE, "--data-path", path)
    assert "10 tokens is shorter than one sample of --seq-length 16" in err
    assert "shorter --seq-length" in err


def test_data_path_that_is_not_a_token_file(capsys, tmp_path) -> None:
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x01\x02\x03")
    assert "not a multiple of 2" in error_of(capsys, *MCORE, *SHAPE, "--data-path", str(odd))


def test_only_the_samples_the_run_reads_are_checked(capsys, tmp_path, monkeypatch) -> None:
    """10 steps x 2 ranks x 2 sequences read samples 0..39 of 100; eval batches from 50 on."""

    def environment(*_):  # the check after the data checks: stop there
        raise CLIError("past the data checks")

    monkeypatch.setattr(megatron_cli, "check_mcore_environment", environment)
    tokens = np.arange(100 * 16 + 1) % 128
    tokens[45 * 16 + 3] = 999  # sample 45: never read for training
    path = token_file(tmp_path, tokens)
    argv = [*MCORE, *SHAPE, "--train-iters", "10", "--data-path", path]
    assert "past the data checks" in error_of(capsys, *argv)
    tokens[45 * 16 + 3] = 1
    # The first eval batch (after step 4, --eval-interval 5): samples 50 + 4 * 2 * 2 = 66...69
    tokens[67 * 16 + 7] = 999
    path = token_file(tmp_path, tokens)
    err = error_of(capsys, *argv, "--eval-interval", "5")
    assert "(sample 67) has id 999" in err
    # A resumed run reads from its start step on: samples 8 * 4 = 32 ...
    tokens[67 * 16 + 7] = 1
    tokens[33 * 16 + 1] = 500
    path = token_file(tmp_path, tokens)
    ckpt = dcp_dir(tmp_path, {"iteration": 8, "model": "mcore-gpt"})
    assert "(sample 33) has id 500" in error_of(capsys, *argv, "--load", str(ckpt))


# ------------------------------------------------------------------ offload flags
@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--optimizer-cpu-offload", "--optimizer-offload-fraction", "0"], "must be in (0, 1]"),
        (["--optimizer-cpu-offload", "--optimizer-offload-fraction", "1.5"], "must be in (0, 1]"),
        (["--optimizer-offload-fraction", "0.5"], "without --optimizer-cpu-offload"),
        (["--optimizer-cpu-offload", "--recompute-activations"], "drop --recompute-activations"),
    ],
)
def test_optimizer_offload_flags(capsys, argv: list[str], expected: str) -> None:
    for model in ("gpt", "mcore-gpt"):
        err = error_of(capsys, "train", "--model", model, "--device", "cpu", *argv)
        assert expected in err, (model, err)


# ------------------------------------------------------------------ plumbing into the run
def test_flags_reach_the_mcore_train_config(tmp_path, monkeypatch, capsys) -> None:
    """--load/--save/--save-interval/--data-path/--optimizer-cpu-offload as MCoreTrainConfig
    fields (the launch is replaced: megatron-core does not import here; the GPU test runs
    it)."""
    ckpt = dcp_dir(tmp_path, {"iteration": 3, "model": "mcore-gpt"})
    path = token_file(tmp_path, np.arange(100 * 16 + 1) % 128)
    seen = {}

    def fake_launch(plan, fn, cfg):
        seen.update(plan=plan, fn=fn, cfg=cfg)
        return None  # as on a rank > 0: nothing to print

    monkeypatch.setattr(megatron_cli, "check_mcore_environment", lambda *a: None)
    monkeypatch.setattr(megatron_cli, "launch", fake_launch)
    argv = [*MCORE, *SHAPE, "--train-iters", "8", "--load", str(ckpt), "--save"]
    argv += [str(tmp_path / "out"), "--save-interval", "4", "--data-path", path]
    argv += ["--optimizer-cpu-offload", "--optimizer-offload-fraction", "0.25"]
    assert main([*argv, "--save-on-interrupt"]) == 0
    cfg = seen["cfg"]
    # Saves at iteration 4 (the interval) and 8 (the end), one iter_NNNNNNN directory each.
    policy = cfg.checkpoint
    assert (cfg.start_step, cfg.steps, policy.save_at, policy.save_interval) == (3, 5, 5, 4)
    assert policy.save_on_interrupt  # the loop saves where a stop signal ends the run
    assert policy.load_path == str(ckpt) and policy.save_path == str(tmp_path / "out")
    assert cfg.data_path == path and cfg.optimizer_offload_fraction == 0.25
    assert cfg.model_name == "mcore-gpt" and seen["fn"] is megatron_cli._worker
    assert policy.resume_optimizer_settings == "check" and cfg.check_for_nan_in_loss_and_grad


GRAPHED = ["--cuda-graph-impl", "te", "--cuda-graph-scope", "attn", "--fsdp-double-buffer"]
GRAPHED += ["--fsdp-db-use-persist-buf-on-alloc-fail"]


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--cuda-graph-verify"], "but --cuda-graph-impl is none"),
        ([*GRAPHED, "--cuda-graph-verify", "--use-megatron-schedule"], "drop --use-megatron"),
        ([*GRAPHED, "--cuda-graph-verify", "always"], "invalid choice: 'always'"),
        (["--ddp-reduce-scatter-with-fp32-accumulation"], "is not wired for Megatron-Core"),
        (["--vocab-parallel-embedding"], "split by --tensor-model-parallel-size); drop it"),
    ],
)
def test_cuda_graph_verify_is_checked(capsys, argv: list[str], expected: str) -> None:
    assert expected in error_of(capsys, *MCORE, *SHAPE, *argv)


@pytest.mark.parametrize(("flag", "verify"), [([], False), ([""], True), (["raise"], "raise")])
def test_cuda_graph_verify_reaches_the_run_and_its_summary(monkeypatch, capsys, flag, verify):
    """--cuda-graph-verify [raise] becomes MCoreTrainConfig.cuda_graph_verify; the summary
    prints what the run's graphs report verified."""
    seen = {}
    summary = "layerwise step (microbatch 0), scopes [attn]: graphed != eager: ..."

    def fake_launch(plan, fn, cfg):
        seen["cfg"] = cfg
        report = {"verification": [{"summary": summary}]} if cfg.cuda_graph_verify else {}
        return {"losses": [1.0], "times": [0.1], "cuda_graphs": report}

    monkeypatch.setattr(megatron_cli, "check_mcore_environment", lambda *a: None)
    monkeypatch.setattr(megatron_cli, "launch", fake_launch)
    argv = [*MCORE, *SHAPE, *GRAPHED, "--train-iters", "4"]
    argv += ["--cuda-graph-verify", *[f for f in flag if f]] if flag else []
    assert main(argv) == 0
    assert seen["cfg"].cuda_graph_verify == verify
    out = capsys.readouterr().out
    assert (f"graph verification: {summary}" in out) == bool(verify), out
