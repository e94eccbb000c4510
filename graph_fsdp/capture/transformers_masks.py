"""HuggingFace transformers' attention-mask decisions, made under a full-iteration capture as
in an eager step.

[Note: transformers masks under capture] transformers builds a decoder's attention mask in
``transformers.masking_utils``. In an eager step without a padding mask and with the position
ids the model makes itself (``arange``: one sequence per row), it decides that no mask is
needed and SDPA runs with ``is_causal=True`` (flash attention). Two of those decisions read
tensor values on the host, so while a CUDA graph is captured (``is_tracing()`` is then True)
transformers takes the conservative branch instead: it treats the rows as possibly packed
(``find_packed_sequence_indices`` returns sequence ids, not None) and, up to 5.17, never skips
the mask (``_ignore_causal_mask_sdpa``). The captured step then materialises a 4-D mask and
runs another attention kernel than eager: other numbers, and slower. For a model call given
neither ``attention_mask`` nor ``position_ids`` the eager answers do not depend on data, so
during that call :func:`eager_mask_decisions` gives masking_utils the eager answers:
``is_tracing()`` without a tensor evaluated as if no stream were capturing (what it guards
then reads nothing from the device: there is no padding mask) and
``find_packed_sequence_indices`` returning None (position ids from ``arange`` are never
packed). ``is_tracing(tensor)`` keeps the capture's answer: a mask the model builds itself
(OPT's 2-D mask of ones) would be read on the host next, which a capture cannot do. A call that passes either keeps transformers'
behaviour (padding or packed positions are data the graph must read at replay; the
verification step reports a difference, if any). Host-side only: nothing of it enters the
graph. Works with transformers 5.17 through 5.23 (both names exist there); without them, or
without transformers, nothing changes.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

_DECISIONS = ("is_tracing", "find_packed_sequence_indices")
"""masking_utils' functions whose capture-time answers differ from eager ones."""


def _masking_utils():
    """transformers.masking_utils when the process uses transformers and it has the
    functions the note names; else None."""
    module = sys.modules.get("transformers.masking_utils")
    if module is None or not all(callable(getattr(module, n, None)) for n in _DECISIONS):
        return None
    return module


def _is_transformers_model(module: nn.Module) -> bool:
    return any(
        c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers")
        for c in type(module).__mro__
    )


def _not_capturing() -> bool:
    return False


class _EagerDecisions:
    """Hooks on the transformers models of a captured model: the outermost call given no
    mask and no position ids swaps masking_utils' decisions for the eager ones until it
    returns."""

    def __init__(self, masking_utils) -> None:
        self.mu = masking_utils
        self.depth = 0
        self.originals: dict[str, object] = {}

    def enter(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self.depth += 1
        if self.depth > 1:
            return  # an inner model (e.g. LlamaModel in LlamaForCausalLM): the outer decided
        # forward(input_ids, attention_mask, position_ids, ...): only input_ids positional
        given = len(args) > 1 or any(kwargs.get(k) is not None for k in _DATA_KWARGS)
        if not given:
            self._swap()

    def leave(self, module: nn.Module, args: tuple, output) -> None:
        self.depth -= 1
        if self.depth == 0:
            self.restore()

    def _swap(self) -> None:
        is_tracing = self.mu.is_tracing

        def eager_is_tracing(tensor=None):
            if tensor is not None:  # a mask's values would be read next: capture's answer
                return is_tracing(tensor)
            saved = torch.cuda.is_current_stream_capturing
            torch.cuda.is_current_stream_capturing = _not_capturing
            try:
                return is_tracing(tensor)
            finally:
                torch.cuda.is_current_stream_capturing = saved

        def one_sequence_per_row(*args, **kwargs) -> None:
            return None

        self.originals = {n: getattr(self.mu, n) for n in _DECISIONS}
        self.mu.is_tracing = eager_is_tracing
        self.mu.find_packed_sequence_indices = one_sequence_per_row

    def restore(self) -> None:
        for name, original in self.originals.items():
            setattr(self.mu, name, original)
        self.originals = {}


_DATA_KWARGS = ("attention_mask", "position_ids")
"""Model-call arguments that carry data the mask depends on."""


@contextmanager
def eager_mask_decisions(model: nn.Module) -> Iterator[None]:
    """During the block, calls of ``model``'s transformers models without a padding mask and
    position ids build their attention mask as an eager step does ([Note: transformers masks
    under capture]). No-op for other models."""
    mu = _masking_utils()
    roots = [m for m in model.modules() if _is_transformers_model(m)] if mu else []
    if not roots:
        yield
        return
    decisions = _EagerDecisions(mu)
    handles = []
    for m in roots:
        handles.append(m.register_forward_pre_hook(decisions.enter, with_kwargs=True))
        handles.append(m.register_forward_hook(decisions.leave, always_call=True))
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        decisions.restore()
