"""Helpers to run real multi-process groups (gloo on CPU, NCCL on GPUs) in tests and tools."""

from __future__ import annotations

import gc
import io
import os
import socket
import traceback
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(
    rank: int, fn: Callable, world_size: int, port: int, backend: str, args: tuple, queue
) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
    )
    try:
        if backend == "nccl":
            from graph_fsdp.capture.te_backend import preload_te  # noqa: PLC0415

            preload_te()
            torch.cuda.set_device(rank)
            dist.init_process_group(
                backend, rank=rank, world_size=world_size, device_id=torch.device("cuda", rank)
            )
        else:
            dist.init_process_group(backend, rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        buf = io.BytesIO()  # plain bytes: shared-memory tensors die with the child
        torch.save(result, buf)
        queue.put((rank, "ok", buf.getvalue()))
    except BaseException:  # noqa: BLE001 - report any failure to the parent
        queue.put((rank, "error", traceback.format_exc()))
        raise
    finally:
        if dist.is_initialized():
            # Collect cycles that keep the engine (and its group) alive first, so that the group
            # really is destroyed here, not by a gloo thread during interpreter shutdown.
            gc.collect()
            dist.destroy_process_group()


def spawn(
    fn: Callable, world_size: int = 2, *args, backend: str = "gloo", timeout: float = 300
) -> list:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` fresh processes; return results.

    ``fn`` must be importable (module level). Raises with the first failing rank's traceback.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [
        ctx.Process(target=_entry, args=(r, fn, world_size, port, backend, args, queue))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    errors = []
    for _ in range(world_size):
        rank, status, payload = queue.get()
        if status == "ok":
            results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
        else:
            errors.append(f"rank {rank} failed:\n{payload}")
            break
    for p in procs:
        p.join(timeout=timeout if not errors else 5)
        if p.is_alive():
            p.terminate()
    if errors:
        raise RuntimeError("\n".join(errors))
    return [results[r] for r in range(world_size)]
