"""HuggingFace decoders (graph_fsdp.models.hf) under the training loop (graph_fsdp.training.loop)::

    cfg = HFTrainConfig(family="qwen2", steps=10, grad_accum=2, clip_grad=1.0)
    result = run(rank, world_size, cfg)         # under graph_fsdp.training.processes.spawn or torchrun

``fully_shard`` per decoder layer, then the root; ``mode="reference"`` trains the unsharded
model on the global batch through the loop's mixed-precision reference placement (the one
graph_fsdp's GPT uses). The loss is HuggingFace's own causal-LM loss (``labels`` = the input
ids, shifted inside the model); the batches are synthetic token ids addressed by (seed, step,
rank), so every run reads the same data.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
from torch import nn

from graph_fsdp.fsdp.fully_shard import fully_shard
from graph_fsdp.models.hf import hf_decoder, hf_decoder_layers
from graph_fsdp.models.packed import check_packed_inputs, document_mask, packed_loss_sum
from graph_fsdp.parallel.vocab_parallel import shard_embedding_by_vocab
from graph_fsdp.training.adapters import DataParallelAdapter, sharded_trainer
from graph_fsdp.training.loop import LoopConfig, Trainer, run_loop, use_deterministic_kernels
from graph_fsdp.training.packing import PackingPolicy, RunDocuments
from graph_fsdp.training.train import MixedPrecisionReference, device_of, vocab_parallel_mesh

NO_DROPOUT = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "dropout": 0.0}
"""Config fields some families default to a dropout with (GPT-2, GPTBigCode, OPT): off, so
that sharded and reference runs compute the same function."""


@dataclass(kw_only=True)
class HFTrainConfig(LoopConfig):
    """A HuggingFace decoder family at a given size under the loop (random init, no
    download); the loop's fields are :class:`~graph_fsdp.training.loop.LoopConfig`'s."""

    family: str = "llama"
    """A key of graph_fsdp.models.hf.HF_DECODERS."""
    vocab_size: int = 128
    hidden_size: int = 32
    intermediate_size: int = 64
    num_layers: int = 2
    num_attention_heads: int = 4
    seq_length: int = 16
    seed: int = 1234
    """Seed of the weights and the synthetic batches."""
    model_kwargs: dict = field(default_factory=lambda: dict(NO_DROPOUT))
    """Further config fields of the family (dropout off by default)."""
    mode: str = "fsdp"
    """fsdp: graph_fsdp; reference: the unsharded model on the global batch."""
    device: str = "cpu"
    """cpu or cuda."""
    vocab_parallel_embedding: bool = False
    """The input embedding sharded by vocabulary rows over every rank, never gathered
    (vocab_parallel.py); refused for tied embeddings."""
    packing: PackingPolicy | None = None
    """Packed variable-length documents (training/packing.py): each row a pack of
    ``packing.budget`` (= ``seq_length``) tokens, attention within documents through a 4-D
    mask, positions restarting per document, the per-token loss. None: fixed rows."""

    def __post_init__(self) -> None:
        if self.packing is not None:
            self.packing.check_budget(self.seq_length, "HFTrainConfig.seq_length")

    @property
    def recompute(self) -> bool:
        """Activation recompute is not wired for HuggingFace decoders (make_optimizer reads
        it to refuse optimizer offload with recompute)."""
        return False


class CausalLM(nn.Module):
    """The decoder as the loop calls models: ``loss = model(input_ids, labels)``."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        *,
        position_ids: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """HuggingFace's causal-LM loss; packed documents (``cu_seqlens``, models/packed.py
        [Note: packed sequences under CUDA graphs]): positions restarting per document, a 4-D
        mask of attention within documents, and the loss summed over the real tokens of the
        pack's own (already shifted) labels."""
        if cu_seqlens is None:
            return self.lm(input_ids=input_ids, labels=labels, use_cache=False).loss
        check_packed_inputs(input_ids, position_ids, cu_seqlens)
        b, s = input_ids.shape
        dtype = self.lm.get_input_embeddings().weight.dtype
        mask = document_mask(cu_seqlens, b, s, dtype)
        out = self.lm(
            input_ids=input_ids, attention_mask=mask, position_ids=position_ids, use_cache=False
        )
        return packed_loss_sum(out.logits, labels)


class HFAdapter(DataParallelAdapter):
    """A HuggingFace decoder under the loop: sharded per decoder layer, or the reference."""

    def __init__(self, cfg: HFTrainConfig) -> None:
        super().__init__(
            cfg,
            RunDocuments(dataclasses.replace(cfg.packing, seed=cfg.seed), vocab_size=cfg.vocab_size)
            if cfg.packing is not None
            else None,
        )
        self.reference = cfg.mode == "reference"

    @property
    def model_name(self) -> str:
        return f"hf-{self.cfg.family}"

    def setup(self, rank: int, world_size: int) -> torch.device:
        self.data_rank, self.data_world = rank, world_size
        if self.cfg.deterministic:
            use_deterministic_kernels()
        return device_of(self.cfg)

    def build(self, device: torch.device, world_size: int) -> Trainer:
        cfg = self.cfg
        torch.manual_seed(cfg.seed)
        lm = hf_decoder(
            cfg.family,
            vocab=cfg.vocab_size,
            hidden=cfg.hidden_size,
            intermediate=cfg.intermediate_size,
            layers=cfg.num_layers,
            heads=cfg.num_attention_heads,
            seq=cfg.seq_length,
            **cfg.model_kwargs,
        ).to(device)
        model = CausalLM(lm)
        if self.reference:
            return MixedPrecisionReference(model, cfg, world_size)
        placement = dict(
            strategy=cfg.strategy,
            mp_policy=cfg.mp,
            buffer_policy=cfg.buffers,
            separate_all_gather_group=cfg.separate_all_gather_group,
        )
        for layer in hf_decoder_layers(lm):
            fully_shard(layer, **placement)
        if cfg.vocab_parallel_embedding:
            mesh = vocab_parallel_mesh(cfg.device)
            embedding = lm.get_input_embeddings()
            fqn = next(n for n, m in model.named_modules() if m is embedding)
            shard_embedding_by_vocab(model, fqn, mesh["ep"].get_group())
            placement["expert_mesh"] = mesh
        fully_shard(model, **placement)
        return sharded_trainer(model, cfg, device, world_size)

    def make_graphs(self, trainer: Trainer):
        if self.reference:
            return None
        return self.cfg.graphs.build(
            trainer.model, optimizer=trainer.optimizer, clip_grad=self.cfg.clip_grad
        )

    def microbatches(self, step: int, device: torch.device):
        ranks = range(self.data_world) if self.reference else [self.data_rank]
        accum = self.cfg.grad_accum
        return [[self._batch(step * accum + m, r, device) for r in ranks] for m in range(accum)]

    def fixed_batch(self, index: int, rank: int, device: torch.device, *, eval: bool):
        cfg = self.cfg
        g = torch.Generator().manual_seed(
            (cfg.seed * 1_000_003 + index * 7919 + rank * 104729 + (1 << 20 if eval else 0)) % 2**63
        )
        ids = torch.randint(0, cfg.vocab_size, (cfg.micro_batch_size, cfg.seq_length), generator=g)
        ids = ids.to(device)
        return ids, ids  # HuggingFace shifts the labels inside its loss


def run(rank: int, world_size: int, cfg: HFTrainConfig) -> dict:
    """Train ``cfg`` on this rank (graph_fsdp.training.loop.run_loop over :class:`HFAdapter`)."""
    return run_loop(HFAdapter(cfg), rank, world_size)
