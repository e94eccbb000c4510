"""GPU tests (the ``gpu`` marker, beside the CPU tests of their feature): NVLink multicast off,
the GPU hosts' rule, set before any test runs when a selected test is a GPU test. A CPU run
(``-m "not gpu"``) starts its gloo ranks from a forkserver that imported torch once
(training/processes.py [Note: forkserver ranks]); commands a test runs keep spawning theirs."""

from __future__ import annotations

import os

import pytest

from graph_fsdp.training.processes import set_start_method

MULTICAST_OFF = (
    ("NCCL_NVLS_ENABLE", "0"),
    ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
    ("NVSHMEM_DISABLE_NVLS", "1"),
)


FORKSERVER_PRELOAD = ("torch", "torch.distributed", "graph_fsdp.training.train")
"""What the ranks' forkserver imports once (the loop and the models; no CUDA)."""


def pytest_collection_finish(session: pytest.Session) -> None:
    if any(item.get_closest_marker("gpu") is not None for item in session.items):
        for var, value in MULTICAST_OFF:
            os.environ.setdefault(var, value)
        return
    set_start_method("forkserver", preload=FORKSERVER_PRELOAD)
