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
    "eager_forward_backward",
    "scope_label",
    "select_targets",
]
