"""Benchmark report: ratios to the reference, markdown, JSON and PNG outputs."""

from __future__ import annotations

import json

import pytest

from graph_fsdp.bench.report import gpu_tag, markdown, with_ratios, write_report
from graph_fsdp.bench.runner import host_numbers
from graph_fsdp.models import GPTConfig
from graph_fsdp.training.train import TrainConfig


def ok(
    name: str,
    ms: float,
    tokens: float,
    world: int,
    peak: int | None = None,
    *,
    baseline: bool = False,
) -> dict:
    return {
        "name": name,
        "status": "ok",
        "baseline": baseline,
        "world_size": world,
        "median_step_ms": ms,
        "min_step_ms": ms * 0.9,
        "tokens_per_s": tokens,
        "tflops_per_gpu": 1.5,
        "own_peak_allocated_bytes": peak,
        "final_loss": 4.2,
        "step_times_ms": [ms],
    }


REPORT = {
    "world_size": 2,
    "device_name": "NVIDIA H100 80GB HBM3",
    "backend": "nccl",
    "created": "2025-01-01T00:00:00",
    "setup": "tiny model",
    "rows": [
        {
            **ok("graph_fsdp eager", 12.0, 2000.0, 2, 2**30),
            "own_peak_reserved_bytes": 3 * 2**29,
            "start_allocated_bytes": 2**29,
            "start_reserved_slack_bytes": 2**20,
            "median_host_ms": 11.5,
            "host_fwd_us_per_layer": 140.2,
            "host_bwd_us_per_layer": 201.7,
        },
        {"name": "megatron_fsdp", "status": "skipped", "reason": "not importable"},
        ok("unsharded eager (1 rank)", 10.0, 1200.0, 1, 2**31, baseline=True),
        {
            **ok("graph_fsdp torch [layer]", 9.0, 2600.0, 2, 2**30),
            "own_peak_reserved_bytes": 2**31,
            "start_reserved_slack_bytes": 2**28,
            "graph_captures": 1,
            "graph_replays": 40,
            "graph_eager_fallbacks": 0,
            "comm_graphs": "8 graphs, 160 replays, 0 eager calls",
        },
        {
            "name": "graph_fsdp torch [attn]",
            "status": "failed",
            "reason": "FELL BACK: 3 calls of captured modules ran eagerly",
            "own_peak_allocated_bytes": 2**30,
            "own_peak_reserved_bytes": 2**31,
            "graph_captures": 1,
            "graph_replays": 37,
            "graph_eager_fallbacks": 3,
            "comm_graphs": "off",
        },
    ],
    "code": {
        "commit": "0123abcd",
        "dirty": True,
        "commit_source": "git",
        "source_sha256": "feedfacefeedface",
    },
}


def test_ratios_to_the_reference() -> None:
    rows = with_ratios(REPORT["rows"])
    assert rows[0]["step_time_vs_ref"] == pytest.approx(1.2)
    assert rows[0]["tokens_per_gpu_vs_ref"] == pytest.approx(1000 / 1200)
    assert rows[0]["ratio_baseline"] == "unsharded eager (1 rank)"
    assert "step_time_vs_ref" not in rows[1]
    assert rows[2]["step_time_vs_ref"] == 1.0


def test_ratios_are_taken_against_the_fastest_baseline() -> None:
    rows = [
        ok("graph_fsdp torch [full_iteration]", 13.0, 2 * 820.0, 2),
        # A slower non-baseline single-GPU row never becomes the denominator, even when the
        # baselines are slower than it.
        ok("parity reference (1 rank)", 8.0, 1300.0, 1),
        ok("unsharded eager (1 rank)", 15.5, 660.0, 1, baseline=True),
        ok("unsharded captured (1 rank)", 10.0, 1024.0, 1, baseline=True),
    ]
    out = with_ratios(rows)
    assert [r["ratio_baseline"] for r in out] == ["unsharded captured (1 rank)"] * 4
    assert out[0]["step_time_vs_ref"] == pytest.approx(1.3)
    assert out[0]["tokens_per_gpu_vs_ref"] == pytest.approx(820.0 / 1024.0)
    assert out[2]["step_time_vs_ref"] == pytest.approx(1.55)
    assert out[3]["step_time_vs_ref"] == 1.0
    # The faster baseline skipped or failed: the other one is the denominator.
    rows[3] = {"name": rows[3]["name"], "status": "failed", "reason": "x", "baseline": True}
    out = with_ratios(rows)
    assert out[0]["step_time_vs_ref"] == pytest.approx(13.0 / 15.5)
    assert "step_time_vs_ref" not in out[3]
    assert "ref: unsharded eager (1 rank), the fastest" in markdown({**REPORT, "rows": rows})


def test_no_baseline_no_ratios_and_legacy_reports() -> None:
    rows = [ok("graph_fsdp eager", 12.0, 2000.0, 2), ok("torch FSDP2", 11.0, 2100.0, 2)]
    assert all("step_time_vs_ref" not in r for r in with_ratios(rows))
    assert "ref: none (no unsharded row ran): no ratios" in markdown({**REPORT, "rows": rows})
    # Reports written before rows carried "baseline": the one "unsharded reference" row.
    legacy = [{k: v for k, v in r.items() if k != "baseline"} for r in rows]
    legacy.append(
        {
            k: v
            for k, v in ok("unsharded reference (1 rank)", 10.0, 1200.0, 1).items()
            if k != "baseline"
        }
    )
    assert with_ratios(legacy)[0]["step_time_vs_ref"] == pytest.approx(1.2)


def test_markdown_and_files(tmp_path) -> None:
    text = markdown(REPORT)
    assert text.splitlines()[2] == (
        "Code: commit 0123abcd (DIRTY; from git), graph_fsdp source sha256 feedfacefeedface."
    )
    assert (
        "| graph_fsdp eager | 2 | 12.00 | 10.80 | 11.50 | 140, 202 | 2,000 | 1.500 | 1.00 | 1.50 | "
        "- | 4.20000 | 1.20x | 0.83x |" in text
    )
    assert "| unsharded eager (1 rank) | 1 | 10.00 | 9.00 | - | - | 1,200 |" in text
    # Own peaks, allocated and reserved, and the graph counts next to every graphed row.
    assert (
        "| 1.00 | 2.00 | 1/40/0, comm 8 graphs, 160 replays, 0 eager calls | 4.20000 | 0.90x |"
        in text
    )
    # A failed graphed row gives no time, only its memory, its counts and the reason.
    assert (
        "| graph_fsdp torch [attn] | FAILED | | | | | | | 1.00 | 2.00 | 1/37/3, comm off | | | |"
        in text
    )
    assert "- graph_fsdp torch [attn]: FAILED: FELL BACK: 3 calls of captured modules" in text
    assert "| megatron_fsdp | skipped | | | | | | | - | - | - | | | |" in text
    assert "- megatron_fsdp: skipped: not importable" in text
    assert "- graph_fsdp eager: 0.50 GiB were still allocated when the row started" in text
    assert "not counted in its own peaks" in text
    assert "- graph_fsdp torch [layer]: its own reserved peak may be low by about 0.25 GiB" in text
    assert "graph_fsdp eager: its own reserved" not in text  # 1 MiB of slack: no note
    assert "unsharded eager (1 rank): " not in text.split("Notes:")[1]
    paths = write_report(REPORT, str(tmp_path / "out"))
    assert set(paths) == {"md", "json", "png"}
    data = json.loads((tmp_path / "out" / "results.json").read_text())
    assert data["rows"][0]["step_time_vs_ref"] == pytest.approx(1.2)
    assert data["code"]["commit"] == "0123abcd" and data["code"]["dirty"] is True
    assert "step_time_vs_ref" not in data["rows"][4]  # failed: no time, no ratio
    assert "Code: not recorded" in markdown({k: v for k, v in REPORT.items() if k != "code"})


def test_gpu_tag() -> None:
    assert gpu_tag("NVIDIA H100 80GB HBM3") == "h100"
    assert gpu_tag("NVIDIA H200") == "h200"
    assert gpu_tag("Tesla") == "tesla"


def test_host_numbers_per_layer_and_direction() -> None:
    cfg = TrainConfig(model=GPTConfig(num_layers=4), grad_accum=2)
    raw = {
        "host_step_times": [0.010, 0.012, 0.011],
        "host_forward_times": [0.0008, 0.0016, 0.0008],  # median 0.8 ms over 8 layer calls
        "host_backward_times": [0.0, 0.0, 0.0],  # a full_iteration replay: no split
    }
    out = host_numbers(raw, cfg)
    assert out["median_host_ms"] == pytest.approx(11.0)
    assert out["host_fwd_us_per_layer"] == pytest.approx(100.0)
    assert "host_bwd_us_per_layer" not in out
    assert host_numbers({}, cfg) == {}


def test_the_bench_header_names_nccl_graph_registration(monkeypatch) -> None:
    """A process-wide NCCL setting is every row's, the peers' too: the bench says it."""
    from graph_fsdp.cli.bench_cmd import environment_label

    monkeypatch.delenv("NCCL_GRAPH_REGISTER", raising=False)
    assert environment_label() == ""
    monkeypatch.setenv("NCCL_GRAPH_REGISTER", "0")
    assert environment_label() == " Every row (the peers' too): NCCL_GRAPH_REGISTER=0."
