"""Megatron-Core ``dist_checkpointing`` checkpoints of a GPTModel, read into and written from a
graph_fsdp-sharded model.

    from graph_fsdp.integrations import megatron as gm

    lm = gm.shard_gpt(gm.build_gpt(cfg), mp_policy=...)   # any TP and DP size
    gm.load_megatron_checkpoint(lm, "megatron_ckpt/iter_0001000")   # written by Megatron-Core
    ...                                                              # train
    gm.save_megatron_checkpoint(lm, "for_megatron")       # dist_checkpointing.load reads it

Imports nothing from megatron-core at module level (CI imports graph_fsdp without it).

[Note: Megatron-Core checkpoint interop]
- The format (megatron-core 0.16 / 0.19, torch_dist backend): ``dist_checkpointing.save(
  model.sharded_state_dict(), dir)`` writes a torch DCP checkpoint (``.metadata``,
  ``__<rank>_<i>.distcp``) plus ``common.pt`` and ``metadata.json``. Each parameter is a
  ``ShardedTensor`` of its *global* shape; the decoder's layers share one key with a leading
  layer axis (``decoder.layers.self_attention.linear_qkv.weight`` of shape ``[L, ...]``,
  transformer_block.py ``sharded_state_dict``: ``sharded_offsets`` ``(0, layer, L)``), TP
  pieces sit at their offsets along ``partition_dim`` (column-parallel weights axis 0,
  row-parallel axis 1; tensor_parallel/layers.py), the local spec's norms are stored under the
  TE spec's names (``input_layernorm.weight`` -> ``linear_qkv.layer_norm_weight``: the layer
  spec's ``sharded_state_dict_keys_map``), and SwiGLU's ``linear_fc1`` is split by
  ``apply_swiglu_sharded_factory`` (transformer/mlp.py) into its gate and up halves at
  offsets ``r`` and ``r + TP`` of ``2 * TP`` pieces - the logical ``[gate; up]`` tensor.
  ``linear_qkv``'s rows are already grouped per query group (``[q..., k, v]`` per group) in
  the parameter itself, so its TP split is a plain split of axis 0.
- The path taken: every key map, axis and split above is Megatron's own code, so this module
  does not re-implement them. It builds a second, plain ``GPTModel`` on every rank with the
  sharded model's ``TransformerConfig``, layer spec and sizes (same TP layout: Megatron's
  parallel state), on the CPU, and lets ``dist_checkpointing.load`` / ``save`` run on its
  ``sharded_state_dict()`` - which reshards between TP sizes as Megatron does. Loading then
  hands that model's TP-local tensors to the sharded model's ``load_state_dict`` (graph_fsdp
  keeps this rank's data-parallel piece, unit_init.py ``full_tensor_loader``); saving gathers
  the sharded model's global tensors (``checkpoint.full_state_dict``) and copies this TP
  rank's piece of each into the plain model first (``partition_stride`` pieces: blocks
  ``r, r + TP, ...``). Weights only: optimizer state stays in graph_fsdp's own checkpoints.
- Cost: host memory for one TP-local copy of the model per rank while a call runs, and, when
  saving, the global weights gathered on every rank (``full_state_dict``) on the model's device.
- Scope: dense GPTModels (local or TE spec, TP and sequence parallelism); MoE models and hybrid
  models are refused (their expert layouts differ between graph_fsdp's experts and
  Megatron's). The plain model is built inside ``torch.random.fork_rng`` so the caller's CPU
  RNG stream is unchanged (its initial values are overwritten by the load, or unused).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn

from graph_fsdp.fsdp.checkpoint import full_state_dict


def load_megatron_checkpoint(lm: nn.Module, path: str) -> None:
    """Load the weights of a Megatron-Core ``dist_checkpointing`` checkpoint of a GPTModel
    (any TP size) into ``lm``, a GPTModel wrapped by ``build_gpt`` and sharded by
    ``shard_gpt``. Every rank calls it. [Note: Megatron-Core checkpoint interop]"""
    from megatron.core import dist_checkpointing  # noqa: PLC0415 (optional dependency)

    plain = _plain_gpt(lm, "load_megatron_checkpoint")
    loaded = dist_checkpointing.load(plain.sharded_state_dict(), path)
    plain.load_state_dict(loaded)  # as Megatron's training loop does after load
    values = {f"module.{name}": p.detach() for name, p in plain.named_parameters()}
    _check_names(lm, values, "load_megatron_checkpoint")
    with torch.no_grad():
        lm.load_state_dict(values, strict=False)  # names checked above


def save_megatron_checkpoint(lm: nn.Module, path: str) -> None:
    """Write ``lm``'s weights (a ``shard_gpt``-sharded GPTModel) as Megatron-Core's
    ``dist_checkpointing.save(gpt.sharded_state_dict(), path)`` would at the same TP size;
    Megatron reads it at any TP size. ``path`` is created; an existing one must be empty (as
    Megatron requires). Every rank calls it. [Note: Megatron-Core checkpoint interop]"""
    from megatron.core import dist_checkpointing  # noqa: PLC0415 (optional dependency)
    from megatron.core import parallel_state as ps  # noqa: PLC0415 (optional dependency)

    _check_writer()
    plain = _plain_gpt(lm, "save_megatron_checkpoint")
    full = full_state_dict(lm)
    names = {f"module.{name}" for name, _ in plain.named_parameters()}
    _check_names(lm, names, "save_megatron_checkpoint")
    rank, size = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    with torch.no_grad():
        for name, p in plain.named_parameters():
            p.copy_(_tp_piece(full[f"module.{name}"], p, rank, size))
    del full
    if dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(plain.sharded_state_dict(), path)


def _check_writer() -> None:
    """Megatron's torch_dist writer logs each writer process's memory through psutil, which
    megatron-core does not require; without it the writer processes fail and the save waits
    for them forever (megatron-core 0.16.1 and 0.19.2), so refuse before writing."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async  # noqa: PLC0415 (optional dependency)

    if not getattr(filesystem_async, "HAVE_PSUTIL", True):
        raise ImportError(
            "save_megatron_checkpoint: Megatron-Core's torch_dist checkpoint writer needs "
            "psutil (its writer processes log their memory with it), which is not installed: "
            "pip install psutil"
        )


def _tp_piece(full: torch.Tensor, p: nn.Parameter, rank: int, size: int) -> torch.Tensor:
    """TP rank ``rank``'s piece of the global tensor ``full`` of Megatron parameter ``p``: its
    share of ``partition_dim`` in ``size * partition_stride`` equal blocks, blocks ``rank,
    rank + size, ...`` (Megatron's ``_initialize_affine_weight_cpu``)."""
    if not getattr(p, "tensor_model_parallel", False) or size == 1:
        return full
    dim, stride = p.partition_dim, getattr(p, "partition_stride", 1)
    blocks = full.chunk(size * stride, dim)
    return torch.cat([blocks[rank + i * size] for i in range(stride)], dim)


def _plain_gpt(lm: nn.Module, what: str) -> nn.Module:
    """A plain (unsharded) Megatron GPTModel of ``lm``'s structure on the CPU."""
    from megatron.core.models.gpt import GPTModel  # noqa: PLC0415 (optional dependency)

    gpt = getattr(lm, "module", None)
    if not isinstance(gpt, GPTModel):
        raise TypeError(
            f"{what}: {type(gpt).__name__} is not a Megatron-Core GPTModel; pass the MCoreLM "
            "build_gpt returned (hybrid models are not supported)"
        )
    if getattr(gpt.config, "num_moe_experts", None):
        raise ValueError(
            f"{what}: num_moe_experts={gpt.config.num_moe_experts}: Megatron-Core checkpoint "
            "interop covers dense GPTModels; use graph_fsdp.fsdp.checkpoint for MoE models"
        )
    with torch.random.fork_rng(devices=[]):
        plain = GPTModel(
            config=gpt.config,
            transformer_layer_spec=gpt.transformer_layer_spec,
            vocab_size=gpt.vocab_size,
            max_sequence_length=gpt.max_sequence_length,
            position_embedding_type=gpt.position_embedding_type,
            share_embeddings_and_output_weights=gpt.share_embeddings_and_output_weights,
            rotary_percent=gpt.rotary_percent,
            rotary_base=gpt.rotary_base,
        )
    return plain


def _check_names(lm: nn.Module, names, what: str) -> None:
    """The plain model's parameters are the sharded model's (no silent partial load)."""
    have = {name for name, _ in lm.named_parameters()}
    missing, extra = sorted(have - set(names)), sorted(set(names) - have)
    if missing or extra:
        raise ValueError(
            f"{what}: the plain GPTModel's parameters differ from the sharded model's: "
            f"only in the sharded model {missing[:5]}, only in the plain one {extra[:5]}; the "
            "model must be a build_gpt GPTModel whose modules shard_gpt left in place"
        )
