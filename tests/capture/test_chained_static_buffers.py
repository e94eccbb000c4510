"""Which static buffers the torch backend chains ([Note: chained static buffers],
capture/graphed.py): a callable's recorded input that *was* the previous callable's output
(same address, shape, stride, dtype) is read in place; anything else keeps its own buffer.
The replay side needs a GPU (tests/gpu/test_cuda_graphs_gpu.py, bit-exact with eager)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from graph_fsdp.capture.graphed import CallSignature, _chain


def _prev(outputs, recorded):
    return SimpleNamespace(
        static_outputs=outputs, recorded_output_ptrs=[t.data_ptr() for t in recorded]
    )


def _cap(recorded_args, static_inputs):
    return SimpleNamespace(signature=CallSignature(recorded_args, {}), static_inputs=static_inputs)


def test_an_input_that_was_the_previous_output_is_chained():
    h = torch.randn(2, 4, 8)
    mask = torch.ones(2, 4)
    prev = _prev([torch.empty(2, 4, 8)], [h])
    cap = _cap((mask, h), [torch.empty(2, 4), torch.empty(2, 4, 8)])
    assert _chain(prev, cap) == ((1, 0),)


def test_views_other_layouts_and_unrelated_tensors_are_not_chained():
    h = torch.randn(2, 4, 8)
    prev = _prev([torch.empty(2, 4, 8)], [h])
    # The same address, another shape (a view of the output): its own buffer.
    view = h[:, :2]
    assert _chain(prev, _cap((view,), [torch.empty(2, 2, 8)])) == ()
    # Another tensor of the same shape.
    assert _chain(prev, _cap((torch.randn(2, 4, 8),), [torch.empty(2, 4, 8)])) == ()
    # The same tensor, but the static buffers disagree in dtype.
    assert _chain(prev, _cap((h,), [torch.empty(2, 4, 8, dtype=torch.float64)])) == ()
