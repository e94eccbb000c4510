"""Will a run fit? Bytes per rank from the model's shape, against the device's or host's memory,
before any rank allocates.

    estimate = estimate_memory(cfg, world_size=2)       # parameters, gradients, optimizer, ...
    check_fits(cfg, world_size=2, local_ranks=2)        # raises MemoryPlanError naming them

[Note: memory pre-flight] The estimate counts what a rank must hold and nothing it might not,
so a refusal is certain, not a guess: the main weights (fp32) and the compute-dtype weights
it gathers, the main gradients, AdamW's two fp32 moments per owned element, each at the
sharding the strategy gives them (``fsdp/api.py`` placements; ZeRO-3 holds ``num_slots``
gathered units at a time; a shard is the ranks' average, so the busiest rank holds at least
that), and the activations of one microbatch (Megatron's count for
16-bit tensors, ``s * b * h * (34 + 5 * a * s / h)`` bytes per layer, twice that in fp32;
with recompute only each layer's input plus one layer's; the logits and their gradient).
Allocator slack, CUDA contexts, the optimizer's temporaries and the interpreter are left
out. The parameter counts come from one layer of each kind built on the meta device, so a
model of 100000 layers is counted in milliseconds and never built. The budget is the GPU's
total memory (one rank per GPU) or the host's available memory shared by its local ranks.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from graph_fsdp.fsdp.api import placements_for
from graph_fsdp.models.gpt import TransformerLayer
from graph_fsdp.training.train import TrainConfig

GIB = 2**30


class MemoryPlanError(ValueError):
    """A configuration whose per-rank estimate exceeds the memory it has; the message names
    the numbers and what to change."""


@dataclass(frozen=True, kw_only=True)
class MemoryEstimate:
    """Bytes one rank holds at least, by role ([Note: memory pre-flight])."""

    num_params: int
    """Parameters of the whole model."""
    params: int
    """Main weights (fp32) and the compute-dtype weights held or gathered."""
    grads: int
    """Main gradients (fp32) and, under ZeRO-3, the gathered units' gradient slots."""
    optimizer: int
    """AdamW's two fp32 moments of the elements this rank updates (the device's part when the
    optimizer is partly offloaded)."""
    activations: int
    """One microbatch's activations kept for backward, and the logits."""

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations

    def describe(self) -> str:
        parts = (
            ("parameters", self.params),
            ("gradients", self.grads),
            ("optimizer state", self.optimizer),
            ("activations", self.activations),
        )
        terms = " + ".join(f"{name} {_gib(n)}" for name, n in parts)
        return f"{terms} = {_gib(self.total)} per rank"


def _gib(nbytes: float) -> str:
    if nbytes >= 100 * GIB:
        return f"{nbytes / GIB:,.0f} GiB"
    return f"{nbytes / GIB:.3g} GiB" if nbytes >= GIB else f"{nbytes / 2**20:.3g} MiB"


def _count(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6)):
        if n >= scale:
            value = n / scale
            return f"{value:,.0f}{unit}" if value >= 100 else f"{value:.3g}{unit}"
    return f"{n:,}"


def _layer_numels(cfg: TrainConfig) -> tuple[int, int]:
    """(parameters of a dense layer, of an MoE layer) of ``cfg.model``, from one of each
    built on the meta device (0 for a kind the model does not have)."""
    model = cfg.model
    counts = [0, 0]
    kinds = {model.is_moe_layer(0): 0}
    if model.num_layers > 1:
        kinds.setdefault(model.is_moe_layer(1), 1)
    with torch.device("meta"):
        for is_moe, index in kinds.items():
            layer = TransformerLayer(model, index)
            counts[int(is_moe)] = sum(p.numel() for p in layer.parameters())
    return counts[0], counts[1]


def estimate_memory(cfg: TrainConfig, *, world_size: int) -> MemoryEstimate:
    """The bytes a rank of ``cfg`` on ``world_size`` ranks holds at least."""
    m = cfg.model
    h, s, b, v = m.hidden_size, m.seq_length, cfg.micro_batch_size, m.vocab_size
    tp = cfg.tensor_parallel or 1
    dp = max(world_size // tp, 1)
    shard = cfg.mesh_shape[1] if cfg.mesh_shape else dp
    optim_shard = dp if cfg.optim_over_replicas else shard
    dense, moe = _layer_numels(cfg)
    moe_layers = len(range(0, m.num_layers, m.moe_layer_freq)) if m.num_experts else 0
    # Units by size (parameters -> how many): the layers (TP splits their matrices), the
    # root (embedding, positions, final norm) and the output projection.
    units: dict[int, int] = {}
    for size, count in (
        (dense // tp, m.num_layers - moe_layers),
        (moe // tp, moe_layers),
        (v * h + s * h + h, 1),
        (h * v, 1),
    ):
        if count:
            units[size] = units.get(size, 0) + count
    local = sum(size * count for size, count in units.items())
    num_params = local + (tp - 1) * (dense * (m.num_layers - moe_layers) + moe * moe_layers) // tp
    cb = cfg.compute_dtype.itemsize
    placements = placements_for(cfg.strategy)
    owned = math.ceil(local / optim_shard) if placements.optim else local
    if placements.params:  # ZeRO-3: gathered units live in num_slots slots per size class
        compute = (
            sum(min(cfg.buffers.num_slots, count) * size for size, count in units.items()) * cb
        )
    else:
        compute = local * cb
    grad_shard = shard if placements.grads else 1
    grads = math.ceil(local / grad_shard) * 4 + (compute if placements.params else 0)
    offloaded = cfg.optimizer_offload_fraction if cfg.device == "cuda" else 0.0
    optimizer = int(2 * owned * 4 * (1 - offloaded))
    layer_activations = s * b * h * (34 + 5 * m.num_attention_heads * s / h) * cb / 2
    if cfg.recompute:  # each layer's input, and one layer recomputed at a time
        kept = m.num_layers * s * b * h * cb + layer_activations
    else:
        kept = m.num_layers * layer_activations
    logits = s * b * v * (cb + 8)  # the logits, their fp32 copy for the loss and its gradient
    return MemoryEstimate(
        num_params=num_params,
        params=owned * 4 + compute,
        grads=grads,
        optimizer=optimizer,
        activations=int(kept / tp + logits),
    )


def available_memory(device: str, *, local_ranks: int) -> tuple[int, str]:
    """(bytes one rank may use, where that number comes from): a GPU's total memory, or the
    host's available memory divided among its ``local_ranks`` ranks; 0 when unknown."""
    if device == "cuda":
        index = int(os.environ.get("LOCAL_RANK", 0)) % max(torch.cuda.device_count(), 1)
        props = torch.cuda.get_device_properties(index)
        return props.total_memory, f"GPU {index}'s {_gib(props.total_memory)} ({props.name})"
    host = _host_available()
    if not host:
        return 0, "unknown host memory"
    share = host // max(local_ranks, 1)
    return share, f"the host's available {_gib(host)} shared by {local_ranks} local rank(s)"


def _host_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0


def check_fits(cfg: TrainConfig, *, world_size: int, local_ranks: int) -> MemoryEstimate:
    """The estimate of ``cfg``; raises :class:`MemoryPlanError` when it exceeds a rank's
    memory ([Note: memory pre-flight])."""
    estimate = estimate_memory(cfg, world_size=world_size)
    budget, source = available_memory(cfg.device, local_ranks=local_ranks)
    if budget and estimate.total > budget:
        raise MemoryPlanError(
            f"{cfg.model.num_layers} layers of hidden {cfg.model.hidden_size} "
            f"({_count(estimate.num_params)} parameters) on {world_size} rank(s) need at "
            f"least {estimate.describe()}, but a rank has {_gib(budget)} ({source}); use "
            "fewer or smaller layers, more ranks, a sharding strategy that shards more "
            "(optim_grads_params), --bf16, --recompute-activations or a smaller "
            "--micro-batch-size"
        )
    return estimate
