"""Process-group setup with failure bounds: a rank that dies must not hang the others.

    graph_fsdp.init_distributed(timeout_s=60)   # torchrun's env vars; NCCL on GPUs, else gloo

[Note: failure bounds] A collective whose peer died never completes on its own. What bounds
the wait: the process group ``timeout`` (here ``timeout_s``, default 60 s, instead of torch's
10 minutes), and for NCCL the watchdog with ``TORCH_NCCL_ASYNC_ERROR_HANDLING=1``: when a
collective times out or fails, the watchdog logs which one (``Watchdog caught collective
operation timeout: WorkNCCL(SeqNum=..., OpType=...)``) and tears the process down, so the
job exits with an error instead of waiting forever (the graphs and side streams of FSDP
never block the host, so a host-side exception could not be raised). gloo raises in the
calling rank: a closed peer connection at once, a silent peer after ``timeout_s``. Raise
``timeout_s`` (or set ``GRAPH_FSDP_PG_TIMEOUT_S``) for steps or checkpoint writes longer than
it (every rank waits at most that long for the slowest one).
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 60.0
"""Seconds a collective may wait for its peers before the ranks fail (see the note)."""

TIMEOUT_ENV = "GRAPH_FSDP_PG_TIMEOUT_S"
"""Environment variable overriding the default timeout (the CLI and spawn read it too)."""

NCCL_ENV = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
"""Set (unless already set) before an NCCL group is created: see [Note: failure bounds]."""

GRAPH_REGISTER_ENV = "NCCL_GRAPH_REGISTER"
"""NCCL's registration of the buffers of graph-captured collectives; 0 is what a graph that
captures an all-to-all needs (capture/step.py [Note: NCCL graph registration and the
all-to-all])."""


def init_distributed(
    backend: str | None = None,
    *,
    timeout_s: float | None = None,
    rank: int | None = None,
    world_size: int | None = None,
) -> dist.ProcessGroup:
    """``dist.init_process_group`` with bounded failure (see [Note: failure bounds]).

    ``timeout_s``: None reads ``GRAPH_FSDP_PG_TIMEOUT_S`` (default 60 s).
    ``backend``: None picks NCCL when CUDA is available, else gloo. Rank and world size
    default to the launcher's ``RANK``/``WORLD_SIZE``; NCCL ranks use the GPU ``LOCAL_RANK``
    names (``torch.cuda.set_device`` and the group's ``device_id``).
    """
    if timeout_s is None:
        timeout_s = float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S))
    if timeout_s <= 0:
        raise ValueError(f"timeout_s={timeout_s} must be > 0 (seconds a collective may wait)")
    if dist.is_initialized():
        raise RuntimeError(
            "init_distributed: a default process group exists already; call "
            "dist.destroy_process_group() first or use the existing group"
        )
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    rank = int(os.environ.get("RANK", 0)) if rank is None else rank
    world_size = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size
    kwargs = {}
    if backend == "nccl":
        for key, value in NCCL_ENV.items():
            os.environ.setdefault(key, value)
        local = int(os.environ.get("LOCAL_RANK", rank % max(torch.cuda.device_count(), 1)))
        torch.cuda.set_device(local)
        kwargs["device_id"] = torch.device("cuda", local)
    dist.init_process_group(
        backend,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
        **kwargs,
    )
    return dist.group.WORLD
