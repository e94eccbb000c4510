"""The root's capture context (capture_context.py [Note: capture context]): the one object the
capture tools switch and the core reads. Each switch changes what FSDP does in an eager step on
real gloo groups, and is undone when its block ends, raised or not."""

from __future__ import annotations

import torch
from torch import nn

from graph_fsdp.fsdp.api import BufferPolicy
from graph_fsdp.fsdp.fully_shard import fully_shard
from graph_fsdp.training.processes import spawn


class _Recorder:
    """A stand-in for the communication graphs: runs the kernels, counts the calls by kind."""

    def __init__(self) -> None:
        self.kinds: list[str] = []

    def run(self, key, owner, fn) -> None:
        self.kinds.append(key[0])
        fn()


def _step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> torch.Tensor:
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def _trained_once(rank: int):
    """A two-unit ZeRO-2 model after one step, its gradient and weight slots pinned as a
    layerwise capture pins them."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
    buffers = BufferPolicy(allocator="double_buffer", persist_on_alloc_fail=True)
    fully_shard(model[0], strategy="optim_grads", buffer_policy=buffers)
    fully_shard(model, strategy="optim_grads", buffer_policy=buffers)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    loss = _step(model, opt, x)
    model._fsdp_state.root.allocator.pin_roles(("param", "grad"))
    return model, opt, x, loss


def _switches(rank: int, world: int) -> dict:
    model, opt, x, loss = _trained_once(rank)
    out = {"losses": [loss]}
    root = model._fsdp_state.root
    capture = root.capture
    groups = [g for s in root.states for g in s.groups]
    out["shared"] = all(g.capture is capture for g in groups)

    # Layerwise capture: the backward frees the gradients unreduced and exposes none.
    before = [p.detach().clone() for p in model.parameters()]
    with capture.layerwise_capture():
        model(x).square().mean().backward()
    out["grads_in_capture"] = [p.grad for p in model.parameters()]
    out["unchanged_in_capture"] = all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    try:
        with capture.layerwise_capture():
            raise KeyError("capture failed")
    except KeyError:
        pass
    out["capturing_after_raise"] = capture.capturing_layers

    # Weight refresh: every ZeRO-1/2 gather casts again while it is on, never after.
    out["stale_before"] = [g.stale() for g in groups]
    with capture.refreshing_weights():
        out["stale_in_refresh"] = [g.stale() for g in groups]
    out["stale_after"] = [g.stale() for g in groups]

    # Communication graphs: every group's gather and reduction go through the lent runner.
    recorder = _Recorder()
    capture.lend_comm_graphs(recorder)
    out["losses"].append(_step(model, opt, x))  # weights fresh: reductions only
    out["losses"].append(_step(model, opt, x))  # updated weights: gathers too
    capture.take_comm_graphs_back()
    out["lent_kinds"] = sorted(set(recorder.kinds))
    out["lent_calls"] = len(recorder.kinds)
    out["losses"].append(_step(model, opt, x))
    out["calls_after_return"] = len(recorder.kinds)
    out["params"] = [p.detach().clone() for p in model.parameters()]

    # Forgotten events: no slot waits on, and no group consumes, an event recorded before.
    slots = root.allocator.slots()
    for slot in slots:
        slot.pending = ["recorded before the capture"]
    for g in groups:
        g.ag_event = "recorded before the capture"
    capture.forget_events()
    out["events_left"] = [s.pending for s in slots] + [g.ag_event for g in groups]
    out["slots"] = len(slots)

    # Pinned main gradients keep their bytes through the forward that would release them.
    opt.zero_grad(set_to_none=True)
    model(x)
    out["released"] = [g.main_grad.untyped_storage().nbytes() for g in groups]
    for g in groups:  # as a full_iteration capture pins them
        g.pin_main_grad()
    opt.zero_grad(set_to_none=True)
    model(x)
    out["pinned"] = [g.main_grad.untyped_storage().nbytes() for g in groups]
    out["sizes"] = [g.main_grad.numel() * g.main_grad.element_size() for g in groups]
    return out


def _plain(rank: int, world: int) -> dict:
    """The same four training steps with no switch touched."""
    model, opt, x, loss = _trained_once(rank)
    losses = [loss, *[_step(model, opt, x) for _ in range(3)]]
    return {"losses": losses, "params": [p.detach().clone() for p in model.parameters()]}


def _both(rank: int, world: int) -> tuple[dict, dict]:
    return _switches(rank, world), _plain(rank, world)


def test_capture_switches_change_fsdp_and_are_undone():
    for switched, plain in spawn(_both, 2):
        assert switched["shared"]
        assert switched["grads_in_capture"] == [None] * 4
        assert switched["unchanged_in_capture"]
        assert not switched["capturing_after_raise"]
        assert switched["stale_before"] == [False, False]
        assert switched["stale_in_refresh"] == [True, True]
        assert switched["stale_after"] == [False, False]
        # Lent: every reduction, and the gathers of the ZeRO-2 groups once they are stale.
        assert switched["lent_kinds"] == ["gather", "reduce"]
        assert switched["calls_after_return"] == switched["lent_calls"]
        nslots = switched["slots"]
        assert nslots and switched["events_left"] == [[]] * nslots + [None, None]
        assert switched["released"] == [0, 0]
        assert switched["pinned"] == switched["sizes"] and all(switched["sizes"])
        # The capture-mode backward changed nothing: the same losses and weights as a
        # training that never touched a switch.
        assert all(torch.equal(a, b) for a, b in zip(switched["losses"], plain["losses"]))
        assert all(torch.equal(a, b) for a, b in zip(switched["params"], plain["params"]))
