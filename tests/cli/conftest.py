"""In-process CLI calls must not inherit a launcher environment; one saved training run that
several test files read (copies of it where they change it)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from _cli_helpers import TINY, run_cli


@pytest.fixture(autouse=True)
def _no_launcher_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """In-process main() calls must not think they run under torchrun."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="session")
def saved_run(tmp_path_factory) -> dict:
    """``graph-fsdp train --train-iters 5 --save DIR --save-interval 2 --save-keep-last 2``:
    saves at 2, 4 and the end (5), keeps 4 and 5, the tracker names 5. Read-only: tests that
    change the checkpoints copy the directory. ``ck``: the directory, ``start``: its latest
    iteration, ``out``: the command's stdout (test_cli_long_runs.py checks all of it)."""
    ck = tmp_path_factory.mktemp("saved_run") / "ck"
    proc = run_cli(
        "train", *TINY, "--train-iters", "5", "--save", str(ck), "--save-interval", "2",
        "--save-keep-last", "2",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return {"ck": ck, "start": 5, "out": proc.stdout}


@pytest.fixture(scope="session")
def token_file_run(tmp_path_factory) -> dict:
    """``graph-fsdp train --train-iters 4 --lr 1e-2 --deterministic --data-path FILE`` on a
    learnable token file (every token determines the next, period 13; 400 samples of 16), the
    run test_cli_train_data.py and test_cli_optimizer_offload.py both examine. ``path``: the
    file, ``proc``: the finished command, ``losses``: its --log-json losses."""
    root = tmp_path_factory.mktemp("token_file_run")
    path, log = root / "tokens.bin", root / "steps.jsonl"
    ((np.arange(400 * 16 + 1) * 7) % 13).astype(np.uint16).tofile(path)
    flags = ["train", *TINY, "--train-iters", "4", "--lr", "1e-2", "--deterministic"]
    proc = run_cli(*flags, "--data-path", str(path), "--log-json", str(log))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    losses = [json.loads(line)["loss"] for line in log.read_text().splitlines()]
    return {"path": str(path), "proc": proc, "losses": losses}
