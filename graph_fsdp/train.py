"""Training loop shared by the CLI, the tests and the benchmarks.

``run(rank, world_size, cfg)`` trains the reference model under graph_fsdp (or, with
``cfg.mode == "reference"``, an unsharded single-process mixed-precision reference on the
global batch) and returns per-step losses, step times and final full parameters.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.checkpoint import checkpoint

from graph_fsdp import checkpoint as ckpt
from graph_fsdp.api import BufferPolicy, MixedPrecisionPolicy
from graph_fsdp.capture import (
    FullIterationGraphs,
    GraphConfigError,
    LayerwiseGraphs,
    check_scopes,
    te_backend,
)
from graph_fsdp.capture.step import HostClock, eager_forward_backward
from graph_fsdp.data import batch_for
from graph_fsdp.experts import init_expert_mesh
from graph_fsdp.fully_shard import fully_shard
from graph_fsdp.grad_norm import clip_grad_norm_
from graph_fsdp.interrupt import mean_loss_and_stop
from graph_fsdp.models import (
    GPTConfig,
    build_model,
    partition_experts,
    sharding_units,
    transformer_layers,
)
from graph_fsdp.optim_offload import CPUOffloadOptimizer, check_offload_config


@dataclass(kw_only=True)
class TrainConfig:
    model: GPTConfig = field(default_factory=GPTConfig)
    """Model shape."""
    mode: str = "fsdp"
    """fsdp: graph_fsdp; reference: unsharded single-process model on the global batch."""
    strategy: str = "optim_grads_params"
    """Data-parallel sharding strategy."""
    mesh_shape: tuple[int, int] | None = None
    """HSDP: (replicate, shard) sizes of a 2-D device mesh over every rank (their product is
    the world size; e.g. (nodes, GPUs per node)). None: 1-D FSDP over every rank."""
    optim_over_replicas: bool = False
    """HSDP: shard the optimizer (main weights and grads) across the replicas as well."""
    expert_parallel: int | None = None
    """MoE models: partition the experts over expert-parallel groups of this many ranks and
    shard them over the expert-data-parallel group (world / this), the other parameters over
    the data-parallel group (graph_fsdp.experts). None: experts are sharded like the rest."""
    micro_batch_size: int = 1
    """Sequences per rank per microbatch."""
    grad_accum: int = 1
    """Microbatches per step (no_sync on all but the last)."""
    steps: int = 10
    """Optimizer steps."""
    lr: float = 1e-3
    """AdamW learning rate."""
    weight_decay: float = 0.01
    """AdamW weight decay."""
    clip_grad: float = 0.0
    """Global gradient-norm clipping before each optimizer step (0: off)."""
    bf16: bool = False
    """bf16 compute weights with fp32 main weights and grads."""
    grad_comm_dtype: str | None = None
    """None (fp32) or bf16 reduction."""
    reduce_scatter_fp32_accumulation: bool = False
    """bf16 gradients over the wire (all-to-all), summed in fp32 by each rank
    (MixedPrecisionPolicy.reduce_scatter_fp32_accumulation)."""
    allocator: str = "dynamic"
    """dynamic | double_buffer | trace_pool."""
    num_slots: int = 2
    """Double-buffer slots per size class."""
    persist_on_alloc_fail: bool = False
    """Dedicated persistent buffers for unplanned requests."""
    recompute: bool = False
    """Activation checkpointing of every transformer layer."""
    eval_interval: int = 0
    """Run a forward-only eval pass every N steps (0: never)."""
    save_path: str | None = None
    """DCP checkpoint directory written after ``save_at`` steps."""
    save_at: int = 0
    """Step after which to save."""
    save_on_interrupt: bool = False
    """Save to ``save_path`` when a stop request (SIGINT/SIGTERM, interrupt.py) ends the run
    early, at the step boundary where it stops."""
    load_path: str | None = None
    """DCP checkpoint to resume from before training (steps continue at ``start_step``)."""
    start_step: int = 0
    """Data stream position of the first step (for resume)."""
    data_path: str | None = None
    """Training data: a flat numpy uint16 token file, read through np.memmap
    (``np.array(ids, dtype=np.uint16).tofile(path)``); None = synthetic tokens."""
    fused_optimizer: bool = False
    """AdamW(fused=True)."""
    optimizer_offload_fraction: float = 0.0
    """Share of the local shards (by elements) whose AdamW state lives and steps on the CPU
    (graph_fsdp.optim_offload); 0 keeps it on the device. Needs recompute off."""
    device: str = "cpu"
    """cpu or cuda."""
    deterministic: bool = False
    """torch.use_deterministic_algorithms(True) for the whole process (plus cuBLAS and
    TransformerEngine settings): bit-reproducible eager runs, e.g. flash-attention backward."""
    log_path: str | None = None
    """JSON lines: one record per step (rank 0)."""
    return_params: bool = True
    """Gather full parameters at the end (for parity tests)."""
    cuda_graph_impl: str = "none"
    """none | torch | te: layerwise/full-iteration CUDA graphs (CUDA only)."""
    cuda_graph_scope: list[str] = field(default_factory=list)
    """Megatron scopes: [] whole layer, attn, mlp, moe, moe_router, moe_preprocess, full_iteration."""
    cuda_graph_warmup_steps: int = 2
    """Eager training steps before capture."""
    cuda_graph_scope_modules: dict[str, list[str]] = field(default_factory=dict)
    """Scope -> submodule paths relative to each FSDP unit, replacing that scope's presets
    or defining a new scope (``{"attn": ["self_attn"]}``; --cuda-graph-scope-modules)."""
    cuda_graph_comm: bool = True
    """Layerwise graphs: each unit's gather and reduction kernels replay as CUDA graphs
    (capture/comm_graphs.py [Note: communication graphs]; --no-cuda-graph-comm: eager)."""
    cuda_graph_verify: bool = False
    """Check the first graphed step against an eager run of it from the same state and name
    the first module whose output differs (graph-fsdp compare turns it on)."""

    @property
    def compute_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.bf16 else torch.float32


def shard_model(model: nn.Module, cfg: TrainConfig) -> nn.Module:
    mp = MixedPrecisionPolicy(
        param_dtype=cfg.compute_dtype if cfg.bf16 else None,
        grad_comm_dtype=torch.bfloat16 if cfg.grad_comm_dtype == "bf16" else None,
        reduce_scatter_fp32_accumulation=cfg.reduce_scatter_fp32_accumulation,
    )
    bp = BufferPolicy(
        allocator=cfg.allocator,
        num_slots=cfg.num_slots,
        persist_on_alloc_fail=cfg.persist_on_alloc_fail,
    )
    placement = {
        "mesh": data_parallel_mesh(cfg),
        "strategy": cfg.strategy,
        "optim_over_replicas": cfg.optim_over_replicas,
    }
    if cfg.expert_parallel is not None:
        if cfg.model.num_experts is None:
            raise ValueError(
                f"TrainConfig.expert_parallel={cfg.expert_parallel} needs an MoE model: set "
                "GPTConfig.num_experts (or leave expert_parallel None)"
            )
        expert_mesh = _cached_mesh(
            cfg.device,
            (dist.get_world_size() // cfg.expert_parallel, cfg.expert_parallel),
            ("edp", "ep"),
            lambda: init_expert_mesh(cfg.device, cfg.expert_parallel),
        )
        partition_experts(model, expert_mesh["ep"].get_group())
        placement["expert_mesh"] = expert_mesh  # units without experts ignore it
    for unit, reshard in sharding_units(model):
        fully_shard(
            unit, **placement, mp_policy=mp, buffer_policy=bp, reshard_after_forward=reshard
        )
    return fully_shard(model, **placement, mp_policy=mp, buffer_policy=bp)


def placement_label(cfg: TrainConfig) -> str:
    """The strategy and, for HSDP, the mesh (and the EP size): for summaries and reports."""
    ep = "" if cfg.expert_parallel is None else f", expert parallel {cfg.expert_parallel}"
    if cfg.mesh_shape is None:
        return cfg.strategy + ep
    r, s = cfg.mesh_shape
    over = ", optimizer over replicas" if cfg.optim_over_replicas else ""
    return f"{cfg.strategy} HSDP replicate {r} x shard {s}{over}{ep}"


_MESHES: dict[tuple, tuple] = {}
"""(device type, shape, dimension names) -> (the default group it was built under, mesh):
runs in one process (compare, bench, tests) reuse one mesh instead of creating new process
groups each time."""


def data_parallel_mesh(cfg: TrainConfig):
    """The 2-D (replicate, shard) DeviceMesh of ``cfg.mesh_shape`` (None: 1-D, no mesh)."""
    if cfg.mesh_shape is None:
        return None
    shape = tuple(cfg.mesh_shape)
    world = dist.get_world_size()
    if len(shape) != 2 or min(shape) < 1 or shape[0] * shape[1] != world:
        raise ValueError(
            f"TrainConfig.mesh_shape={cfg.mesh_shape} must be (replicate, shard) sizes >= 1 "
            f"whose product is the world size {world}, e.g. (2, {world // 2}) or (1, {world})"
        )
    names = ("replicate", "shard")
    return _cached_mesh(
        cfg.device, shape, names, lambda: init_device_mesh(cfg.device, shape, mesh_dim_names=names)
    )


def _cached_mesh(device: str, shape: tuple, names: tuple, build):
    key = (device, shape, names)
    cached = _MESHES.get(key)
    if cached is None or cached[0] is not dist.group.WORLD:
        cached = _MESHES[key] = (dist.group.WORLD, build())
    return cached[1]


class MixedPrecisionReference:
    """Unsharded reference: compute-dtype model, fp32 master weights and AdamW over them."""

    def __init__(self, model: nn.Module, cfg: TrainConfig) -> None:
        self.model = model
        self.params = [p for p in model.parameters()]
        self.master = [p.detach().float().clone().requires_grad_(True) for p in self.params]
        self.opt = make_optimizer(self.master, cfg)
        if cfg.bf16:
            model.to(torch.bfloat16)

    def step(self, clip_grad: float = 0.0) -> None:
        for m, p in zip(self.master, self.params):
            m.grad = p.grad.float() if p.grad is not None else None
        if clip_grad > 0:
            torch.nn.utils.clip_grad_norm_(self.master, clip_grad)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            torch._foreach_copy_(self.params, self.master)
        for p in self.params:
            p.grad = None


def device_of(cfg: TrainConfig) -> torch.device:
    """The device this process trains on: the current CUDA device (launchers set it from
    LOCAL_RANK, so this is right on every node) or the CPU."""
    if cfg.device == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def checkpoint_layers(model: nn.Module) -> None:
    """Activation checkpointing (non-reentrant) around every transformer layer."""
    for layer in transformer_layers(model):
        forward = layer.forward

        def wrapped(*args, _f=forward, **kwargs):
            return checkpoint(_f, *args, use_reentrant=False, **kwargs)

        layer.forward = wrapped


def build_for(cfg: TrainConfig, device: torch.device) -> nn.Module:
    """The (unsharded) model ``cfg`` describes: seeded, with recompute when asked."""
    torch.manual_seed(cfg.model.seed)
    model = build_model(cfg.model, device=device)
    if cfg.recompute:
        checkpoint_layers(model)
    return model


def make_optimizer(params, cfg: TrainConfig) -> torch.optim.Optimizer:
    kwargs = {"lr": cfg.lr, "weight_decay": cfg.weight_decay, "fused": cfg.fused_optimizer or None}
    if cfg.optimizer_offload_fraction > 0:
        check_offload_config(recompute=cfg.recompute)
        return CPUOffloadOptimizer(
            params,
            torch.optim.AdamW,
            offload_fraction=cfg.optimizer_offload_fraction,
            **kwargs,
        )
    return torch.optim.AdamW(params, **kwargs)


def make_graphs(model: nn.Module, cfg: TrainConfig):
    """The CUDA graph runner ``cfg`` asks for (None for eager runs)."""
    if cfg.cuda_graph_impl == "none":
        return None
    if cfg.model.transformer_impl == "transformer_engine":
        # Before any step; the capture checks every TE attention call again (any model).
        te_backend.check_attention_capture(
            seq_length=cfg.model.seq_length,
            impl=cfg.cuda_graph_impl,
            scopes=cfg.cuda_graph_scope,
            backend=te_backend.te_attention_backend_from_env(),
        )
    if "full_iteration" in cfg.cuda_graph_scope:
        if cfg.cuda_graph_impl != "torch":
            raise GraphConfigError(
                f"cuda_graph_scope full_iteration is captured with torch.cuda graphs, not "
                f"cuda_graph_impl={cfg.cuda_graph_impl!r}: use --cuda-graph-impl torch"
            )
        check_scopes(cfg.cuda_graph_scope)
        return FullIterationGraphs(
            model, warmup_steps=cfg.cuda_graph_warmup_steps, verify=cfg.cuda_graph_verify
        )
    if cfg.recompute:
        raise GraphConfigError(
            "recompute=True (--recompute-activations) re-runs layer forwards inside backward, "
            "which layerwise CUDA graphs do not capture; turn recompute off, use "
            "--cuda-graph-scope full_iteration, or cuda_graph_impl='none'"
        )
    return LayerwiseGraphs(
        model,
        impl=cfg.cuda_graph_impl,
        scopes=cfg.cuda_graph_scope,
        warmup_steps=cfg.cuda_graph_warmup_steps,
        scope_modules=cfg.cuda_graph_scope_modules,
        verify=cfg.cuda_graph_verify,
        comm_graphs=cfg.cuda_graph_comm,
    )


def run(rank: int, world_size: int, cfg: TrainConfig) -> dict:
    if cfg.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        os.environ.setdefault("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")
        torch.use_deterministic_algorithms(True)
    device = device_of(cfg)
    if device.type == "cuda":  # the peaks reported are this run's (runs share a process)
        torch.cuda.reset_peak_memory_stats(device)
    reference = cfg.mode == "reference"
    model = build_for(cfg, device)
    if reference:
        trainer = MixedPrecisionReference(model, cfg)
        optimizer = None
    else:
        shard_model(model, cfg)
        optimizer = make_optimizer(model.parameters(), cfg)
        if cfg.load_path:
            ckpt.load(cfg.load_path, model, optimizer)
    graphs = None if reference else make_graphs(model, cfg)
    # The reference sees every rank's microbatches as one global batch.
    ranks = range(world_size) if reference else [rank]
    losses, times, eval_losses = [], [], []
    host = {"step": [], "forward": [], "backward": []}
    log = open(cfg.log_path, "a") if cfg.log_path and rank == 0 else None
    saved_at = stopped_at = None
    for step in range(cfg.start_step, cfg.start_step + cfg.steps):
        if graphs is not None:
            graphs.before_step()  # capture (after the warmup steps) is not timed
        if cfg.device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        clock = HostClock()
        step_loss = torch.zeros((), device=device)
        for micro in range(cfg.grad_accum):
            last = micro == cfg.grad_accum - 1
            if not reference:
                model.set_requires_gradient_sync(last)
            # The reference runs every rank's microbatch in turn (MoE capacity is per
            # microbatch, so concatenating them would route tokens differently).
            for r in ranks:
                x, y = batch_for(
                    cfg, step * cfg.grad_accum + micro, r, device, world_size=world_size
                )
                denom = cfg.grad_accum * len(ranks)
                if graphs is not None:
                    step_loss += graphs.forward_backward(micro, x, y, denom, clock)
                else:
                    # No live autograd graph is kept (it would pin AccumulateGrad streams).
                    step_loss += eager_forward_backward(model, x, y, denom, clock)
        if reference:
            trainer.step(cfg.clip_grad)
        else:
            if cfg.clip_grad > 0:  # the global norm: grad_norm.py
                clip_grad_norm_(model.parameters(), cfg.clip_grad)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        # The mean loss over the ranks and their stop requests: interrupt.py [Note: stopping at
        # a step boundary].
        step_loss, stop_votes = mean_loss_and_stop(step_loss, 1 if reference else world_size)
        host["step"].append(time.perf_counter() - t0)  # all of the step issued
        host["forward"].append(clock.forward)
        host["backward"].append(clock.backward)
        if cfg.device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(step_loss.item())
        stopping = stop_votes.item() > 0
        if cfg.eval_interval and (step + 1) % cfg.eval_interval == 0:
            with torch.no_grad():
                xe, ye = batch_for(cfg, step, rank, device, eval=True, world_size=world_size)
                eval_losses.append(model(xe, ye).item())
        if log is not None:
            log.write(
                json.dumps({"step": step, "loss": losses[-1], "step_time_s": times[-1]}) + "\n"
            )
            log.flush()
        scheduled = step + 1 == cfg.start_step + cfg.save_at
        if cfg.save_path and not reference and (scheduled or stopping and cfg.save_on_interrupt):
            ckpt.save(cfg.save_path, model, optimizer, meta={"iteration": step + 1, "model": "gpt"})
            saved_at = step + 1
        if stopping:
            stopped_at = step + 1
            break
    result = {
        "losses": losses,
        "times": times,
        "host_times": host,
        "eval_losses": eval_losses,
        "config": asdict(cfg),
        "saved_at": saved_at,
        "stopped_at": stopped_at,
    }
    if cfg.return_params:
        if reference:
            result["params"] = {
                n: p.detach().float().cpu()
                for n, p in zip([n for n, _ in model.named_parameters()], trainer.master)
            }
        else:
            result["params"] = {k: v.cpu() for k, v in ckpt.full_state_dict(model).items()}
    if graphs is not None:
        result["cuda_graphs"] = graphs.report()
    if cfg.device == "cuda":
        # Allocated misses what graph replays use in their pools; reserved holds the pools.
        result["peak_memory_bytes"] = torch.cuda.max_memory_allocated(device)
        result["peak_reserved_bytes"] = torch.cuda.max_memory_reserved(device)
    if log is not None:
        log.close()
    return result
