"""compare's bitwise verdicts on train.run results."""

from __future__ import annotations

import torch

from graph_fsdp.cli.compare_cmd import diff_runs, format_verdict


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
