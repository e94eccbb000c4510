"""Stop requests: SIGINT / SIGTERM end a training run at the next step boundary.

    install_stop_handlers()          # in each rank's process (the CLI's launcher does it)
    for step in ...:
        ...                          # forward, backward, optimizer step
        loss, votes = mean_loss_and_stop(step_loss, world_size)
        if votes.item() > 0:         # every rank sees the same sum: all stop after this step
            break

[Note: stopping at a step boundary] A signal reaches each rank's process at its own moment
(a terminal's Ctrl-C reaches every process of the group, the CLI's launcher forwards what it
gets, torchrun's agent sends SIGTERM), so each rank may notice it at another step. A rank that
left the loop alone would leave its peers waiting in a collective, so the decision is agreed:
every rank adds its request (0 or 1) to the all-reduce that averages the step's loss (one
collective, as before: the loss is element 0 of the same sum), and all ranks stop after the
step in which any of them was asked. A second signal (more than :data:`DUPLICATE_S` after the
first, which tells the terminal's copy of one Ctrl-C from the launcher's) ends the process
at once with exit status 128 + the signal number, without a traceback; a checkpoint being
written then is left as it was (``checkpoint.save`` replaces checkpoints atomically). The
handlers raise nothing, so no KeyboardInterrupt traceback is ever printed by a rank.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import torch
import torch.distributed as dist

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
"""Signals that ask a run to stop at the next step boundary."""

DUPLICATE_S = 1.0
"""Signals closer together than this count as one request (a terminal's Ctrl-C and the
launcher's forwarded copy of it arrive within milliseconds)."""


class StopRequest:
    """The stop requests this process received (see [Note: stopping at a step boundary])."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.count = 0
        self._last = 0.0

    def handle(self, signum: int, frame) -> None:
        if self.count and time.monotonic() - self._last < DUPLICATE_S:
            return  # the same request, delivered twice
        self.record(signum)
        if self.count >= 2:
            os._exit(128 + signum)  # at once: the user asked twice

    def record(self, signum: int) -> None:
        self.count += 1
        self._last = time.monotonic()
        self.signum = self.signum or signum


_REQUEST = StopRequest()
"""This process's requests: signal dispositions are per process, so is this record."""


def install_stop_handlers() -> None:
    """Make SIGINT and SIGTERM stop requests in this process (main thread only; a no-op in
    other threads, where Python cannot install handlers)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in STOP_SIGNALS:
        signal.signal(sig, _REQUEST.handle)


def request_stop(signum: int) -> None:
    """Record a stop request that arrived another way than a signal to this process (the
    CLI's launcher: a signal sent before this process installed its handlers)."""
    if not _REQUEST.count:
        _REQUEST.record(signum)


def stop_requested() -> bool:
    """Whether this process was asked to stop (always False without the handlers)."""
    return _REQUEST.count > 0


def stop_signal() -> int | None:
    """The signal of the first stop request, or None."""
    return _REQUEST.signum


def mean_loss_and_stop(
    step_loss: torch.Tensor, world_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mean of step_loss over the ranks, number of ranks asked to stop)``, from one
    all-reduce; both stay on the device (no host synchronization here). ``world_size`` 1:
    no collective."""
    votes = step_loss.new_full((), float(stop_requested()))
    if world_size == 1:
        return step_loss, votes
    both = torch.stack([step_loss, votes])
    dist.all_reduce(both)
    return both[0] / world_size, both[1]
