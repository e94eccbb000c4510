"""NaN and Inf in a training run: the step checks, the skipped-step limit, the save guard.

[Note: non-finite steps] After each step the loop hands :class:`NonFiniteGuard` the mean loss
over the ranks and, where the step computed one, the global gradient norm - the same numbers
on every rank, so every rank stops at the same iteration and none waits in a collective.
With ``check_for_nan_in_loss_and_grad`` (Megatron's name; on by default) a NaN or Inf stops
the run with :class:`NonFiniteError`, one line naming the iteration and the value, before the
step's checkpoint. The one-graph step (capture/whole_step.py) instead skips a step whose
gradient norm is not finite on the device, leaving the model as it was: such steps are
counted, and more than ``max_consecutive_skipped_steps`` of them in a row stop the run the same
way. Whatever the check, a save refuses a model holding NaN or Inf
(:func:`check_finite_model`): a diverged run never replaces a good checkpoint. The step log
writes a non-finite number as the string ``"nan"``, ``"inf"`` or ``"-inf"``
(:func:`json_number`), never JSON's invalid bare ``NaN``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn


class NonFiniteError(RuntimeError):
    """A NaN or Inf stopped the run ([Note: non-finite steps]); one line."""


def json_number(value: float) -> float | str:
    """``value`` for a JSON log: itself when finite, else ``"nan"``, ``"inf"`` or ``"-inf"``
    (``float()`` reads each back)."""
    return value if math.isfinite(value) else str(value)


@dataclass(kw_only=True)
class NonFiniteGuard:
    """The loop's per-step check ([Note: non-finite steps])."""

    check: bool = True
    """Stop at a non-finite loss or gradient norm of an applied step."""
    max_consecutive_skips: int = 10
    """Stop after more than this many skipped steps in a row (0: never)."""
    skipped: int = 0
    """Steps skipped so far."""
    consecutive: int = 0

    def after_step(
        self, iteration: int, loss: float, grad_norm: float | None, skipped: bool
    ) -> None:
        if skipped:
            self.skipped += 1
            self.consecutive += 1
            limit = self.max_consecutive_skips
            if limit and self.consecutive > limit:
                raise NonFiniteError(
                    f"iteration {iteration}: {self.consecutive} steps in a row skipped for a "
                    f"non-finite gradient norm (now {grad_norm}, loss {loss}), more than "
                    f"max_consecutive_skipped_steps={limit}: the run diverged; lower the "
                    "learning rate or resume from the last checkpoint"
                )
            return
        self.consecutive = 0
        if not self.check:
            return
        for what, value in (("loss", loss), ("gradient norm", grad_norm)):
            if value is not None and not math.isfinite(value):
                raise NonFiniteError(
                    f"iteration {iteration}: the {what} is {value}; stopped without saving "
                    "this model (check_for_nan_in_loss_and_grad): lower the learning rate or "
                    "resume from the last checkpoint"
                )


def check_finite_model(model: nn.Module, iteration: int, where: str) -> None:
    """Every rank: refuse to save a model with a NaN or Inf in any rank's parameters."""
    ok = torch.ones((), dtype=torch.float32)
    for p in model.parameters():
        local = p.detach()
        local = local.to_local() if hasattr(local, "to_local") else local  # a DTensor's piece
        if local.numel() and not bool(torch.isfinite(local).all()):
            ok.zero_()
            break
    if dist.is_initialized() and dist.get_world_size() > 1:
        device = next(model.parameters()).device
        ok = ok.to(device)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    if ok.item() < 1:
        raise NonFiniteError(
            f"iteration {iteration}: the model holds NaN or Inf; not saving it to {where}, "
            "whose checkpoints stay as they are: lower the learning rate or resume from the "
            "last checkpoint"
        )
