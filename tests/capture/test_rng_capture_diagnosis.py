"""A capture that fails on a random-number generator's state is reported with its fix
(diagnosis.py [Note: Megatron's RNG tracker under capture]), not the generic
host-synchronization cause. CPU unit tests of the diagnosis; the capture itself fails on a
GPU: tests/capture/test_safe_defaults_gpu.py."""

from __future__ import annotations

import pytest

from graph_fsdp.capture.diagnosis import MEGATRON_RNG_FIX, ModuleTracker, explain_capture_failure


def _explain(err: BaseException) -> str:
    return str(explain_capture_failure(err, ModuleTracker({}), what="a layer", layerwise=True))


def test_megatron_default_tracker_is_named_with_the_fix() -> None:
    """An error raised inside Megatron-Core's tracker code (here: reading the CUDA generator
    state on a machine without CUDA, the call the default tracker makes under capture)."""
    random = pytest.importorskip("megatron.core.tensor_parallel.random")
    try:
        random._get_cuda_rng_state(graph_safe=False)
    except Exception as err:  # noqa: BLE001 - whatever torch raises without CUDA
        message = _explain(err)
    else:
        pytest.skip("CUDA is available: the generator state was readable")
    assert MEGATRON_RNG_FIX in message
    assert "use_cudagraphable_rng=True" in message and "host synchronization" not in message


def test_generator_state_under_capture_is_named() -> None:
    """torch's refusal to read a CUDA generator's state inside a capture."""
    try:
        raise RuntimeError(
            "Cannot call CUDAGeneratorImpl::current_seed during CUDA graph capture. If you "
            "need this call to be captured, please file an issue. Current "
            "cudaStreamCaptureStatus: cudaStreamCaptureStatusActive"
        )
    except RuntimeError as err:
        message = _explain(err)
    assert "CUDA generator's state" in message and "graphsafe_get_state" in message
    assert "host synchronization" not in message
