"""Megatron-Core's ``--cuda-graph-scope`` for graph_fsdp's Megatron-Core GPTs: which scopes a
model can capture (with the module and setting behind every refusal), and ``MoELayer``'s
``preprocess`` as a module to capture. Needs no megatron-core (the CLI checks configs with it).

The scopes resolve through graph_fsdp's generic presets
(:data:`~graph_fsdp.capture.scopes.SCOPE_PRESETS`, their Megatron-Core entries:
:data:`MCORE_SCOPE_MODULES`); ``megatron.make_graphs`` builds the graphs.
"""

from __future__ import annotations

import torch
from torch import nn

from graph_fsdp.capture.scopes import SCOPE_PRESETS, GraphConfigError, check_scopes
from graph_fsdp.capture.te_backend import check_attention_capture
from graph_fsdp.cuda_streams import stream_capturing
from graph_fsdp.integrations.megatron.config import MCoreGPTConfig

MCORE_SCOPE_MODULES: dict[str, str] = {
    scope: next(p.path for p in paths if "Megatron-Core" in p.family)
    for scope, paths in SCOPE_PRESETS.items()
}
"""Scope -> submodule of a Megatron-Core ``TransformerLayer``: the Megatron-Core entries of
graph_fsdp's generic :data:`~graph_fsdp.capture.scopes.SCOPE_PRESETS` (``attn`` = the
attention block ``SelfAttention``; ``mlp`` = a dense ``MLP``; ``moe`` = the ``MoELayer``;
``moe_router`` = its ``TopKRouter``; ``moe_preprocess`` = ``MoELayer.preprocess``, a method,
made a module by :class:`MoEPreprocess` - :func:`install_moe_preprocess`)."""


def _is_moe_layer(layer: nn.Module) -> bool:
    return hasattr(getattr(layer, "mlp", None), "router")


def check_mcore_scopes(cfg: MCoreGPTConfig, scopes: list[str] | tuple[str, ...]) -> list[str]:
    """Megatron's scopes this model can capture; clear errors for the others.

    The expert part of an MoE layer (captured by the whole layer, ``moe`` and
    ``full_iteration``) needs no host sync with drop-padding through the alltoall dispatcher
    (static expert shapes) or with graph_fsdp's ``grouped_mm`` experts (device token counts);
    Megatron's dropless experts copy their token counts to the host, so there
    :func:`moe_expert_capture_refusal` refuses, and ``attn`` / ``moe_router``
    [``moe_preprocess``] are the capturable parts, as in Megatron. The same holds at
    expert_model_parallel_size > 1: drop-padding's all-to-all exchanges equal, capacity-sized
    splits (captured whole), Megatron's dropless one needs its split sizes on the host, and the
    grouped_mm experts' exchange has fixed-size blocks and device offsets (captured whole).
    """
    scopes = list(scopes)
    check_scopes(scopes)
    _check_layer_kinds(cfg, scopes)
    if not cfg.is_moe:
        return scopes
    if not scopes or "moe" in scopes or "full_iteration" in scopes:
        refusal = moe_expert_capture_refusal(cfg)
        if refusal:
            what = (
                "the whole layer" if not scopes else "moe" if "moe" in scopes else "full_iteration"
            )
            raise GraphConfigError(f"--cuda-graph-scope {what}: {refusal}")
    if "moe_preprocess" in scopes and (
        cfg.moe_experts_impl == "grouped_mm" or cfg.moe_expert_capacity_factor is not None
    ):
        why = (
            "the grouped_mm experts' dispatch has no host sync to split off: capture moe or the "
            "whole layer instead"
            if cfg.moe_experts_impl == "grouped_mm"
            else "with a capacity factor, capture moe or the whole layer with drop-padding "
            "(moe_pad_expert_input_to_capacity=True) instead"
        )
        raise GraphConfigError(
            "--cuda-graph-scope moe_preprocess graphs the preprocess of Megatron's dropless "
            f"alltoall dispatcher apart from its host-syncing dispatch; {why}"
        )
    return scopes


_SCOPE_LAYERS = {"attn": "*", "mlp": "-", "moe": "E", "moe_router": "E", "moe_preprocess": "E"}
"""The layer kind (a hybrid pattern's character) each partial scope captures a part of."""


def _check_layer_kinds(cfg: MCoreGPTConfig, scopes: list[str]) -> None:
    """Partial scopes whose layer kind the model does not have."""
    absent = [s for s in scopes if s in _SCOPE_LAYERS and not cfg.has_layers(_SCOPE_LAYERS[s])]
    if not absent:
        return
    if cfg.is_hybrid:
        kinds = ", ".join(f"{s} needs '{_SCOPE_LAYERS[s]}' layers" for s in absent)
        raise GraphConfigError(
            f"--cuda-graph-scope {' '.join(absent)}: the hybrid pattern "
            f"{cfg.hybrid_layer_pattern!r} has no such layer ({kinds}); drop "
            f"{'it' if len(absent) == 1 else 'them'}, or capture the whole layer or "
            "full_iteration"
        )
    if "mlp" in absent:
        raise GraphConfigError(
            "--cuda-graph-scope mlp: every layer of this Megatron-Core MoE GPT is an MoELayer, "
            "so there is no dense MLP to capture; use moe_router"
        )
    raise GraphConfigError(
        f"--cuda-graph-scope {' '.join(absent)} needs an MoE model (--num-experts N), but "
        "this GPT is dense; use attn, mlp, the whole layer or full_iteration"
    )


_DROPLESS_SYNC = {
    "alltoall": "MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize, token_dispatcher.py",
    "allgather": "MoEAllGatherTokenDispatcher.dispatch_postprocess: tokens_per_expert.cpu()",
    "flex": "MoEFlexTokenDispatcher and its DeepEP / HybridEP buffers",
}


def moe_expert_capture_refusal(cfg: MCoreGPTConfig) -> str | None:
    """Why a CUDA graph cannot hold the expert part of ``cfg``'s MoE layers (None: it can),
    naming the Megatron module that syncs and the settings that avoid it."""
    if cfg.moe_experts_impl == "grouped_mm":
        return None  # device token counts, fixed-size exchanges: megatron/moe.py
    factor, dispatcher = cfg.moe_expert_capacity_factor, cfg.moe_token_dispatcher_type
    ep = cfg.expert_model_parallel_size
    if factor is None and ep > 1:
        return (
            f"MoE layers with Megatron's dropless {dispatcher} dispatcher at "
            f"expert_model_parallel_size={ep} copy tokens_per_expert and the all-to-all's "
            f"per-rank split sizes to the host ({_DROPLESS_SYNC[dispatcher]}): a host sync "
            "with data-dependent shapes, which a CUDA graph cannot hold. Capture the experts "
            "with drop-padding (moe_expert_capacity_factor=1.0 and "
            "moe_pad_expert_input_to_capacity=True: equal, capacity-sized all-to-all splits; "
            "drops the tokens over capacity), or capture the parts before the dispatch instead: "
            "--cuda-graph-scope attn moe_router (alltoall: also moe_preprocess); or keep them "
            "dropless with graph_fsdp's experts (moe_experts_impl='grouped_mm': device token "
            "counts, fixed-size all-to-alls over the EP group), captured whole"
        )
    if factor is None:
        return (
            f"MoE layers with Megatron's dropless {dispatcher} dispatcher copy tokens_per_expert "
            f"to the host for the experts' split sizes ({_DROPLESS_SYNC[dispatcher]}): a host "
            "sync with data-dependent shapes, which a CUDA graph cannot hold. Capture the experts "
            "with graph_fsdp's dropless experts (moe_experts_impl='grouped_mm': device token "
            "counts, torch._grouped_mm) or with drop-padding (moe_expert_capacity_factor=1.0 and "
            "moe_pad_expert_input_to_capacity=True; drops the tokens over capacity), or capture "
            "the parts before the dispatch instead: --cuda-graph-scope attn moe_router"
        )
    if not cfg.moe_pad_expert_input_to_capacity:
        return (
            f"moe_expert_capacity_factor={factor} without moe_pad_expert_input_to_capacity drops "
            "tokens to a data-dependent count, which MoEAlltoAllTokenDispatcher.preprocess sums "
            "on the device and the permutation waits for on the host (_maybe_dtoh_and_synchronize,"
            " a host sync): set moe_pad_expert_input_to_capacity=True (static expert inputs)"
        )
    if dispatcher != "alltoall":
        return (
            f"the {dispatcher} token dispatcher syncs with the host even with drop-padding "
            f"({_DROPLESS_SYNC[dispatcher]}, .item()): use moe_token_dispatcher_type='alltoall'"
        )
    return None


class MoEPreprocess(nn.Module):
    """``MoELayer.preprocess`` as a module: the ``moe_preprocess`` scope's graph target.

    The alltoall dispatcher's preprocess (token counts, the permutation map, the permuted
    tokens and probs) keeps its results as Python attributes of the dispatcher, read later
    by the eager dispatch/combine - a replayed graph would leave them stale. As Megatron does
    for its own moe_preprocess graphs, the tensors among them are graph *outputs*
    (:data:`PREPROCESS_TENSORS`) put back on the dispatcher after every call, and the
    non-tensor ones (shapes, the dropless output size) are restored from the capture (a
    replay only runs for calls with the captured shapes). The host copy of the token counts
    moves from the preprocess to the (eager) dispatch: ``cuda_dtoh_point =
    "before_ep_alltoall"``, Megatron's setting when moe_preprocess is graphed.

    Which of :data:`PREPROCESS_TENSORS` the preprocess sets depends on the configuration (the
    all-to-all split sizes only at EP > 1, the per-local-expert counts only with several local
    experts): each eager or captured call records the names it returns, and a replay puts its
    outputs back under the names recorded at its capture.
    """

    def __init__(self, moe: nn.Module) -> None:
        super().__init__()
        self._moe = [moe]  # a list: not a submodule (no second path to its parameters)
        self._ran = False
        self._capture_consts: dict | None = None
        self._tensor_names: tuple[str, ...] = ()

    def forward(self, hidden_states, probs, routing_map):
        moe = self._moe[0]
        self._ran = True
        hidden_states, probs = type(moe).preprocess(moe, hidden_states, probs, routing_map)
        disp = moe.token_dispatcher
        names = tuple(a for a in PREPROCESS_TENSORS if torch.is_tensor(getattr(disp, a, None)))
        self._tensor_names = names
        if stream_capturing():
            self._capture_consts = {a: getattr(disp, a) for a in PREPROCESS_CONSTS}
        return hidden_states, probs, tuple(getattr(disp, a) for a in names)

    def __call__(self, hidden_states, probs, routing_map):
        self._ran = False
        out, out_probs, tensors = super().__call__(hidden_states, probs, routing_map)
        disp = self._moe[0].token_dispatcher
        if len(tensors) != len(self._tensor_names):
            raise RuntimeError(
                f"MoEPreprocess: {len(tensors)} dispatcher tensors came back for the names "
                f"{self._tensor_names} recorded at capture"
            )
        for name, t in zip(self._tensor_names, tensors):
            setattr(disp, name, t)
        if not self._ran:  # replayed: the Python side of the preprocess did not run
            if self._capture_consts is None:
                raise RuntimeError("MoEPreprocess replayed before it was captured")
            for name, value in self._capture_consts.items():
                setattr(disp, name, value)
            disp.probs, disp.routing_map = probs, routing_map
        return out, out_probs


PREPROCESS_TENSORS = (
    "tokens_per_expert",
    "num_global_tokens_per_local_expert",
    "reversed_local_input_permutation_mapping",
    "input_splits",
    "output_splits",
    "output_splits_tp",
)
"""Tensor attributes the alltoall dispatcher's preprocess sets and dispatch/combine read
(the last three, the all-to-all's split sizes, at expert_model_parallel_size > 1)."""
PREPROCESS_CONSTS = ("hidden_shape", "hidden_shape_before_permute", "num_out_tokens")
"""Non-tensor attributes it sets (fixed for the captured shapes)."""


def install_moe_preprocess(lm: nn.Module) -> int:
    """Put a :class:`MoEPreprocess` in place of every MoELayer's ``preprocess`` method, so that
    the ``moe_preprocess`` scope's preset (``mlp.preprocess``) finds a module to capture, and
    make the alltoall dispatcher copy its token counts to the host at the (eager) dispatch
    (``cuda_dtoh_point = "before_ep_alltoall"``). Returns the number of layers changed.

    An instance attribute (``object.__setattr__``), not a registered submodule: MoELayer's
    forward calls ``self.preprocess(...)``, which now reaches the module, while parameter names,
    state dicts and checkpoints keep Megatron's (``decoder.layers.N.mlp.*``). Idempotent.
    """
    changed = 0
    for layer in lm.module.decoder.layers:
        if not _is_moe_layer(layer):
            continue
        moe = layer.mlp
        if isinstance(moe.__dict__.get("preprocess"), MoEPreprocess):
            continue
        disp = moe.token_dispatcher
        if not hasattr(disp, "cuda_dtoh_point"):
            raise GraphConfigError(
                f"--cuda-graph-scope moe_preprocess supports the alltoall token dispatcher, "
                f"not {type(disp).__name__}; use moe_token_dispatcher_type='alltoall'"
            )
        disp.cuda_dtoh_point = "before_ep_alltoall"
        object.__setattr__(moe, "preprocess", MoEPreprocess(moe))
        changed += 1
    return changed


def check_mcore_attention_capture(cfg: MCoreGPTConfig, impl: str, scopes: list[str]) -> None:
    """TE attention in the captured scopes at a sequence length TE's cuDNN attention cannot
    be captured at (te_backend.py [Note: TE attention under capture])."""
    if cfg.transformer_impl == "transformer_engine":
        check_attention_capture(
            seq_length=cfg.seq_length,
            impl=impl,
            scopes=scopes,
            backend=cfg.attention_backend,
            fix="--attention-backend unfused (attention_backend='unfused'; or flash, with "
            "flash-attn installed)",
        )
