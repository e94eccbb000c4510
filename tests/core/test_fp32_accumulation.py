"""Reduce-scatter with fp32 accumulation (MixedPrecisionPolicy.reduce_scatter_fp32_accumulation,
--ddp-reduce-scatter-with-fp32-accumulation) on real gloo groups: bf16 gradients through an
all-to-all, summed in fp32 by each rank (param_group.py [Note: reduce-scatter with fp32
accumulation])."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from graph_fsdp_testing import BF16_MP, TINY_GPT, shard_layers, spawn_cases

from graph_fsdp import BufferPolicy, MixedPrecisionPolicy, fully_shard
from graph_fsdp.models import build_model, synthetic_batch
from graph_fsdp.training.train import TrainConfig, run

TINY = TINY_GPT
BASE = TrainConfig(model=TINY, strategy="optim_grads_params", steps=3, mp=BF16_MP, lr=1e-2)


TWO_RANK_CONFIGS = {
    "default": BASE,
    # ZeRO-2, static buffers, and accumulated microbatches (fp32: the plain reduce-scatter
    # for them, the all-to-all for the last one's bf16 gradients).
    "zero2_static_accum": dataclasses.replace(
        BASE,
        strategy="optim_grads",
        grad_accum=2,
        allocator="double_buffer",
        persist_on_alloc_fail=True,
    ),
}
FOUR_RANKS = dataclasses.replace(BASE, steps=2)


def _both(configs: dict[str, TrainConfig]) -> dict[str, tuple]:
    """Each config trained plainly and with fp32 accumulation: ``(run, cfg)`` cases."""
    cases = {}
    for label, cfg in configs.items():
        cases[f"{label}:plain"] = (run, cfg)
        accum = dataclasses.replace(
            cfg, mp=dataclasses.replace(cfg.mp, reduce_scatter_fp32_accumulation=True)
        )
        cases[f"{label}:fp32_accumulation"] = (run, accum)
    return cases


@pytest.fixture(scope="module")
def two_ranks():
    """Every 2-rank check of this file in one spawned group."""
    return spawn_cases(
        {
            **_both(TWO_RANK_CONFIGS),
            "grad_comm_bytes": (_grad_comm_bytes,),
        },
        2,
    )


@pytest.mark.parametrize("config", list(TWO_RANK_CONFIGS))
def test_two_ranks_are_bit_identical_to_the_fp32_reduce_scatter(two_ranks, config):
    """Both schemes sum the same bf16 values in fp32; with 2 ranks the one addition a + b
    has no order, so losses and weights match the default bit for bit."""
    plain = two_ranks[f"{config}:plain"][0]
    accum = two_ranks[f"{config}:fp32_accumulation"][0]
    assert plain["losses"] == accum["losses"]
    for name, value in plain["params"].items():
        assert torch.equal(value, accum["params"][name]), name


def test_four_ranks_sum_in_fp32_in_another_order():
    """4 ranks: only the order of the fp32 additions differs from gloo's reduce-scatter, and
    both stay next to the fp32 single-process reference."""
    four = spawn_cases(_both({"default": FOUR_RANKS}), 4)
    plain, accum = four["default:plain"][0], four["default:fp32_accumulation"][0]
    ref = run(0, 4, dataclasses.replace(FOUR_RANKS, mode="reference"))
    for res in (plain, accum):
        assert max(abs(a - b) for a, b in zip(res["losses"], ref["losses"])) < 1e-2
    for name, value in plain["params"].items():
        torch.testing.assert_close(accum["params"][name], value, rtol=0, atol=1e-5)


def _grad_comm_bytes(rank: int, world: int) -> dict:
    out = {}
    for fp32_accumulation in (False, True):
        torch.manual_seed(0)
        model = build_model(TINY, device="cpu")
        mp = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_scatter_fp32_accumulation=fp32_accumulation
        )
        bp = BufferPolicy(allocator="double_buffer", persist_on_alloc_fail=True)
        shard_layers(model, mp_policy=mp, buffer_policy=bp)
        x, y = synthetic_batch(TINY, micro_batch_size=2, step=rank, device="cpu")
        model(x, y).backward()
        out[fp32_accumulation] = model.fsdp_memory_report()["peak_live_bytes"]["grad_comm"]
    for strategy in ("no_shard", "optim"):
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_scatter_fp32_accumulation=True)
        try:
            fully_shard(build_model(TINY, device="cpu"), strategy=strategy, mp_policy=mp)
            out[strategy] = ""
        except ValueError as err:
            out[strategy] = str(err)
    return out


def test_the_unsharded_comm_buffer_is_bf16_and_unsharded_gradients_are_refused(two_ranks):
    """The all-to-all reads the bf16 gradients and writes a bf16 buffer: the fp32 copy of
    the unsharded gradients that feeds the plain reduce-scatter is gone (half the bytes).
    Strategies that all-reduce full gradients are refused."""
    out = two_ranks["grad_comm_bytes"][0]
    assert out[False] > 0 and out[True] * 2 == out[False], out
    for strategy in ("no_shard", "optim"):
        assert (
            "needs sharded gradients (strategy optim_grads or optim_grads_params)"
            in (out[strategy])
        ), out[strategy]


def test_a_second_reduction_dtype_is_refused():
    with pytest.raises(ValueError, match="set one of the two"):
        MixedPrecisionPolicy(
            param_dtype=torch.bfloat16,
            grad_comm_dtype=torch.bfloat16,
            reduce_scatter_fp32_accumulation=True,
        )
