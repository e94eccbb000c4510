"""What the model adapters of the training loop share (loop.py's :class:`ModelAdapter`):
the optimizer, the sharded trainer restored from a checkpoint, and the batches of each
data-parallel rank, fixed rows or packed documents. graph_fsdp's GPT (train.py), the
HuggingFace decoders (integrations/hf_train.py) and Megatron-Core models
(integrations/megatron/train.py) build on them.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from graph_fsdp.fsdp.optim_offload import CPUOffloadOptimizer, check_offload_config
from graph_fsdp.training.loop import LoopConfig, ModelAdapter, ShardedTrainer, load_checkpoint
from graph_fsdp.training.packing import PackingPolicy, RunDocuments


class PackedRunConfig(Protocol):
    """The fields of a model's config that say where its packed documents come from."""

    packing: PackingPolicy | None
    data_path: str | None
    eod_token_id: int | None


def make_optimizer(params, cfg: LoopConfig) -> torch.optim.Optimizer:
    """AdamW over ``params``, or with ``cfg.optimizer_offload_fraction`` > 0 the
    CPUOffloadOptimizer around it (which refuses a config with ``recompute``: every model's
    config has that property)."""
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


def sharded_trainer(
    model: nn.Module, cfg: LoopConfig, device: torch.device, world_size: int
) -> ShardedTrainer:
    """The sharded ``model`` under the loop: :func:`make_optimizer`'s optimizer over its
    shards, restored from ``cfg.checkpoint.load_path`` when one is given."""
    optimizer = make_optimizer(model.parameters(), cfg)
    if cfg.checkpoint.load_path:
        load_checkpoint(cfg, model, optimizer)
    return ShardedTrainer(model, optimizer, loss_world=world_size, device=device)


def packed_documents(cfg: PackedRunConfig, vocab_size: int) -> RunDocuments | None:
    """The run's packed documents (``cfg.packing``; None without): from ``cfg.data_path``,
    each ending at ``cfg.eod_token_id``, or synthetic."""
    if cfg.packing is None:
        return None
    return RunDocuments(
        cfg.packing, vocab_size=vocab_size, data_path=cfg.data_path, eod_token_id=cfg.eod_token_id
    )


class DataParallelAdapter(ModelAdapter):
    """What the model adapters share: the batches of each data-parallel rank (``data_rank``
    of ``data_world``; the TP ranks of one read the same), from the run's packed
    ``documents`` or, with none, :meth:`fixed_batch`; and the model a checkpoint records."""

    model_name: str
    """The ``model`` every checkpoint's metadata records."""

    def __init__(self, cfg: LoopConfig, documents: RunDocuments | None) -> None:
        self.cfg = cfg
        self.data_rank, self.data_world = 0, 1
        """This rank's place among the data-parallel ranks (set up by ``setup``)."""
        self._documents = documents
        """Packed runs: the training and eval documents."""

    def fixed_batch(
        self, index: int, rank: int, device: torch.device, *, eval: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Microbatch ``index`` of data-parallel ``rank`` as fixed rows (runs without packing)."""
        raise NotImplementedError

    def _batch(self, index: int, rank: int, device: torch.device, *, eval: bool = False):
        """Microbatch ``index`` of data-parallel ``rank``: fixed rows, or a PackedBatch."""
        if self._documents is None:
            return self.fixed_batch(index, rank, device, eval=eval)
        return self._documents(eval).batch(
            self.cfg.micro_batch_size, index, rank, self.data_world, device
        )

    def eval_batch(self, step: int, device: torch.device):
        return self._batch(step, self.data_rank, device, eval=True)

    def checkpoint_meta(self, step: int) -> dict:
        return {"iteration": step, "model": self.model_name}
