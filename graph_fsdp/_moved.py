"""Old module paths of graph_fsdp, from before its modules were grouped into layer folders.

``import graph_fsdp.train`` (or ``from graph_fsdp.state import ...``) keeps working: the old
name is bound to the module that now holds the code - the same module object, so classes and
module state are shared - with a ``DeprecationWarning`` naming the new path. New code imports
the new paths; :data:`MOVED` lists them.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings

_FSDP = (
    "address_keeping api capture_context checkpoint comm experts fully_shard grad_norm "
    "hook_markers offload optim_offload param_group reduce state tensor_parallel"
).split()
_MEGATRON = {"config": "config", "ep": "ep", "fsdp": "megatron_fsdp", "moe": "moe"}
_MEGATRON |= {"scopes": "scopes", "tp": "tp", "train": "train"}

MOVED: dict[str, str] = {f"graph_fsdp.{m}": f"graph_fsdp.fsdp.{m}" for m in _FSDP}
MOVED |= {f"graph_fsdp.{m}": f"graph_fsdp.training.{m}" for m in ("data", "interrupt", "loop")}
MOVED |= {f"graph_fsdp.{m}": f"graph_fsdp.training.{m}" for m in ("supervision", "train")}
MOVED |= {
    f"graph_fsdp.integrations.megatron_{old}": f"graph_fsdp.integrations.megatron.{new}"
    for old, new in _MEGATRON.items()
}
MOVED |= {
    "graph_fsdp.launch": "graph_fsdp.training.processes",
    "graph_fsdp.vocab_parallel": "graph_fsdp.parallel.vocab_parallel",
    "graph_fsdp.models.ep_dispatch": "graph_fsdp.parallel.ep_dispatch",
    "graph_fsdp.integrations.grouped_moe": "graph_fsdp.parallel.grouped_moe",
    "graph_fsdp.hooks": "graph_fsdp.capture.module_hooks",
}


class _MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old name of :data:`MOVED` and loads it as the module at its new path."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=False)

    def create_module(self, spec):
        new = MOVED[spec.name]
        warnings.warn(
            f"{spec.name} moved to {new}: import it from there", DeprecationWarning, stacklevel=2
        )
        return importlib.import_module(new)

    def exec_module(self, module) -> None:
        """The module at the new path ran when it was imported: nothing to execute."""


def install() -> None:
    """Put the finder on ``sys.meta_path`` once (``import graph_fsdp`` calls this)."""
    if not any(isinstance(f, _MovedModuleFinder) for f in sys.meta_path):
        sys.meta_path.append(_MovedModuleFinder())
