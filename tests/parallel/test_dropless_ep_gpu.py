"""Dropless expert parallelism under CUDA graphs on NCCL (parallel/dropless_ep.py): the
reference MoE GPT with ``moe_dropless`` at EP 2 (and EP 2 x EDP 2 on 4 GPUs), eager vs whole
layers vs ``attn moe`` vs ``full_iteration`` vs the one graph, over ZeRO-3 and ZeRO-2 - every
loss, eval loss and final weight bit-identical to eager, one capture, a replay every graphed
step, no fallback. Prints one JSON line per graphed mode (step time, own peak reserved).

    GRAPH_FSDP_GPU_TEST_WORLD=2 python -m pytest -q -s -m gpu tests/parallel/test_dropless_ep_gpu.py
"""

from __future__ import annotations

import dataclasses
import json
from statistics import median

import pytest
import torch
from graph_fsdp_testing import GPU_TEST_WORLD as WORLD
from graph_fsdp_testing import GRAPH_MODES, bit_exact_gpu_run, needs_gpus

from graph_fsdp.models import GPTConfig
from graph_fsdp.training.processes import spawn

pytestmark = [pytest.mark.gpu, needs_gpus(2)]

MODEL = GPTConfig(
    vocab_size=1024,
    num_layers=4,
    hidden_size=256,
    num_attention_heads=4,
    seq_length=256,
    num_experts=8,
    moe_router_topk=2,
    moe_dropless=True,
)
STEPS, WARMUP = 30, 2
MODES = {
    **GRAPH_MODES,
    "attn_moe": {"cuda_graph_impl": "torch", "cuda_graph_scope": ["attn", "moe"]},
}


def _train(rank: int, world: int, strategy: str) -> dict:
    from graph_fsdp.training.train import run

    base = bit_exact_gpu_run(
        MODEL,
        expert_parallel=2,
        strategy=strategy,
        steps=STEPS,
        eval_interval=10,
        clip_grad=1.0,
        fused_optimizer=True,
        cuda_graph_warmup_steps=WARMUP,
    )
    out = {"eager": run(rank, world, base)}
    for name, change in MODES.items():
        out[name] = run(rank, world, dataclasses.replace(base, **change))
    return out


@pytest.mark.parametrize("strategy", ["optim_grads_params", "optim_grads"], ids=["zero3", "zero2"])
def test_dropless_ep_every_capture_mode_bit_identical(monkeypatch, strategy):
    # The dispatch's all-to-alls inside full_iteration graphs: capture/step.py [Note: NCCL
    # graph registration and the all-to-all].
    monkeypatch.setenv("NCCL_GRAPH_REGISTER", "0")
    results = spawn(_train, WORLD, strategy, backend="nccl", timeout=1500)[0]
    eager = results["eager"]
    for name in MODES:
        got, report = results[name], results[name]["cuda_graphs"]
        print(json.dumps({
            "model": "dropless-ep2", "mode": name, "world": WORLD, "strategy": strategy,
            "captures": report["captures"], "replays": report["replays"],
            "eager_fallbacks": report["eager_fallbacks"],
            "median_step_ms": 1e3 * median(got["times"][WARMUP + 1 :]),
            "eager_median_step_ms": 1e3 * median(eager["times"][WARMUP + 1 :]),
            "peak_reserved_bytes": got.get("peak_reserved_bytes"),
            "eager_peak_reserved_bytes": eager.get("peak_reserved_bytes"),
        }))  # fmt: skip
        assert report["captures"] == 1 and report["eager_fallbacks"] == 0, (name, report)
        assert report["replays"] >= STEPS - WARMUP - 1, (name, report)
        assert got["losses"] == eager["losses"], name
        assert got["eval_losses"] == eager["eval_losses"], name
        for p, value in eager["params"].items():
            assert torch.equal(got["params"][p], value), (name, p)
