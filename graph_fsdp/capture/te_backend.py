"""TransformerEngine backend: ``te.pytorch.make_graphed_callables`` (TE >= 2.19).

TE gets one small wrapper module per callable: the wrapper takes the recorded call's
tensors positionally (TE's sample_args must be tensors) and puts the non-tensor arguments
back, and it carries no hooks (TE refuses modules with hooks). FSDP's work around warmup and
capture travels in ``capture_time_hooks`` (hooks/module_hooks.py).
"""

from __future__ import annotations

import importlib.util

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


def preload_te() -> None:
    """Import TransformerEngine (if installed) before this process does any CUDA work.

    TE loads the system cuDNN libraries; imported after torch has loaded its own cuDNN
    (by a first attention kernel) it fails with an undefined cuDNN symbol - measured on the
    GPU host, where the bench's TE and megatron_fsdp rows ran after eager rows. Every CUDA
    rank the CLI or the tests start calls this first. An installed but broken TE is left
    for the code that needs it to report.
    """
    if importlib.util.find_spec("transformer_engine") is None:
        return
    try:
        import transformer_engine.pytorch  # noqa: F401, PLC0415
    except (ImportError, OSError):
        pass


class _Positional(nn.Module):
    """What TE captures for one callable: the original forward, called from positional
    tensors (TE's sample_args must be tensors), with the non-tensor arguments put back.

    [Note: TE parameter gradients] TE passes a callable's ``parameters()`` to its replay
    Function as extra inputs and returns their gradients, which autograd's AccumulateGrad
    then adds eagerly - in the nodes TE's capture created and keeps alive, bound to the
    capture stream. Measured on 2x H200 with that path: losses left eager within the first
    replayed steps, and making the reduce-scatter also wait for the streams those adds ran
    on did not fix it. This wrapper shows TE no parameters, so TE's
    backward capture (``torch.autograd.backward``) accumulates them *inside* the graph into
    FSDP's preset ``grad_full`` views - the torch backend's contract ([Note: gradients of
    graphed modules]), bit-identical to eager. The module stays a submodule, so TE still
    finds the TE layers in it (FP8 metadata, delayed wgrad). The last positional input is
    an anchor leaf that requires grad and is never read: the replay's outputs require grad
    (its backward replays) even when no recorded input does.
    """

    def __init__(self, cap: CapturedCallable) -> None:
        super().__init__()
        self.inner = cap.module
        self._cap = [cap]  # not a submodule attribute

    def parameters(self, recurse: bool = True):
        return iter(())

    def forward(self, *tensors: torch.Tensor):
        cap = self._cap[0]
        args, kwargs = cap.signature.rebuild(list(tensors[:-1]))  # tensors[-1]: the anchor
        # TE sees a flat tuple of tensors; the replay puts the structure (and the None
        # leaves Megatron-Core modules return) back (CapturedCallable.unflatten).
        return tuple(cap.flatten_outputs(cap.orig_forward(*args, **kwargs)))


def capture_te(
    caps: list[CapturedCallable], hooks: list[CaptureHooks], *, warmup_iters: int, pool
) -> None:
    from transformer_engine.pytorch import make_graphed_callables  # noqa: PLC0415

    wrappers = tuple(_Positional(cap) for cap in caps)
    for cap in caps:
        cap.te_anchor = torch.zeros(1, device=cap.static_inputs[0].device, requires_grad=True)
    graphed = make_graphed_callables(
        wrappers,
        tuple((*cap.static_inputs, cap.te_anchor) for cap in caps),
        num_warmup_iters=warmup_iters,
        allow_unused_input=True,  # the anchor, and inputs a callable does not differentiate
        pool=pool,
        capture_time_hooks=hooks,
    )
    if not isinstance(graphed, tuple):
        graphed = (graphed,)
    for cap, g in zip(caps, graphed):
        cap.te_callable = g
