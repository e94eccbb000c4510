"""Memory before work: the training loop builds graph_fsdp's GPT on the meta device and
``fully_shard`` materialises it one unit at a time (train.py [Note: meta build]), with the
same bits as a model built whole; the pre-flight estimate (preflight.py [Note: memory
pre-flight]) counts the parameters exactly and never more optimizer state than a rank holds.

One spawned group of 2 gloo ranks runs every configuration (spawn_cases).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from graph_fsdp_testing import BF16_MP, error_of, spawn_cases

from graph_fsdp.fsdp import checkpoint as ckpt
from graph_fsdp.models import GPTConfig, build_model, synthetic_batch
from graph_fsdp.training.preflight import MemoryPlanError, check_fits, estimate_memory
from graph_fsdp.training.train import (
    GPTAdapter,
    TrainConfig,
    build_for,
    builds_on_meta,
    make_optimizer,
    shard_model,
)

CPU = torch.device("cpu")
DENSE = GPTConfig(
    vocab_size=128, num_layers=3, hidden_size=32, num_attention_heads=4, seq_length=16
)
MOE = dataclasses.replace(DENSE, num_experts=4, moe_layer_freq=2, ffn_hidden_size=None)

CONFIGS = {
    "dense zero-3 fp32": TrainConfig(model=DENSE),
    "dense zero-2 bf16 recompute": TrainConfig(
        model=DENSE, strategy="optim_grads", mp=BF16_MP, recompute=True
    ),
    "dense no_shard": TrainConfig(model=DENSE, strategy="no_shard"),
    "dense hsdp 2 x 1": TrainConfig(model=DENSE, mesh_shape=(2, 1)),
    "moe expert parallel 2": TrainConfig(model=MOE, expert_parallel=2),
}


def _one_step(model, cfg: TrainConfig, rank: int) -> tuple[float, dict]:
    opt = make_optimizer(model.parameters(), cfg)
    x, y = synthetic_batch(cfg.model, 2, 0, rank=rank, device=CPU)
    loss = model(x, y)
    loss.backward()
    opt.step()
    state = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values())
    return loss.item(), ckpt.full_state_dict(model), state


def _meta_vs_whole(rank: int, world_size: int, cfg: TrainConfig) -> dict:
    assert builds_on_meta(cfg)
    whole = shard_model(build_for(cfg, CPU), cfg)
    before = ckpt.full_state_dict(whole)
    meta = build_for(cfg, CPU, meta=True)
    all_meta = all(p.is_meta for p in meta.parameters())
    shard_model(meta, cfg)
    meta_weights = ckpt.full_state_dict(meta)
    adapter = GPTAdapter(cfg)  # the loop's own build (what graph-fsdp train runs)
    adapter.setup(rank, world_size)
    loop_model = adapter.build(CPU, world_size).model
    loop_weights = ckpt.full_state_dict(loop_model)
    stepped = [_one_step(m, cfg, rank) for m in (whole, meta)]
    estimate = estimate_memory(cfg, world_size=world_size)
    return {
        "all_meta": all_meta,
        "loop_equal": all(torch.equal(loop_weights[k], v) for k, v in before.items()),
        "meta_equal": meta_weights.keys() == before.keys()
        and all(torch.equal(meta_weights[k], v) for k, v in before.items()),
        "loss": [s[0] for s in stepped],
        "stepped_equal": all(torch.equal(stepped[1][1][k], v) for k, v in stepped[0][1].items()),
        "num_params": sum(p.numel() for p in build_model(cfg.model, device="meta").parameters()),
        "estimated_params": estimate.num_params,
        "optimizer_bytes": stepped[0][2],
        "estimated_optimizer": estimate.optimizer,
    }


@pytest.fixture(scope="module")
def results():
    return spawn_cases({name: (_meta_vs_whole, cfg) for name, cfg in CONFIGS.items()})


@pytest.mark.parametrize("name", list(CONFIGS))
def test_meta_build_is_bit_identical_to_the_whole_build(results, name: str) -> None:
    for r in results[name]:
        assert r["all_meta"], "build_for(meta=True) allocated parameters"
        assert r["meta_equal"], "the meta build's weights differ from the whole build's"
        assert r["loop_equal"], "the loop's (meta) build differs from the whole build"
        assert r["loss"][0] == r["loss"][1], r["loss"]
        assert r["stepped_equal"], "one optimizer step later the weights differ"
        assert r["estimated_params"] == r["num_params"]
    # The estimate is the ranks' average: the busiest rank holds at least that much.
    busiest = max(r["optimizer_bytes"] for r in results[name])
    assert 0 < results[name][0]["estimated_optimizer"] <= busiest


def test_builds_that_need_materialised_weights_are_not_meta() -> None:
    for cfg in (
        TrainConfig(model=DENSE, tensor_parallel=2),
        TrainConfig(model=DENSE, vocab_parallel_embedding=True),
        TrainConfig(model=DENSE, mode="reference"),
    ):
        assert not builds_on_meta(cfg)
    message = error_of(
        lambda: build_for(TrainConfig(model=DENSE, tensor_parallel=2), CPU, meta=True)
    )
    assert "build_for(meta=True) with {'tensor_parallel': 2}: build it on cpu instead" in message


def test_a_model_that_cannot_fit_is_refused_with_the_numbers() -> None:
    huge = TrainConfig(
        model=dataclasses.replace(DENSE, num_layers=10**6, hidden_size=1024, ffn_hidden_size=None)
    )
    with pytest.raises(MemoryPlanError) as info:
        check_fits(huge, world_size=2, local_ranks=2)
    message = str(info.value)
    assert message.startswith("1000000 layers of hidden 1024 (12,585B parameters) on 2 rank")
    for role in ("parameters ", "gradients ", "optimizer state ", "activations "):
        assert role in message, message
    assert "but a rank has " in message and "use fewer or smaller layers" in message
    fits = check_fits(TrainConfig(model=DENSE), world_size=2, local_ranks=2)
    assert fits.total < 2**30
