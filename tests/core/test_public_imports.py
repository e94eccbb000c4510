"""The public import paths: the package's names, the old flat module paths (aliases of the
modules that now hold the code) and the README's example, run as a user runs it."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import graph_fsdp
from graph_fsdp._moved import MOVED

ROOT = Path(__file__).resolve().parents[2]


def test_package_exports_resolve():
    for name in graph_fsdp.__all__:
        assert getattr(graph_fsdp, name) is not None, name
    from graph_fsdp.integrations import megatron  # a package; megatron-core imported lazily

    assert megatron.__name__ == "graph_fsdp.integrations.megatron"


@pytest.mark.parametrize("old", sorted(MOVED))
def test_old_module_path_is_the_new_module(old):
    new = MOVED[old]
    if "megatron" in new and new != "graph_fsdp.integrations.megatron.config":
        pytest.importorskip("megatron.core", reason="megatron-core does not import here")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sys.modules.pop(old, None)
        module = importlib.import_module(old)
    assert module is importlib.import_module(new)
    assert any(new in str(w.message) for w in caught), [str(w.message) for w in caught]


def test_unknown_module_is_still_an_import_error():
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("graph_fsdp.no_such_module")


@pytest.mark.slow
def test_readme_example_runs_on_cpu(tmp_path):
    """examples/quickstart.py under torchrun, 2 gloo ranks: 10 steps of the one-graph step's
    eager twin, each printing a finite loss."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    out = subprocess.run(
        [*cmd, str(ROOT / "examples" / "quickstart.py")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    steps = [line for line in out.stdout.splitlines() if line.startswith("step ")]
    assert len(steps) == 10, out.stdout
    assert all(float(line.split()[3]) < 20 for line in steps), steps
