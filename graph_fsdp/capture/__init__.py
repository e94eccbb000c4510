"""Layerwise CUDA graph capture over fully_shard-ed models (TE and pure-PyTorch backends)."""

from graph_fsdp.capture.diagnosis import CaptureFailedError
from graph_fsdp.capture.full_iteration import FullIterationGraphs
from graph_fsdp.capture.layerwise import LayerwiseGraphs
from graph_fsdp.capture.scopes import (
    GRAPH_IMPLS,
    MOE_SCOPES,
    SCOPE_PRESETS,
    SCOPES,
    GraphConfigError,
    ScopePath,
    check_scopes,
    check_static_buffers,
    normalize_scope_modules,
    parse_scope_modules,
    scope_label,
    scope_paths,
    select_targets,
)
from graph_fsdp.capture.step import GraphedStep, HostClock, eager_forward_backward
from graph_fsdp.capture.teardown import (
    close_live_runners,
    install_shutdown_guard,
    live_runners,
)
from graph_fsdp.capture.verify import GraphVerificationError, VerifyResult
from graph_fsdp.capture.whole_step import StepPolicy, StepResult, WholeStep, WholeStepGraph

__all__ = [
    "GRAPH_IMPLS",
    "MOE_SCOPES",
    "SCOPES",
    "SCOPE_PRESETS",
    "CaptureFailedError",
    "FullIterationGraphs",
    "GraphConfigError",
    "GraphVerificationError",
    "GraphedStep",
    "HostClock",
    "LayerwiseGraphs",
    "ScopePath",
    "StepPolicy",
    "StepResult",
    "VerifyResult",
    "WholeStep",
    "WholeStepGraph",
    "check_scopes",
    "check_static_buffers",
    "close_live_runners",
    "eager_forward_backward",
    "normalize_scope_modules",
    "parse_scope_modules",
    "install_shutdown_guard",
    "live_runners",
    "scope_label",
    "scope_paths",
    "select_targets",
]
