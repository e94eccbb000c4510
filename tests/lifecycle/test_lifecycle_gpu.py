"""Lifecycle on 2 GPUs (NCCL): clean shutdown of graphed scripts, offload/onload with CUDA
graphs (bit-identical replay after recapture, bytes freed per call), and the step-time cost
of optimizer CPU offload on the reference GPT. Results are printed as JSON lines
(``pytest -s``).

    python -m pytest -q -s -m gpu tests/lifecycle/test_lifecycle_gpu.py

This file is also the user script the shutdown test runs in a fresh interpreter:
``python tests/lifecycle/test_lifecycle_gpu.py shutdown full_iteration|layerwise``.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import signal
import subprocess
import sys
import time
import weakref

import pytest
import torch
from graph_fsdp_testing import BF16_MP, needs_gpus
from graph_fsdp_testing import GPU_TEST_WORLD as WORLD

from graph_fsdp.models import GPTConfig

GPU_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
    "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
}
SMALL = GPTConfig(
    vocab_size=1024, num_layers=4, hidden_size=256, num_attention_heads=4, seq_length=128
)
SHUTDOWN_BOUND_S = 60.0


def _runner(model, mode: str):
    from graph_fsdp.capture import FullIterationGraphs, LayerwiseGraphs

    if mode == "full_iteration":
        return FullIterationGraphs(model, warmup_steps=2)
    return LayerwiseGraphs(model, impl="torch", scopes=[], warmup_steps=2)


def _build(rank: int, model_cfg: GPTConfig = SMALL):
    from graph_fsdp.models import build_model
    from graph_fsdp.training.train import TrainConfig, shard_model

    cfg = TrainConfig(
        model=model_cfg, mp=BF16_MP, allocator="double_buffer", persist_on_alloc_fail=True
    )
    torch.manual_seed(0)
    model = shard_model(build_model(model_cfg, device=torch.device("cuda", rank)), cfg)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _step(model, opt, graphs, step: int, rank: int, cfg: GPTConfig = SMALL) -> torch.Tensor:
    from graph_fsdp.models import synthetic_batch

    x, y = synthetic_batch(cfg, 2, step, rank=rank, device=torch.device("cuda", rank))
    if graphs is not None:
        graphs.before_step()
        loss = graphs.forward_backward(0, x, y, 1.0).clone()
    else:
        loss = model(x, y)
        loss.backward()
        loss = loss.detach()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


# ---------------------------------------------------------------------- shutdown (script)
def _shutdown_rank(rank: int, mode: str, port: int) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank))
    os.environ.update(WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    model, opt = _build(rank)
    graphs = _runner(model, mode)  # never closed: the guard must do it
    for step in range(5):
        _step(model, opt, graphs, step, rank)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    dist.destroy_process_group()
    print(json.dumps({"rank": rank, "destroy_s": time.perf_counter() - t0}), flush=True)


def _shutdown_main(mode: str) -> None:
    import torch.multiprocessing as mp

    from graph_fsdp.training.processes import free_port

    mp.spawn(_shutdown_rank, args=(mode, free_port()), nprocs=WORLD, join=True)


@pytest.mark.gpu
@needs_gpus()
@pytest.mark.parametrize("mode", ["full_iteration", "layerwise"])
def test_graphed_script_exits_cleanly(mode):
    env = {**os.environ, **GPU_ENV}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    # The script imports the package and the test helpers (tests/graph_fsdp_testing.py).
    env["PYTHONPATH"] = os.pathsep.join(
        [root, os.path.join(root, "tests")] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    )
    start = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "shutdown", mode],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # the ranks too can be killed if it hangs
    )
    try:
        out, _ = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"graphed {mode} script did not exit within 240 s:\n{out[-4000:]}")
    total = time.monotonic() - start
    assert proc.returncode == 0, out[-4000:]
    destroys = [json.loads(line)["destroy_s"] for line in out.splitlines() if '"destroy_s"' in line]
    assert len(destroys) == WORLD, out[-4000:]
    record = {"test": "shutdown", "mode": mode, "destroy_s": destroys, "script_s": total}
    print(json.dumps(record))
    assert max(destroys) < SHUTDOWN_BOUND_S


# ---------------------------------------------------------------------- in-process tests
def _deterministic() -> None:
    for key, value in GPU_ENV.items():
        os.environ.setdefault(key, value)
    torch.use_deterministic_algorithms(True)


def _graphed_cycle(rank: int, world_size: int, mode: str) -> dict:
    _deterministic()
    steps, cycle_at = 9, 4
    runs = {}
    report = {}
    for label in ("plain", "cycled"):
        model, opt = _build(rank)
        graphs = _runner(model, mode)
        losses = []
        for step in range(steps):
            losses.append(_step(model, opt, graphs, step, rank))
            if label == "cycled" and step == cycle_at:
                torch.cuda.synchronize()
                before = torch.cuda.memory_allocated()
                report["offload_params"] = model.offload_params()
                report["offload_grads"] = model.offload_grads()
                report["offload_optimizer"] = model.offload_optimizer(opt)
                torch.cuda.synchronize()
                report["allocated_before"] = before
                report["allocated_offloaded"] = torch.cuda.memory_allocated()
                torch.cuda.empty_cache()
                report["reserved_offloaded"] = torch.cuda.memory_reserved()
                report["onload"] = [
                    model.onload_params()["total"],
                    model.onload_grads()["total"],
                    model.onload_optimizer(opt)["total"],
                ]
        runs[label] = [loss.item() for loss in losses]
        report[f"{label}_report"] = graphs.report()
        graphs.close()
        graphs.close()  # idempotent
        try:
            graphs.before_step()
            report[f"{label}_reuse_refused"] = False
        except RuntimeError:
            report[f"{label}_reuse_refused"] = True
        # Closed: original forwards back, and the model trains eagerly.
        report[f"{label}_restored"] = all("forward" not in m.__dict__ for m in model.modules())
        report[f"{label}_eager_after_close"] = _step(model, opt, None, steps, rank).item()
        alive = weakref.ref(model)
        del model, opt, graphs
        gc.collect()
        report[f"{label}_collected"] = alive() is None
    report["losses"] = runs
    return report


@pytest.mark.gpu
@needs_gpus()
@pytest.mark.parametrize("mode", ["full_iteration", "layerwise"])
def test_graphs_replay_bit_identically_after_offload_cycle(mode):
    from graph_fsdp.training.processes import spawn

    result = spawn(_graphed_cycle, WORLD, mode, backend="nccl")[0]
    plain, cycled = result["losses"]["plain"], result["losses"]["cycled"]
    freed = {k: result[k] for k in ("offload_params", "offload_grads", "offload_optimizer")}
    print(
        json.dumps(
            {
                "test": "offload_cycle",
                "mode": mode,
                "gpu": torch.cuda.get_device_name(0),
                "bytes_freed": freed,
                "allocated_before": result["allocated_before"],
                "allocated_offloaded": result["allocated_offloaded"],
                "onload_bytes": result["onload"],
                "captures": result["cycled_report"]["captures"],
            }
        )
    )
    assert cycled == plain, f"losses differ after the offload cycle:\n{plain}\n{cycled}"
    assert result["plain_collected"] and result["cycled_collected"], "model not freed"
    for label in ("plain", "cycled"):
        assert result[f"{label}_reuse_refused"] and result[f"{label}_restored"]
    assert result["plain_eager_after_close"] == result["cycled_eager_after_close"]
    assert result["cycled_report"]["captures"] == result["plain_report"]["captures"] + 1
    for label in ("plain", "cycled"):  # both runs graphed: replayed, never eagerly
        report = result[f"{label}_report"]
        assert report["replays"] > 0 and report["eager_fallbacks"] == 0, (label, report)
    dropped = result["allocated_before"] - result["allocated_offloaded"]
    counted = sum(v["total"] for v in freed.values())
    assert dropped > 0 and counted > 0
    # What the calls report was really given back (NCCL may hold the last collectives'
    # buffers a little longer, hence the margin).
    assert dropped >= 0.75 * (counted - freed["offload_params"]["graph_pools"])


# ---------------------------------------------------------------------- optimizer offload cost
REFERENCE = dataclasses.replace(
    SMALL, vocab_size=32000, num_layers=4, hidden_size=1024, num_attention_heads=16, seq_length=1024
)


def _offload_cost(rank: int, world_size: int) -> dict:
    from graph_fsdp.fsdp.optim_offload import CPUOffloadOptimizer
    from graph_fsdp.models import synthetic_batch

    out = {}
    device = torch.device("cuda", rank)
    variants = (
        ("device", None, None),
        ("offload_1.0", 1.0, None),
        ("offload_0.5", 0.5, None),
        ("offload_1.0_cpu_fused", 1.0, {"fused": True}),
    )
    for label, fraction, cpu_kwargs in variants:
        model, _ = _build(rank, REFERENCE)
        params = list(model.parameters())
        if fraction is None:
            opt = torch.optim.AdamW(params, lr=1e-4)
        else:
            opt = CPUOffloadOptimizer(
                params,
                torch.optim.AdamW,
                offload_fraction=fraction,
                cpu_kwargs=cpu_kwargs,
                lr=1e-4,
            )
        times, losses = [], []
        for step in range(13):
            x, y = synthetic_batch(REFERENCE, 1, step, rank=rank, device=device)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            losses.append(loss.item())
        out[label] = {"median_ms": 1e3 * sorted(times[3:])[len(times[3:]) // 2], "losses": losses}
        del model, opt
        torch.cuda.empty_cache()
    return out


@pytest.mark.gpu
@needs_gpus()
def test_optimizer_offload_step_time():
    from graph_fsdp.training.processes import spawn

    result = spawn(_offload_cost, WORLD, backend="nccl")[0]
    device_ms = result["device"]["median_ms"]
    record = {
        "test": "optimizer_offload_step_time",
        "gpu": torch.cuda.get_device_name(0),
        "model": "reference GPT h1024 x4 layers, seq 1024, vocab 32000, bf16, ZeRO-3, 2 ranks",
        **{f"{k}_ms": round(v["median_ms"], 2) for k, v in result.items()},
        **{
            f"{k}_ratio": round(v["median_ms"] / device_ms, 2)
            for k, v in result.items()
            if k != "device"
        },
    }
    print(json.dumps(record))
    device_losses = result["device"]["losses"]
    for label in ("offload_1.0", "offload_0.5", "offload_1.0_cpu_fused"):
        losses = result[label]["losses"]
        assert losses[0] == device_losses[0]  # same weights before the first update
        # CPU and GPU AdamW kernels round differently; the trajectories stay together.
        assert all(abs(a - b) <= 2e-2 * abs(b) for a, b in zip(losses, device_losses)), label


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "shutdown":
        for key, value in GPU_ENV.items():
            os.environ.setdefault(key, value)
        _shutdown_main(sys.argv[2])
    else:
        raise SystemExit(f"usage: {sys.argv[0]} shutdown full_iteration|layerwise")
