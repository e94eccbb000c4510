"""Dropless expert parallelism under CUDA graphs on NCCL (parallel/dropless_ep.py): the
reference MoE GPT with ``moe_dropless`` at EP 2 (and EP 2 x EDP 2 on 4 GPUs), eager vs whole
layers vs ``attn moe`` vs ``full_iteration`` vs the one graph, over ZeRO-3 and ZeRO-2 - every
loss, eval loss and final weight bit-identical to eager, one capture, a replay every graphed
step, no fallback. Prints one JSON line per graphed mode (step time, own peak reserved).

With a receive buffer that overflows on some steps (the smallest factor a probe run's warnings
named: the steps that needed more overflow): eager, whole layers, ``moe``, ``full_iteration``
and the one graph at EP 2 on 2 GPUs, and eager and the one graph at EP 4 and EP 2 x EDP 2 on 4
GPUs (skipped with fewer) - overflow steps counted, every loss, eval loss and final weight
bit-identical to the run without a factor, one capture, a replay every graphed step, no eager
fallback; a factor that holds every step (the largest named) overflows none.

    GRAPH_FSDP_GPU_TEST_WORLD=2 python -m pytest -q -s -m gpu tests/parallel/test_dropless_ep_gpu.py
    python -m pytest -q -s -m gpu tests/parallel/test_dropless_ep_gpu.py -k overflow   # 4 GPUs
"""

from __future__ import annotations

import dataclasses
import json
from statistics import median

import pytest
import torch
from graph_fsdp_testing import GPU_TEST_WORLD as WORLD
from graph_fsdp_testing import (
    GRAPH_MODES,
    OVERFLOW_MODES,
    bit_exact_gpu_run,
    needs_gpus,
    overflow_probe,
    overflow_problems,
)

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


OVERFLOW_STEPS = 8


def _overflow_base(ep: int, factor: float | None):
    model = dataclasses.replace(MODEL, moe_receive_buffer_factor=factor)
    return bit_exact_gpu_run(
        model, expert_parallel=ep, steps=OVERFLOW_STEPS, eval_interval=4, clip_grad=1.0,
        fused_optimizer=True, cuda_graph_warmup_steps=WARMUP,
    )  # fmt: skip


def _probe(rank: int, world: int, ep: int) -> list[float]:
    from graph_fsdp.training.train import run

    return overflow_probe(rank, world, run, _overflow_base(ep, 0.5))  # overflows every step


def _overflow_runs(rank: int, world: int, ep: int, factors: tuple, modes: list) -> dict:
    from graph_fsdp.training.train import run

    low, high = factors
    out = {"none": run(rank, world, _overflow_base(ep, None))}
    for name in modes:
        out[name] = run(
            rank, world, dataclasses.replace(_overflow_base(ep, low), **OVERFLOW_MODES[name])
        )
    out["held"] = run(rank, world, _overflow_base(ep, high))
    out["none again"] = run(rank, world, _overflow_base(ep, None))  # the process's own drift
    return out


def _check_overflow_repeats(world: int, ep: int, modes: list) -> None:
    named = spawn(_probe, world, ep, backend="nccl", timeout=900)[0]
    assert len(named) == OVERFLOW_STEPS and min(named) < max(named), named
    factors = (min(named), max(named))  # the smallest: the steps that needed more overflow
    results = spawn(_overflow_runs, world, ep, factors, modes, backend="nccl", timeout=1500)
    problems = []
    for rank, res in enumerate(results):
        for name in modes:
            print(json.dumps({"model": f"dropless-ep{ep}-world{world}", "mode": name,
                              "factor": factors[0], "overflow_steps": res[name]["overflow_steps"],
                              "report": res[name].get("cuda_graphs")}, default=str))  # fmt: skip
            problems += [
                f"rank {rank}: {p}"
                for p in overflow_problems(
                    name, res["none"], res[name], steps=OVERFLOW_STEPS, warmup=WARMUP
                )
            ]
        held, none = res["held"], res["none"]
        differ = [i for i, (a, b) in enumerate(zip(held["losses"], none["losses"])) if a != b]
        if held["overflow_steps"] or differ:
            problems.append(
                f"rank {rank}: factor {factors[1]} (the largest named of {named}) did not hold "
                f"every step: {held['overflow_steps']} overflow steps, losses differ from the "
                f"run without a factor at steps {differ}; a second run without a factor "
                f"{'equals' if res['none again']['losses'] == none['losses'] else 'differs from'}"
                " the first"
            )
    assert not problems, "\n".join(problems)


@needs_gpus(2)
def test_overflowed_steps_repeat_exactly_in_every_capture_mode(monkeypatch):
    """EP 2 on 2 GPUs: eager, whole layers, moe, full_iteration and the one graph."""
    monkeypatch.setenv("NCCL_GRAPH_REGISTER", "0")
    _check_overflow_repeats(2, 2, list(OVERFLOW_MODES))


@needs_gpus(4)
@pytest.mark.parametrize("ep", [4, 2], ids=["ep4", "ep2xedp2"])
def test_overflowed_steps_repeat_exactly_on_four_gpus(monkeypatch, ep):
    """EP 4, and EP 2 x expert-data-parallel 2, on 4 GPUs: eager and the one graph."""
    monkeypatch.setenv("NCCL_GRAPH_REGISTER", "0")
    _check_overflow_repeats(4, ep, ["eager", "one_graph"])
