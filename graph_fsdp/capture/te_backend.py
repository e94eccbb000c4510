"""TransformerEngine backend: ``te.pytorch.make_graphed_callables`` (TE >= 2.19).

TE gets one small wrapper module per callable: the wrapper takes the recorded call's
tensors positionally (TE's sample_args must be tensors) and puts the non-tensor arguments
back, and it carries no hooks (TE refuses modules with hooks). FSDP's work around warmup and
capture travels in ``capture_time_hooks`` (hooks/module_hooks.py).
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_pre_hook

from graph_fsdp.capture.scopes import GraphConfigError
from graph_fsdp.capture.torch_backend import CapturedCallable, CaptureHooks

MIN_TE_VERSION = (2, 19)


def te_version() -> tuple[int, ...] | None:
    try:
        import transformer_engine  # noqa: PLC0415 (optional dependency)
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


# [Note: TE attention under capture] TransformerEngine's cuDNN fused attention has a known
# illegal memory access in its backward when it is captured into a CUDA graph with a key/value
# sequence length that is not a multiple of 128 (non-padding masks, BSHD/SBHD layouts) and
# cuDNN <= 9.15.0. TE works around it only inside its own make_graphed_callables, whose
# capture flag (is_graph_capturing) makes the backend selection skip fused attention there:
# the graphed attention then runs another backend (flash-attn, or TE's unfused attention)
# than the eager one, so graphed != eager by a few bf16 ulps. A torch capture sets no such
# flag, records the cuDNN backward, and the replay faults. Measured on 2x H200 (TE 2.20.2,
# Megatron-Core GPT, seq 64): te graphs differ from eager from the first graphed step on,
# torch graphs hit the illegal memory access; at seq 128 both are bit-exact. The check
# below refuses the crash up front and warns about the mismatch, naming the fixes: one
# attention backend for eager and graphed steps alike, a sequence length that is a multiple
# of 128, or cuDNN >= 9.15.1 for TE (which loads the system cuDNN first).

FUSED_ATTENTION_CAPTURE_CUDNN = (9, 15, 1)
"""The cuDNN from which TE's fused attention backward captures at any sequence length."""


def te_cudnn_version() -> tuple[int, int, int] | None:
    """The cuDNN TransformerEngine runs (it may differ from torch's), or None without TE."""
    try:
        from transformer_engine.pytorch.utils import get_cudnn_version  # noqa: PLC0415 (optional dependency)

        return tuple(int(v) for v in get_cudnn_version())
    except Exception:  # noqa: BLE001 - no TE, or a TE without the helper: nothing to check
        return None


GENERIC_ATTENTION_FIX = (
    "NVTE_FUSED_ATTN=0 in the environment (TE then runs flash-attn or its unfused attention "
    "in eager and graphed steps alike; Megatron-Core models: --attention-backend unfused)"
)
_warned: set[tuple] = set()
"""(sequence length, cuDNN) pairs already warned about in this process."""


def te_attention_backend_from_env() -> str:
    """The attention backend TE's NVTE_* switches leave (TE reads them at every selection;
    Megatron-Core's attention_backend sets them): "unfused" when cuDNN attention is off
    (NVTE_FUSED_ATTN=0), "fused" when it is the only one on, else "auto"."""
    if os.environ.get("NVTE_FUSED_ATTN") == "0":
        return "unfused"
    if os.environ.get("NVTE_FLASH_ATTN") == "0" and os.environ.get("NVTE_UNFUSED_ATTN") == "0":
        return "fused"
    return "auto"


def check_attention_capture(
    *,
    seq_length: int,
    impl: str,
    scopes: list[str],
    backend: str = "auto",
    fix: str = GENERIC_ATTENTION_FIX,
    where: str = "",
    cudnn: tuple[int, int, int] | None = None,
) -> str | None:
    """TE attention captured at ``seq_length`` ([Note: TE attention under capture]).

    ``impl``: "torch" or "te"; ``scopes``: the captured scopes ([] = whole layers; attn and
    full_iteration hold the attention too); ``backend``: the attention backend the model pins
    ("auto" lets TE choose, "fused" forces cuDNN); ``fix``: how this model gets one attention
    backend for eager and graphed steps; ``where``: the attention module, when known.
    ``cudnn``: TE's cuDNN (default: asked from TE). Raises GraphConfigError where the capture
    would crash or find no backend; warns (rank 0, once per process and shape) and returns
    the warning where graphed steps will differ from eager ones; else None.
    """
    captures_attention = not scopes or "attn" in scopes or "full_iteration" in scopes
    if not captures_attention or seq_length % 128 == 0 or backend not in ("auto", "fused"):
        return None
    cudnn = cudnn or te_cudnn_version()
    if cudnn is None or cudnn >= FUSED_ATTENTION_CAPTURE_CUDNN:
        return None
    version = ".".join(map(str, cudnn))
    fixes = (
        f"{fix}, a sequence length that is a multiple of 128, or cuDNN >= 9.15.1 for "
        "TransformerEngine (it loads the system cuDNN first: CUDNN_PATH / CUDNN_HOME)"
    )
    hazard = (
        f"TransformerEngine's cuDNN fused attention (cuDNN {version}"
        f"{f'; {where}' if where else ''}) cannot be captured at sequence length {seq_length} "
        "(not a multiple of 128): its backward faults with an illegal memory access under CUDA "
        "graph capture before cuDNN 9.15.1"
    )
    if impl == "torch" or "full_iteration" in scopes:
        raise GraphConfigError(
            f"{hazard}. Torch graphs would record it: use {fixes}, or leave attention out of "
            "the captured scopes"
        )
    if backend == "fused":
        raise GraphConfigError(
            f"{hazard}, and the attention backend is pinned to fused, so TE's capture finds no "
            f"backend: use {fixes}"
        )
    warning = (
        f"{hazard}; TE's graphs run another attention backend than eager steps do, so graphed "
        f"steps will not be bit-identical to eager ones. For bit-exact graphs use {fixes}"
    )
    rank0 = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
    if rank0 and (seq_length, cudnn) not in _warned:
        _warned.add((seq_length, cudnn))
        warnings.warn(warning, stacklevel=3)
    return warning


@contextmanager
def attention_capture_guard(impl: str, names: dict[int, str]) -> Iterator[None]:
    """While a capture's warmup and capture run: every TransformerEngine DotProductAttention
    call (Megatron's TEDotProductAttention too) is checked with check_attention_capture at
    the key/value sequence length of its inputs - for any model, whatever its scopes say.
    ``names``: ``{id(module): fqn}`` for the messages. A model without TE is untouched."""
    te = sys.modules.get("transformer_engine.pytorch")
    attention = getattr(te, "DotProductAttention", None)
    if not isinstance(attention, type):
        yield
        return

    def check(module: nn.Module, args: tuple) -> None:
        if isinstance(module, attention):
            seq = attention_kv_length(module, args)
            if seq is not None:
                where = names.get(id(module), type(module).__name__)
                check_attention_capture(
                    seq_length=seq,
                    impl=impl,
                    scopes=["attn"],
                    backend=te_attention_backend_from_env(),
                    where=where,
                )

    handle = register_module_forward_pre_hook(check)
    try:
        yield
    finally:
        handle.remove()


def attention_kv_length(module: nn.Module, args: tuple) -> int | None:
    """The key/value sequence length of a DotProductAttention call ``module(q, k, v, ...)``,
    or None where TE's capture guard does not apply (padding masks, the packed thd layout)
    or the call passes no key tensor positionally."""
    key = args[1] if len(args) > 1 else None
    mask = str(getattr(module, "attn_mask_type", ""))
    layout = str(getattr(module, "qkv_format", "sbhd"))
    if not isinstance(key, torch.Tensor) or "padding" in mask or "thd" in layout:
        return None
    kv_layout = layout.split("_2")[-1]  # "sbhd_2bshd": queries sbhd, keys/values bshd
    if "s" not in kv_layout or key.dim() != len(kv_layout):
        return None
    return int(key.shape[kv_layout.index("s")])


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
        if cap.tracker is not None:  # capture-failure diagnosis (diagnosis.py)
            with cap.tracker.phase(cap.name, "forward"):
                out = cap.orig_forward(*args, **kwargs)
        else:
            out = cap.orig_forward(*args, **kwargs)
        tensors_out = cap.split_outputs(out)
        # TE graphs tensors only: non-tensor outputs (None, ...) are put back at replay.
        return tuple(tensors_out) if cap.out_has_consts else out


def capture_te(
    caps: list[CapturedCallable], hooks: list[CaptureHooks], *, warmup_iters: int, pool
) -> None:
    from transformer_engine.pytorch import make_graphed_callables  # noqa: PLC0415 (optional dependency)

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
