"""Shared helpers for the CLI tests: a tiny model and a subprocess runner."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

TINY = [
    "--num-layers",
    "2",
    "--hidden-size",
    "32",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "16",
    "--vocab-size",
    "128",
    "--device",
    "cpu",
    "--nproc",
    "2",
]
"""A 2-layer model small enough that a 2-rank gloo run takes a few seconds."""


def run_cli(
    *args: str, timeout: float = 120, launcher: list[str] | None = None, cwd: str | None = None
) -> subprocess.CompletedProcess:
    """``python -m graph_fsdp.cli.main ARGS`` (or under ``launcher``) in a clean environment."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env["PYTHONWARNINGS"] = "ignore::FutureWarning"  # the engine's deprecated c10d calls
    # This checkout's package, whatever else an editable install may point at.
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    cmd = (launcher or [sys.executable]) + ["-m", "graph_fsdp.cli.main", *args]
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd or REPO
    )


def saved_meta(root, iteration: int) -> dict:
    """What ``--save root`` recorded for ``iteration`` (its ``iter_NNNNNNN`` directory), after
    checking that ``latest_checkpointed_iteration.txt`` names it."""
    root = Path(root)
    assert (root / "latest_checkpointed_iteration.txt").read_text() == str(iteration)
    return json.loads((root / f"iter_{iteration:07d}" / "graph_fsdp_cli.json").read_text())


SETTINGS = {"lr": 0.001, "weight_decay": 0.01}
"""The optimizer settings a checkpoint of the default flags records."""
