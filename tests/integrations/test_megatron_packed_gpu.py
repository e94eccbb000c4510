"""Packed documents through a Megatron-Core GPT (TransformerEngine layer spec, THD attention;
integrations/megatron/packed.py [Note: Megatron-Core packed sequences]) on NCCL.

- Every capture mode over packs whose document counts and lengths change every step: eager vs
  whole layers, ``attn``, ``attn mlp`` (torch graphs), ``attn`` (TE graphs), ``full_iteration``
  and the one-graph step, at world 1 and 2 (FSDP over the ranks), 200 steps each: one capture,
  a replay every graphed step, no eager fallback, and losses, eval losses and final weights
  bit-identical to eager's; each run's JSON row gives its peak allocated and reserved memory.
- Tensor parallelism: TP 2 with sequence parallelism on 2 GPUs, eager vs whole layers,
  ``full_iteration`` and the one graph, 200 steps, the same checks on both TP ranks.
- MoE: drop-padding experts (capacity 1.0, the pack's tail kept out of the capacity) at world
  1 and 2, and dropless grouped_mm experts at EP 2, every capture mode the experts allow, 200
  steps each, the same checks.
- Attention stays within documents: a pack's loss equals the sum of its documents' losses,
  each run alone as an unpacked sequence (fp32 to 1e-4 relative, bf16 to 2e-2 per document),
  and the same pack with its boundaries removed does not.

Deterministic kernels (``deterministic=True``: ``torch.use_deterministic_algorithms`` and
``NVTE_ALLOW_NONDETERMINISTIC_ALGO=0`` before the model is built, which TE's attention reads at
construction). Run:

    python -m pytest -q -s -m gpu tests/integrations/test_megatron_packed_gpu.py
"""

from __future__ import annotations

import json

import pytest
import torch
from graph_fsdp_testing import (
    MCORE_GPU_RUN,
    graphed_modes_failures,
    megatron_gpu_marks,
    run_modes,
)

from graph_fsdp.training.processes import spawn

pytestmark = megatron_gpu_marks()

STEPS, WARMUP, EVAL = 200, 2, 25
BUDGET, MAX_DOCS = 512, 8
MODES = {
    "layerwise": {"cuda_graph_impl": "torch"},
    "attn": {"cuda_graph_impl": "torch", "cuda_graph_scope": ["attn"]},
    "attn_mlp": {"cuda_graph_impl": "torch", "cuda_graph_scope": ["attn", "mlp"]},
    "te_attn": {"cuda_graph_impl": "te", "cuda_graph_scope": ["attn"]},
    "full_iteration": {"cuda_graph_impl": "torch", "cuda_graph_scope": ["full_iteration"]},
    "one_graph": {
        "cuda_graph_impl": "torch",
        "cuda_graph_scope": ["full_iteration"],
        "cuda_graph_optimizer": True,
    },
}


def _model(**kw):
    from graph_fsdp.integrations import megatron as gm

    # 4 TE layers, hidden 256, 4 heads over 2 key/value groups (GQA), RoPE; the budget is a
    # multiple of 128 (te_backend.py [Note: TE attention under capture]).
    base = dict(
        num_layers=4,
        hidden_size=256,
        num_attention_heads=4,
        num_query_groups=2,
        seq_length=BUDGET,
        vocab_size=1024,
        transformer_impl="transformer_engine",
    )
    return gm.MCoreGPTConfig(**{**base, **kw})


def _cfg(**kw):
    from graph_fsdp.integrations.megatron.train import MCoreTrainConfig
    from graph_fsdp.training.packing import PackingPolicy

    base = dict(
        model=_model(),
        packing=PackingPolicy(budget=BUDGET, max_documents=MAX_DOCS, mean_document_length=90),
        steps=STEPS,
        micro_batch_size=1,
        eval_interval=EVAL,
        cuda_graph_warmup_steps=WARMUP,
        **MCORE_GPU_RUN,
    )
    return MCoreTrainConfig(**{**base, **kw})


def _train(rank: int, world: int) -> dict:
    from graph_fsdp.integrations.megatron.train import run

    return run_modes(run, rank, world, _cfg(), MODES)


@pytest.mark.parametrize("world", [1, 2])
def test_packed_mcore_gpt_every_capture_mode_bit_identical(world: int) -> None:
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA GPUs")
    results = spawn(_train, world, backend="nccl", timeout=1200)[0]
    eager = results["eager"]
    assert len(eager["losses"]) == STEPS
    assert all(map(torch.isfinite, map(torch.tensor, eager["losses"]))), eager["losses"]
    failures = graphed_modes_failures(
        {"model": "mcore-gpt packed", "world": world}, results, MODES, steps=STEPS, warmup=WARMUP
    )
    assert not failures, "\n".join(failures)


# ------------------------------------------------------------------ tensor parallelism
TP_MODES = {k: MODES[k] for k in ("layerwise", "full_iteration", "one_graph")}


def _train_tp(rank: int, world: int) -> dict:
    from graph_fsdp.integrations.megatron.train import run

    tp = _model(tensor_model_parallel_size=2, sequence_parallel=True)
    return run_modes(run, rank, world, _cfg(model=tp), TP_MODES)


def test_packed_mcore_gpt_tensor_parallel_bit_identical() -> None:
    """TP 2 with sequence parallelism over 2 GPUs (each pack's ``b * T`` tokens split over the
    TP ranks between the blocks; the loss through Megatron's vocabulary-parallel cross
    entropy): eager vs whole layers, full_iteration and the one graph, 200 steps."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    results = spawn(_train_tp, 2, backend="nccl", timeout=1200)
    failures = []
    for rank, result in enumerate(results):
        eager = result["eager"]
        assert len(eager["losses"]) == STEPS
        assert all(map(torch.isfinite, map(torch.tensor, eager["losses"]))), eager["losses"]
        label = {"model": "mcore-gpt packed tp2 sp", "world": 2, "rank": rank}
        failures += graphed_modes_failures(label, result, TP_MODES, steps=STEPS, warmup=WARMUP)
    assert not failures, "\n".join(failures)


# ------------------------------------------------------------------ MoE
MOE = dict(num_experts=4, moe_router_topk=2, moe_aux_loss_coeff=1e-2)
MOE_CASES = {
    # Megatron's experts, capacity 1.0 padded to it: the pack's tail is kept out of the
    # capacity (packed_moe.py TailMaskedRouter, [Note: packed MoE routing]).
    "drop_padding": (
        dict(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True),
        {
            **{k: MODES[k] for k in ("layerwise", "te_attn", "full_iteration", "one_graph")},
            "attn_moe_router": {
                "cuda_graph_impl": "torch",
                "cuda_graph_scope": ["attn", "moe_router"],
            },
        },
    ),
    # graph_fsdp's dropless grouped_mm experts (device counts), split over 2 GPUs.
    "grouped_mm_ep2": (
        dict(moe_experts_impl="grouped_mm", expert_model_parallel_size=2),
        {
            **{k: MODES[k] for k in ("layerwise", "full_iteration", "one_graph")},
            "moe": {"cuda_graph_impl": "torch", "cuda_graph_scope": ["moe"]},
        },
    ),
}


def _train_moe(rank: int, world: int, case: str) -> dict:
    from graph_fsdp.integrations.megatron.train import run

    experts, modes = MOE_CASES[case]
    return run_modes(run, rank, world, _cfg(model=_model(**MOE, **experts)), modes)


@pytest.mark.parametrize(
    ("case", "world"), [("drop_padding", 1), ("drop_padding", 2), ("grouped_mm_ep2", 2)]
)
def test_packed_mcore_moe_every_capture_mode_bit_identical(case: str, world: int, monkeypatch):
    """Packed Megatron-Core MoE GPTs, 200 steps of changing packs: drop-padding experts
    (whole layers, TE ``attn``, ``attn moe_router``, ``full_iteration``, one graph) at world 1
    and 2, dropless grouped_mm experts at EP 2 (whole layers, ``moe``, ``full_iteration``, one
    graph); every graphed mode bit-identical to eager, one capture, a replay per step."""
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA GPUs")
    if "ep2" in case:
        monkeypatch.setenv("NCCL_GRAPH_REGISTER", "0")  # full_iteration holds the all-to-alls
    failures = []
    for rank, results in enumerate(spawn(_train_moe, world, case, backend="nccl", timeout=1200)):
        eager = results["eager"]  # every rank: at EP 2 each holds other experts
        assert len(eager["losses"]) == STEPS
        assert all(map(torch.isfinite, map(torch.tensor, eager["losses"]))), eager["losses"]
        label = {"model": f"mcore-moe packed {case}", "world": world, "rank": rank}
        modes = MOE_CASES[case][1]
        failures += graphed_modes_failures(label, results, modes, steps=STEPS, warmup=WARMUP)
    assert not failures, "\n".join(failures)


# ------------------------------------------------------------------ attention within documents
def _document_losses(rank: int, world: int) -> dict:
    """Per document (fp32 weights, then bf16): its loss and logits inside the pack against the
    document run alone, unpacked; and how far the logits move when the pack's boundaries are
    removed (one document per row: documents see their predecessors)."""
    from graph_fsdp.integrations import megatron as gm
    from graph_fsdp.models.packed import IGNORE_INDEX, packed_loss_sum
    from graph_fsdp.training.loop import use_deterministic_kernels
    from graph_fsdp.training.packing import PackingPolicy, pack_tensors

    use_deterministic_kernels(warn_only=True)
    gm.init_parallel_state()
    budget = 256
    policy = PackingPolicy(budget=budget, max_documents=4)
    g = torch.Generator().manual_seed(0)
    rows = [[37, 100, 5], [200, 56], [3]]  # the last row: a short document, a long tail
    docs = [[torch.randint(0, 1024, (n,), generator=g) for n in row] for row in rows]
    pack = pack_tensors(docs, policy, "cuda")
    b = len(rows)
    # One document per row (the row's tail slot holds it all), the same tokens and labels.
    joined = [r * budget for r in range(b) for _ in range(policy.max_documents + 1)]
    joined = torch.tensor([*joined, b * budget], dtype=torch.int32, device="cuda")
    flat = [t.reshape(1, -1) for t in (pack.input_ids, pack.position_ids)]
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = gm.packed_model_config(_model(seq_length=budget, bf16=dtype == torch.bfloat16))
        lm = gm.build_gpt(model, "cuda").to(dtype)
        gpt = lm.module
        with torch.no_grad():
            logits = gpt(
                *flat, None, packed_seq_params=gm.packed_seq_params(pack.cu_seqlens, budget)
            )
            crossed = gpt(*flat, None, packed_seq_params=gm.packed_seq_params(joined, budget))
            logits, crossed = logits[0].float(), crossed[0].float()
            labels = pack.labels.flatten()
            token_loss = torch.nn.functional.cross_entropy(
                logits, labels, ignore_index=IGNORE_INDEX, reduction="none"
            )
            rec = dict(packed=[], alone=[], logit_diff=0.0, logit_scale=0.0, crossed_diff=0.0)
            for r, row in enumerate(docs):
                start = r * budget
                for i, tokens in enumerate(row):
                    n = tokens.numel()
                    ids = tokens.cuda()[None]
                    alone_logits = gpt(ids, torch.arange(n, device="cuda")[None], None)
                    doc_labels = labels[start : start + n][None]
                    rec["alone"].append(packed_loss_sum(alone_logits, doc_labels).item())
                    rec["packed"].append(token_loss[start : start + n].sum().item())
                    here = logits[start : start + n]
                    diff = (here - alone_logits[0].float()).abs().max().item()
                    rec["logit_diff"] = max(rec["logit_diff"], diff)
                    rec["logit_scale"] = max(rec["logit_scale"], here.abs().max().item())
                    if i > 0:  # a document with predecessors in its row
                        moved = (crossed[start : start + n] - here).abs().max().item()
                        rec["crossed_diff"] = max(rec["crossed_diff"], moved)
                    start += n
            rec["total"] = lm(
                pack.input_ids,
                pack.labels,
                position_ids=pack.position_ids,
                cu_seqlens=pack.cu_seqlens,
            ).item()
        out[str(dtype)] = rec
        del lm, gpt
    return out


def test_packed_attention_stays_within_documents() -> None:
    """fp32 runs TE's unfused THD attention, bf16 its cuDNN fused one (the training path)."""
    out = spawn(_document_losses, 1, backend="nccl", timeout=600)[0]
    print(json.dumps({"mcore_packed_document_losses": out}))
    for dtype, rtol in (("torch.float32", 1e-3), ("torch.bfloat16", 3e-2)):
        got = out[dtype]
        packed, alone = torch.tensor(got["packed"]), torch.tensor(got["alone"])
        torch.testing.assert_close(packed, alone, rtol=rtol, atol=rtol, msg=dtype)
        total = torch.tensor(got["total"])
        torch.testing.assert_close(total, alone.sum(), rtol=rtol, atol=rtol, msg=dtype)
        assert got["logit_diff"] <= 10 * rtol * max(got["logit_scale"], 1.0), (dtype, got)
    # Without the boundaries a document's logits move by far more than packed and alone
    # differ: the comparison above would see attention that crossed a document.
    fp32 = out["torch.float32"]
    assert fp32["crossed_diff"] > 20 * fp32["logit_diff"], fp32
