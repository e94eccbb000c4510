"""The optimizer inside a captured training step (whole_step.py): which torch optimizers can
run there, the learning rate as a device tensor, and the update skipped on the device.

[Note: optimizers in the step graph] A CUDA graph replays kernels with the arguments they
were recorded with, so whatever an optimizer computes on the host is frozen at capture:
- torch's ``Adam``/``AdamW`` with ``fused=True`` keep the step count on the device and read a
  tensor learning rate in the kernel: capturable. (``fused`` kernels never do host math, but
  torch's capture check looks at the ``capturable`` flag only; the runner sets it for fused
  groups while it captures and puts it back - it changes nothing else for them.)
- ``Adam``/``AdamW`` with ``capturable=True`` (foreach or single-tensor): capturable, but
  they refuse ``found_inf``, so the Inf/NaN skip needs ``fused=True``;
- ``SGD`` with ``fused=True``: capturable (a tensor learning rate is read in the kernel); the
  foreach/for-loop SGD turns a tensor learning rate into a host number (``alpha=-lr``);
- anything else is refused with this list.

[Note: the update skipped on the device] torch's fused Adam, AdamW and SGD take a
``found_inf`` tensor (how ``torch.amp.GradScaler`` skips a step without a host sync): the
Python step adds 1 to every step count, the kernel returns at once when ``found_inf == 1``
(parameters, moments and momentum buffers untouched, the gradients too), and the Python step
subtracts ``found_inf`` from the step counts again. A skipped step therefore leaves the
whole optimizer state exactly as it was - what a host-side ``if finite: optimizer.step()``
leaves - and an applied step (``found_inf == 0``) is bit-identical to a step without it.
The step decides ``found_inf`` from the global gradient norm (grad_norm.py), which every
rank computes over all ranks' shards, so all ranks skip together.

[Note: learning rate on the device] The runner keeps each parameter group's ``lr`` as a
0-d float32 tensor on the parameters' device (what torch's fused kernels read: a tensor lr
is read as float32), created once and kept in ``group["lr"]``. LR schedulers update it in
place (``torch.optim.lr_scheduler`` fills tensor learning rates; a float learning rate is
kept as ``initial_lr``, where a scheduler created later starts from, as it would have, instead
of a device tensor whose reads would sync the host); a value the host assigns
(``group["lr"] = 0.1``, a checkpoint load) is copied into it before the next step. The
graph reads it at every replay. Values equal a loop whose optimizer was given the same
tensor learning rate; against a Python float lr, CUDA kernels can differ in the last bits
(the float is used in double precision there).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from graph_fsdp.capture.scopes import GraphConfigError

SUPPORTED = (
    "torch.optim.AdamW / torch.optim.Adam with fused=True (or capturable=True without the "
    "Inf/NaN skip), torch.optim.SGD with fused=True"
)

_HOST_ONLY_KEYS = ("params", "lr", "initial_lr")
"""Param-group entries the graph does not bake in: the parameter list is checked apart, the
learning rate lives on the device, ``initial_lr`` is an LR scheduler's own record."""


def _kind(optimizer: torch.optim.Optimizer) -> str | None:
    if isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
        return "adam"
    if isinstance(optimizer, torch.optim.SGD):
        return "sgd"
    return None


def check_optimizer(
    optimizer: torch.optim.Optimizer, *, skip_nonfinite: bool, graphs: bool
) -> None:
    """Refuse an optimizer the step cannot run as asked ([Note: optimizers in the step
    graph]); ``graphs`` False (the eager step) checks only what the skip needs."""
    name = type(optimizer).__name__
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {name}")
    kind = _kind(optimizer)
    if kind is None and (graphs or skip_nonfinite):
        what = "run inside the step's CUDA graph" if graphs else "skip an Inf/NaN step"
        raise GraphConfigError(
            f"{name} cannot {what}: supported are {SUPPORTED}. Use one of those, keep the "
            "optimizer eager (FullIterationGraphs captures forward+backward only)"
            + ("" if graphs else ", or StepPolicy(skip_nonfinite=False)")
        )
    for i, group in enumerate(optimizer.param_groups):
        fused = bool(group.get("fused"))
        capturable = bool(group.get("capturable"))
        where = f"{name} param group {i}"
        if group.get("differentiable"):
            raise GraphConfigError(
                f"{where}: differentiable=True is not supported; use {SUPPORTED}"
            )
        if skip_nonfinite and not fused:
            raise GraphConfigError(
                f"{where} has fused={group.get('fused')}: the Inf/NaN skip passes found_inf to "
                f"the update kernel, which only fused=True takes ([Note: the update skipped on "
                f"the device]). Create {name}(..., fused=True), or pass "
                "StepPolicy(skip_nonfinite=False)"
            )
        if graphs and not fused and not (kind == "adam" and capturable):
            fix = "fused=True or capturable=True" if kind == "adam" else "fused=True"
            raise GraphConfigError(
                f"{where} (fused={group.get('fused')}, capturable={group.get('capturable')}) "
                "computes its step on the host, which a CUDA graph would freeze at capture: "
                f"create {name}(..., {fix}) ([Note: optimizers in the step graph])"
            )


class DeviceLearningRates:
    """Each parameter group's ``lr`` as a float32 device tensor ([Note: learning rate on the
    device]); groups whose optimizer path cannot take a tensor keep theirs (eager only)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.tensors: list[torch.Tensor | None] = []
        for group in optimizer.param_groups:
            if not (group.get("fused") or group.get("capturable")):
                self.tensors.append(None)
                continue
            device = group["params"][0].device if group["params"] else torch.device("cpu")
            lr = group["lr"]
            if (
                isinstance(lr, torch.Tensor)
                and lr.device == device
                and lr.dtype == torch.float32
                and lr.dim() == 0
            ):
                tensor = lr  # adopted as it is: whoever holds it updates the step's lr
            else:
                tensor = torch.empty((), dtype=torch.float32, device=device)
                _set(tensor, lr)
                group["lr"] = tensor
                if not isinstance(lr, torch.Tensor):
                    # A scheduler made later starts from this float, as it would have: one
                    # made from a device tensor reads its values with .item() (host syncs).
                    group.setdefault("initial_lr", lr)
            self.tensors.append(tensor)

    def sync(self) -> None:
        """Before a step: a learning rate the host replaced is copied into the device tensor
        (in place, no host sync), and the tensor is put back into the group."""
        groups = self.optimizer.param_groups
        if len(groups) != len(self.tensors):
            raise GraphConfigError(
                f"{type(self.optimizer).__name__} has {len(groups)} param groups, "
                f"{len(self.tensors)} when the step was built: create the whole-step runner "
                "after the last add_param_group"
            )
        for group, tensor in zip(groups, self.tensors):
            if tensor is not None and group["lr"] is not tensor:
                _set(tensor, group["lr"])
                group["lr"] = tensor


def _set(tensor: torch.Tensor, value) -> None:
    if isinstance(value, torch.Tensor):
        tensor.copy_(value.detach().reshape(()))
    else:
        tensor.fill_(float(value))


def hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict]:
    """What a captured step baked in, per group: every entry but the learning rate, and the
    parameters by identity."""
    return [
        {
            **{k: v for k, v in group.items() if k not in _HOST_ONLY_KEYS},
            "params": tuple(id(p) for p in group["params"]),
        }
        for group in optimizer.param_groups
    ]


def changed_hyperparameter(optimizer: torch.optim.Optimizer, recorded: list[dict]) -> str | None:
    """The first entry that differs from ``recorded`` (a sentence), or None."""
    now = hyperparameters(optimizer)
    if len(now) != len(recorded):
        return f"the optimizer has {len(now)} param groups, {len(recorded)} at capture"
    for i, (a, b) in enumerate(zip(recorded, now)):
        for key in sorted(set(a) | set(b)):
            if not _same(a.get(key), b.get(key)):
                if key == "params":
                    return f"param group {i}'s parameters changed"
                return f"param group {i}'s {key} is {b.get(key)!r}, captured as {a.get(key)!r}"
    return None


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return a is b
    if isinstance(a, tuple | list) and isinstance(b, tuple | list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def step_optimizer(
    optimizer: torch.optim.Optimizer,
    found_inf: torch.Tensor | None,
    *,
    params: list[torch.Tensor] | None = None,
    exclude: set[int] | None = None,
) -> None:
    """``optimizer.step()``, skipped on the device where ``found_inf`` is 1 ([Note: the
    update skipped on the device]); None: always applied. ``params`` steps only those
    parameters, ``exclude`` all but those (ids): [Note: the optimizer over a subset]."""
    if params is None and exclude is None:
        _step(optimizer, found_inf)
        return
    wanted = {id(p) for p in params} if params is not None else None
    groups = optimizer.param_groups
    subset = []
    for group in groups:
        kept = [
            p
            for p in group["params"]
            if (wanted is None or id(p) in wanted) and (exclude is None or id(p) not in exclude)
        ]
        if kept:
            subset.append({**group, "params": kept})
    optimizer.param_groups = subset
    try:
        _step(optimizer, found_inf)
    finally:
        optimizer.param_groups = groups


# [Note: the optimizer over a subset] To update some parameters before the others (the next
# step's gathers: next_gather.py), ``step_optimizer`` runs the optimizer's own ``step()`` over
# shallow copies of its param groups that keep only those parameters (the same settings, the
# same learning-rate tensor, the same per-parameter state), then puts the groups back. Each
# parameter's update reads only its own gradient and state, and torch's fused kernels are
# elementwise per tensor: the calls over disjoint subsets write the bits one call writes.
# An empty subset of a group is left out (no empty list reaches a kernel).
def _step(optimizer: torch.optim.Optimizer, found_inf: torch.Tensor | None) -> None:
    if found_inf is None:
        optimizer.step()
        return
    optimizer.found_inf = found_inf  # read by torch's fused step, as GradScaler sets it
    try:
        optimizer.step()
    finally:
        del optimizer.found_inf


@contextmanager
def capturable_for_capture(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Fused groups flagged capturable while a capture runs ([Note: optimizers in the step
    graph]: torch's capture check reads only the flag); the flags are restored after."""
    flipped = []
    for group in optimizer.param_groups:
        if group.get("fused") and "capturable" in group and not group["capturable"]:
            group["capturable"] = True
            flipped.append(group)
    try:
        yield
    finally:
        for group in flipped:
            group["capturable"] = False
