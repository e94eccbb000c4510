"""``--cuda-graph-scope``: Megatron's vocabulary, validation, and the modules each scope names.

No scope at all captures every FSDP unit below the root (a transformer layer) whole. Partial
scopes capture pieces of a layer and leave the rest eager - MoE dispatch has data-dependent
work, so ``moe_router`` (+ ``moe_preprocess``) graphs the routing and keeps experts eager.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from graph_fsdp.api import BufferPolicy

SCOPES = ("attn", "mlp", "moe", "moe_router", "moe_preprocess", "full_iteration")
"""Accepted scope names; an empty list means whole layers."""
GRAPH_IMPLS = ("none", "te", "torch")
MOE_SCOPES = ("moe", "moe_router", "moe_preprocess")

SCOPE_ATTRS: dict[str, tuple[str, ...]] = {
    "attn": ("self_attention",),
    "mlp": ("mlp", "layernorm_mlp"),
    "moe": ("moe",),
    "moe_router": ("moe.router",),
    "moe_preprocess": ("moe.preprocess",),
}
"""Attribute paths (relative to a layer) that a scope captures: the reference models'
names and TransformerEngine's ``TransformerLayer`` (``self_attention``, ``layernorm_mlp``)."""


class GraphConfigError(ValueError):
    """An invalid CUDA graph configuration; the message names the option to change."""


def scope_label(scopes: list[str] | tuple[str, ...]) -> str:
    return " ".join(scopes) if scopes else "layer"


def check_scopes(scopes: list[str] | tuple[str, ...], *, flag: str = "--cuda-graph-scope") -> None:
    """Reject unknown, repeated and conflicting scopes (model-independent rules)."""
    for s in scopes:
        if s not in SCOPES:
            raise GraphConfigError(
                f"{flag}: unknown scope {s!r}; accepted scopes are {', '.join(SCOPES)} "
                "(no scope at all captures the whole layer)"
            )
        if list(scopes).count(s) > 1:
            raise GraphConfigError(f"{flag}: scope {s!r} is given more than once; list it once")
    if "full_iteration" in scopes and len(scopes) > 1:
        others = " ".join(s for s in scopes if s != "full_iteration")
        raise GraphConfigError(
            f"{flag}: full_iteration captures the whole forward+backward and cannot be combined "
            f"with {others}; pass full_iteration alone, or only layer scopes"
        )
    if "moe_preprocess" in scopes and "moe_router" not in scopes:
        raise GraphConfigError(
            f"{flag}: moe_preprocess requires moe_router (the preprocess consumes the router's "
            f"captured outputs); add moe_router, e.g. {flag} moe_router moe_preprocess"
        )
    if "moe" in scopes and ("moe_router" in scopes or "moe_preprocess" in scopes):
        raise GraphConfigError(
            f"{flag}: moe already captures the whole MoE layer including its router; use either "
            "moe, or moe_router [moe_preprocess]"
        )


def check_static_buffers(
    policy: BufferPolicy, scopes: list[str] | tuple[str, ...], *, flag: str = "--cuda-graph-scope"
) -> None:
    """Layerwise graphs replay fixed addresses: FSDP's unsharded buffers must never move."""
    if "full_iteration" in scopes:
        return
    missing = []
    if policy.allocator == "dynamic":
        missing.append(
            "BufferPolicy(allocator='double_buffer') (--fsdp-double-buffer) or "
            "allocator='trace_pool' (--fsdp-trace-pool)"
        )
    if not policy.persist_on_alloc_fail:
        missing.append(
            "BufferPolicy(persist_on_alloc_fail=True) (--fsdp-db-use-persist-buf-on-alloc-fail)"
        )
    if missing:
        raise GraphConfigError(
            f"layerwise CUDA graphs ({flag} {scope_label(scopes)}) with FSDP replay fixed buffer "
            f"addresses, so FSDP's unsharded buffers must be static: set {' and '.join(missing)}"
        )


@dataclass
class Target:
    """One module to capture: its name, the module, and the FSDP unit whose weights it uses."""

    name: str
    module: nn.Module
    unit: nn.Module
    scope: str


def _lookup(layer: nn.Module, path: str) -> nn.Module | None:
    m: nn.Module | None = layer
    for part in path.split("."):
        m = getattr(m, part, None)
        if not isinstance(m, nn.Module):
            return None
    return m


def select_targets(
    units: list[tuple[str, nn.Module]],
    scopes: list[str] | tuple[str, ...],
    *,
    flag: str = "--cuda-graph-scope",
) -> list[Target]:
    """The modules ``scopes`` name inside each (non-root) FSDP unit, in unit order.

    ``units``: ``(fqn, module)`` of the units, in forward order. A scope that matches no
    module of the model is an error (a dense model asked for ``moe_router``, ...).
    """
    check_scopes(scopes, flag=flag)
    if "full_iteration" in scopes:
        raise GraphConfigError(
            f"{flag} full_iteration is not a layerwise scope; it is captured by the full-iteration "
            "path, not by per-module graphs"
        )
    if not units:
        raise GraphConfigError(
            "layerwise CUDA graphs capture the FSDP units below the root, but this model has "
            "none: fully_shard each transformer layer before the root"
        )
    if not scopes:
        return [Target(fqn, m, m, "layer") for fqn, m in units]
    targets, matched = [], set()
    for fqn, unit in units:
        for scope in scopes:
            for path in SCOPE_ATTRS[scope]:
                module = _lookup(unit, path)
                if module is None:
                    continue
                if scope == "mlp" and hasattr(module, "router"):
                    continue  # an MoE block under the name mlp: the moe scopes own it
                targets.append(Target(f"{fqn}.{path}", module, unit, scope))
                matched.add(scope)
                break
    missing = [s for s in scopes if s not in matched]
    if missing:
        hint = (
            "an MoE model (--num-experts) for moe scopes"
            if any(s in MOE_SCOPES for s in missing)
            else "dense layers for mlp"
        )
        raise GraphConfigError(
            f"{flag} {' '.join(missing)}: no module of the model matches (looked for "
            f"{', '.join(p for s in missing for p in SCOPE_ATTRS[s])} in every FSDP unit); "
            f"drop {' '.join(missing)} or use {hint}"
        )
    return targets
