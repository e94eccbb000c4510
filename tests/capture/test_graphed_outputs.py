"""Graphed modules may return Megatron-Core's ``(output, None)`` tuples: the graphs carry the
tensors, the replay puts the structure and the None leaves back (capture/torch_backend.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from graph_fsdp.capture.scopes import Target
from graph_fsdp.capture.torch_backend import CapturedCallable


def _cap() -> CapturedCallable:
    m = nn.Linear(2, 2)
    return CapturedCallable(Target("layer.mlp", m, m, "mlp"), m.forward)


@pytest.mark.parametrize(
    "make",
    [
        lambda a, b: a,
        lambda a, b: (a, None),
        lambda a, b: (a, b),
        lambda a, b: (None, a, (b, None)),
        lambda a, b: {"out": a, "bias": None, "ctx": [b]},
    ],
)
def test_outputs_round_trip_with_none_leaves(make) -> None:
    a, b = torch.randn(3), torch.randn(2)
    cap = _cap()
    flat = cap.split_outputs(make(a, b))
    assert all(isinstance(t, torch.Tensor) for t in flat)
    replayed = [t + 1 for t in flat]  # what a replay returns: other tensors, same order
    rebuilt = cap.join_outputs(list(replayed))
    expected = make(a + 1, b + 1)
    assert type(rebuilt) is type(expected)
    if isinstance(expected, torch.Tensor):
        assert torch.equal(rebuilt, expected)
    else:
        assert str(rebuilt) == str(expected)


def test_non_tensor_output_is_a_clear_error() -> None:
    cap = _cap()
    with pytest.raises(TypeError, match=r"layer\.mlp returns a object"):
        cap.split_outputs((torch.ones(1), object()))
