"""The training loop's repeat of a step whose dropless expert-parallel exchange overflowed its
bounded receive buffer (parallel/dropless_ep.py [Note: dropless overflow reports])::

    repeats = OverflowRepeats(model, device, rank)      # nothing to do without a factor
    rng = repeats.rng_state()                           # at the step's start
    loss = forward_backward()
    report = repeats.take()                             # one all-reduce and host read
    if report is not None:
        trainer.drop_grads()
        with repeats.repeating(graphs, rng):
            loss = forward_backward()                   # eager, every copy's buffer
        report = repeats.measured(report, step)         # the factor it needed; the warning

The repeat is the step a buffer of every copy computes, bit for bit: the same microbatches,
from the same generator states, through exchanges that cannot overflow.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import replace

import torch
from torch import nn

from graph_fsdp.capture.verify import rng_state, set_rng_state
from graph_fsdp.parallel.dropless_ep import (
    OverflowReport,
    bounded_buffers,
    holding_every_copy,
    take_needed_factor,
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

    def take(self) -> OverflowReport | None:
        """After a step's backward: whether an exchange of any rank overflowed (one all-reduce
        and one host read; none without a bounded layer), and which layers; counted."""
        if not self.buffers:
            return None
        report = take_overflow_report(self.buffers, self.device)
        if report is not None:
            self.steps += 1
        return report

    @contextmanager
    def repeating(self, graphs, rng) -> Iterator[None]:
        """The repeat of an overflowed step: the generators back at the step's start, every
        exchange holding every copy and measuring what it needed, and the graph runner's
        graphs out of the way (``graphs.eagerly()``)."""
        set_rng_state(rng, self.device)
        with (
            holding_every_copy(self.buffers, measure=True),
            graphs.eagerly() if graphs else nullcontext(),
        ):
            yield

    def measured(self, report: OverflowReport, step: int) -> OverflowReport:
        """After the repeat: ``report`` with the factor the repeat's exchanges needed, warned
        about on rank 0. The overflowed pass cannot say it: the layers after the first that
        dropped rows saw inputs without them, and routed them otherwise; the repeat routes
        every layer's tokens as the model does (one all-reduce and one host read)."""
        report = replace(report, factor=take_needed_factor(self.buffers, self.device))
        if self.rank == 0:
            warnings.warn(
                f"step {step}: {report.describe()}. The step was repeated with a receive buffer "
                "of every copy (moe_receive_buffer_factor of GPTConfig / MCoreGPTConfig, "
                "--moe-receive-buffer-factor; unset: never overflows)",
                stacklevel=2,
            )
        return report

    def evaluating(self):
        """Evaluation with every copy's buffer (nothing repeats an eval pass)."""
        return holding_every_copy(self.buffers)


def overflow_record(report: OverflowReport | None) -> dict:
    """The step log's entry for an overflowed step (``{}`` for any other)."""
    if report is None:
        return {}
    return {"overflow": {"layers": report.layers, "receive_buffer_factor_needed": report.factor}}
