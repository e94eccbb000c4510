"""The eager side of [Note: backward handlers in the replay] (capture/torch_backend.py), on gloo.

While a whole-layer torch graph is captured its unit's handlers belong to the replay
(``FSDPState.hand_handlers_to_replay``): FSDP's registration hooks stand aside and the
runner's ``Dispatcher`` (``capture/layerwise.py``, the layer's ``forward`` once a
``LayerwiseGraphs`` targets it) registers
the handlers for every eager call (``FSDPState.forward_with_backward_handlers``); with the
hooks handed to the dispatcher ([Note: forward handlers in the dispatcher], state.py) it
runs ``pre_forward`` and ``post_forward`` too. Here a real ``LayerwiseGraphs`` installs its
dispatchers on a CPU model (built with the checks an eager runner makes: CPU cannot
capture), each unit is put in the state its capture leaves it in, and every call takes the
dispatcher's eager side, which must train exactly like the hooks, with the same order of
handlers. The replay side needs a GPU (tests/capture/test_cuda_graphs_gpu.py).
"""

from __future__ import annotations

import pytest
import torch
from graph_fsdp_testing import spawn_cases
from torch import nn

from graph_fsdp.models import GPTConfig, build_model, synthetic_batch, transformer_layers
from graph_fsdp.training.train import TrainConfig, shard_model

TINY = GPTConfig(vocab_size=128, num_layers=3, hidden_size=32, num_attention_heads=4, seq_length=16)


def _runner_dispatching(model: nn.Module, forward_handlers: bool):
    """A ``LayerwiseGraphs`` over every unit (whole-unit targets) whose dispatchers own
    the units' backward handlers (and, ``forward_handlers``, their forward handlers), as
    after a torch-backend capture (``LayerwiseGraphs._capture``), without graphs."""
    from graph_fsdp.capture import layerwise as runner

    checks = runner.check_capturable
    runner.check_capturable = lambda *a, **kw: checks(*a, **{**kw, "graphs": False})
    try:
        graphs = runner.LayerwiseGraphs(model, impl="torch", scopes=[], warmup_steps=1)
    finally:
        runner.check_capturable = checks
    targets = [c.module for c in graphs.caps]  # every unit below the root: whole units
    assert all(any(layer is t for t in targets) for layer in transformer_layers(model))
    for cap in graphs.caps:
        assert isinstance(cap.module.forward, runner.Dispatcher)  # the runner's dispatcher
        assert cap.module.forward.cap is cap
        assert not cap.captured
        cap.unit_state = cap.module._fsdp_state
        handed = cap.unit_state.hand_handlers_to_replay(forward=forward_handlers)
        assert cap.unit_state.backward_by_replay and handed == forward_handlers
        if forward_handlers:
            assert not cap.module._forward_pre_hooks and not cap.module._forward_hooks
    return graphs


def _train(rank: int, world: int, by_replay: bool, forward_handlers: bool = False) -> dict:
    cfg = TrainConfig(model=TINY, strategy="optim_grads_params", steps=3)
    torch.manual_seed(0)
    model = shard_model(build_model(TINY, device="cpu"), cfg)
    order: list[str] = []
    for i, layer in enumerate(transformer_layers(model)):
        state = layer._fsdp_state
        for phase in ("pre_backward", "post_backward"):
            inner = getattr(state, phase)

            def traced(inner=inner, name=f"{phase}:{i}"):
                order.append(name)
                inner()

            setattr(state, phase, traced)
    graphs = _runner_dispatching(model, forward_handlers) if by_replay else None
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(3):
        order.clear()
        x, y = synthetic_batch(TINY, 2, step, rank=rank, device=torch.device("cpu"))
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        model.eval()
        with torch.no_grad():
            losses.append(model(x, y).item())  # eval: no handlers registered, none run
        model.train()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    eager_calls = sum(c.replays + c.fallbacks for c in graphs.caps) if graphs else 0
    return {"losses": losses, "params": params, "order": list(order), "counted": eager_calls}


def _three(rank: int, world: int) -> list[dict]:
    """FSDP's hooks, then backward handlers from the dispatcher, then forward ones too: one
    launch for the three trainings."""
    return [
        _train(rank, world, False),
        _train(rank, world, True, False),
        _train(rank, world, True, True),
    ]


@pytest.fixture(scope="module")
def two_ranks():
    """Every check of this file in one spawned group."""
    return spawn_cases(
        {
            "three": (_three,),
            "hand_over": (_hand_over,),
            "replay_handlers": (_sharded_through_replay_handlers,),
        },
        2,
    )


def test_dispatcher_registered_handlers_train_like_the_hooks(two_ranks):
    for hooks, *dispatched in two_ranks["three"]:
        for d in dispatched:  # backward handlers only, forward ones too
            assert d["losses"] == hooks["losses"]
            assert all(torch.equal(d["params"][n], v) for n, v in hooks["params"].items())
            # Each layer reduces right after its own backward, before the layer below starts:
            # the post-backward handler ran from the backward, not from the final callback.
            assert d["order"] == hooks["order"]
            assert d["order"][:4] == [
                "pre_backward:2",
                "post_backward:2",
                "pre_backward:1",
                "post_backward:1",
            ]
            assert d["counted"] == 0  # nothing captured: no replay, no counted fallback


def _hand_over(rank: int, world: int) -> dict:
    cfg = TrainConfig(model=TINY, strategy="optim_grads_params")
    model = shard_model(build_model(TINY, device="cpu"), cfg)
    first, second = transformer_layers(model)[:2]
    s1, s2 = first._fsdp_state, second._fsdp_state
    handles = s1._handles
    out = {"handed": s1.hand_handlers_to_replay()}
    out["hooks_while_handed"] = len(first._forward_pre_hooks) + len(first._forward_hooks)
    s1.take_handlers_back()
    out["hooks_after"] = len(first._forward_pre_hooks) + len(first._forward_hooks)
    out["flag_after"] = s1.forward_by_dispatcher or s1.backward_by_replay
    out["new_handles"] = s1._handles is not handles
    # A module with a hook of its own keeps FSDP's hooks where they are.
    second.register_forward_hook(lambda m, a, o: None)
    out["handed_with_user_hook"] = s2.hand_handlers_to_replay()
    out["hooks_with_user_hook"] = len(second._forward_pre_hooks) + len(second._forward_hooks)
    return out


def test_forward_hooks_come_off_only_when_they_are_fsdps_alone(two_ranks):
    for r in two_ranks["hand_over"]:
        assert r["handed"] and r["hooks_while_handed"] == 0
        assert r["hooks_after"] == 4 and not r["flag_after"] and r["new_handles"]
        assert not r["handed_with_user_hook"] and r["hooks_with_user_hook"] == 5


def _sharded_through_replay_handlers(rank: int, world: int) -> dict:
    """The replay side's handler calls (no module code runs): the module keeps its sharded
    parameters through ``pre_forward(params_on_modules=False)`` and ``post_forward``."""
    cfg = TrainConfig(model=TINY, strategy="optim_grads_params")
    model = shard_model(build_model(TINY, device="cpu"), cfg)
    layer = transformer_layers(model)[1]
    x, y = synthetic_batch(TINY, 2, 0, rank=rank, device=torch.device("cpu"))
    model(x, y).backward()  # lazy init, forward order
    state = layer._fsdp_state
    sharded = {n: p for n, p in layer.named_parameters()}
    state.pre_forward(params_on_modules=False)
    during = all(p is sharded[n] for n, p in layer.named_parameters())
    gathered = all(g.full is not None and g._holds_full for g in state.groups)
    state.post_forward()
    after = all(p is sharded[n] for n, p in layer.named_parameters())
    state.pre_forward()  # an eager call: the unsharded parameters go on the module
    unsharded = all(
        isinstance(p, nn.Parameter) and p is not sharded[n] for n, p in layer.named_parameters()
    )
    state.post_forward()
    back = all(p is sharded[n] for n, p in layer.named_parameters())
    return {
        "during": during,
        "gathered": gathered,
        "after": after,
        "unsharded": unsharded,
        "back": back,
    }


def test_replay_handlers_leave_the_sharded_parameters_on_the_module(two_ranks):
    for r in two_ranks["replay_handlers"]:
        assert r == {
            "during": True,
            "gathered": True,
            "after": True,
            "unsharded": True,
            "back": True,
        }
