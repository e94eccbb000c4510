"""``python -m graph_fsdp.run_demo`` (the README's main command): header, steps, summary."""

from __future__ import annotations

import re

import pytest

from graph_fsdp import run_demo


def test_run_demo_prints_header_steps_and_summary(capsys: pytest.CaptureFixture[str]) -> None:
    run_demo.main()
    lines = capsys.readouterr().out.strip().splitlines()
    header, steps, summary = lines[0], lines[1:-1], lines[-1]
    assert re.match(r"graph_fsdp demo: reference GPT \(\d+ layers, hidden \d+, [\d.]+M ", header)
    assert " ranks, " in header and "ZeRO-3 (optim_grads_params)" in header, header
    assert len(steps) == 10 and all(s.startswith("step ") for s in steps), steps
    losses = [float(re.search(r"loss (\S+)", s).group(1)) for s in steps]
    match = re.match(r"done: 10 steps, loss (\S+) -> (\S+), median step [\d.]+ ms, ", summary)
    assert match, summary
    assert (float(match.group(1)), float(match.group(2))) == (losses[0], losses[-1]), summary
