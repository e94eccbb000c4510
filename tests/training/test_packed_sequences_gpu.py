"""Packed variable-length documents under every capture mode on NCCL: eager vs layerwise
(whole layers; ``attn`` + ``mlp``/``moe``) vs ``full_iteration`` vs the one-graph step, over
changing packs of 1..D lognormal documents every step - one capture, a replay every graphed
step, no eager fallback, and losses, eval losses and final weights bit-identical to eager -
200 steps each for the reference GPT (dense and MoE) and a HuggingFace Llama. Every run prints a
JSON row with its graph counts, median step time and peak allocated / reserved CUDA memory.
Run at world 2 and 1:

    GRAPH_FSDP_GPU_TEST_WORLD=2 python -m pytest -q -s -m gpu tests/training/test_packed_sequences_gpu.py
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from graph_fsdp_testing import (
    GPU_RUN,
    GRAPH_MODES,
    bit_exact_gpu_run,
    graphed_modes_failures,
    needs_gpus,
)
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
    failures = graphed_modes_failures(
        {"model": "gpt", "world": WORLD, "strategy": strategy},
        results,
        MODES,
        steps=STEPS,
        warmup=WARMUP,
    )
    assert not failures, "\n".join(failures)


HF_MODES = ("layerwise", "full_iteration", "one_graph")


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
        steps=STEPS,
        grad_accum=2,
        eval_interval=50,
        clip_grad=1.0,
        fused_optimizer=True,
        cuda_graph_warmup_steps=WARMUP,
        **GPU_RUN,
    )
    out = {"eager": run(rank, world, base)}
    for name in HF_MODES:
        out[name] = run(rank, world, dataclasses.replace(base, **MODES[name]))
    return out


def test_huggingface_llama_packed_every_capture_mode_bit_identical():
    """HuggingFace Llama on packs (positions restarting per document, a 4-D mask of attention
    within documents): whole layers, full_iteration and the one graph equal eager bit for bit
    over 200 steps of changing packs, one capture, a replay every graphed step, no fallback."""
    pytest.importorskip("transformers")
    results = spawn(_train_hf, WORLD, backend="nccl", timeout=1500)[0]
    eager = results["eager"]
    assert len(eager["losses"]) == STEPS
    failures = graphed_modes_failures(
        {"model": "hf-llama", "world": WORLD}, results, HF_MODES, steps=STEPS, warmup=WARMUP
    )
    assert not failures, "\n".join(failures)
