"""Extract, transform and restore a module's hooks around CUDA graph capture.

Capture must not record collectives, and both ``torch.cuda.make_graphed_callables`` and
TransformerEngine's refuse modules that carry hooks. So, per captured module:

1. **extract** (:func:`extract_module_hooks`): copy the four hook dicts and their flags,
   clear them on the module, and keep an independent copy to restore from;
2. **transform** (:func:`capture_time_hooks`): turn the extracted hooks into the
   ``capture_time_hooks`` entry TE >= 2.19 expects - keys exactly ``forward_pre_hooks``,
   ``forward_hooks``, ``backward_pre_hooks``, ``backward_hooks``, values ``{id: fn}``,
   called as ``fn(module)`` around warmup and capture, never at replay;
3. **restore** (:func:`restore_module_hooks`): put every hook back with its id, order
   and flags, so at replay the hooks fire around the graphed forward as before.

[Note: sentinel hooks] A hook that only *registers* autograd backward handlers (FSDP's
forward-pre hook that wraps the inputs for post-backward, its forward hook that registers
pre-backward on the outputs) is useless at capture time: the graph's backward runs outside
autograd's view of the module. Such a hook carries :data:`BACKWARD_HANDLER` or
:data:`BACKWARD_PRE_HANDLER`, the *name* of a method on its owner (``hook.__self__``); the
transform withholds the hook and routes that method to ``backward_hooks`` /
``backward_pre_hooks``. A hook with :data:`CAPTURE_TIME_FN` names the owner method to call
instead of the hook (its nn.Module signature cannot be called as ``fn(module)``). Hooks with
no marker - user hooks - are not run at capture time (they would see the capture's sample
inputs); they are restored and fire at replay.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from torch import nn

from graph_fsdp.fsdp.hook_markers import BACKWARD_HANDLER, BACKWARD_PRE_HANDLER, CAPTURE_TIME_FN

HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
FLAG_DICTS = (
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
)
CAPTURE_KEYS = ("forward_pre_hooks", "forward_hooks", "backward_pre_hooks", "backward_hooks")
"""TE's ``capture_time_hooks`` keys (TE >= 2.19 rejects the ``*_with_kwargs`` spellings)."""

CaptureHookFn = Callable[[nn.Module], None]


@dataclass
class ModuleHooks:
    """An independent copy of one module's hooks (what :func:`restore_module_hooks` puts back)."""

    module: nn.Module
    dicts: dict[str, OrderedDict] = field(default_factory=dict)
    flags: dict[str, OrderedDict] = field(default_factory=dict)
    is_full_backward_hook: bool | None = None

    def __len__(self) -> int:
        return sum(len(d) for d in self.dicts.values())


def has_hooks(module: nn.Module) -> bool:
    return any(len(getattr(module, name)) for name in HOOK_DICTS)


def extract_module_hooks(module: nn.Module) -> ModuleHooks:
    """Copy and clear ``module``'s hook dicts and flags; return the copy."""
    saved = ModuleHooks(
        module,
        dicts={name: OrderedDict(getattr(module, name)) for name in HOOK_DICTS},
        flags={name: OrderedDict(getattr(module, name)) for name in FLAG_DICTS},
        is_full_backward_hook=module._is_full_backward_hook,
    )
    # Clear in place: RemovableHandles hold weak references to these very dicts, so a
    # user's handle.remove() after restore still finds its hook.
    for name in (*HOOK_DICTS, *FLAG_DICTS):
        getattr(module, name).clear()
    module._is_full_backward_hook = None
    return saved


def restore_module_hooks(saved: ModuleHooks) -> None:
    """Put the extracted hooks back exactly: same ids, same order, same flags.

    Hooks registered on the module while it was extracted would be silently reordered, so
    they are an error.
    """
    module = saved.module
    added = {name: list(getattr(module, name)) for name in HOOK_DICTS if len(getattr(module, name))}
    if added:
        raise RuntimeError(
            f"{type(module).__name__} got new hooks {added} while its hooks were extracted for "
            "CUDA graph capture; register hooks before capture or after it finished"
        )
    for name in HOOK_DICTS:
        getattr(module, name).update(saved.dicts[name])
    for name in FLAG_DICTS:
        getattr(module, name).clear()
        getattr(module, name).update(saved.flags[name])
    module._is_full_backward_hook = saved.is_full_backward_hook


def _adapt(handler: Callable[[], object]) -> CaptureHookFn:
    """``handler()`` as TE calls capture-time hooks: ``fn(module)``, returning None."""

    def fn(module: nn.Module) -> None:
        handler()

    fn.__wrapped__ = handler
    return fn


def _owner_method(hook, attr: str) -> Callable[[], object]:
    name = getattr(hook, attr)
    owner = getattr(hook, "__self__", None)
    if owner is None or not callable(getattr(owner, name, None)):
        raise TypeError(
            f"hook {hook!r} carries {attr}={name!r} but is not a bound method of an object with "
            f"a method {name!r}; sentinel hooks must be methods of their state object"
        )
    return getattr(owner, name)


def capture_time_hooks(*hook_sets: ModuleHooks) -> dict[str, dict[int, CaptureHookFn]]:
    """The ``capture_time_hooks`` entry for one captured callable.

    ``hook_sets`` are the extracted hooks that must run around the callable's warmup and
    capture - its own, and for a submodule of an FSDP unit, the unit's. Sentinel hooks are
    withheld and their handlers routed (see [Note: sentinel hooks]); unmarked hooks are left
    for replay.
    """
    out: dict[str, dict[int, CaptureHookFn]] = {key: {} for key in CAPTURE_KEYS}
    for saved in hook_sets:
        for dict_name, key in (
            ("_forward_pre_hooks", "forward_pre_hooks"),
            ("_forward_hooks", "forward_hooks"),
        ):
            for hook_id, hook in saved.dicts[dict_name].items():
                if hasattr(hook, BACKWARD_HANDLER):
                    out["backward_hooks"][hook_id] = _adapt(_owner_method(hook, BACKWARD_HANDLER))
                elif hasattr(hook, BACKWARD_PRE_HANDLER):
                    out["backward_pre_hooks"][hook_id] = _adapt(
                        _owner_method(hook, BACKWARD_PRE_HANDLER)
                    )
                elif hasattr(hook, CAPTURE_TIME_FN):
                    out[key][hook_id] = _adapt(_owner_method(hook, CAPTURE_TIME_FN))
    return out


def user_hook_count(*hook_sets: ModuleHooks) -> int:
    """Hooks without a sentinel: restored for replay, not run at capture."""
    marked = (BACKWARD_HANDLER, BACKWARD_PRE_HANDLER, CAPTURE_TIME_FN)
    return sum(
        1
        for saved in hook_sets
        for d in saved.dicts.values()
        for hook in d.values()
        if not any(hasattr(hook, m) for m in marked)
    )
