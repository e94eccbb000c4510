"""Every subcommand end to end on CPU: 2 gloo ranks, a 2-layer model, real processes.

Covers the two launch paths (spawned ranks and torchrun) and all four sharding strategies of
``train``, resume from a ``--save`` checkpoint, ``compare`` in strategy mode (identical, and
with an injected difference), ``bench`` outputs and ``profile`` traces and summary.
"""

from __future__ import annotations

import json
import re
import shutil
import sys

import numpy as np
import pytest
from _cli_helpers import SETTINGS, TINY, run_cli, run_module_entries, saved_meta


def _ok(proc) -> str:
    assert proc.returncode == 0, (
        f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    )
    return proc.stdout


def _records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_train_writes_one_record_per_step_and_resumes_across_strategies(tmp_path) -> None:
    log, ckpt = tmp_path / "logs" / "steps.jsonl", tmp_path / "ckpt"
    out = _ok(
        run_cli(
            "train",
            *TINY,
            "--train-iters",
            "3",
            "--global-batch-size",
            "8",
            "--fsdp-double-buffer",
            "--fsdp-db-use-persist-buf-on-alloc-fail",
            "--eval-interval",
            "2",
            "--save",
            str(ckpt),
            "--log-json",
            str(log),
        )
    )
    records = _records(log)
    assert [r["step"] for r in records] == [0, 1, 2]
    for r in records:
        assert {"loss", "step_time_s", "tokens_per_s", "tflops_per_gpu"} <= set(r)
        assert r["loss"] > 0 and r["tokens_per_s"] > 0
    assert "3 steps on 2 x cpu (gloo, spawned); optim_grads_params" in out
    assert "grad accumulation 2" in out and "eval losses:" in out
    assert saved_meta(ckpt, 3) == {"iteration": 3, "model": "gpt", "optimizer": SETTINGS}

    # Resume under another strategy (checkpoints are strategy independent): steps 3 and 4.
    out = _ok(
        run_cli(
            "train",
            *TINY,
            "--train-iters",
            "5",
            "--global-batch-size",
            "8",
            "--data-parallel-sharding-strategy",
            "no_shard",
            "--fsdp-buffer",
            "trace_pool",
            "--load",
            str(ckpt),
            "--log-json",
            str(log),
        )
    )
    assert [r["step"] for r in _records(log)] == [3, 4]
    assert "2 steps on 2 x cpu" in out and "no_shard" in out


@pytest.mark.slow
def test_train_moe_recompute_bf16_with_token_file(tmp_path) -> None:
    tokens = tmp_path / "tokens.bin"
    (np.arange(1000) % 128).astype(np.uint16).tofile(tokens)
    log = tmp_path / "steps.jsonl"
    proc = run_cli(
        "train",
        *TINY,
        "--train-iters",
        "2",
        "--num-experts",
        "4",
        "--moe-layer-freq",
        "2",
        "--recompute-activations",
        "--bf16",
        "--grad-comm-dtype",
        "bf16",
        "--data-parallel-sharding-strategy",
        "optim_grads",
        "--data-path",
        str(tokens),
        "--log-json",
        str(log),
    )
    out = _ok(proc)
    assert len(_records(log)) == 2
    assert "optim_grads" in out and "4 experts top-2" in out
    assert f"data: {tokens} (uint16 token file)" in out


@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun not on PATH")
def test_train_under_torchrun_runs_ranks_in_process(tmp_path) -> None:
    log = tmp_path / "steps.jsonl"
    tiny = [a for a in TINY]
    del tiny[tiny.index("--nproc") : tiny.index("--nproc") + 2]
    launcher = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
    ]
    out = _ok(
        run_cli(
            "train",
            *tiny,
            "--train-iters",
            "2",
            "--data-parallel-sharding-strategy",
            "optim",
            "--log-json",
            str(log),
            launcher=launcher,
        )
    )
    assert "2 steps on 2 x cpu (gloo, torchrun); optim" in out
    assert out.count("graph-fsdp train:") == 1  # only rank 0 reports
    assert len(_records(log)) == 2


@pytest.mark.slow
def test_compare_strategies_identical_then_injected_difference(tmp_path) -> None:
    verdicts = tmp_path / "compare.json"
    strategies = ("compare", *TINY, "--train-iters", "3", "--reference-strategy", "no_shard")
    out = _ok(run_cli(*strategies, "--log-json", str(verdicts)))
    assert "reference no_shard eager" in out and "deterministic algorithms on" in out
    assert re.search(r"optim_grads_params eager\s+IDENTICAL", out)
    assert json.loads(verdicts.read_text())["results"][0]["identical"] is True
    assert "\ncode: commit " in out  # the commit that produced the verdicts (provenance.py)
    assert json.loads(verdicts.read_text())["code"]["source_sha256"]

    proc = run_cli(*strategies, "--inject-difference")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    match = re.search(r"DIFFERENT\s+first differing step (\d+)", proc.stdout)
    assert match, proc.stdout
    assert int(match.group(1)) >= 1  # step 0's loss is computed before any update
    assert "params 16/16 tensors differ" in proc.stdout


@pytest.mark.slow
def test_bench_writes_markdown_json_and_png(tmp_path) -> None:
    out_dir = tmp_path / "bench"
    out = _ok(
        run_cli(
            "bench",
            *TINY,
            "--train-iters",
            "2",
            "--warmup-iters",
            "1",
            "--graph-impls",
            "torch",
            "te",
            "--cuda-graph-warmup-steps",
            "0",
            "--scopes",
            "full_iteration",
            "--fsdp-double-buffer",  # full_iteration's static buffers, checked before launch
            "--output-dir",
            str(out_dir),
        )
    )
    assert {p.name for p in out_dir.iterdir()} == {"results.md", "results.json", "results.png"}
    report = json.loads((out_dir / "results.json").read_text())
    # Stamped with the code that produced it (bench/provenance.py).
    assert set(report["code"]) == {"commit", "dirty", "commit_source", "source_sha256"}
    assert (out_dir / "results.md").read_text().splitlines()[2].startswith("Code: commit ")
    rows = {r["name"]: r for r in report["rows"]}
    for name in ("graph_fsdp eager", "torch FSDP2", "unsharded eager (1 rank)"):
        assert rows[name]["status"] == "ok", rows[name]
        assert rows[name]["median_step_ms"] > 0 and "step_time_vs_ref" in rows[name]
    # The captured baseline needs CUDA: the eager one is the fastest that ran.
    assert rows["unsharded captured (1 rank)"]["status"] == "skipped"
    assert rows["unsharded eager (1 rank)"]["step_time_vs_ref"] == 1.0
    assert "parity reference" not in " ".join(rows)  # only with --rows reference
    # Host time to issue a step, and per layer and direction where forward/backward are calls.
    for name in ("graph_fsdp eager",):
        r = rows[name]
        assert 0 < r["median_host_ms"] <= r["median_step_ms"] * 1.05, r
        assert r["host_fwd_us_per_layer"] > 0 and r["host_bwd_us_per_layer"] > 0, r
    assert 0 < rows["torch FSDP2"]["median_host_ms"]
    assert "host_fwd_us_per_layer" not in rows["torch FSDP2"]
    # Two backends, one full_iteration row (it is captured with torch either way).
    assert [n for n in rows if "full_iteration" in n] == ["graph_fsdp torch [full_iteration]"]
    # Same model, seeds and data: graph_fsdp and FSDP2 end at the same loss.
    assert rows["graph_fsdp eager"]["final_loss"] == pytest.approx(
        rows["torch FSDP2"]["final_loss"], rel=1e-5
    )
    for name in (
        "graph_fsdp torch [full_iteration]",
        "torch FSDP2 + CUDA graph (fwd+bwd)",
        "megatron_fsdp",
    ):
        assert rows[name]["status"] == "skipped" and "CUDA" in rows[name]["reason"]
    assert "| graph_fsdp eager | 2 |" in out and "skipped: CUDA graphs need a CUDA device" in out
    assert (out_dir / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_profile_writes_traces_and_prints_summary(tmp_path) -> None:
    out_dir = tmp_path / "profile"
    out = _ok(run_cli("profile", *TINY, "--train-iters", "2", "--output-dir", str(out_dir)))
    for rank in (0, 1):
        trace = json.loads((out_dir / f"trace_rank{rank}.json").read_text())
        assert any(e.get("name") == "graph_fsdp/step/1" for e in trace["traceEvents"])
    assert "graph_fsdp/step/1" in out and "graph_fsdp/step/2" in out
    assert "graph_fsdp/forward/layers.0" in out and "graph_fsdp/backward/model" in out
    assert re.search(r"communication [\d.]+ ms/step of which [\d.]+ ms \(\d+%\) exposed", out)
    assert "gloo:all_gather" in out and "rank 1: mean step" in out
    assert "\ncode: commit " in out
    summary = json.loads((out_dir / "profile_summary.json").read_text())
    assert summary["code"]["source_sha256"] and len(summary["ranks"]) == 2


COMMANDS = ["train", "compare", "bench", "profile"]


@pytest.fixture(scope="module")
def module_entries() -> dict:
    """``python -m graph_fsdp.cli.main CMD --help`` for each command and ``--version`` of it
    and of ``python -m graph_fsdp``, all in one Python process (run_module_entries)."""
    calls = [("graph_fsdp.cli.main", [command, "--help"]) for command in COMMANDS]
    calls += [("graph_fsdp", ["--version"]), ("graph_fsdp.cli.main", ["--version"])]
    results = run_module_entries(calls, timeout=120)
    return {(module, argv[0]): result for (module, argv), result in zip(calls, results)}


@pytest.mark.parametrize("command", COMMANDS)
def test_module_entry_prints_each_commands_help(module_entries, command: str) -> None:
    code, out = module_entries[("graph_fsdp.cli.main", command)]
    assert code == "0" and f"usage: graph-fsdp {command}" in out, (code, out)


def test_version_and_python_m_graph_fsdp(module_entries) -> None:
    from graph_fsdp import __version__

    for module in ("graph_fsdp", "graph_fsdp.cli.main"):
        code, out = module_entries[(module, "--version")]
        assert code == "0", (module, code, out)
        assert out.strip() == f"graph-fsdp {__version__}"
