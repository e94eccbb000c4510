"""Every strategy, on real gloo process groups, matches a single-process reference."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from graph_fsdp_testing import TINY_GPT, spawn_cases, tiny_gpt

from graph_fsdp.fsdp.checkpoint import full_state_dict
from graph_fsdp.training.data import batch_for
from graph_fsdp.training.processes import spawn
from graph_fsdp.training.train import TrainConfig, build_for, run, shard_model

TINY = TINY_GPT
# Parameters far smaller than 4 ranks x 64-element alignment: most ranks own nothing of
# several of them (zero-numel local shards), and shards split parameters unevenly.
UNEVEN = tiny_gpt(
    vocab_size=7, hidden_size=8, num_attention_heads=2, ffn_hidden_size=12, seq_length=4
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


STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]
CONFIGS: dict[str, TrainConfig] = {
    **{f"strategy:{s}": TrainConfig(model=TINY, strategy=s, steps=3) for s in STRATEGIES},
    **{
        f"clip:{s}": TrainConfig(model=TINY, strategy=s, steps=3, clip_grad=0.05)
        for s in ("optim_grads_params", "no_shard")
    },
    "no_sync": TrainConfig(model=TINY, strategy="optim_grads_params", steps=2, grad_accum=3),
    **{
        f"recompute:{s}": TrainConfig(model=TINY, strategy=s, steps=3, recompute=True)
        for s in ("optim", "optim_grads_params")
    },
    "moe_eval": TrainConfig(model=MOE, strategy="optim_grads_params", steps=4, eval_interval=2),
}
STATIC_BASE = TrainConfig(
    model=MOE,
    strategy="optim_grads_params",
    steps=5,
    eval_interval=2,
    grad_accum=2,
    persist_on_alloc_fail=False,
)
ALLOCATORS = ["dynamic", "double_buffer", "trace_pool"]
UNEVEN_CFG = TrainConfig(model=UNEVEN, strategy="optim_grads_params", steps=3, fused_optimizer=True)


# Gradient accumulation WITHOUT no_sync: every microbatch's backward reduces, and from the
# second one on the reduction adds into the main gradients (``overwrite=False``: reduce.py
# scales each microbatch's reduced sum by 1 / data-parallel size as it adds it). Plain SGD,
# whose update is the gradient times lr: AdamW's normalised update would hide most of a
# wrong scale. "sync": every microbatch synchronises; "mixed": the first under no_sync,
# the others synchronise (the pending no_sync gradients go with the second).
ACCUM_MICROS, ACCUM_STEPS, ACCUM_LR = 3, 2, 0.5
ACCUM_CASES = {
    **{f"accumulate:{s}:sync": (s, 0) for s in STRATEGIES},
    **{f"accumulate:{s}:mixed": (s, 1) for s in ("no_shard", "optim_grads_params")},
}


def _accum_cfg(strategy: str) -> TrainConfig:
    return TrainConfig(model=TINY, strategy=strategy, micro_batch_size=2, grad_accum=ACCUM_MICROS)


def accumulate_without_no_sync(rank: int, world: int, strategy: str, no_sync_micros: int):
    """``ACCUM_STEPS`` SGD steps of ``ACCUM_MICROS`` microbatches each on 2 ranks; the first
    ``no_sync_micros`` microbatches of a step under no_sync, every later one synchronising."""
    cfg = _accum_cfg(strategy)
    device = torch.device("cpu")
    model = shard_model(build_for(cfg, device), cfg)
    opt = torch.optim.SGD(model.parameters(), lr=ACCUM_LR)
    losses = []
    for step in range(ACCUM_STEPS):
        total = torch.zeros(())
        for micro in range(ACCUM_MICROS):
            model.set_requires_gradient_sync(micro >= no_sync_micros)
            x, y = batch_for(cfg, step * ACCUM_MICROS + micro, rank, device)
            loss = model(x, y) / ACCUM_MICROS
            loss.backward()
            total += loss.detach()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.distributed.all_reduce(total)
        losses.append(total.item() / world)
    return {"losses": losses, "params": {k: v.cpu() for k, v in full_state_dict(model).items()}}


def accumulation_reference(strategy: str, world: int) -> dict:
    """One process, the unsharded model: the same SGD steps on every rank's microbatches,
    each loss over microbatches x ranks (what FSDP's mean over the ranks makes of it)."""
    cfg = _accum_cfg(strategy)
    device = torch.device("cpu")
    model = build_for(cfg, device)
    opt = torch.optim.SGD(model.parameters(), lr=ACCUM_LR)
    losses = []
    for step in range(ACCUM_STEPS):
        total = 0.0
        for micro in range(ACCUM_MICROS):
            for rank in range(world):
                x, y = batch_for(cfg, step * ACCUM_MICROS + micro, rank, device)
                loss = model(x, y) / (ACCUM_MICROS * world)
                loss.backward()
                total += loss.item()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
    return {
        "losses": losses,
        "params": {k: v.detach().clone() for k, v in model.named_parameters()},
    }


@pytest.fixture(scope="module")
def two_ranks():
    """Every 2-rank training of this file in one spawned group."""
    cases = {label: (run, cfg) for label, cfg in CONFIGS.items()}
    cases.update(
        {f"allocator:{a}": (run, dataclasses.replace(STATIC_BASE, allocator=a)) for a in ALLOCATORS}
    )
    cases.update(
        {label: (accumulate_without_no_sync, *args) for label, args in ACCUM_CASES.items()}
    )
    return spawn_cases(cases, 2)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_strategies_match_reference(two_ranks, strategy):
    label = f"strategy:{strategy}"
    assert_matches_reference(two_ranks[label], reference_for(CONFIGS[label], 2))


def test_uneven_and_empty_shards_with_fused_adamw_four_ranks():
    assert_matches_reference(spawn(run, 4, UNEVEN_CFG), reference_for(UNEVEN_CFG, 4))


@pytest.mark.parametrize("strategy", ["optim_grads_params", "no_shard"])
def test_clip_grad_clips_by_the_global_norm_as_the_reference(two_ranks, strategy):
    """TrainConfig.clip_grad (``--clip-grad``): the norm of the whole gradient over every
    rank's shards (grad_norm.py), as the unsharded reference clips; small enough to clip."""
    cfg = CONFIGS[f"clip:{strategy}"]
    ref = reference_for(cfg, 2)
    unclipped = reference_for(dataclasses.replace(cfg, clip_grad=0.0), 2)
    moved = max((ref["params"][k] - v).abs().max().item() for k, v in unclipped["params"].items())
    assert moved > 1e-4  # it clips (AdamW's steps change little: its updates are normalised)
    assert_matches_reference(two_ranks[f"clip:{strategy}"], ref)


def test_no_sync_accumulation_equals_large_batch(two_ranks):
    assert_matches_reference(two_ranks["no_sync"], reference_for(CONFIGS["no_sync"], 2))


@pytest.mark.parametrize("strategy", ["optim", "optim_grads_params"])
def test_activation_recompute(two_ranks, strategy):
    label = f"recompute:{strategy}"
    assert_matches_reference(two_ranks[label], reference_for(CONFIGS[label], 2))


def test_moe_model_with_eval_passes(two_ranks):
    results = two_ranks["moe_eval"]
    assert_matches_reference(results, reference_for(CONFIGS["moe_eval"], 2))
    assert len(results[0]["eval_losses"]) == 2


def test_static_allocators_bit_identical_to_dynamic(two_ranks):
    runs = {a: two_ranks[f"allocator:{a}"] for a in ALLOCATORS}
    for rank, dynamic in enumerate(runs["dynamic"]):
        for allocator in ALLOCATORS[1:]:
            static = runs[allocator][rank]
            assert dynamic["losses"] == static["losses"], allocator
            for name in dynamic["params"]:
                assert torch.equal(dynamic["params"][name], static["params"][name]), (
                    allocator,
                    name,
                )


@pytest.mark.parametrize("label", list(ACCUM_CASES))
def test_accumulation_without_no_sync_matches_reference(two_ranks, label):
    """Every microbatch reduces (no no_sync), the main gradients summing the reduced
    microbatches: the same SGD steps as the unsharded model on the global batch."""
    strategy, _ = ACCUM_CASES[label]
    ref = accumulation_reference(strategy, 2)
    # The SGD update is lr x the gradient: a microbatch reduced without its 1 / world scale
    # moves the weights by about lr x |g| / 2 (~1e-3 here) more than the reference.
    assert_matches_reference(two_ranks[label], ref, tol=1e-6)
    moved = max(
        (ref["params"][k] - v).abs().max().item()
        for k, v in build_for(_accum_cfg(strategy), torch.device("cpu")).named_parameters()
    )
    assert moved > 1e-2, moved  # the steps move the weights far beyond the tolerance
