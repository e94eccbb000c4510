"""User-facing value types: frozen policies resolved once at the API edge.

Strategy names become placements here and nowhere else: the engine and ``buffers/`` only
ever see ``Placements`` (is this tensor kind sharded or replicated over the data-parallel
group, and - with a 2-D (replicate, shard) mesh - over which of its dimensions?).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


@dataclass(frozen=True, kw_only=True)
class Placements:
    """Which tensor kinds of a unit are sharded over the data-parallel group.

    With a 1-D mesh the group is every data-parallel rank. With a 2-D (replicate, shard)
    mesh (HSDP) ``params``/``grads``/``optim`` mean "sharded over the shard dimension and
    replicated over the replicate one"; ``optim_over_replicas`` shards the optimizer's part
    over the replicate dimension as well.
    """

    params: bool
    """Compute weights sharded (ZeRO-3): all-gathered before use, released after."""
    grads: bool
    """Gradients reduce-scattered into a sharded main grad (ZeRO-2/3); else all-reduced."""
    optim: bool
    """Main weights and optimizer state sharded (ZeRO-1/2/3)."""
    optim_over_replicas: bool = False
    """HSDP only: main weights, optimizer state and (with ``grads``) main grads are sharded
    over both mesh dimensions (Megatron-FSDP's HFSDP, ``outer_dp_sharding_strategy="optim"``):
    gradients are reduce-scattered across replicas instead of all-reduced, and the updated
    weights are all-gathered across replicas before the shard all-gather."""


def placements_for(strategy: str, *, optim_over_replicas: bool = False) -> Placements:
    """Map a Megatron-FSDP strategy name to placements (the only place names are read)."""
    level = {name: i for i, name in enumerate(STRATEGIES)}.get(strategy)
    if level is None:
        raise ValueError(
            f"unknown strategy {strategy!r}; valid strategies are {', '.join(STRATEGIES)} "
            "(no_shard=DDP, optim=ZeRO-1, optim_grads=ZeRO-2, optim_grads_params=ZeRO-3)"
        )
    if optim_over_replicas and level == 0:
        raise ValueError(
            "optim_over_replicas=True shards the optimizer across replicas, but strategy "
            "'no_shard' does not shard the optimizer at all; use strategy 'optim', "
            "'optim_grads' or 'optim_grads_params', or drop optim_over_replicas"
        )
    return Placements(
        params=level >= 3,
        grads=level >= 2,
        optim=level >= 1,
        optim_over_replicas=optim_over_replicas,
    )


@dataclass(frozen=True, kw_only=True)
class MixedPrecisionPolicy:
    """Dtypes of the four tensor kinds FSDP keeps per parameter."""

    param_dtype: torch.dtype | None = None
    """Compute dtype of the gathered weights (e.g. torch.bfloat16). None: the parameter's
    original dtype."""
    main_params_dtype: torch.dtype = torch.float32
    """Dtype of the sharded main weights the optimizer updates."""
    main_grads_dtype: torch.dtype = torch.float32
    """Dtype of the sharded main gradients the optimizer reads."""
    grad_comm_dtype: torch.dtype | None = None
    """Dtype gradients are reduced in. None: ``main_grads_dtype`` (fp32 reduction). bf16
    halves reduce-scatter bytes; the sum is then rounded to bf16 before fp32 accumulation."""
    reduce_scatter_fp32_accumulation: bool = False
    """Megatron's reduce_scatter_with_fp32_accumulation: the gradients of a backward go over
    the wire in their compute dtype (bf16 with bf16 weights) through an all-to-all, and each
    rank sums the pieces of its shard in ``main_grads_dtype`` locally ([Note: reduce-scatter
    with fp32 accumulation], reduce.py). Half the bytes of the fp32 reduce-scatter with
    the same fp32 accumulation; needs sharded gradients (optim_grads, optim_grads_params) and
    no ``grad_comm_dtype``."""

    def __post_init__(self) -> None:
        if self.reduce_scatter_fp32_accumulation and self.grad_comm_dtype is not None:
            raise ValueError(
                "MixedPrecisionPolicy.reduce_scatter_fp32_accumulation sends the gradients in "
                "their compute dtype and sums them in main_grads_dtype; grad_comm_dtype="
                f"{self.grad_comm_dtype} asks for another reduction dtype: set one of the two"
            )
        for name in ("param_dtype", "main_params_dtype", "main_grads_dtype", "grad_comm_dtype"):
            value = getattr(self, name)
            if value is not None and (
                not isinstance(value, torch.dtype) or not value.is_floating_point
            ):
                raise ValueError(
                    f"MixedPrecisionPolicy.{name}={value!r} must be a floating torch.dtype "
                    "such as torch.bfloat16 or torch.float32"
                )

    def compute_dtype(self, original: torch.dtype) -> torch.dtype:
        return self.param_dtype or original

    def comm_dtype(self) -> torch.dtype:
        return self.grad_comm_dtype or self.main_grads_dtype


def dtype_label(dtype: torch.dtype) -> str:
    """``bf16``, ``fp16``, ``fp32`` (else the dtype's own name), for summaries and reports."""
    short = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
    return short.get(dtype, str(dtype).removeprefix("torch."))


AllocatorKind = Literal["dynamic", "double_buffer", "trace_pool"]


@dataclass(frozen=True, kw_only=True)
class BufferPolicy:
    """Where the unsharded weights and gradients of the units live.

    ``dynamic`` frees them back to the caching allocator (lowest memory, addresses change:
    eager only). ``double_buffer`` and ``trace_pool`` keep every graph-visible buffer at a
    fixed address, which layerwise and full-iteration CUDA graphs require.
    """

    allocator: AllocatorKind = "dynamic"
    """One of dynamic, double_buffer, trace_pool."""
    num_slots: int = 2
    """double_buffer: slots per buffer size class (units of one size alternate slots)."""
    persist_on_alloc_fail: bool = False
    """double_buffer/trace_pool: a request no planned slot can serve gets a persistent
    dedicated buffer instead of an error."""
    keep_addresses_on_offload: bool = False
    """RL loops: ``offload_*`` releases the device memory of the main weights, gradients,
    optimizer state, static buffers (and, under torch-memory-saver's preload hook, the CUDA
    graphs' pools) and ``onload_*`` maps it back at the same virtual addresses, so captured
    graphs replay right after an onload (address_keeping.py [Note: offload keeps addresses]).
    Needs torch-memory-saver and a static-address allocator; without the package, offload
    falls back to recapturing the graphs (a one-line notice says which mode runs). Read from
    the root's ``fully_shard`` call."""

    def __post_init__(self) -> None:
        if self.allocator not in ("dynamic", "double_buffer", "trace_pool"):
            raise ValueError(
                f"BufferPolicy.allocator={self.allocator!r}; choose dynamic, double_buffer "
                "or trace_pool"
            )
        if self.num_slots < 1:
            raise ValueError(f"BufferPolicy.num_slots={self.num_slots} must be >= 1 (default 2)")
        if self.keep_addresses_on_offload and self.allocator == "dynamic":
            raise ValueError(
                "BufferPolicy.keep_addresses_on_offload=True keeps the addresses CUDA graphs "
                "read across offload, but allocator='dynamic' gives buffers new addresses at "
                "every step (no graphs can run on it): use allocator='double_buffer' or "
                "'trace_pool', or drop keep_addresses_on_offload"
            )

    @property
    def static_addresses(self) -> bool:
        return self.allocator != "dynamic"
