"""Expert parallelism on GPUs (NCCL): CUDA graphs bit for bit with eager, EP 1, 2 and 2 x 2.

The reference MoE GPT (4 layers, layers 0 and 2 MoE, 4 experts top-2, capacity-padded so the
EP all-to-all has static splits) with ``TrainConfig.expert_parallel``: dense parameters
sharded over every rank, expert parameters over the expert-data-parallel group. Each layout
trains eagerly, then with layerwise graphs (whole layers, ``attn moe``, ``attn moe_router
moe_preprocess``) and ``full_iteration`` (FSDP's and the dispatch's collectives inside the
graph), 20 steps with an eval pass every 5: every loss, eval loss and final parameter must
equal eager bit for bit. One spawn per layout; a layout needing more GPUs than the host has
skips.

    python -m pytest -q -m gpu tests/core/test_expert_parallel_gpu.py            # 1, 2, 4 GPUs
    python -m pytest -q -m gpu tests/core/test_expert_parallel_gpu.py -k "ep1"   # one GPU
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from graph_fsdp_testing import MOE_LAYERS, bit_exact_gpu_run, differing_params, gpu_gpt

from graph_fsdp.models import GPTConfig
from graph_fsdp.training.processes import spawn
from graph_fsdp.training.train import TrainConfig, run

pytestmark = pytest.mark.gpu


def _has_te() -> bool:
    try:
        import transformer_engine.pytorch  # noqa: F401

        return True
    except Exception:  # noqa: BLE001 - any import failure means no TE
        return False


STEPS, EVAL = 20, 5
MOE = gpu_gpt(**MOE_LAYERS)
LAYOUTS = {"ep1_world1": (1, 1), "ep2_world2": (2, 2), "ep2x2_world4": (4, 2), "ep4_world4": (4, 4)}
"""label -> (world size, EP size); EDP = world / EP."""
VARIANTS = [
    ("torch", [], "double_buffer"),
    ("torch", ["attn", "moe"], "double_buffer"),
    ("torch", ["attn", "moe_router", "moe_preprocess"], "double_buffer"),
    ("torch", ["full_iteration"], "double_buffer"),
    ("torch", ["full_iteration"], "trace_pool"),
    *([("te", [], "double_buffer"), ("te", ["attn", "moe"], "double_buffer")] if _has_te() else []),
]


def _key(impl: str, scopes: list[str], allocator: str) -> str:
    return f"{impl}:{' '.join(scopes) or 'layer'}:{allocator}"


def _cfg(ep: int) -> TrainConfig:
    return bit_exact_gpu_run(MOE, expert_parallel=ep, steps=STEPS, eval_interval=EVAL)


def _train(rank: int, world: int, ep: int) -> dict:
    base = _cfg(ep)
    out = {"eager": run(rank, world, base)}
    for impl, scopes, allocator in VARIANTS:
        cfg = dataclasses.replace(
            base, cuda_graph_impl=impl, cuda_graph_scope=scopes, allocator=allocator
        )
        out[_key(impl, scopes, allocator)] = run(rank, world, cfg)
    return out


@pytest.mark.parametrize("label", list(LAYOUTS))
def test_expert_parallel_graphs_are_bit_exact_with_eager(label, monkeypatch):
    world, ep = LAYOUTS[label]
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA GPUs")
    # full_iteration captures the dispatch's all-to-all: capture/step.py [Note: NCCL graph
    # registration and the all-to-all] (process-wide: the layerwise variants run under it too)
    monkeypatch.setenv("NCCL_GRAPH_REGISTER", "0")
    results = spawn(_train, world, ep, backend="nccl", timeout=1200)
    failures = []
    for rank, res in enumerate(results):
        eager = res["eager"]
        assert len(eager["losses"]) == STEPS and len(eager["eval_losses"]) == STEPS // EVAL
        assert "layers.0.moe.experts.w1" in eager["params"]
        for impl, scopes, allocator in VARIANTS:
            key = _key(impl, scopes, allocator)
            got = res[key]
            report = got["cuda_graphs"]
            problems = []
            if not (report["captures"] >= 1 and report["replays"] > 0):
                problems.append(f"captures {report['captures']} replays {report['replays']}")
            if report["eager_fallbacks"]:
                problems.append(f"{report['eager_fallbacks']} eager fallbacks")
            if got["losses"] != eager["losses"]:
                step = next(
                    i for i, (a, b) in enumerate(zip(got["losses"], eager["losses"])) if a != b
                )
                problems.append(f"losses differ from step {step}")
            if got["eval_losses"] != eager["eval_losses"]:
                problems.append("eval losses differ")
            differ = differing_params(got, eager)
            if differ:
                problems.append(f"final params differ: {differ[:4]}")
            if problems:
                failures.append(f"{label} rank {rank} {key}: {'; '.join(problems)}")
    assert not failures, "\n".join(failures)


HUNG = dataclasses.replace(
    MOE,
    vocab_size=32000,
    num_layers=8,
    hidden_size=1024,
    num_attention_heads=16,
    seq_length=1024,
    num_experts=8,
    moe_layer_freq=1,
)
"""The size at which a full_iteration graph holding the dispatch hung with NCCL's graph
registration on (2 H200s; MOE above replayed)."""


def _full_iteration_at(rank: int, world: int, model: GPTConfig, steps: int) -> dict:
    from graph_fsdp.capture.scopes import GraphConfigError

    base = dataclasses.replace(
        _cfg(2), model=model, steps=steps, micro_batch_size=1, grad_accum=1, eval_interval=0
    )
    out = {"eager": run(rank, world, base)}
    graphed = dataclasses.replace(
        base, cuda_graph_impl="torch", cuda_graph_scope=["full_iteration"]
    )
    try:
        out["graphed"] = run(rank, world, graphed)
    except GraphConfigError as err:
        out["refused"] = str(err)
    return out


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_a_graphed_dispatch_replays_with_nccl_graph_registration_off(monkeypatch):
    """EP 2, 8 MoE layers of hidden 1024: full_iteration equals eager bit for bit and every
    graphed step replays - the size whose replay hung with the registration on."""
    monkeypatch.setenv("NCCL_GRAPH_REGISTER", "0")
    for rank, res in enumerate(spawn(_full_iteration_at, 2, HUNG, 6, backend="nccl", timeout=600)):
        report = res["graphed"]["cuda_graphs"]
        assert report["replays"] > 0 and report["eager_fallbacks"] == 0, (rank, report)
        assert res["graphed"]["losses"] == res["eager"]["losses"], rank


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_a_graphed_dispatch_is_refused_while_nccl_registers_graph_buffers(monkeypatch):
    """NCCL_GRAPH_REGISTER unset: the capture stops at the dispatch's all-to-all, naming the
    module, the call site and the fix (eager steps before it ran)."""
    monkeypatch.delenv("NCCL_GRAPH_REGISTER", raising=False)
    for res in spawn(_full_iteration_at, 2, MOE, 4, backend="nccl", timeout=600):
        err = res["refused"]
        assert "all_to_all_single over 2 NCCL ranks" in err and "ep_dispatch.py:" in err, err
        assert "in the forward of layers.0.moe.experts" in err, err
        assert "(NCCL_GRAPH_REGISTER=unset): its replay hangs" in err, err
        assert len(res["eager"]["losses"]) == 4, res["eager"]["losses"]
