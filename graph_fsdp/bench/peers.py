"""Benchmark runners for the engines graph_fsdp is measured against.

Every runner builds the same model (:func:`graph_fsdp.models.build_model`, same config and
seed), feeds the same synthetic batches as :func:`graph_fsdp.training.train.run` (step ``i``, this
rank), trains ``warmup + steps`` optimizer steps with AdamW and times each step with
``synchronize`` + ``perf_counter`` (as ``train.run`` does). It returns the timed steps'
times (warmup dropped), the host time until each step's work was issued (before the
closing synchronize; host-bound when it is close to the step time), the timed steps' losses
(this rank's), the final loss (mean over ranks) and, for a graphed row, ``graphs``: its
captures, replays and eager fallbacks (bench/verdicts.py [Note: graphed rows must replay]).
The bench measures each row's memory around the runner (bench/runner.py).

A runner that cannot run here raises :class:`Skip` with the reason.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import fsdp as torch_fsdp  # torch's, kept apart from graph_fsdp's names
from torch.distributed.device_mesh import init_device_mesh

from graph_fsdp.bench.verdicts import COMM_INSIDE, COMM_NONE
from graph_fsdp.integrations.megatron.megatron_fsdp import megatron_fsdp_shard
from graph_fsdp.models import TransformerLayer, sharding_units, synthetic_batch
from graph_fsdp.training.train import TrainConfig, build_for, device_of, run


class Skip(Exception):  # a verdict, not an error
    """This row cannot run on this machine/config; the message says why."""


@dataclass(frozen=True, kw_only=True)
class BenchSpec:
    """What every row runs: the training config and how many steps to warm up and time."""

    cfg: TrainConfig
    warmup: int
    steps: int


# --------------------------------------------------------------------------------------------
# Shared helpers
# --------------------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _batch(cfg: TrainConfig, step: int, micro: int, rank: int, device: torch.device):
    return synthetic_batch(
        cfg.model, cfg.micro_batch_size, step * cfg.grad_accum + micro, rank=rank, device=device
    )


def _step_graph_report(replays: int, comm: str) -> dict:
    """The graph report of a row that captures its forward+backward once and replays it per
    microbatch (no module can fall back: the step is one graph)."""
    return {"captures": 1, "replays": replays, "eager_fallbacks": 0, "comm_status": comm}


def _mean_loss(loss: torch.Tensor, world_size: int) -> float:
    loss = loss.detach().float().clone()
    if world_size > 1:
        dist.all_reduce(loss)
        loss /= world_size
    return float(loss)


def _timed(
    spec: BenchSpec,
    device: torch.device,
    step_fn: Callable[[int], torch.Tensor],
    world_size: int,
    *,
    first_step: int = 0,
) -> dict:
    times, host, losses = [], [], []
    for i in range(first_step, spec.warmup + spec.steps):
        _sync(device)
        t0 = time.perf_counter()
        losses.append(step_fn(i))  # a fresh tensor per step: read after the loop
        host.append(time.perf_counter() - t0)
        _sync(device)
        times.append(time.perf_counter() - t0)
    skip = max(0, spec.warmup - first_step)
    return {
        "times": times[skip:],
        "host_step_times": host[skip:],
        "losses": [float(x) for x in losses[skip:]],
        "final_loss": _mean_loss(losses[-1], world_size),
    }


def _from_run(result: dict, warmup: int) -> dict:
    """A ``train.run`` result as a row's raw numbers (warmup steps dropped)."""
    host = result["host_times"]
    return {
        "times": result["times"][warmup:],
        "host_step_times": host["step"][warmup:],
        "host_forward_times": host["forward"][warmup:],
        "host_backward_times": host["backward"][warmup:],
        "losses": result["losses"][warmup:],
        "final_loss": result["losses"][-1],
        "graphs": result.get("cuda_graphs"),
        "document_tokens": result.get("document_tokens", [])[warmup:],
    }


def accumulating_step(
    cfg: TrainConfig,
    model: nn.Module,
    opt: torch.optim.Optimizer,
    rank: int,
    device: torch.device,
    set_sync: Callable[[bool], None] | None,
    *,
    autocast: bool = False,
) -> Callable[[int], torch.Tensor]:
    """An eager step of ``cfg.grad_accum`` microbatches of ``rank``'s batches, then the
    optimizer; ``set_sync(last)`` before each microbatch (sharded models), the forward under
    :func:`_autocast` with ``autocast`` (the unsharded baseline)."""

    def step(i: int) -> torch.Tensor:
        total = torch.zeros((), device=device)
        for micro in range(cfg.grad_accum):
            x, y = _batch(cfg, i, micro, rank, device)
            if set_sync is not None:
                set_sync(micro == cfg.grad_accum - 1)
            with _autocast(cfg, device) if autocast else contextlib.nullcontext():
                loss = model(x, y) / cfg.grad_accum
            loss.backward()
            total += loss.detach().float()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return total

    return step


# --------------------------------------------------------------------------------------------
# graph_fsdp itself and the unsharded reference (both through graph_fsdp.training.train.run)
# --------------------------------------------------------------------------------------------


def run_graph_fsdp(rank: int, world_size: int, spec: BenchSpec) -> dict:
    """graph_fsdp through ``train.run`` (eager or graphed, as ``spec.cfg`` says)."""
    cfg = replace(spec.cfg, steps=spec.warmup + spec.steps, return_params=False, log_path=None)
    return _from_run(run(rank, world_size, cfg), spec.warmup)


def run_reference(rank: int, world_size: int, spec: BenchSpec) -> dict | None:
    """graph_fsdp's parity reference on rank 0 with the per-GPU batch: bf16 weights, fp32
    master copies, grads cast to fp32 and a non-fused AdamW (``train.MixedPrecisionReference``).

    Slower than a well-written single-GPU step (see ``run_unsharded``): not a baseline for
    ratios. The other ranks wait at a barrier; the row's world size is 1.
    """
    result = None
    if rank == 0:
        cfg = replace(
            spec.cfg.with_graphs(impl="none", scopes=()),
            mode="reference",
            steps=spec.warmup + spec.steps,
            return_params=False,
            log_path=None,
        )
        result = _from_run(run(0, 1, cfg), spec.warmup)
    if world_size > 1:
        dist.barrier()
    return result


# --------------------------------------------------------------------------------------------
# Fast unsharded single-GPU steps: the baselines every row's ratio is taken against
# --------------------------------------------------------------------------------------------

UNSHARDED_SCHEME = (
    "fp32 weights, bf16 autocast (cache off), fused AdamW over the fp32 weights, per-GPU batch"
)
"""Precision scheme of the ``unsharded eager`` / ``unsharded captured`` rows in bf16 runs
(without --bf16 they compute in fp32: autocast is off)."""


def _unsharded(cfg: TrainConfig, device: torch.device):
    """fp32 model and fused AdamW (foreach where fused is unavailable) on this device."""
    model = build_for(cfg, device)
    try:
        opt = torch.optim.AdamW(
            model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, fused=True
        )
    except RuntimeError:  # a device without a fused kernel
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    return model, opt


def _autocast(cfg: TrainConfig, device: torch.device):
    # cache off: every weight is cast once per forward anyway, and a captured graph must not
    # keep casts cached from outside the capture.
    return torch.autocast(
        device.type,
        dtype=torch.bfloat16,
        enabled=cfg.mp.param_dtype is not None,
        cache_enabled=False,
    )


def _on_rank0(rank: int, world_size: int, fn: Callable[[], dict]) -> dict | None:
    """Run ``fn`` on rank 0 only (a 1-GPU row); the other ranks wait at a barrier."""
    result = fn() if rank == 0 else None
    if world_size > 1:
        dist.barrier()
    return result


def run_unsharded(rank: int, world_size: int, spec: BenchSpec) -> dict | None:
    """One GPU (rank 0), whole model, eager: autocast forward+backward, fused AdamW step."""

    def body() -> dict:
        cfg, device = spec.cfg, device_of(spec.cfg)
        model, opt = _unsharded(cfg, device)
        step = accumulating_step(cfg, model, opt, 0, device, None, autocast=True)
        return _timed(spec, device, step, 1)

    return _on_rank0(rank, world_size, body)


def _static_batch(cfg, rank: int, device: torch.device):
    """``x, y, load``: a batch in fixed tensors (what a captured graph reads) and
    ``load(i, micro=0)``, which copies microbatch ``micro`` of step ``i`` into them."""
    x, y = _batch(cfg, 0, 0, rank, device)

    def load(i: int, micro: int = 0) -> None:
        xi, yi = _batch(cfg, i, micro, rank, device)
        x.copy_(xi)
        y.copy_(yi)

    return x, y, load


def run_unsharded_captured(rank: int, world_size: int, spec: BenchSpec) -> dict | None:
    """One GPU (rank 0): autocast forward+backward captured in one CUDA graph, eager fused
    AdamW step. Microbatches replay the graph, which accumulates into the fixed ``.grad``."""
    cfg = spec.cfg
    if cfg.device != "cuda":
        raise Skip("CUDA graphs need a CUDA device")
    if spec.warmup < 1:
        raise Skip("needs at least one warmup step before capture")

    def body() -> dict:
        device = device_of(cfg)
        model, opt = _unsharded(cfg, device)
        x, y, load = _static_batch(cfg, 0, device)

        def forward_backward() -> torch.Tensor:
            with _autocast(cfg, device):
                loss = model(x, y) / cfg.grad_accum
            loss.backward()
            return loss.detach()

        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # eager warmup steps (untimed) on the capture stream
            for i in range(spec.warmup):
                opt.zero_grad(set_to_none=False)
                for micro in range(cfg.grad_accum):
                    load(i, micro)
                    forward_backward()
                opt.step()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        opt.zero_grad(set_to_none=False)
        with torch.cuda.graph(graph, stream=side):
            static_loss = forward_backward()

        replays = [0]

        def replay(i: int) -> torch.Tensor:
            opt.zero_grad(set_to_none=False)
            total = torch.zeros((), device=device)
            for micro in range(cfg.grad_accum):
                load(i, micro)
                graph.replay()
                replays[0] += 1
                total += static_loss.float()
            opt.step()
            return total

        out = _timed(spec, device, replay, 1, first_step=spec.warmup)
        return {**out, "graphs": _step_graph_report(replays[0], COMM_NONE)}

    return _on_rank0(rank, world_size, body)


# --------------------------------------------------------------------------------------------
# torch FSDP2
# --------------------------------------------------------------------------------------------


def fsdp2_model(cfg: TrainConfig, world_size: int, device: torch.device):
    model = build_for(cfg, device)
    # A 2-D (replicate, shard) mesh is FSDP2's HSDP (its optimizer stays replicated).
    mesh = init_device_mesh(device.type, tuple(cfg.mesh_shape or (world_size,)))
    mp = torch_fsdp.MixedPrecisionPolicy(param_dtype=cfg.compute_dtype, reduce_dtype=torch.float32)
    # FSDP2 has one sharding scheme; keeping weights gathered after forward is its ZeRO-2.
    reshard = cfg.strategy == "optim_grads_params"
    for unit, unit_reshard in sharding_units(model):  # the units graph_fsdp's rows use
        torch_fsdp.fully_shard(
            unit, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard and unit_reshard
        )
    torch_fsdp.fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
    opt = torch.optim.AdamW(
        model.parameters(),
        lr=cfg.lr,
        weight_decay=cfg.weight_decay,
        fused=cfg.fused_optimizer or None,
    )
    return model, opt


def run_fsdp2(rank: int, world_size: int, spec: BenchSpec) -> dict:
    """torch FSDP2 ``fully_shard`` per layer then root; bf16 params, fp32 reduction."""
    cfg, device = spec.cfg, device_of(spec.cfg)
    model, opt = fsdp2_model(cfg, world_size, device)
    step = accumulating_step(cfg, model, opt, rank, device, model.set_requires_gradient_sync)
    return _timed(spec, device, step, world_size)


def run_fsdp2_cuda_graph(rank: int, world_size: int, spec: BenchSpec) -> dict:
    """FSDP2 with forward+backward captured whole in one CUDA graph; eager optimizer step.

    Recipe: warm up on a side stream, ``zero_grad(set_to_none=False)`` so the gradients keep
    their addresses, capture ``loss = model(x, y); loss.backward()`` on that stream, then per
    step copy the batch into the static inputs, replay, and step the optimizer eagerly.
    """
    cfg = spec.cfg
    if cfg.device != "cuda":
        raise Skip("CUDA graphs need a CUDA device")
    if cfg.grad_accum != 1:
        raise Skip("the captured step holds one microbatch: needs gradient accumulation 1")
    if spec.warmup < 1:
        raise Skip("needs at least one warmup step before capture")
    device = device_of(cfg)
    model, opt = fsdp2_model(cfg, world_size, device)
    x, y, load = _static_batch(cfg, rank, device)

    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # eager warmup steps (untimed) on the capture stream
        for i in range(spec.warmup):
            load(i)
            opt.zero_grad(set_to_none=False)
            model(x, y).backward()
            opt.step()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=False)
    with torch.cuda.graph(graph, stream=side):
        static_loss = model(x, y)
        static_loss.backward()

    replays = [0]

    def replay(i: int) -> torch.Tensor:
        load(i)
        opt.zero_grad(set_to_none=False)
        graph.replay()
        replays[0] += 1
        opt.step()
        return static_loss.detach().clone()

    out = _timed(spec, device, replay, world_size, first_step=spec.warmup)
    return {**out, "graphs": _step_graph_report(replays[0], COMM_INSIDE)}


# --------------------------------------------------------------------------------------------
# Megatron-FSDP
# --------------------------------------------------------------------------------------------


def run_megatron_fsdp(rank: int, world_size: int, spec: BenchSpec) -> dict:
    """``megatron_fsdp.fully_shard`` with TransformerLayer units and fp32 main params/grads."""
    cfg = spec.cfg
    if cfg.device != "cuda":
        raise Skip("megatron_fsdp needs a CUDA device")
    try:
        import megatron_fsdp  # noqa: F401, PLC0415 - availability check (optional package)
    except ImportError as err:
        raise Skip(f"megatron_fsdp is not importable ({err.__class__.__name__}: {err})") from None
    if cfg.mp.param_dtype is None:
        raise Skip("megatron_fsdp runs a bf16 model: pass --bf16 for a like-for-like row")
    if cfg.grad_accum != 1:
        raise Skip(
            "this runner does not drive megatron_fsdp's no-sync accumulation: needs "
            "gradient accumulation 1"
        )
    device = device_of(cfg)
    mesh = init_device_mesh("cuda", (world_size, 1), mesh_dim_names=("dp_shard", "tp"))
    model = build_for(cfg, device).to(torch.bfloat16)
    model, opt = megatron_fsdp_shard(model, mesh, "dp_shard", TransformerLayer, cfg)

    def step(i: int) -> torch.Tensor:
        x, y = _batch(cfg, i, 0, rank, device)
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach().float()

    return _timed(spec, device, step, world_size)
