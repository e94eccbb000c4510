"""graph_fsdp's NVTX ranges: off unless a profiler listens or GRAPH_FSDP_NVTX=1 asks."""

from __future__ import annotations

import pytest
import torch

from graph_fsdp import cuda_streams
from graph_fsdp.cuda_streams import nvtx_enabled, nvtx_range, set_nvtx_ranges


@pytest.fixture
def fake_cuda(monkeypatch):
    """A CUDA build's view (is_available) with NVTX pushes recorded; decision reset."""
    pushed: list[str] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda.nvtx, "range_push", pushed.append)
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", lambda: None)
    for var in ("GRAPH_FSDP_NVTX", "NSYS_PROFILING_SESSION_ID", "NVTX_INJECTION64_PATH"):
        monkeypatch.delenv(var, raising=False)
    set_nvtx_ranges(None)
    yield pushed
    set_nvtx_ranges(None)
    cuda_streams._RANGES.clear()


def _emit(name: str) -> None:
    with nvtx_range(name):
        pass


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, False),
        ({"NSYS_PROFILING_SESSION_ID": "3"}, True),
        ({"NVTX_INJECTION64_PATH": "/opt/nsys/libToolsInjection64.so"}, True),
        ({"GRAPH_FSDP_NVTX": "1"}, True),
        ({"GRAPH_FSDP_NVTX": "0", "NSYS_PROFILING_SESSION_ID": "3"}, False),
    ],
)
def test_ranges_follow_the_environment(fake_cuda, monkeypatch, env, expected):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert nvtx_enabled() is expected
    _emit("graph_fsdp/unshard/layers.0")
    assert fake_cuda == (["graph_fsdp/unshard/layers.0"] if expected else [])


def test_bad_value_is_named(fake_cuda, monkeypatch):
    monkeypatch.setenv("GRAPH_FSDP_NVTX", "yes")
    with pytest.raises(ValueError, match="GRAPH_FSDP_NVTX='yes'"):
        nvtx_enabled()


def test_set_nvtx_ranges_overrides(fake_cuda):
    set_nvtx_ranges(True)
    _emit("a")
    set_nvtx_ranges(False)
    _emit("b")
    assert fake_cuda == ["a"]


def test_never_on_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("GRAPH_FSDP_NVTX", "1")
    set_nvtx_ranges(None)
    try:
        assert not nvtx_enabled()
        assert nvtx_range("x") is nvtx_range("y")  # the shared no-op context
    finally:
        set_nvtx_ranges(None)
