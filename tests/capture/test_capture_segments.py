"""Growing capture segments (address_keeping.py [Note: growing capture segments]): a capture
turns expandable segments on for itself and off after, unless the process chose; a model
whose addresses are kept is left to its library. The CUDA side (the pool's segments are
expandable, later ones are not) runs in tests/capture/test_full_iteration_pool_gpu.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from graph_fsdp.fsdp import address_keeping as ak


@pytest.fixture
def settings(monkeypatch):
    calls: list[str] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_allocator_backend", lambda: "native")
    monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", calls.append)
    for var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "LD_PRELOAD"):
        monkeypatch.delenv(var, raising=False)
    return calls


def test_on_for_the_capture_and_off_after_also_when_it_fails(settings) -> None:
    with ak.growing_segments():
        assert settings == ["expandable_segments:True"]
    assert settings == ["expandable_segments:True", "expandable_segments:False"]
    settings.clear()
    with pytest.raises(RuntimeError, match="capture failed"), ak.growing_segments():
        raise RuntimeError("capture failed")
    assert settings == ["expandable_segments:True", "expandable_segments:False"]


@pytest.mark.parametrize(
    ("var", "value"),
    [
        ("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False"),
        ("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:64,expandable_segments:True"),
        ("PYTORCH_ALLOC_CONF", "expandable_segments:False"),
        ("LD_PRELOAD", "/x/torch_memory_saver_hook_mode_preload_cu12.so"),
    ],
)
def test_a_choice_of_the_process_is_left_alone(settings, monkeypatch, var, value) -> None:
    monkeypatch.setenv(var, value)
    with ak.growing_segments():
        pass
    assert settings == []


def test_without_cuda_nothing_is_set(settings, monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with ak.growing_segments():
        pass
    assert settings == []


def test_another_allocator_backend_is_left_alone(settings, monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_allocator_backend", lambda: "cudaMallocAsync")
    with ak.growing_segments():
        pass
    assert settings == []


def test_a_build_without_cuda_is_left_alone(settings, monkeypatch) -> None:
    def no_backend() -> str:
        raise AttributeError("module 'torch._C' has no attribute '_cuda_getAllocatorBackend'")

    monkeypatch.setattr(torch.cuda, "get_allocator_backend", no_backend)
    with ak.growing_segments():
        pass
    assert settings == []


def test_a_setting_the_allocator_refuses_leaves_the_capture_as_it_was(monkeypatch) -> None:
    def refuse(value: str) -> None:
        raise RuntimeError(f"unsupported: {value}")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_allocator_backend", lambda: "native")
    monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", refuse)
    for var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "LD_PRELOAD"):
        monkeypatch.delenv(var, raising=False)
    ran = []
    with ak.growing_segments():
        ran.append(True)
    assert ran == [True]


def _states(keeper) -> list:
    mode = None if keeper is None else SimpleNamespace(keeper=keeper)
    return [SimpleNamespace(root=SimpleNamespace(offload_mode=mode))]


def test_kept_addresses_capture_through_their_library() -> None:
    assert ak.graph_capture(_states(None)) is ak._growing_graph
    assert isinstance(ak.capture_segments(_states(None)), type(ak.growing_segments()))
    plain = SimpleNamespace(backend=SimpleNamespace(releases_graph_pools=False), paused=set())
    assert ak.graph_capture(_states(plain)) is torch.cuda.graph
    pools = SimpleNamespace(backend=SimpleNamespace(releases_graph_pools=True), paused=set())
    assert ak.graph_capture(_states(pools), keeper_pool=False) is torch.cuda.graph
    assert ak.graph_capture(_states(pools)) not in (torch.cuda.graph, ak._growing_graph)
    assert type(ak.capture_segments(_states(pools))).__name__ == "nullcontext"
