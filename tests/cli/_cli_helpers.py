"""Shared helpers for the CLI tests: a tiny model and a subprocess runner."""

from __future__ import annotations

import json
import os
import re
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
    cmd = (launcher or [sys.executable]) + ["-m", "graph_fsdp.cli.main", *args]
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, env=clean_env(), cwd=cwd or REPO
    )


def clean_env() -> dict[str, str]:
    """This environment without a launcher's variables, importing this checkout's package."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env["PYTHONWARNINGS"] = "ignore::FutureWarning"  # the engine's deprecated c10d calls
    # This checkout's package, whatever else an editable install may point at.
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    return env


ENTRY_POINTS = """
import runpy, sys
for module, argv in CALLS:
    sys.argv = [module, *argv]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = "(no exit)"
    except SystemExit as exc:
        code = exc.code
    print(f"=== exit {code}", flush=True)
"""


def run_module_entries(calls: list[tuple[str, list[str]]], timeout: float = 120) -> list:
    """``python -m MODULE ARGV`` for each ``(MODULE, ARGV)`` of ``calls``, one after another in
    one Python process (runpy, the machinery behind ``python -m``: the module runs as
    ``__main__`` with that ``sys.argv``), so the interpreter and torch start once.
    ``[(exit code as text, stdout)]``, one per call."""
    script = f"CALLS = {calls!r}\n{ENTRY_POINTS}"
    proc = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True, text=True, timeout=timeout, env=clean_env(), cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    parts = re.split(r"=== exit (.*)\n", proc.stdout)
    assert len(parts) == 2 * len(calls) + 1 and not parts[-1], (proc.stdout, proc.stderr)
    return [(parts[i + 1], parts[i]) for i in range(0, 2 * len(calls), 2)]


def saved_meta(root, iteration: int) -> dict:
    """What ``--save root`` recorded for ``iteration`` (its ``iter_NNNNNNN`` directory), after
    checking that ``latest_checkpointed_iteration.txt`` names it."""
    root = Path(root)
    assert (root / "latest_checkpointed_iteration.txt").read_text() == str(iteration)
    return json.loads((root / f"iter_{iteration:07d}" / "graph_fsdp_cli.json").read_text())


SETTINGS = {"lr": 0.001, "weight_decay": 0.01}
"""The optimizer settings a checkpoint of the default flags records."""
