"""``graph-fsdp bench --model mcore-*`` on CPU: flag validation, the rows a launch plans, and
the report's ratios and bit-exactness verdicts. The launch itself needs megatron-core and
GPUs (the command in the README's Megatron-Core section)."""

from __future__ import annotations

import json

import pytest
import torch
from graph_fsdp_testing import cli_error

from graph_fsdp.bench import megatron as mb
from graph_fsdp.cli import mcore as megatron_cli
from graph_fsdp.cli.errors import CLIError
from graph_fsdp.cli.main import build_parser

MOE = ["bench", "--model", "mcore-moe", "--moe-shared-expert-intermediate-size", "512"]
STATIC = ["--fsdp-double-buffer", "--fsdp-db-use-persist-buf-on-alloc-fail"]
SETS = ["--scopes", "attn", "--scopes", "attn moe_router", "--scopes", "moe_router moe_preprocess"]


error_of = cli_error


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        ([*MOE, "--device", "cpu"], ["needs CUDA", "MoE (alltoall dispatcher)"]),
        ([*MOE, "--rows", "fsdp2", "unsharded"], ["--rows fsdp2 unsharded: not available"]),
        ([*MOE, "--scopes", "attn"], ["no graphed row runs", "--graph-impls te"]),
        ([*MOE, "--graph-impls", "te", "--scopes", "moe", *STATIC], ["host sync"]),
        ([*MOE, "--graph-impls", "te", "--scopes", "attn"], ["--fsdp-double-buffer"]),
        (
            [*MOE, "--graph-impls", "te", *SETS, *STATIC, "--warmup-iters", "2"],
            ["--warmup-iters 2 must exceed --cuda-graph-warmup-steps 2"],
        ),
        ([*MOE, "--grad-comm-dtype", "bf16"], ["--grad-comm-dtype bf16 is not wired"]),
        ([*MOE, "--recompute-activations"], ["--recompute-activations is not wired"]),
        (
            [*MOE, "--cuda-graph-impl", "torch", "--graph-impls", "te"],
            ["--cuda-graph-impl torch and --graph-impls te disagree"],
        ),
        (["bench", "--use-megatron-schedule"], ["Megatron-Core model flags, but --model is gpt"]),
    ],
)
def test_bench_rejects(capsys, argv: list[str], expected: list[str]) -> None:
    err = error_of(capsys, *argv)
    for text in expected:
        assert text in err, (text, err)


def test_rows_one_per_backend_and_scope_set() -> None:
    rows = mb.plan_rows(
        list(mb.MCORE_ROWS),
        ["te", "torch"],
        [["attn"], ["attn", "moe_router"], ["full_iteration"]],
    )
    assert [(r.name, r.kind) for r in rows] == [
        ("graph_fsdp eager", "none"),
        ("graph_fsdp te [attn]", "te"),
        ("graph_fsdp te [attn moe_router]", "te"),
        ("graph_fsdp torch [full_iteration]", "torch"),  # always torch, planned once
        ("graph_fsdp torch [attn]", "torch"),
        ("graph_fsdp torch [attn moe_router]", "torch"),
        ("megatron_fsdp eager", "megatron_fsdp"),
    ]
    assert rows[2].scopes == ("attn", "moe_router")
    assert not any(r.one_graph for r in rows)


def test_build_job_for_the_issue_measurement(monkeypatch) -> None:
    """The lead's command: the GPU test's MoE GPT, eager + 2 backends x 3 scope sets."""
    monkeypatch.setattr(megatron_cli, "check_mcore_environment", lambda *a: None)
    argv = [*MOE, "--transformer-impl", "transformer_engine", "--bf16", "--deterministic"]
    argv += [*STATIC, "--graph-impls", "te", "torch", *SETS, "--warmup-iters", "5"]
    argv += ["--train-iters", "20", "--nproc", "2", "--fused-adamw"]
    args = build_parser().parse_args(argv)
    job, plan, setup = megatron_cli.build_bench_job(args)
    assert [r.name for r in job.rows] == [
        "graph_fsdp eager",
        "graph_fsdp te [attn]",
        "graph_fsdp te [attn moe_router]",
        "graph_fsdp te [moe_router moe_preprocess]",
        "graph_fsdp torch [attn]",
        "graph_fsdp torch [attn moe_router]",
        "graph_fsdp torch [moe_router moe_preprocess]",
        "megatron_fsdp eager",
    ]
    base = job.base
    assert (base.steps, job.warmup, base.eval_interval, base.cuda_graph_impl) == (25, 5, 0, "none")
    assert base.fused_optimizer and base.deterministic and base.mp.param_dtype == torch.bfloat16
    m = base.model
    assert (m.num_layers, m.hidden_size, m.num_experts, m.moe_router_topk) == (4, 256, 4, 2)
    assert m.moe_shared_expert_intermediate_size == 512 and m.seq_length == 128
    assert "4 experts top-2, shared expert 512" in setup and "5 warmup + 20 timed" in setup


def test_cuda_graph_optimizer_adds_the_one_graph_beside_full_iteration() -> None:
    rows = mb.plan_rows(["graph_fsdp_graphed"], ["torch"], [[], ["full_iteration"]], optimizer=True)
    assert [(r.name, r.one_graph) for r in rows] == [
        ("graph_fsdp torch [layer]", False),
        ("graph_fsdp torch [full_iteration]", False),
        ("graph_fsdp torch [full_iteration + optimizer]", True),
    ]


EP2 = [*MOE[:3], "--moe-experts-impl", "grouped_mm", "--expert-model-parallel-size", "2"]
EP2 += ["--moe-receive-buffer-factor", "1.5", "--nproc", "2"]


def test_skews_and_drop_padding_plan_one_set_of_rows_per_variant(monkeypatch) -> None:
    monkeypatch.setattr(megatron_cli, "check_mcore_environment", lambda *a: None)
    argv = [*EP2, *STATIC, "--graph-impls", "torch", "--scopes", "full_iteration"]
    argv += ["--cuda-graph-optimizer", "--fused-adamw", "--warmup-iters", "5"]
    argv += ["--moe-router-skew", "0", "4", "--moe-drop-padding-capacity-factor", "1.0"]
    argv += ["--rows", "graph_fsdp", "graph_fsdp_graphed"]
    job, _, _ = megatron_cli.build_bench_job(build_parser().parse_args(argv))
    labels = ["dropless, balanced", "drop-padding 1, balanced", "dropless, skew +4"]
    labels += ["drop-padding 1, skew +4"]
    assert [label for label, _ in job.variants] == labels
    each = ["graph_fsdp eager", "graph_fsdp torch [full_iteration]"]
    each += ["graph_fsdp torch [full_iteration + optimizer]"]
    assert [r.name for r in job.rows] == [f"{v}: {n}" for v in labels for n in each]
    for row in job.rows:
        cfg = job.config_of(row)
        padded = row.variant.startswith("drop-padding")
        assert cfg.router_skew == (4.0 if row.variant.endswith("+4") else 0.0)
        assert cfg.model.moe_experts_impl == ("megatron" if padded else "grouped_mm")
        assert cfg.model.moe_expert_capacity_factor == (1.0 if padded else None)
        assert cfg.model.moe_receive_buffer_factor == (None if padded else 1.5)
        assert cfg.graphs.optimizer == row.one_graph
        assert cfg.graphs.impl == ("none" if row.kind == "none" else "torch")


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (
            ["bench", "--moe-router-skew", "4"],
            ["--moe-router-skew: Megatron-Core model flags, but --model is gpt"],
        ),
        (
            ["bench", "--model", "mcore-gpt", "--moe-router-skew", "4"],
            ["vary an MoE model's experts: add --num-experts N"],
        ),
        ([*EP2, "--moe-router-skew", "nan"], ["--moe-router-skew nan: give finite numbers"]),
        (
            [*MOE[:3], "--moe-drop-padding-capacity-factor", "1.0"],
            ["compares graph_fsdp's dropless grouped_mm experts", "--moe-experts-impl grouped_mm"],
        ),
        ([*EP2, "--moe-drop-padding-capacity-factor", "0"], ["must be > 0"]),
    ],
)
def test_variant_flags_refused(capsys, argv: list[str], expected: list[str]) -> None:
    err = error_of(capsys, *argv)
    for text in expected:
        assert text in err, (text, err)


def test_each_variant_is_compared_with_its_own_eager_row_and_summarised() -> None:
    def row(variant: str, name: str, ms: float, reserved: int, losses, overflow=0) -> dict:
        return {
            **_row(f"{variant}: {name}", ms, reserved // 2, losses),
            "variant": variant,
            "overflow_steps": overflow,
        }

    fi, one = "graph_fsdp torch [full_iteration]", "graph_fsdp torch [full_iteration + optimizer]"
    rows = [
        row("dropless, balanced", "graph_fsdp eager", 50.0, 400, [2.0, 1.5]),
        row("dropless, balanced", fi, 5.0, 440, [2.0, 1.5]),
        row("dropless, balanced", one, 4.5, 480, [2.0, 1.5]),
        row("drop-padding 1, balanced", "graph_fsdp eager", 60.0, 500, [2.0, 1.6]),
        row("drop-padding 1, balanced", fi, 4.0, 400, [2.0, 1.7]),
        row("dropless, skew +4", "graph_fsdp eager", 52.0, 400, [2.1, 1.5], overflow=2),
        row("dropless, skew +4", fi, 5.2, 440, [2.1, 1.5], overflow=2),
        row("drop-padding 1, skew +4", fi, 4.0, 400, [2.1, 1.4]),
    ]
    out = {r["name"]: r for r in mb.with_ratios(rows)}
    assert out[f"dropless, balanced: {fi}"]["step_time_vs_eager"] == 0.1
    assert out[f"dropless, balanced: {fi}"]["losses_equal_eager"]
    assert out[f"drop-padding 1, balanced: {fi}"]["step_time_vs_eager"] == 4.0 / 60.0
    assert not out[f"drop-padding 1, balanced: {fi}"]["losses_equal_eager"]
    assert "losses_equal_eager" not in out[f"drop-padding 1, skew +4: {fi}"]  # no eager twin
    balanced, skewed = mb.ep_summary(rows)
    assert balanced["routing"] == "balanced" and balanced["against"] == "drop-padding 1, balanced"
    assert balanced["dropless full_iteration / dropless eager, step"] == 0.1
    assert balanced["dropless full_iteration / drop-padding full_iteration, step"] == 1.25
    assert balanced["dropless one graph / drop-padding full_iteration, step"] == 1.125
    assert (
        balanced["dropless full_iteration / drop-padding full_iteration, own peak reserved"] == 1.1
    )
    assert balanced["overflow steps of the dropless rows"] == {"graph_fsdp eager": 0, fi: 0, one: 0}
    assert skewed["dropless one graph / drop-padding full_iteration, step"] is None
    assert skewed["overflow steps of the dropless rows"] == {"graph_fsdp eager": 2, fi: 2}
    report = {"model": "mcore-moe", "world_size": 2, "device_name": "CPU", "backend": "gloo"}
    report |= {"created": "now", "setup": "setup", "rows": rows}
    text = mb.markdown(report)
    assert (
        "- balanced (against drop-padding 1, balanced): dropless full_iteration / dropless " in text
    )
    assert "overflow repeats: graph_fsdp eager 2, graph_fsdp torch [full_iteration] 2" in text


def test_only_rows_a_megatron_model_has(monkeypatch) -> None:
    monkeypatch.setattr(megatron_cli, "check_mcore_environment", lambda *a: None)
    args = build_parser().parse_args([*MOE, "--rows", "graph_fsdp", "megatron_fsdp"])
    job, _, _ = megatron_cli.build_bench_job(args)
    assert [r.name for r in job.rows] == ["graph_fsdp eager", "megatron_fsdp eager"]
    with pytest.raises(CLIError, match="choose from graph_fsdp, graph_fsdp_graphed"):
        megatron_cli.build_bench_job(build_parser().parse_args([*MOE, "--rows", "reference"]))


def _row(name: str, ms: float, peak: int, losses: list[float]) -> dict:
    return {
        "name": name,
        "status": "ok",
        "median_step_ms": ms,
        "min_step_ms": ms - 1,
        "own_peak_allocated_bytes": peak,
        "own_peak_reserved_bytes": 2 * peak,
        "losses": losses,
        "final_loss": losses[-1],
    }


def test_report_ratios_and_verdicts(tmp_path) -> None:
    gib = 2**30
    rows = [
        _row("graph_fsdp eager", 60.0, gib, [6.0, 5.5, 5.0]),
        _row("graph_fsdp te [attn]", 30.0, 2 * gib, [6.0, 5.5, 5.0]),
        _row("graph_fsdp torch [attn]", 45.0, gib, [6.0, 5.5, 5.0000001]),
        {"name": "megatron_fsdp eager", "status": "skipped", "reason": "no megatron_fsdp"},
        {
            "name": "graph_fsdp te [moe_router]",
            "status": "failed",
            "reason": "NOT GRAPHED: 0 replays (every step ran eagerly)",
            "graph_captures": 1,
            "graph_replays": 0,
            "graph_eager_fallbacks": 40,
            "comm_graphs": "not lent (one rank, or not NCCL)",
        },
    ]
    rows[1] |= {
        "graph_captures": 1,
        "graph_replays": 40,
        "graph_eager_fallbacks": 0,
        "comm_graphs": "not lent (one rank, or not NCCL)",
    }
    report = {
        "rows": rows,
        "model": "mcore-moe",
        "device_name": "GPU",
        "world_size": 2,
        "backend": "nccl",
        "created": "now",
        "setup": "setup line",
        "code": {"commit": "abc", "dirty": False, "commit_source": "git", "source_sha256": "f"},
    }
    out = mb.with_ratios(rows)
    assert out[1]["step_time_vs_eager"] == 0.5 and out[1]["peak_memory_vs_eager"] == 2.0
    assert out[1]["peak_reserved_vs_eager"] == 2.0
    assert out[1]["losses_equal_eager"] and not out[2]["losses_equal_eager"]
    assert out[2]["first_loss_difference_step"] == 2
    md = mb.markdown(report)
    assert "Code: commit abc (clean; from git), graph_fsdp source sha256 f." in md
    assert (
        "| graph_fsdp te [attn] | 30.00 | 29.00 | 2.00 | 4.00 | 1/40/0, comm not lent (one rank, "
        "or not NCCL) | 5.00000 | 0.50x | 2.00x | 2.00x | bit-identical |" in md
    )
    # A graphed row that never replayed: FAILED, no time, its counts and the reason.
    assert "| graph_fsdp te [moe_router] | FAILED | | - | - | 1/0/40, comm" in md
    assert "- graph_fsdp te [moe_router]: FAILED: NOT GRAPHED: 0 replays" in md
    assert "step_time_vs_eager" not in mb.with_ratios(rows)[4]
    assert "| bit-identical |" in md and "differs from step 2 (max abs 1.00e-07)" in md
    assert "- megatron_fsdp eager: skipped: no megatron_fsdp" in md
    paths = mb.write_report(report, str(tmp_path / "out"))
    saved = json.loads(open(paths["json"]).read())
    assert saved["rows"][2]["step_time_vs_eager"] == 0.75


def test_memory_ratio_counts_only_the_rows_own_bytes() -> None:
    gib = 2**30
    eager = _row("graph_fsdp eager", 60.0, gib, [6.0])
    # A later row's own peaks (what it added to what it started with): ratios use those.
    later = _row("graph_fsdp te [attn]", 30.0, 3 * gib // 2, [6.0]) | {
        "start_allocated_bytes": gib,
        "process_peak_allocated_bytes": 5 * gib // 2,
    }
    out = mb.with_ratios([eager, later])
    assert out[1]["peak_memory_vs_eager"] == 1.5 and out[1]["peak_reserved_vs_eager"] == 1.5
