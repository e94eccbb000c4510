"""GPU host: the host time of one call of each per-layer operation of a layerwise step.

    torchrun --nproc-per-node 2 tools/nccl_host_cost.py [--numel 65536] [--calls 400]

Times, per call and without synchronising between calls (the GPU work is tiny, so the
host is the bottleneck), what FSDP issues around a layer's graph replay: all-gather and
reduce-scatter through ``torch.distributed`` and through the process group's own methods
(no Python argument checks), a copy kernel, an event record + wait, a stream switch, and a
graph replay. Run it under different ``TORCH_NCCL_*`` settings to see what they cost.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions, ReduceScatterOptions


def _wait(work) -> None:
    if work is not None:
        work.wait()


def timed(fn, calls: int) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / calls * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False)
    ap.add_argument("--numel", type=int, default=1 << 16)
    ap.add_argument("--calls", type=int, default=400)
    args = ap.parse_args()
    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", device_id=dev)
    world = dist.get_world_size()
    group = dist.group.WORLD
    n = args.numel
    full = torch.zeros(n * world, dtype=torch.bfloat16, device=dev)
    shard = full[rank * n : (rank + 1) * n]
    grads = torch.ones(n * world, dtype=torch.float32, device=dev)
    out = torch.empty(n, dtype=torch.float32, device=dev)
    src = torch.ones(n, dtype=torch.float32, device=dev)
    side = torch.cuda.Stream()
    event = torch.cuda.Event()
    main_stream = torch.cuda.current_stream()

    ag_opts = AllgatherOptions()
    rs_opts = ReduceScatterOptions()
    rs_opts.reduceOp = dist.ReduceOp.SUM
    ag_opts.asyncOp = rs_opts.asyncOp = False

    def on_side(fn):
        def run():
            torch.cuda.set_stream(side)
            fn()
            torch.cuda.set_stream(main_stream)

        return run

    graph = torch.cuda.CUDAGraph()
    static = torch.zeros(n, device=dev)
    s = torch.cuda.Stream()
    s.wait_stream(main_stream)
    with torch.cuda.stream(s):
        static.add_(1)
        with torch.cuda.graph(graph, stream=s):
            static.add_(1)
    main_stream.wait_stream(s)

    def rec_wait():
        event.record(side)
        main_stream.wait_event(event)

    cases = {
        "dist.all_gather_into_tensor": lambda: dist.all_gather_into_tensor(full, shard),
        "group._allgather_base": lambda: _wait(group._allgather_base(full, shard, ag_opts)),
        "dist.reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(out, grads),
        "group._reduce_scatter_base": lambda: _wait(
            group._reduce_scatter_base(out, grads, rs_opts)
        ),
        "all_gather on a side stream (set_stream x2)": on_side(
            lambda: _wait(group._allgather_base(full, shard, ag_opts))
        ),
        "copy_ (fp32 -> bf16)": lambda: shard.copy_(src),
        "mul_": lambda: out.mul_(0.5),
        "event.record + wait_event": rec_wait,
        "torch.cuda.set_stream x2": on_side(lambda: None),
        "graph.replay (1 kernel)": graph.replay,
        "torch.cuda.current_stream()": torch.cuda.current_stream,
    }
    env = {k: v for k, v in os.environ.items() if k.startswith(("TORCH_NCCL", "TORCH_FR", "NCCL_"))}
    rows = [(name, timed(fn, args.calls)) for name, fn in cases.items()]
    if rank == 0:
        print(f"# host us per call, {torch.cuda.get_device_name()}, torch {torch.__version__}")
        print(f"# numel {n} x {world} ranks; env {env}")
        for name, us in rows:
            print(f"{name:48s} {us:7.1f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
