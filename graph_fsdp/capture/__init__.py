"""Layerwise CUDA graph capture over fully_shard-ed models (TE and pure-PyTorch backends)."""

from graph_fsdp.capture.full_iteration import (
    FullIterationGraphs,
    HostClock,
    eager_forward_backward,
)
from graph_fsdp.capture.runner import LayerwiseGraphs
from graph_fsdp.capture.scopes import (
    GRAPH_IMPLS,
    MOE_SCOPES,
    SCOPES,
    GraphConfigError,
    check_scopes,
    check_static_buffers,
    scope_label,
    select_targets,
)
from graph_fsdp.capture.shutdown import (
    close_live_runners,
    install_shutdown_guard,
    live_runners,
)

# Live graphs keep NCCL communicators alive: destroy_process_group closes them first.
install_shutdown_guard()

__all__ = [
    "GRAPH_IMPLS",
    "MOE_SCOPES",
    "SCOPES",
    "FullIterationGraphs",
    "GraphConfigError",
    "HostClock",
    "LayerwiseGraphs",
    "check_scopes",
    "check_static_buffers",
    "close_live_runners",
    "eager_forward_backward",
    "install_shutdown_guard",
    "live_runners",
    "scope_label",
    "select_targets",
]
