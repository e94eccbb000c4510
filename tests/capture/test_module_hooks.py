"""Hook extraction, restore and transform: plain modules, and real fully_shard-ed units."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from graph_fsdp.capture.module_hooks import (
    CAPTURE_KEYS,
    FLAG_DICTS,
    HOOK_DICTS,
    capture_time_hooks,
    extract_module_hooks,
    has_hooks,
    restore_module_hooks,
    user_hook_count,
)
from graph_fsdp.fsdp.hook_markers import (
    BACKWARD_HANDLER,
    BACKWARD_PRE_HANDLER,
    CAPTURE_TIME_FN,
    mark,
)
from graph_fsdp.training.processes import spawn


def _snapshot(module: nn.Module) -> dict:
    return {name: list(getattr(module, name).items()) for name in (*HOOK_DICTS, *FLAG_DICTS)} | {
        "full": module._is_full_backward_hook
    }


def _hooked_linear(calls: list) -> tuple[nn.Linear, list]:
    m = nn.Linear(4, 4)
    handles = [
        m.register_forward_pre_hook(lambda mod, args: calls.append("pre")),
        m.register_forward_pre_hook(
            lambda mod, args, kwargs: calls.append("pre_kw"), with_kwargs=True, prepend=True
        ),
        m.register_forward_hook(lambda mod, args, out: calls.append("fwd")),
        m.register_forward_hook(
            lambda mod, args, kwargs, out: calls.append("fwd_kw"),
            with_kwargs=True,
            always_call=True,
        ),
        m.register_full_backward_pre_hook(lambda mod, gout: calls.append("bwd_pre")),
        m.register_full_backward_hook(lambda mod, gin, gout: calls.append("bwd")),
    ]
    return m, handles


def test_extract_clears_and_restore_puts_back_ids_order_and_flags():
    calls: list[str] = []
    m, handles = _hooked_linear(calls)
    before = _snapshot(m)
    saved = extract_module_hooks(m)
    assert not has_hooks(m) and len(saved) == 6
    assert all(not getattr(m, name) for name in FLAG_DICTS)
    m(torch.randn(2, 4, requires_grad=True)).sum().backward()
    assert calls == []  # nothing fires while extracted
    restore_module_hooks(saved)
    assert _snapshot(m) == before
    m(torch.randn(2, 4, requires_grad=True)).sum().backward()
    # prepend keeps pre_kw first; always_call/kwargs flags survive; full backward hooks fire.
    assert calls == ["pre_kw", "pre", "fwd", "fwd_kw", "bwd_pre", "bwd"]
    # Handles still address the restored dicts.
    for h in handles:
        h.remove()
    assert not has_hooks(m)


def test_saved_copy_is_independent_of_the_module():
    m, _ = _hooked_linear([])
    saved = extract_module_hooks(m)
    n_saved = len(saved)
    m.register_forward_hook(lambda *a: None)
    assert len(saved) == n_saved
    with pytest.raises(RuntimeError, match="got new hooks .* while its hooks were extracted"):
        restore_module_hooks(saved)


class _FakeState:
    """Our own sentinel logic on a stand-in owner (the real FSDP state is tested below)."""

    def __init__(self):
        self.calls: list[str] = []

    @mark(CAPTURE_TIME_FN, "on_pre")
    def pre_hook(self, module, args, kwargs):
        raise AssertionError("the hook itself must not run at capture time")

    @mark(BACKWARD_HANDLER, "on_post_backward")
    def registers_post_backward(self, module, args, kwargs):
        raise AssertionError("withheld")

    @mark(BACKWARD_PRE_HANDLER, "on_pre_backward")
    def registers_pre_backward(self, module, args, out):
        raise AssertionError("withheld")

    def on_pre(self):
        self.calls.append("pre")
        return "ignored"  # TE demands None from capture-time hooks: the adapter drops it

    def on_post_backward(self):
        self.calls.append("post_backward")

    def on_pre_backward(self):
        self.calls.append("pre_backward")


def test_transform_routes_sentinels_and_withholds_user_hooks():
    owner = _FakeState()
    m = nn.Linear(2, 2)
    h_pre = m.register_forward_pre_hook(owner.pre_hook, with_kwargs=True)
    h_post_bwd = m.register_forward_pre_hook(owner.registers_post_backward, with_kwargs=True)
    h_pre_bwd = m.register_forward_hook(owner.registers_pre_backward)
    m.register_forward_hook(lambda *a: None)  # a user hook
    saved = extract_module_hooks(m)
    hooks = capture_time_hooks(saved)
    assert tuple(hooks) == CAPTURE_KEYS
    assert list(hooks["forward_pre_hooks"]) == [h_pre.id]
    assert list(hooks["forward_hooks"]) == []
    assert list(hooks["backward_hooks"]) == [h_post_bwd.id]
    assert list(hooks["backward_pre_hooks"]) == [h_pre_bwd.id]
    assert user_hook_count(saved) == 1
    for key in CAPTURE_KEYS:
        for fn in hooks[key].values():
            assert fn(m) is None  # called as TE calls them: fn(module) -> None
    assert owner.calls == ["pre", "pre_backward", "post_backward"]  # CAPTURE_KEYS order
    restore_module_hooks(saved)


def test_sentinel_on_a_plain_function_is_an_error():
    def hook(module, args):
        return None

    hook._cuda_graph_backward_handler = "post_backward"
    m = nn.Linear(2, 2)
    m.register_forward_pre_hook(hook)
    with pytest.raises(TypeError, match="sentinel hooks must be methods"):
        capture_time_hooks(extract_module_hooks(m))


def _real_unit(rank: int, world: int) -> dict:
    from graph_fsdp import fully_shard
    from graph_fsdp.fsdp.state import TrainingState

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8))
    fully_shard(model[0])
    fully_shard(model[1])
    fully_shard(model)
    x = torch.randn(2, 8)
    model(x).sum().backward()  # lazy init, forward order
    unit, state = model[1], model[1]._fsdp_state
    user_calls = []
    unit.register_forward_hook(lambda *a: user_calls.append("user"))
    before = _snapshot(unit)
    saved = extract_module_hooks(unit)
    hooks = capture_time_hooks(saved)
    out = {"counts": {k: len(v) for k, v in hooks.items()}, "user": user_hook_count(saved)}
    bound = [fn.__wrapped__ for key in CAPTURE_KEYS for fn in hooks[key].values()]
    out["targets"] = [(b.__self__ is state, b.__name__) for b in bound]
    # Run them as TE would around one capture, twice (warmup iterations), with the
    # reduction skipped as during capture.
    with state.root.capture.layerwise_capture():
        for _ in range(2):
            for key in CAPTURE_KEYS:
                for fn in hooks[key].values():
                    fn(unit)
    out["state_after"] = state.training_state == TrainingState.IDLE
    restore_module_hooks(saved)
    out["restored"] = _snapshot(unit) == before
    model(x).sum().backward()
    out["user_calls"] = user_calls
    return out


def test_transform_of_a_fully_shard_unit_on_real_process_groups():
    res = spawn(_real_unit, 2)
    for r in res:
        assert r["counts"] == {
            "forward_pre_hooks": 1,
            "forward_hooks": 1,
            "backward_pre_hooks": 1,
            "backward_hooks": 1,
        }
        assert r["user"] == 1
        assert r["targets"] == [
            (True, "pre_forward"),
            (True, "post_forward"),
            (True, "capture_pre_backward"),
            (True, "capture_post_backward"),
        ]
        assert r["state_after"] and r["restored"]
        assert r["user_calls"] == ["user"]  # user hooks still fire after restore
