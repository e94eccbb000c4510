"""Every strategy, on real gloo process groups, matches a single-process reference."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from graph_fsdp.launch import spawn
from graph_fsdp.models import GPTConfig
from graph_fsdp.train import TrainConfig, run

TINY = GPTConfig(vocab_size=128, num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16)
# Parameters far smaller than 4 ranks x 64-element alignment: most ranks own nothing of
# several of them (zero-numel local shards), and shards split parameters unevenly.
UNEVEN = GPTConfig(
    vocab_size=7,
    num_layers=2,
    hidden_size=8,
    num_attention_heads=2,
    ffn_hidden_size=12,
    seq_length=4,
)
MOE = dataclasses.replace(TINY, num_experts=4, moe_layer_freq=2, ffn_hidden_size=None)


def assert_matches_reference(results: list[dict], ref: dict, tol: float = 1e-6) -> None:
    for res in results:
        assert max(abs(a - b) for a, b in zip(res["losses"], ref["losses"])) <= tol, (
            res["losses"],
            ref["losses"],
        )
        for name, value in ref["params"].items():
            diff = (res["params"][name] - value).abs().max().item()
            assert diff <= tol, f"{name}: max abs diff {diff}"


def reference_for(cfg: TrainConfig, world: int) -> dict:
    return run(0, world, dataclasses.replace(cfg, mode="reference"))


@pytest.mark.parametrize("strategy", ["no_shard", "optim", "optim_grads", "optim_grads_params"])
def test_strategies_match_reference(strategy):
    cfg = TrainConfig(model=TINY, strategy=strategy, steps=3)
    assert_matches_reference(spawn(run, 2, cfg), reference_for(cfg, 2))


def test_uneven_and_empty_shards_with_fused_adamw_four_ranks():
    cfg = TrainConfig(model=UNEVEN, strategy="optim_grads_params", steps=3, fused_optimizer=True)
    assert_matches_reference(spawn(run, 4, cfg), reference_for(cfg, 4))


@pytest.mark.parametrize("strategy", ["optim_grads_params", "no_shard"])
def test_clip_grad_clips_by_the_global_norm_as_the_reference(strategy):
    """TrainConfig.clip_grad (``--clip-grad``): the norm of the whole gradient over every
    rank's shards (grad_norm.py), as the unsharded reference clips; small enough to clip."""
    cfg = TrainConfig(model=TINY, strategy=strategy, steps=3, clip_grad=0.05)
    ref = reference_for(cfg, 2)
    unclipped = reference_for(dataclasses.replace(cfg, clip_grad=0.0), 2)
    moved = max((ref["params"][k] - v).abs().max().item() for k, v in unclipped["params"].items())
    assert moved > 1e-4  # it clips (AdamW's steps change little: its updates are normalised)
    assert_matches_reference(spawn(run, 2, cfg), ref)


def test_no_sync_accumulation_equals_large_batch():
    cfg = TrainConfig(model=TINY, strategy="optim_grads_params", steps=2, grad_accum=3)
    assert_matches_reference(spawn(run, 2, cfg), reference_for(cfg, 2))


@pytest.mark.parametrize("strategy", ["optim", "optim_grads_params"])
def test_activation_recompute(strategy):
    cfg = TrainConfig(model=TINY, strategy=strategy, steps=3, recompute=True)
    assert_matches_reference(spawn(run, 2, cfg), reference_for(cfg, 2))


def test_moe_model_with_eval_passes():
    cfg = TrainConfig(model=MOE, strategy="optim_grads_params", steps=4, eval_interval=2)
    results = spawn(run, 2, cfg)
    assert_matches_reference(results, reference_for(cfg, 2))
    assert len(results[0]["eval_losses"]) == 2


def _runs(rank: int, world: int, cfgs: list[TrainConfig]) -> list[dict]:
    return [run(rank, world, cfg) for cfg in cfgs]  # one launch for several trainings


def test_static_allocators_bit_identical_to_dynamic():
    base = TrainConfig(
        model=MOE,
        strategy="optim_grads_params",
        steps=5,
        eval_interval=2,
        grad_accum=2,
        persist_on_alloc_fail=False,
    )
    allocators = ["double_buffer", "trace_pool"]
    cfgs = [base] + [dataclasses.replace(base, allocator=a) for a in allocators]
    per_rank = spawn(_runs, 2, cfgs)
    for rank_runs in per_rank:
        dynamic = rank_runs[0]
        for allocator, static in zip(allocators, rank_runs[1:]):
            assert dynamic["losses"] == static["losses"], allocator
            for name in dynamic["params"]:
                assert torch.equal(dynamic["params"][name], static["params"][name]), (
                    allocator,
                    name,
                )
