"""``--cuda-graph-scope``: Megatron's vocabulary, validation, and the modules each scope names.

No scope at all captures every FSDP unit below the root (a transformer layer) whole. Partial
scopes capture pieces of a layer and leave the rest eager - MoE dispatch has data-dependent
work, so ``moe_router`` (+ ``moe_preprocess``) graphs the routing and keeps experts eager.

Which submodule a scope names depends on the model family: :data:`SCOPE_PRESETS` knows
graph_fsdp's models, TransformerEngine, Megatron-Core and HuggingFace decoder layers, and a
user's ``scope_modules`` (``{"attn": "attention"}``) replaces a scope's presets or defines a
new scope. A scope that matches nothing is an error listing the units' children.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from torch import nn

from graph_fsdp.fsdp.api import BufferPolicy

SCOPES = ("attn", "mlp", "moe", "moe_router", "moe_preprocess", "full_iteration")
"""Accepted scope names; an empty list means whole layers."""
GRAPH_IMPLS = ("none", "te", "torch")
MOE_SCOPES = ("moe", "moe_router", "moe_preprocess")


@dataclass(frozen=True)
class ScopePath:
    """A submodule path (relative to an FSDP unit) a preset scope captures.

    ``needs``: ``"moe"`` / ``"dense"`` when the path's first component must (not) be an MoE
    block - ``mlp`` is a dense MLP in most models but the MoE layer in Megatron-Core and
    recent HuggingFace MoE decoders.
    """

    path: str
    needs: str | None = None
    family: str = ""


SCOPE_PRESETS: dict[str, tuple[ScopePath, ...]] = {
    "attn": (
        ScopePath("self_attention", family="graph_fsdp, TransformerEngine, Megatron-Core"),
        ScopePath("self_attn", family="HuggingFace"),
        ScopePath("attn", family="HuggingFace GPT-2, GPT-J"),
        ScopePath("attention", family="HuggingFace GPT-NeoX"),
    ),
    "mlp": (
        ScopePath("mlp", "dense", "graph_fsdp, Megatron-Core, HuggingFace"),
        ScopePath("layernorm_mlp", family="TransformerEngine"),
    ),
    "moe": (
        ScopePath("moe", family="graph_fsdp"),
        ScopePath("mlp", "moe", "Megatron-Core MoELayer, HuggingFace Mixtral/Qwen-MoE"),
        ScopePath("block_sparse_moe", family="HuggingFace Mixtral (transformers < 5)"),
    ),
    "moe_router": (
        ScopePath("moe.router", family="graph_fsdp"),
        ScopePath("mlp.router", "moe", "Megatron-Core"),
        ScopePath("mlp.gate", "moe", "HuggingFace Mixtral/Qwen-MoE"),
        ScopePath("block_sparse_moe.gate", family="HuggingFace Mixtral (transformers < 5)"),
    ),
    "moe_preprocess": (
        ScopePath("moe.preprocess", family="graph_fsdp"),
        # MoELayer.preprocess is a method; graph_fsdp.integrations.megatron.make_graphs puts
        # a MoEPreprocess module in its place (an instance attribute, not a submodule).
        ScopePath("mlp.preprocess", "moe", "Megatron-Core (MoEPreprocess)"),
    ),
}
"""The submodules each scope captures, per model family, tried in order (first match wins
per FSDP unit). Extend or override them with ``scope_modules`` (:func:`scope_paths`)."""

SCOPE_ATTRS: dict[str, tuple[str, ...]] = {
    scope: tuple(p.path for p in paths) for scope, paths in SCOPE_PRESETS.items()
}
"""The presets' paths per scope (kept for callers that only want the names)."""

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

ScopeModules = Mapping[str, str | Sequence[str]]
"""``{scope: path or paths}``: submodule paths relative to each FSDP unit, e.g.
``{"attn": "self_attn"}`` or ``{"mlp": ["mlp", "feed_forward"]}``."""


class GraphConfigError(ValueError):
    """An invalid CUDA graph configuration; the message names the option to change."""


def scope_label(scopes: list[str] | tuple[str, ...], optimizer: bool = False) -> str:
    """Scopes in reports: ``layer`` for the whole layer; ``optimizer``: the full_iteration
    graph holds the optimizer step too (``+ optimizer``, the whole-step graph)."""
    label = " ".join(scopes) if scopes else "layer"
    return f"{label} + optimizer" if optimizer and "full_iteration" in scopes else label


def check_scopes(
    scopes: list[str] | tuple[str, ...],
    *,
    flag: str = "--cuda-graph-scope",
    scope_modules: ScopeModules | None = None,
) -> None:
    """Reject unknown, repeated and conflicting scopes (model-independent rules).

    A scope name that is not Megatron's is accepted when ``scope_modules`` defines it.
    """
    custom = normalize_scope_modules(scope_modules) if scope_modules else {}
    for s in scopes:
        if s not in SCOPES and s not in custom:
            defined = f"; scope_modules defines {', '.join(custom)}" if custom else ""
            raise GraphConfigError(
                f"{flag}: unknown scope {s!r}; accepted scopes are {', '.join(SCOPES)} "
                f"(no scope at all captures the whole layer){defined}. A scope of your own "
                f"needs its modules: scope_modules={{{s!r}: 'path.in.layer'}} "
                f"(--cuda-graph-scope-modules {s}=path.in.layer)"
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
    """Graphs replay fixed addresses: FSDP's unsharded buffers must never move. Layerwise
    graphs also need a persistent buffer for a request no slot can serve (their eager hooks
    run between replays); full_iteration replays the hand-offs inside its graph."""
    if "full_iteration" in scopes:
        if policy.allocator == "dynamic":
            raise GraphConfigError(
                f"{flag} full_iteration replays FSDP's buffer hand-offs at fixed addresses: set "
                "BufferPolicy(allocator='double_buffer') (--fsdp-double-buffer) or "
                "allocator='trace_pool' (--fsdp-buffer trace_pool)"
            )
        return
    missing = []
    if policy.allocator == "dynamic":
        missing.append(
            "BufferPolicy(allocator='double_buffer') (--fsdp-double-buffer) or "
            "allocator='trace_pool' (--fsdp-buffer trace_pool)"
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


def normalize_scope_modules(
    scope_modules: ScopeModules, *, flag: str = "scope_modules"
) -> dict[str, tuple[str, ...]]:
    """``{scope: path | [paths]}`` -> ``{scope: (paths,)}``, every name and path checked."""
    if not isinstance(scope_modules, Mapping):
        raise GraphConfigError(
            f"{flag}={scope_modules!r} must be a mapping {{scope: submodule path(s)}}, e.g. "
            "{'attn': 'self_attn', 'mlp': ['mlp', 'feed_forward']}"
        )
    out = {}
    for scope, paths in scope_modules.items():
        if not isinstance(scope, str) or not _IDENT.fullmatch(scope) or scope == "full_iteration":
            raise GraphConfigError(
                f"{flag}: scope name {scope!r} is invalid: use an identifier other than "
                "full_iteration (full_iteration captures the whole step, not modules)"
            )
        if isinstance(paths, str):
            paths = (paths,)
        if not isinstance(paths, Sequence) or not paths:
            raise GraphConfigError(
                f"{flag}[{scope!r}]={paths!r}: give a submodule path or a non-empty list of "
                "them, relative to each FSDP unit (e.g. 'self_attn' or 'mlp.gate')"
            )
        for path in paths:
            if not isinstance(path, str) or not all(
                _IDENT.fullmatch(part) or part.isdigit() for part in path.split(".")
            ):
                raise GraphConfigError(
                    f"{flag}[{scope!r}]: path {path!r} is not a dotted submodule path relative "
                    "to an FSDP unit (e.g. 'self_attn', 'mlp.gate', 'blocks.0')"
                )
        out[scope] = tuple(paths)
    return out


def parse_scope_modules(items: Sequence[str], *, flag: str = "--cuda-graph-scope-modules"):
    """``["attn=self_attn", "mlp=mlp,feed_forward"]`` -> ``{"attn": ("self_attn",), ...}``."""
    out: dict[str, tuple[str, ...]] = {}
    for item in items:
        scope, sep, paths = item.partition("=")
        if not sep or not scope or not paths:
            raise GraphConfigError(
                f"{flag} {item!r}: expected SCOPE=PATH[,PATH...], e.g. attn=self_attn"
            )
        if scope in out:
            raise GraphConfigError(f"{flag}: scope {scope!r} is given twice; list it once")
        out[scope] = tuple(p for p in paths.split(",") if p)
    return normalize_scope_modules(out, flag=flag)


def _lookup(layer: nn.Module, path: str) -> nn.Module | None:
    m: nn.Module | None = layer
    for part in path.split("."):
        m = getattr(m, part, None)
        if not isinstance(m, nn.Module):
            return None
    return m


def _is_moe_block(module: nn.Module) -> bool:
    """An MoE layer under any family's naming: it owns a router/gate and experts."""
    return isinstance(getattr(module, "experts", None), nn.Module) or isinstance(
        getattr(module, "router", None), nn.Module
    )


def _is_mcore_moe(unit: nn.Module) -> bool:
    mlp = getattr(unit, "mlp", None)
    return isinstance(mlp, nn.Module) and hasattr(mlp, "token_dispatcher")


def scope_paths(scope: str, scope_modules: ScopeModules | None = None) -> tuple[ScopePath, ...]:
    """The paths ``scope`` captures: the user's (``scope_modules``) replace the preset."""
    user = normalize_scope_modules(scope_modules) if scope_modules else {}
    if scope in user:
        return tuple(ScopePath(p, family="scope_modules") for p in user[scope])
    return SCOPE_PRESETS.get(scope, ())


PLACEHOLDERS = ("IdentityOp", "IdentityFuncOp")
"""Class names of Megatron-Core's stand-ins for an absent submodule (a hybrid model's MLP layer
has an ``IdentityOp`` as ``self_attention``): no scope captures them."""


def _match(unit: nn.Module, paths: tuple[ScopePath, ...]) -> tuple[str, nn.Module] | None:
    for sp in paths:
        module = _lookup(unit, sp.path)
        if module is None or type(module).__name__ in PLACEHOLDERS:
            continue
        if sp.needs is not None:
            head = getattr(unit, sp.path.split(".")[0])
            if _is_moe_block(head) != (sp.needs == "moe"):
                continue  # e.g. an MoE block under the name mlp: the moe scopes own it
        return sp.path, module
    return None


def select_targets(
    units: list[tuple[str, nn.Module]],
    scopes: list[str] | tuple[str, ...],
    *,
    flag: str = "--cuda-graph-scope",
    scope_modules: ScopeModules | None = None,
) -> list[Target]:
    """The modules ``scopes`` name inside each (non-root) FSDP unit, in unit order.

    ``units``: ``(fqn, module)`` of the units, in forward order. ``scope_modules`` maps a
    scope to submodule paths relative to each unit, replacing the presets of that scope
    (:data:`SCOPE_PRESETS`) or defining a new scope. A scope that matches no module of the
    model is an error that lists the submodules the units do have.
    """
    check_scopes(scopes, flag=flag, scope_modules=scope_modules)
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
    paths = {s: scope_paths(s, scope_modules) for s in scopes}
    targets: list[Target] = []
    matched = set()
    for fqn, unit in units:
        chosen: dict[int, Target] = {}
        for scope in scopes:
            hit = _match(unit, paths[scope])
            if hit is None:
                continue
            path, module = hit
            if id(module) in chosen:
                raise GraphConfigError(
                    f"{flag}: {fqn}.{path} is selected by scopes {chosen[id(module)].scope!r} "
                    f"and {scope!r}; map each module to one scope (scope_modules)"
                )
            chosen[id(module)] = Target(f"{fqn}.{path}", module, unit, scope)
            matched.add(scope)
        _reject_nested(list(chosen.values()), flag)
        targets.extend(chosen.values())
    missing = [s for s in scopes if s not in matched]
    if missing:
        raise GraphConfigError(_no_match_message(units, missing, paths, flag))
    return targets


def _reject_nested(chosen: list[Target], flag: str) -> None:
    for outer in chosen:
        for inner in chosen:
            if inner is not outer and any(m is inner.module for m in outer.module.modules()):
                raise GraphConfigError(
                    f"{flag}: {inner.name} (scope {inner.scope}) lies inside {outer.name} "
                    f"(scope {outer.scope}); a graph cannot be captured inside another: drop one "
                    "of the two scopes"
                )


_SCOPE_WORDS = {
    "attn": ("attn", "attention", "mixer"),
    "mlp": ("mlp", "ffn", "feed_forward", "fc"),
    "moe": ("moe", "expert", "sparse"),
    "moe_router": ("gate", "router"),
}
"""Name fragments of a unit's children that a scope plausibly means: the example mapping in
the error names such a child, else a placeholder (never an unrelated norm)."""


def _no_match_message(
    units: list[tuple[str, nn.Module]],
    missing: list[str],
    paths: dict[str, tuple[ScopePath, ...]],
    flag: str,
) -> str:
    found: dict[str, str] = {}
    for _, unit in units:
        for name, child in unit.named_children():
            found.setdefault(name, type(child).__name__)
    children = ", ".join(f"{n} ({t})" for n, t in found.items()) or "none"
    looked = "; ".join(
        f"{s}: {', '.join(p.path + (f' [{p.needs}]' if p.needs else '') for p in paths[s])}"
        for s in missing
    )
    notes = []
    if "moe_preprocess" in missing and any(_is_mcore_moe(u) for _, u in units):
        notes.append(
            "Megatron-Core's MoELayer runs its preprocess in methods (MoELayer.route / "
            "preprocess, token_dispatcher.dispatch_preprocess), not in a submodule: "
            "graph_fsdp.integrations.megatron.make_graphs (or install_moe_preprocess) puts a "
            "MoEPreprocess module at mlp.preprocess, which the preset captures; otherwise use "
            "moe_router alone, or map a module of yours"
        )
    if any(s in MOE_SCOPES for s in missing) and not any(
        _is_moe_block(c) for _, u in units for c in u.children()
    ):
        notes.append("the units have no MoE block (a dense model): drop the moe scopes")
    for scope in missing:
        heads = {sp.path.split(".")[0] for sp in paths[scope] if sp.needs == "dense"}
        moe_at = sorted(h for h in heads if any(_is_moe_block(_lookup(u, h)) for _, u in units))
        if moe_at:
            notes.append(
                f"{', '.join(moe_at)} is an MoE block here and scope {scope} takes dense MLPs "
                "only: use moe (the whole block) or moe_router (its router)"
            )
    preset_heads = {sp.path.split(".")[0] for ps in SCOPE_PRESETS.values() for sp in ps}
    words = _SCOPE_WORDS.get(missing[0], ())
    example = next(
        (n for n in found if n not in preset_heads and any(w in n.lower() for w in words)),
        "PATH",
    )
    return (
        f"{flag} {' '.join(missing)}: no module of the model matches (looked for {looked} in "
        f"every FSDP unit; [moe]/[dense]: only where that submodule is / is not an MoE block). "
        f"The units' direct submodules are: {children}. "
        + "".join(n + ". " for n in notes)
        + f"Map the scope to your model's submodules with scope_modules={{'{missing[0]}': "
        f"'{example}'}} (LayerwiseGraphs / TrainConfig.graphs.scope_modules; CLI "
        f"--cuda-graph-scope-modules {missing[0]}={example}; dotted paths such as 'mlp.gate' "
        f"work), or drop {' '.join(missing)}"
    )
