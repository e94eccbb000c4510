"""TransformerEngine backend: ``te.pytorch.make_graphed_callables`` (TE >= 2.19).

TE gets one small wrapper module per callable: the wrapper takes the recorded call's
tensors positionally (TE's sample_args must be tensors) and puts the non-tensor arguments
back, and it carries no hooks (TE refuses modules with hooks). FSDP's work around warmup and
capture travels in ``capture_time_hooks`` (hooks/module_hooks.py).
"""

from __future__ import annotations

import torch
from torch import nn

from graph_fsdp.capture.graphed import CapturedCallable, CaptureHooks

MIN_TE_VERSION = (2, 19)


def te_version() -> tuple[int, ...] | None:
    try:
        import transformer_engine  # noqa: PLC0415
    except ImportError:
        return None
    parts = []
    for p in transformer_engine.__version__.split(".")[:3]:
        digits = "".join(ch for ch in p if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def require_te() -> None:
    version = te_version()
    if version is None:
        raise ImportError(
            "cuda_graph_impl='te' needs TransformerEngine >= 2.19, which is not importable: "
            "pip install graph-fsdp[te], or use cuda_graph_impl='torch' (--cuda-graph-impl torch)"
        )
    if version[:2] < MIN_TE_VERSION:
        raise ImportError(
            f"cuda_graph_impl='te' needs TransformerEngine >= 2.19 (capture_time_hooks), found "
            f"{'.'.join(map(str, version))}: upgrade it or use cuda_graph_impl='torch'"
        )


class _Positional(nn.Module):
    """Calls the captured module's original forward from positional tensors."""

    def __init__(self, cap: CapturedCallable) -> None:
        super().__init__()
        self.inner = cap.module
        self._cap = [cap]  # not a submodule attribute

    def forward(self, *tensors: torch.Tensor):
        cap = self._cap[0]
        args, kwargs = cap.signature.rebuild(list(tensors))
        return cap.orig_forward(*args, **kwargs)


def capture_te(
    caps: list[CapturedCallable], hooks: list[CaptureHooks], *, warmup_iters: int, pool
) -> None:
    from transformer_engine.pytorch import make_graphed_callables  # noqa: PLC0415

    wrappers = tuple(_Positional(cap) for cap in caps)
    graphed = make_graphed_callables(
        wrappers,
        tuple(tuple(cap.static_inputs) for cap in caps),
        num_warmup_iters=warmup_iters,
        allow_unused_input=True,
        pool=pool,
        capture_time_hooks=hooks,
        # The params' .grad is always preset (FSDP's zeroed grad_full views), so
        # AccumulateGrad adds the returned static buffer in place and never keeps it.
        clone_param_grads_on_return=False,
    )
    if not isinstance(graphed, tuple):
        graphed = (graphed,)
    for cap, g in zip(caps, graphed):
        cap.te_callable = g
