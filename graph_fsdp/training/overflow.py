"""The training loop's repeat of a step whose dropless expert-parallel exchange overflowed its
bounded receive buffer (parallel/dropless_ep.py [Note: dropless overflow reports])::

    repeats = OverflowRepeats(model, device, rank)      # nothing to do without a factor
    rng = repeats.rng_state()                           # at the step's start
    loss = forward_backward()
    if repeats.take(step) is not None:                  # one all-reduce and host read
        trainer.drop_grads()
        with repeats.repeating(graphs, rng):
            loss = forward_backward()                   # eager, every copy's buffer

The repeat is the step a buffer of every copy computes, bit for bit: the same microbatches,
from the same generator states, through exchanges that cannot overflow.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import torch
from torch import nn

from graph_fsdp.capture.verify import rng_state, set_rng_state
from graph_fsdp.parallel.dropless_ep import (
    OverflowReport,
    bounded_buffers,
    holding_every_copy,
    take_overflow_report,
)


class OverflowRepeats:
    """The run's layers with a receive-buffer factor, its overflow steps and their reports."""

    def __init__(self, model: nn.Module, device: torch.device, rank: int) -> None:
        self.buffers = bounded_buffers(model)
        """``(name, OverflowFlag)`` of the layers that can overflow; empty: nothing to do."""
        self.device, self.rank = device, rank
        self.steps = 0
        """Steps repeated for an overflow so far (the result's ``overflow_steps``)."""

    def rng_state(self):
        """The generators' states at a step's start, for an exact repeat (None without a
        bounded layer: nothing is saved)."""
        return rng_state(self.device) if self.buffers else None

    def take(self, step: int) -> OverflowReport | None:
        """After a step's backward: whether an exchange of any rank overflowed (one all-reduce
        and one host read; none without a bounded layer). An overflow is counted and, on rank
        0, warned about, naming the layers and the factor that would have held the step."""
        if not self.buffers:
            return None
        report = take_overflow_report(self.buffers, self.device)
        if report is None:
            return None
        self.steps += 1
        if self.rank == 0:
            warnings.warn(
                f"step {step}: {report.describe()}. The step was repeated with a receive buffer "
                "of every copy (moe_receive_buffer_factor of GPTConfig / MCoreGPTConfig, "
                "--moe-receive-buffer-factor; unset: never overflows)",
                stacklevel=2,
            )
        return report

    @contextmanager
    def repeating(self, graphs, rng) -> Iterator[None]:
        """The repeat of an overflowed step: the generators back at the step's start, every
        exchange holding every copy, and the graph runner's graphs out of the way
        (``graphs.eagerly()``)."""
        set_rng_state(rng, self.device)
        with holding_every_copy(self.buffers), graphs.eagerly() if graphs else nullcontext():
            yield

    def evaluating(self):
        """Evaluation with every copy's buffer (nothing repeats an eval pass)."""
        return holding_every_copy(self.buffers)


def overflow_record(report: OverflowReport | None) -> dict:
    """The step log's entry for an overflowed step (``{}`` for any other)."""
    if report is None:
        return {}
    return {"overflow": {"layers": report.layers, "receive_buffer_factor_needed": report.factor}}
