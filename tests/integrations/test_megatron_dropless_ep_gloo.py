"""Megatron-Core's dropless grouped_mm MoE at EP > 1 on 4 CPU ranks (gloo, fp32).

``moe_experts_impl="grouped_mm"`` with ``expert_model_parallel_size=2`` (x EDP 2) sends the
routed copies over Megatron's EP group through graph_fsdp's dropless exchange
(parallel/dropless_ep.py). One spawn checks, with a router skewed towards expert 0 (a
constant added to every MoE layer's gating logits, so the EP rank holding expert 0 receives
more rows than a balanced exchange would bring it):

- EP 2 x EDP 2 trains like EP 1 (every expert on every rank): the same global weights at the
  start (bit for bit), then losses and weights within fp32 rounding - with the default
  receive buffer (every copy) and with a receive-buffer factor that holds the skewed load;
  the per-rank receive loads are unequal and one exceeds the balanced load;
- a receive buffer too small for the skewed load (factor 0.5) overflows: every rank's
  ``take_overflow_report`` (the training loop's check before it repeats the step) names every
  MoE layer and the factor that would have held the step;
- a checkpoint saved at EP 2 loads at EP 1 bit for bit and training goes on as at EP 2.

Reuses the EP harness of test_megatron_ep_gloo.py (graph_fsdp_testing.megatron_on_cpu bridges Megatron's CUDA-only details).
"""

from __future__ import annotations

import dataclasses
import os
import re

import pytest
import torch
from graph_fsdp_testing import megatron_on_cpu
from test_megatron_ep_gloo import (
    FP32,
    _assert_close_states,
    _batch,
    _build,
    _model,
    _state,
    _train,
)

from graph_fsdp.training.processes import spawn

WORLD, STEPS, SKEW = 4, 4, 4.0
"""SKEW: added to expert 0's gating logit (top-2 of 4: most tokens send a copy to it)."""
VARIANTS = {"ep1": (1, None), "ep2": (2, None), "ep2 factor 1.75": (2, 1.75)}
"""label -> (expert_model_parallel_size, moe_receive_buffer_factor)."""
EXPERT_KEY = "module.decoder.layers.0.mlp.experts.linear_fc1.weight"


def _record_loads(lm) -> list[int]:
    """Rows each forward's experts receive on this rank (the first MoE layer)."""
    loads: list[int] = []
    experts = lm.module.decoder.layers[0].mlp.experts
    experts.register_forward_pre_hook(lambda m, args: loads.append(int(args[1].sum())))
    return loads


def _expert_group_sizes(lm) -> list[int]:
    groups = {getattr(p, "_graph_fsdp_group", None) for p in lm.parameters()}
    return sorted({g.comm.world_size for g in groups if g is not None and g.expert is not None})


def _build_dropless(cfg, ep: int, factor: float | None, seed: int | None = None):
    cfg = dataclasses.replace(cfg, expert_model_parallel_size=ep, moe_receive_buffer_factor=factor)
    lm, opt = _build(cfg, ep, None, seed)
    from graph_fsdp.integrations.megatron import skew_router

    assert skew_router(lm, SKEW) == len(lm.module.decoder.layers)  # every layer is MoE
    return lm, opt


def _dropless_ep(rank: int, world: int, root: str) -> dict:
    from graph_fsdp.capture.step import eager_forward_backward
    from graph_fsdp.fsdp import checkpoint as ckpt
    from graph_fsdp.parallel.dropless_ep import (
        bounded_buffers,
        take_overflow,
        take_overflow_report,
    )

    megatron_on_cpu()
    cfg = _model(moe_token_dispatcher_type="allgather", moe_experts_impl="grouped_mm")
    out: dict = {}
    saved = os.path.join(root, "at_ep2")
    for label, (ep, factor) in VARIANTS.items():
        lm, opt = _build_dropless(cfg, ep, factor)
        loads = _record_loads(lm)
        start = _state(lm)
        losses = _train(lm, opt, cfg, range(2), rank)
        if label == "ep2":
            ckpt.save(saved, lm, opt)
            out["saved"] = _state(lm)
        losses += _train(lm, opt, cfg, range(2, STEPS), rank)
        out[label] = {
            "start": start,
            "losses": losses,
            "end": _state(lm),
            "loads": loads,
            "overflow": take_overflow(lm),
            "expert_groups": _expert_group_sizes(lm),
        }
    # EP 2 -> EP 1: the weights bit for bit, then the last two steps as at EP 2.
    lm, opt = _build_dropless(cfg, 1, None, seed=99)
    out["ep1 differs before load"] = not torch.equal(
        _state(lm)[EXPERT_KEY], out["saved"][EXPERT_KEY]
    )
    ckpt.load(saved, lm, opt)
    out["loaded at ep1"] = _state(lm)
    out["ep1 continues"] = _train(lm, opt, cfg, range(2, STEPS), rank)
    # A receive buffer of half the balanced load: the skewed exchange overflows.
    lm, opt = _build_dropless(cfg, 2, 0.5)
    x, y = _batch(0, rank, cfg)
    eager_forward_backward(lm, x, y, 1)
    report = take_overflow_report(bounded_buffers(lm), torch.device("cpu"))
    out["overflow report"] = None if report is None else report.describe()
    out["overflow cleared"] = take_overflow(lm)
    out["rank"] = rank
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    root = str(tmp_path_factory.mktemp("dropless_ep"))
    return spawn(_dropless_ep, WORLD, root, timeout=900)


def test_grouped_mm_dropless_ep2_trains_like_ep1(results) -> None:
    out = results[0]
    ref = out["ep1"]
    assert ref["start"][EXPERT_KEY].shape == (4, 64, 32)  # the 4 global experts, stacked
    assert all(not torch.equal(ref["start"][k], ref["end"][k]) for k in ref["start"])
    for label in ("ep2", "ep2 factor 1.75"):
        got = out[label]
        _assert_close_states(ref["start"], got["start"], f"{label} start", exact=True)
        torch.testing.assert_close(got["losses"], ref["losses"], **FP32)
        _assert_close_states(ref["end"], got["end"], f"{label} end", exact=False)
        assert got["overflow"] == [], label
    # The stacked experts are sharded over their EDP group (2 ranks) at EP 2; at EP 1 they stay
    # in the layers' dense groups.
    assert out["ep2"]["expert_groups"] == [2] and out["ep1"]["expert_groups"] == []


def test_skewed_router_loads_the_exchange_unequally(results) -> None:
    """EP ranks 0 and 1 (ranks 0, 1 of the EP group [0, 1]) receive unequal loads, rank 0
    (experts 0 and 1) more than the balanced load: the tokens x topk copies of a rank."""
    copies = 2 * _model().seq_length * 2  # micro-batch 2, top-2
    for label in ("ep2", "ep2 factor 1.75"):
        first, second = results[0][label]["loads"], results[1][label]["loads"]
        assert len(first) == len(second) == STEPS
        assert all(a > copies > b for a, b in zip(first, second)), (label, first, second)
    # At EP 1 every rank's experts take exactly its own copies.
    assert results[0]["ep1"]["loads"] == [copies] * STEPS


def test_checkpoint_moves_from_ep2_to_ep1(results) -> None:
    out = results[0]
    assert out["ep1 differs before load"]
    _assert_close_states(out["saved"], out["loaded at ep1"], "EP 2 -> EP 1", exact=True)
    torch.testing.assert_close(out["ep1 continues"], out["ep2"]["losses"][2:], **FP32)


def test_a_small_receive_buffer_overflow_is_reported_on_every_rank(results) -> None:
    for res in results:
        report = res["overflow report"]
        assert report is not None, f"rank {res['rank']}: the overflow was not reported"
        for layer in ("module.decoder.layers.0.mlp", "module.decoder.layers.1.mlp"):
            assert layer in report, report
        assert "overflowed its receive buffer" in report
        assert re.search(r"moe_receive_buffer_factor >= [0-9.]+ would have held it", report)
        assert res["overflow cleared"] == []  # the check read and cleared the flags
