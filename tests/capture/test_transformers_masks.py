"""transformers' attention-mask decisions under a capture, made as in eager (CPU unit test).

What a CUDA graph capture changes for transformers is the answer of
``torch.cuda.is_current_stream_capturing()``; here it is forced to True around a CPU forward
(a stand-in for a capture: the real one, bit-exact on a GPU, is
tests/capture/test_safe_defaults_gpu.py). Checked: without :func:`eager_mask_decisions` the
decoder layers get a materialised 4-D mask where eager gets none; with it they get exactly
eager's mask and the loss is bit-identical, and the forward reads no tensor value on the host
(which a real capture could not); a mask the model builds itself (OPT) keeps the capture's
choice; a call that passes position ids keeps transformers' own behaviour; masking_utils is
restored afterwards.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from graph_fsdp.capture.transformers_masks import eager_mask_decisions
from graph_fsdp.models.hf import hf_decoder, hf_decoder_layers, hf_family_available

masking_utils = pytest.importorskip("transformers.masking_utils")

SEQ, VOCAB = 64, 64


def _model(family: str):
    return hf_decoder(family, vocab=VOCAB, hidden=32, intermediate=64, layers=2, heads=4, seq=SEQ)


_HOST_READS = (
    torch.ops.aten._local_scalar_dense.default,
    torch.ops.aten.is_nonzero.default,
    torch.ops.aten.item.default,
)


class _HostReads(TorchDispatchMode):
    """Counts the ops that read a tensor's value on the host (.item(), bool(tensor))."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func in _HOST_READS
        return func(*args, **(kwargs or {}))


class _MaskProbe:
    """The attention mask the first decoder layer receives."""

    def __init__(self, model) -> None:
        self.model, self.masks = model, []
        hf_decoder_layers(model)[0].register_forward_pre_hook(self._seen, with_kwargs=True)

    def _seen(self, module, args, kwargs) -> None:
        self.masks.append(kwargs.get("attention_mask"))

    def __call__(self, x: torch.Tensor, **kwargs):
        self.masks.clear()
        with _HostReads() as reads:
            loss = self.model(input_ids=x, labels=x, use_cache=False, **kwargs).loss
        self.host_reads = reads.count
        return loss, self.masks[0]


@pytest.fixture
def capturing(monkeypatch):
    """``is_current_stream_capturing()`` answers True, as inside a capture."""

    def force(on: bool) -> None:
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: on)

    return force


def _same_mask(a, b) -> bool:
    return (a is None and b is None) or (
        isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    )


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3_text", "opt"])
def test_capture_time_mask_is_eagers(family: str, capturing) -> None:
    if not hf_family_available(family):
        pytest.skip(f"transformers has no {family}")
    probe = _MaskProbe(_model(family).eval())  # eval: OPT's dropout
    x = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    eager_loss, eager_mask = probe(x)
    originals = (masking_utils.is_tracing, masking_utils.find_packed_sequence_indices)
    capturing(True)
    _, captured_mask = probe(x)
    if family == "llama":  # the premise: transformers builds another mask under a capture
        assert eager_mask is None and isinstance(captured_mask, torch.Tensor)
    with eager_mask_decisions(probe.model):
        loss, mask = probe(x)
        assert probe.host_reads == 0, "a capture would fail on a host read"
        if family == "opt":  # it builds a 2-D mask itself: reading it needs the host
            assert _same_mask(mask, captured_mask), (mask, captured_mask)
        else:
            assert _same_mask(mask, eager_mask), (mask, eager_mask)
            assert torch.equal(loss, eager_loss)
        if family != "opt":  # position ids given: packed rows are data; transformers decides
            _, given = probe(x, position_ids=torch.arange(SEQ)[None])
            assert isinstance(given, torch.Tensor)
    capturing(False)
    assert (masking_utils.is_tracing, masking_utils.find_packed_sequence_indices) == originals


def test_other_models_are_untouched() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    before = masking_utils.is_tracing
    with eager_mask_decisions(model):
        assert masking_utils.is_tracing is before
        assert not model[0]._forward_pre_hooks
