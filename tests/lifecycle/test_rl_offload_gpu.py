"""RL offload on GPUs: examples/rl_loop.py (graphed training -> offload -> weight export into an
inference copy that decodes on the freed memory -> onload) in a subprocess per variant.

    python -m pytest -q -s -m gpu tests/lifecycle/test_rl_offload_gpu.py            # ~4 min, 1 GPU
    python -m pytest -q -s -m gpu tests/lifecycle/test_rl_offload_gpu.py -k 1b      # the 1B measurement

With torch-memory-saver installed the address-keeping variants run under its preload library
(``LD_PRELOAD``, set here from the installed package), 10 RL iterations each, layerwise and
full_iteration graphs, ZeRO-3 and ZeRO-1, each against the same training without offload:
losses bit-identical, one capture per runner for the whole run, replays in every iteration and
no eager fallback, at least 90% (``MIN_RETURNED_PCT``, the README's claim) of the device
memory training held returned to the driver on every offload, a clean exit (an illegal memory
access would kill the run). Without the package those variants skip and the recapture
fallback still runs. Every run prints its JSON lines (``-s``); a failure quotes the run's tail.
Run it with the GPU to itself: the memory figures are the driver's free memory, which every
process on the device moves.
World size: ``GRAPH_FSDP_GPU_TEST_WORLD`` capped by the GPUs present (torchrun when >= 2).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from graph_fsdp_testing import GPU_TEST_WORLD

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "rl_loop.py"
GPU_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
    "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
    "PYTHONUNBUFFERED": "1",
}
HAS_TMS = importlib.util.find_spec("torch_memory_saver") is not None
MIN_RETURNED_PCT = 90.0
"""The share of training's device memory that must go back on every offload: the README's
"at least 90% (94-95% measured)"."""
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
needs_tms = pytest.mark.skipif(
    not HAS_TMS, reason="torch-memory-saver is not installed: the recapture fallback runs instead"
)


def _world() -> int:
    return max(1, min(GPU_TEST_WORLD, torch.cuda.device_count()))


def _preload_library() -> str:
    from graph_fsdp.fsdp.address_keeping import preload_library

    library = preload_library()
    assert library and os.path.exists(library), f"no preload library found ({library!r})"
    return library


def _run(args: list[str], *, hook: str, timeout: int = 420) -> tuple[dict, list[dict], str]:
    """Run the example; returns (summary, per-iteration records, output)."""
    env = {**os.environ, **GPU_ENV}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    preload = [
        p for p in env.get("LD_PRELOAD", "").split(":") if p and "torch_memory_saver" not in p
    ]
    if hook == "preload":
        preload.insert(0, _preload_library())
    env["LD_PRELOAD"] = ":".join(preload)
    world = _world()
    launcher = [sys.executable]
    if world > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"]
    cmd = [*launcher, str(EXAMPLE), "--tms-hook", hook, *args]
    try:
        proc = subprocess.run(
            cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or "") + (exc.stderr or "")
        out = out if isinstance(out, str) else out.decode(errors="replace")
        pytest.fail(f"{' '.join(cmd)} ran past {timeout} s:\n{out[-6000:]}")
    out = proc.stdout + proc.stderr
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    summary = next((r for r in records if r.get("summary")), None)
    if proc.returncode != 0 or summary is None:
        pytest.fail(
            f"{' '.join(cmd)} exited with {proc.returncode} (summary printed: "
            f"{summary is not None}; an illegal memory access or a crash of the memory saver "
            f"ends the run):\n{out[-8000:]}"
        )
    for record in records:
        print(json.dumps({"args": " ".join(args), "hook": hook, **record}))
    return summary, [r for r in records if "iteration" in r], out


def _first_difference(a: list[float], b: list[float]) -> str:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"step {i}: {x!r} with offload vs {y!r} without"
    return f"lengths {len(a)} vs {len(b)}"


def _check_replayed(summary: dict, iterations: list[dict]) -> None:
    """The graphs replayed in every iteration (the count grows from one to the next) and no
    captured module ever ran eagerly."""
    replays = [r["replays"] for r in iterations]
    assert replays[0] > 0, f"no replay in the first iteration: replays {replays}"
    assert all(b > a for a, b in zip(replays, replays[1:])), f"replays {replays}"
    report = summary["report"]
    assert report["replays"] >= replays[-1] and report["eager_fallbacks"] == 0, report


def _check_kept(summary: dict, iterations: list[dict], out: str, *, min_pct: float | None) -> None:
    assert summary["mode"] == "keep", f"addresses were not kept: {summary['notice']}\n{out[-3000:]}"
    assert summary["bit_identical"], _first_difference(
        summary["losses"], summary["reference_losses"]
    )
    captures = [r["captures"] for r in iterations]
    assert summary["report"]["captures"] == 1 and captures == [1] * len(iterations), (
        f"captures after each iteration {captures}, runner total "
        f"{summary['report']['captures']}: offload/onload must not recapture"
    )
    _check_replayed(summary, iterations)
    if min_pct is not None:
        low = [(r["iteration"], r["returned_pct"], r["held_gib"]) for r in iterations]
        assert all(pct >= min_pct for _, pct, _ in low), (
            f"device memory returned on offload below {min_pct}% of what training held "
            f"(iteration, %, held GiB): {low}"
        )


@pytest.mark.gpu
@needs_gpu
@needs_tms
@pytest.mark.parametrize("strategy", ["optim_grads_params", "optim"])
@pytest.mark.parametrize("graphs", ["full_iteration", "layerwise"])
def test_rl_loop_keeps_graphs_across_offload(graphs, strategy):
    args = ["--graphs", graphs, "--strategy", strategy, "--iterations", "10", "--reference"]
    summary, iterations, out = _run(args, hook="preload")
    assert summary["ld_preload"], "the run did not load torch-memory-saver's preload library"
    _check_kept(summary, iterations, out, min_pct=MIN_RETURNED_PCT)


@pytest.mark.gpu
@needs_gpu
@needs_tms
def test_rl_loop_torch_hook_keeps_graphs():
    """The torch hook (no LD_PRELOAD): graphs kept and exact; the graphs' pools stay on the
    device, so the memory share is printed, not bounded."""
    args = ["--graphs", "full_iteration", "--iterations", "4", "--reference"]
    summary, iterations, out = _run(args, hook="torch")
    assert not summary["ld_preload"] and "torch hook" in summary["notice"], summary["notice"]
    _check_kept(summary, iterations, out, min_pct=None)
    assert all(r["returned_pct"] > 0 for r in iterations)


@pytest.mark.gpu
@needs_gpu
def test_rl_loop_recapture_fallback():
    """Without kept addresses (the policy off; the same path runs without torch-memory-saver):
    bit-identical losses, and each onload costs one capture."""
    args = ["--graphs", "full_iteration", "--addresses", "recapture", "--iterations", "3"]
    summary, iterations, out = _run([*args, "--reference"], hook="torch")
    assert summary["mode"] == "recapture", summary["notice"]
    assert "recaptured after onload" in summary["notice"]
    assert summary["bit_identical"], _first_difference(
        summary["losses"], summary["reference_losses"]
    )
    assert [r["captures"] for r in iterations] == [1, 2, 3], [r["captures"] for r in iterations]
    _check_replayed(summary, iterations)


@pytest.mark.gpu
@needs_gpu
@needs_tms
def test_rl_offload_1b_measurement():
    """The closing note's numbers on a >= 1B-parameter GPT (one GPU): memory returned on
    offload (GiB, % of training's), offload/onload seconds, first step after onload vs a steady
    step (target 1.2x), captures per run (target 1)."""
    args = ["--preset", "1b", "--graphs", "full_iteration", "--iterations", "3"]
    summary, iterations, out = _run(args, hook="preload", timeout=540)
    assert summary["params"] >= 1_000_000_000, summary["params"]
    print(
        json.dumps(
            {
                "test": "rl_offload_1b",
                "gpu": summary["gpu"],
                "world_size": summary["world_size"],
                "params": summary["params"],
                "returned_gib": [r["returned_gib"] for r in iterations],
                "held_gib": [r["held_gib"] for r in iterations],
                "returned_pct": [r["returned_pct"] for r in iterations],
                "offload_s": [r["offload_s"] for r in iterations],
                "onload_s": [r["onload_s"] for r in iterations],
                "first_step_ms": [r["first_step_ms"] for r in iterations],
                "steady_step_ms": [r["steady_step_ms"] for r in iterations],
                "max_first_vs_steady": round(summary["max_first_vs_steady"], 3),
                "captures": summary["report"]["captures"],
            }
        )
    )
    _check_kept({**summary, "bit_identical": True}, iterations, out, min_pct=MIN_RETURNED_PCT)
    # A recapture would cost seconds here: 1.5x bounds noise, the 1.2x target is reported.
    assert summary["max_first_vs_steady"] <= 1.5, summary["max_first_vs_steady"]
