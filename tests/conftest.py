"""GPU tests (the ``gpu`` marker, beside the CPU tests of their feature): NVLink multicast off,
the GPU hosts' rule, set before any test runs when a selected test is a GPU test. A CPU run
(``-m "not gpu"``) is left as it is."""

from __future__ import annotations

import os

import pytest

MULTICAST_OFF = (
    ("NCCL_NVLS_ENABLE", "0"),
    ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
    ("NVSHMEM_DISABLE_NVLS", "1"),
)


def pytest_collection_finish(session: pytest.Session) -> None:
    if any(item.get_closest_marker("gpu") is not None for item in session.items):
        for var, value in MULTICAST_OFF:
            os.environ.setdefault(var, value)
