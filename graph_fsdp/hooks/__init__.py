"""Hook extraction, transform and restore for CUDA graph capture (see module_hooks.py)."""

from graph_fsdp.hook_markers import BACKWARD_HANDLER, BACKWARD_PRE_HANDLER, CAPTURE_TIME_FN, mark
from graph_fsdp.hooks.module_hooks import (
    CAPTURE_KEYS,
    ModuleHooks,
    capture_time_hooks,
    extract_module_hooks,
    has_hooks,
    restore_module_hooks,
    user_hook_count,
)

__all__ = [
    "BACKWARD_HANDLER",
    "BACKWARD_PRE_HANDLER",
    "CAPTURE_KEYS",
    "CAPTURE_TIME_FN",
    "ModuleHooks",
    "capture_time_hooks",
    "extract_module_hooks",
    "has_hooks",
    "mark",
    "restore_module_hooks",
    "user_hook_count",
]
