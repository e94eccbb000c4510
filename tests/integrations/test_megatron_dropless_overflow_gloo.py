"""Megatron-Core's dropless grouped_mm MoE at EP 2 on 2 CPU ranks (gloo, fp32): a receive
buffer that the skewed router overflows on some steps. Each overflowed step is detected after
its backward, its gradients dropped and its microbatch run again with a buffer of every copy
(training/overflow.py with the loop's ``ShardedTrainer``): losses and final weights equal the
run without a factor bit for bit, and rank 0's warnings name the MoE layers and a factor.

Reuses the EP harness of test_megatron_ep_gloo.py and the skewed router of
test_megatron_dropless_ep_gloo.py.
"""

from __future__ import annotations

import re

import torch
from graph_fsdp_testing import megatron_on_cpu
from test_megatron_dropless_ep_gloo import _build_dropless
from test_megatron_ep_gloo import _batch, _model, _state

from graph_fsdp.training.processes import spawn

STEPS, FACTOR = 6, 1.45
"""FACTOR: a receive buffer the skewed router overflows on some of the steps, not all."""


def _run(rank: int, world: int, factor: float | None) -> dict:
    import warnings

    import torch.distributed as dist

    from graph_fsdp.capture.step import eager_forward_backward
    from graph_fsdp.training.loop import ShardedTrainer
    from graph_fsdp.training.overflow import OverflowRepeats

    megatron_on_cpu()
    cfg = _model(moe_token_dispatcher_type="allgather", moe_experts_impl="grouped_mm")
    lm, opt = _build_dropless(cfg, 2, factor)
    device = torch.device("cpu")
    trainer = ShardedTrainer(lm, opt, loss_world=world, device=device)
    repeats = OverflowRepeats(lm, device, rank)
    losses = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(STEPS):  # the loop's step (training/loop.py run_loop), eager
            rng = repeats.rng_state()
            x, y = _batch(step, rank, cfg)
            loss = eager_forward_backward(lm, x, y, 1).detach()
            report = repeats.take()
            if report is not None:
                trainer.drop_grads()
                with repeats.repeating(None, rng):
                    loss = eager_forward_backward(lm, x, y, 1).detach()
                repeats.measured(report, step)
            trainer.grads_to_main()
            trainer.optimizer_step()
            dist.all_reduce(loss)
            losses.append(loss.item())
    return {
        "losses": losses,
        "end": _state(lm),
        "overflow_steps": repeats.steps,
        "warnings": [str(w.message) for w in caught if "overflowed" in str(w.message)],
    }


def _both(rank: int, world: int) -> dict:
    return {"none": _run(rank, world, None), "factor": _run(rank, world, FACTOR)}


def test_grouped_mm_overflowed_steps_are_repeated_exactly() -> None:
    for rank, result in enumerate(spawn(_both, 2, timeout=600)):
        none, got = result["none"], result["factor"]
        assert none["overflow_steps"] == 0
        assert 0 < got["overflow_steps"] < STEPS, got["warnings"]
        assert got["losses"] == none["losses"]
        for key, value in none["end"].items():
            assert torch.equal(got["end"][key], value), key
        said = got["warnings"]
        assert len(said) == (got["overflow_steps"] if rank == 0 else 0), said
        for message in said:
            assert re.search(r"module\.decoder\.layers\.[01]\.mlp", message), message
            assert float(re.search(r"factor >= ([0-9.]+)", message).group(1)) > FACTOR
