"""The profiled training loop behind ``graph-fsdp profile``.

Eager runs use a loop of their own (the same steps, data and optimizer as ``train.run``)
that names what it does with ``graph_fsdp/<phase>/<fqn>`` ranges: ``step/<i>``,
``forward/<layer fqn>`` (including the FSDP hooks around the layer), ``forward/model``,
``backward/model`` and ``optimizer/step``. They are ``record_function`` ranges, which the
torch profiler sees, and on CUDA also NVTX ranges, which nsys sees (the engine's own
``graph_fsdp/...`` ranges are NVTX only). Graphed runs go through ``train.run`` itself,
which owns capture and names each step ``graph_fsdp/step/<i>`` too (loop.py), the
one-graph step included (its optimizer runs inside the replay).
"""

from __future__ import annotations

import json
import os
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import nn

from graph_fsdp.bench.trace import summarize_trace
from graph_fsdp.cuda_streams import STEP_RANGE_PREFIX
from graph_fsdp.models import synthetic_batch, transformer_layers
from graph_fsdp.training.train import (
    TrainConfig,
    build_for,
    device_of,
    make_optimizer,
    run,
    shard_model,
)


@dataclass(frozen=True, kw_only=True)
class ProfileJob:
    cfg: TrainConfig
    """cfg.steps: profiled steps (after ``warmup``)."""
    warmup: int
    output_dir: str
    torch_profiler: bool
    """False under nsys (CUPTI allows one subscriber): NVTX ranges only."""


@contextmanager
def named_range(name: str, cuda: bool):
    with ExitStack() as stack:
        stack.enter_context(torch.profiler.record_function(name))
        if cuda:
            stack.enter_context(torch.cuda.nvtx.range(name))
        yield


class LayerRanges:
    """``graph_fsdp/forward/<fqn>`` around each layer's call, FSDP's hooks included."""

    def __init__(self, model: nn.Module, cuda: bool) -> None:
        self.cuda = cuda
        self.open: dict[int, list[ExitStack]] = {}
        self.handles = []
        names = {id(m): n for n, m in model.named_modules()}
        for layer in transformer_layers(model):
            name = f"graph_fsdp/forward/{names[id(layer)]}"
            # prepend: enter before FSDP's pre-forward (unshard); the post hook runs last.
            self.handles.append(
                layer.register_forward_pre_hook(
                    lambda m, a, _n=name: self._enter(m, _n), prepend=True
                )
            )
            self.handles.append(
                layer.register_forward_hook(lambda m, a, o: self._exit(m), always_call=True)
            )

    def _enter(self, module: nn.Module, name: str) -> None:
        stack = ExitStack()
        stack.enter_context(named_range(name, self.cuda))
        self.open.setdefault(id(module), []).append(stack)

    def _exit(self, module: nn.Module) -> None:
        stacks = self.open.get(id(module))
        if stacks:
            stacks.pop().close()

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _eager_steps(rank: int, cfg: TrainConfig, device: torch.device):
    cuda = device.type == "cuda"
    model = shard_model(build_for(cfg, device), cfg)
    opt = make_optimizer(model.parameters(), cfg)
    LayerRanges(model, cuda)

    def step(i: int) -> float:
        if cuda:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        with named_range(f"{STEP_RANGE_PREFIX}{i}", cuda):
            for micro in range(cfg.grad_accum):
                x, y = synthetic_batch(
                    cfg.model,
                    cfg.micro_batch_size,
                    i * cfg.grad_accum + micro,
                    rank=rank,
                    device=device,
                )
                model.set_requires_gradient_sync(micro == cfg.grad_accum - 1)
                with named_range("graph_fsdp/forward/model", cuda):
                    loss = model(x, y) / cfg.grad_accum
                with named_range("graph_fsdp/backward/model", cuda):
                    loss.backward()
            with named_range("graph_fsdp/optimizer/step", cuda):
                opt.step()
                opt.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize(device)  # inside the range: the step's kernels belong to it
        return time.perf_counter() - t0

    return step


def profile_worker(rank: int, world_size: int, job: ProfileJob) -> dict | None:
    """Profile one rank; rank 0 returns every rank's summary (gathered)."""
    cfg, device = job.cfg, device_of(job.cfg)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    graphed = cfg.graphs.enabled
    times: list[float] = []
    with ExitStack() as stack:
        if graphed:
            # train.run owns capture: profile all of it; its step ranges delimit steps.
            run_cfg = replace(cfg, steps=job.warmup + cfg.steps, return_params=False, log_path=None)
            prof = (
                stack.enter_context(torch.profiler.profile(activities=activities))
                if job.torch_profiler
                else None
            )
            times = run(rank, world_size, run_cfg)["times"][job.warmup :]
        else:
            step = _eager_steps(rank, cfg, device)
            for i in range(job.warmup):
                step(i)
            prof = (
                stack.enter_context(torch.profiler.profile(activities=activities))
                if job.torch_profiler
                else None
            )
            times = [step(i) for i in range(job.warmup, job.warmup + cfg.steps)]
    summary, trace_path = None, None
    if prof is not None:
        trace_path = os.path.join(job.output_dir, f"trace_rank{rank}.json")
        prof.export_chrome_trace(trace_path)
        with open(trace_path) as f:
            summary = summarize_trace(json.load(f), skip_steps=job.warmup if graphed else 0)
    mine = {"rank": rank, "trace": trace_path, "summary": summary, "times": times}
    everyone = [None] * world_size
    if world_size > 1:
        dist.all_gather_object(everyone, mine)
    else:
        everyone = [mine]
    return {"ranks": everyone} if rank == 0 else None
