"""Benchmark report: ratios to the reference, markdown, JSON and PNG outputs."""

from __future__ import annotations

import json

import pytest

from graph_fsdp.bench.report import gpu_tag, markdown, with_ratios, write_report


def ok(name: str, ms: float, tokens: float, world: int, peak: int | None = None) -> dict:
    return {
        "name": name,
        "status": "ok",
        "world_size": world,
        "median_step_ms": ms,
        "min_step_ms": ms * 0.9,
        "tokens_per_s": tokens,
        "tflops_per_gpu": 1.5,
        "peak_memory_bytes": peak,
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
        ok("graph_fsdp eager", 12.0, 2000.0, 2, 2**30),
        {"name": "megatron_fsdp", "status": "skipped", "reason": "not importable"},
        ok("unsharded reference (1 rank)", 10.0, 1200.0, 1, 2**31),
    ],
}


def test_ratios_to_the_reference() -> None:
    rows = with_ratios(REPORT["rows"])
    assert rows[0]["step_time_vs_ref"] == pytest.approx(1.2)
    assert rows[0]["tokens_per_gpu_vs_ref"] == pytest.approx(1000 / 1200)
    assert "step_time_vs_ref" not in rows[1]
    assert rows[2]["step_time_vs_ref"] == 1.0


def test_markdown_and_files(tmp_path) -> None:
    text = markdown(REPORT)
    assert (
        "| graph_fsdp eager | 2 | 12.00 | 10.80 | 2,000 | 1.500 | 1.00 | 4.20000 | 1.20x | 0.83x |"
        in text
    )
    assert "- megatron_fsdp: skipped: not importable" in text
    paths = write_report(REPORT, str(tmp_path / "out"))
    assert set(paths) == {"md", "json", "png"}
    data = json.loads((tmp_path / "out" / "results.json").read_text())
    assert data["rows"][0]["step_time_vs_ref"] == pytest.approx(1.2)


def test_gpu_tag() -> None:
    assert gpu_tag("NVIDIA H100 80GB HBM3") == "h100"
    assert gpu_tag("NVIDIA H200") == "h200"
    assert gpu_tag("Tesla") == "tesla"
