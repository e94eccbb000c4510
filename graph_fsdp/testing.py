"""Test helpers: GPU skip markers and the CLI's refusal message.

Processes are started by :func:`graph_fsdp.launch.spawn`; HuggingFace decoders are built by
:mod:`graph_fsdp.models.hf`. Nothing in the package imports this module.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
import torch

from graph_fsdp.cli.main import main

GPU_TEST_WORLD = int(os.environ.get("GRAPH_FSDP_GPU_TEST_WORLD", "2"))
"""Ranks (one GPU each) the multi-GPU tests spawn: 2, or 1 for a single-GPU smoke run
(``GRAPH_FSDP_GPU_TEST_WORLD=1``, tools/gpu_tests.sh ``WORLD=1``); the tests that need
several ranks by construction skip below 2."""


def needs_gpus(world: int | None = None):
    """``skipif`` marker: fewer CUDA GPUs than ``world`` (default ``GPU_TEST_WORLD``)."""
    world = GPU_TEST_WORLD if world is None else world
    return pytest.mark.skipif(
        torch.cuda.device_count() < world, reason=f"needs {world} CUDA GPU(s)"
    )


def cli_error(capsys, *argv: str) -> str:
    """The message ``graph-fsdp argv`` stops with (a CLIError: exit code 2), on one line.

    ``capsys`` is pytest's fixture; the command runs in this process, so nothing is launched
    when the arguments are refused before that.
    """
    try:
        main(list(argv))
    except SystemExit as exc:
        assert exc.code == 2, f"graph-fsdp {' '.join(argv)} exited with {exc.code}, not 2"
    else:
        raise AssertionError(f"graph-fsdp {' '.join(argv)} was not refused")
    err = capsys.readouterr().err
    assert "error:" in err, err
    return err.split("error:", 1)[1].replace("\n", " ")


def saved_tensor_bytes(fn: Callable[[], object], exclude=()) -> tuple[object, int]:
    """``(fn(), bytes)``: the bytes of the tensors autograd keeps for backward while ``fn``
    runs (``torch.autograd.graph.saved_tensors_hooks``), each storage counted once (views and
    chunks of one tensor share it) and the storages of ``exclude`` (parameters) left out."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            kept[storage.data_ptr()] = storage.nbytes()  # alive until backward: no reuse
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(kept.values())
