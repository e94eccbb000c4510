"""compare's bitwise verdicts on train.run results."""

from __future__ import annotations

import torch

from graph_fsdp.cli.compare_cmd import (
    add_graph_check,
    add_verification,
    diff_runs,
    format_verdict,
    summary_line,
)
from graph_fsdp.training.train import TrainConfig


def result(losses: list[float], **params: torch.Tensor) -> dict:
    return {"losses": losses, "eval_losses": [], "params": params}


def test_identical_runs() -> None:
    a = result([3.0, 2.5], w=torch.ones(3))
    v = diff_runs(a, result([3.0, 2.5], w=torch.ones(3)))
    assert v["identical"] and v["equal_steps"] == 2 and v["params"] == 1
    assert "IDENTICAL" in format_verdict("run", v)


def test_first_differing_step_and_max_differences() -> None:
    a = result([3.0, 2.5, 2.0], w=torch.zeros(2), b=torch.ones(2))
    b = result([3.0, 2.5 + 1e-6, 2.1], w=torch.tensor([0.0, 1e-3]), b=torch.ones(2))
    v = diff_runs(a, b, start_step=10)
    assert not v["identical"] and v["first_diff_step"] == 11
    assert abs(v["max_loss_diff"] - 0.1) < 1e-6
    assert v["differing_params"] == 1 and v["worst_param"] == "w"
    text = format_verdict("run", v)
    assert "DIFFERENT" in text and "first differing step 11" in text and "params 1/2" in text


def test_param_only_difference_and_nan() -> None:
    v = diff_runs(result([1.0], w=torch.zeros(1)), result([1.0], w=torch.ones(1)))
    assert not v["identical"] and "first_diff_step" not in v
    assert "losses 1/1 steps bit-identical" in format_verdict("run", v)
    v = diff_runs(
        result([float("nan")], w=torch.zeros(1)), result([float("nan")], w=torch.zeros(1))
    )
    assert not v["identical"] and v["first_diff_step"] == 0  # NaN is never "identical"


GRAPHED = TrainConfig(cuda_graph_impl="torch", steps=6, cuda_graph_warmup_steps=2)
REPORT = {
    "captures": 1,
    "replays": 8,
    "eager_fallbacks": 0,
    "scopes": ["attn"],
    "comm_graphs": {"graphs": 4, "replays": 32, "eager_calls": 0, "failed": None},
    "verification": [
        {"identical": True, "verified": True, "replays": 2, "fallbacks": 0, "summary": "ok"}
    ],
}


def _graphed_verdict(report: dict | None, cfg: TrainConfig = GRAPHED) -> dict:
    """The verdict of a graphed run whose numbers equal the reference's."""
    same = result([3.0, 2.5], w=torch.ones(3))
    other = {**same, **({"cuda_graphs": report} if report is not None else {})}
    v = diff_runs(same, other)
    add_graph_check(v, other, cfg)
    add_verification(v, other)
    return v


def test_identical_needs_replays_and_no_fallback() -> None:
    v = _graphed_verdict(REPORT)
    assert v["identical"], v
    text = format_verdict("torch [attn]", v)
    assert "IDENTICAL" in text
    assert "graphs: 1 captures, 8 replays, 0 eager fallbacks; communication graphs 4 graphs" in text
    cases = {
        "NOT GRAPHED: 0 replays": {**REPORT, "replays": 0},
        "NOT GRAPHED: 3 replays over 4 timed steps": {**REPORT, "replays": 3},
        "FELL BACK: 5 calls of captured modules ran eagerly": {**REPORT, "eager_fallbacks": 5},
        "COMMUNICATION GRAPHS failed: RuntimeError: boom": {
            **REPORT,
            "comm_graphs": {
                "graphs": 0,
                "replays": 0,
                "eager_calls": 9,
                "failed": "RuntimeError: boom",
            },
        },
        "NOT VERIFIED: its verification step's graphed run had 0 replays": {
            **REPORT,
            "verification": [
                {
                    "identical": False,
                    "verified": False,
                    "replays": 0,
                    "fallbacks": 0,
                    "summary": "x",
                }
            ],
        },
        "NOT GRAPHED: no graph report": None,
    }
    for expected, report in cases.items():
        v = _graphed_verdict(report)
        assert not v["identical"] and v["graph_failure"].startswith(expected), (expected, v)
        text = format_verdict("torch [attn]", v)
        assert f"{'torch [attn]':<44} {expected}" in text and "IDENTICAL" not in text, text
        assert "(numbers equal the reference)" in text
        assert summary_line([_graphed_verdict(REPORT), v]) == (
            "1 graphed run(s) did not replay as configured"
        )
    # --no-cuda-graph-comm: communication graphs that never replay are what was asked for.
    off = {**REPORT, "comm_graphs": {"graphs": 0, "replays": 0, "eager_calls": 9, "failed": None}}
    cfg = TrainConfig(
        cuda_graph_impl="torch", steps=6, cuda_graph_warmup_steps=2, cuda_graph_comm=False
    )
    assert _graphed_verdict(off, cfg)["identical"]
    assert not _graphed_verdict(off)["identical"]  # on: lent but never replayed


def test_summary_line() -> None:
    same = result([1.0], w=torch.zeros(1))
    identical = diff_runs(same, same)
    different = diff_runs(same, result([2.0], w=torch.zeros(1)))
    assert summary_line([identical]).startswith("all runs bit-identical")
    assert summary_line([identical, different]) == "1 run(s) DIFFER from the reference"
