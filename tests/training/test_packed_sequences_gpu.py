"""Packed variable-length documents under every capture mode on NCCL: eager vs layerwise
(whole layers; ``attn`` + ``mlp``/``moe``) vs ``full_iteration`` vs the one-graph step, over
changing packs of 1..D lognormal documents every step - one capture, a replay every graphed
step, no eager fallback, and losses, eval losses and final weights bit-identical to eager.

    GRAPH_FSDP_GPU_TEST_WORLD=2 python -m pytest -q -s -m gpu tests/training/test_packed_sequences_gpu.py
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from graph_fsdp_testing import GPU_RUN, GRAPH_MODES, bit_exact_gpu_run, first_difference, needs_gpus
from graph_fsdp_testing import GPU_TEST_WORLD as WORLD

from graph_fsdp.models import GPTConfig
from graph_fsdp.training.packing import PackingPolicy
from graph_fsdp.training.processes import spawn

pytestmark = [pytest.mark.gpu, needs_gpus(1)]

DENSE = GPTConfig(
    vocab_size=1024, num_layers=4, hidden_size=256, num_attention_heads=4, seq_length=512
)
MOE = dataclasses.replace(DENSE, num_experts=4, moe_router_topk=2)
STEPS, WARMUP = 200, 2
MODES = {
    **GRAPH_MODES,
    "attn_ffn": {"cuda_graph_impl": "torch", "cuda_graph_scope": ["attn", "mlp"]},
}


def _cfg(model: GPTConfig, strategy: str):
    return bit_exact_gpu_run(
        model,
        packing=PackingPolicy(budget=model.seq_length, max_documents=8, mean_document_length=90),
        strategy=strategy,
        steps=STEPS,
        micro_batch_size=1,
        eval_interval=50,
        clip_grad=1.0,
        fused_optimizer=True,
        cuda_graph_warmup_steps=WARMUP,
    )


def _train(rank: int, world: int, model: GPTConfig, strategy: str) -> dict:
    from graph_fsdp.training.train import run

    base = _cfg(model, strategy)
    out = {"eager": run(rank, world, base)}
    for name, change in MODES.items():
        if model.num_experts and name == "attn_ffn":
            change = {**change, "cuda_graph_scope": ["attn", "moe"]}
        out[name] = run(rank, world, dataclasses.replace(base, **change))
    return out


def _assert_same_run(name: str, got: dict, eager: dict) -> None:
    """Losses, eval losses and final weights of a graphed run equal eager's bit for bit."""
    assert got["losses"] == eager["losses"], (
        name,
        first_difference(got["losses"], eager["losses"]),
    )
    assert got["eval_losses"] == eager["eval_losses"], name
    for p, value in eager["params"].items():
        assert torch.equal(got["params"][p], value), (name, p)


@pytest.mark.parametrize(
    ("model", "strategy"),
    [(DENSE, "optim_grads_params"), (DENSE, "optim"), (MOE, "optim_grads")],
    ids=["dense-zero3", "dense-zero1", "moe-zero2"],
)
def test_packed_documents_every_capture_mode_bit_identical(model, strategy):
    results = spawn(_train, WORLD, model, strategy, backend="nccl", timeout=1500)[0]
    eager = results["eager"]
    assert len(eager["losses"]) == STEPS and all(
        map(torch.isfinite, map(torch.tensor, eager["losses"]))
    )
    for name in MODES:
        got = results[name]
        report = got["cuda_graphs"]
        print(
            json.dumps(
                {
                    "mode": name,
                    "world": WORLD,
                    "strategy": strategy,
                    "captures": report["captures"],
                    "replays": report["replays"],
                    "eager_fallbacks": report["eager_fallbacks"],
                    "peak_reserved_bytes": got.get("peak_reserved_bytes"),
                    "median_step_s": sorted(got["times"])[len(got["times"]) // 2],
                }
            )
        )
        assert report["captures"] == 1, (name, report)
        assert report["eager_fallbacks"] == 0, (name, report)
        per_step = len(report["callables"]) if name in ("layerwise", "attn_ffn") else 1
        if name == "full_iteration":
            per_step = 2  # one graph per microbatch position
        assert report["replays"] >= (STEPS - WARMUP - 1) * per_step, (name, report)
        _assert_same_run(name, got, eager)


def _train_hf(rank: int, world: int) -> dict:
    from graph_fsdp.integrations.hf_train import HFTrainConfig, run

    base = HFTrainConfig(
        family="llama",
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=512,
        num_layers=4,
        num_attention_heads=4,
        seq_length=256,
        packing=PackingPolicy(budget=256, max_documents=6, mean_document_length=50),
        steps=HF_STEPS,
        grad_accum=2,
        eval_interval=25,
        clip_grad=1.0,
        fused_optimizer=True,
        cuda_graph_warmup_steps=WARMUP,
        **GPU_RUN,
    )
    out = {"eager": run(rank, world, base)}
    for name in ("layerwise", "full_iteration", "one_graph"):
        out[name] = run(rank, world, dataclasses.replace(base, **MODES[name]))
    return out


HF_STEPS = 50


def test_huggingface_llama_packed_every_capture_mode_bit_identical():
    """HuggingFace Llama on packs (positions restarting per document, a 4-D mask of attention
    within documents): whole layers, full_iteration and the one graph equal eager bit for bit
    over 50 steps of changing packs, one capture, no fallback."""
    pytest.importorskip("transformers")
    results = spawn(_train_hf, WORLD, backend="nccl", timeout=1500)[0]
    eager = results["eager"]
    for name in ("layerwise", "full_iteration", "one_graph"):
        got, report = results[name], results[name]["cuda_graphs"]
        print(
            json.dumps(
                {
                    "model": "hf-llama",
                    "mode": name,
                    "world": WORLD,
                    "captures": report["captures"],
                    "replays": report["replays"],
                    "eager_fallbacks": report["eager_fallbacks"],
                }
            )
        )
        assert report["captures"] == 1 and report["eager_fallbacks"] == 0, (name, report)
        assert report["replays"] >= HF_STEPS - WARMUP - 1, (name, report)
        _assert_same_run(name, got, eager)
