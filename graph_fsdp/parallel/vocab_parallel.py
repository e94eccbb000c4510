"""An input embedding sharded by vocabulary rows over the data-parallel group, never gathered.

    mesh = init_expert_mesh("cuda", ep_size=dist.get_world_size())   # (edp 1, ep = world)
    shard_embedding_by_vocab(model, "embedding", mesh["ep"].get_group())
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model, expert_mesh=mesh)     # the unit holding the embedding

[Note: vocab-parallel embedding] Under ZeRO-3 an input embedding is the first weight every
step gathers (a vocab x hidden all-gather that nothing can overlap: no compute comes before
it) and the last gradient it reduces (a vocab x hidden reduce-scatter after the last backward
kernel, which the optimizer waits for). Yet a step reads only the rows of its tokens, and
its gradient is zero in every other row. ``VocabParallelEmbedding`` keeps rank r's rows
``[r * n, (r + 1) * n)`` (n = vocab / world) - the rows a dimension-0 shard would give it - and
moves activations instead of weights:

- forward: every rank's token ids are all-gathered (``world x batch x seq`` integers); each
  rank looks up the tokens its rows hold, zeros elsewhere, for every rank's tokens; a
  reduce-scatter (sum) gives each rank its own ``batch x seq x hidden`` embeddings. Exactly
  one rank contributes a non-zero value per token, so the sum is that value: the forward is
  bit-identical to ``nn.Embedding`` on the whole table.
- backward: the output gradients are all-gathered and each rank accumulates its rows from
  every rank's tokens: its rows' gradient is already the sum over the data-parallel group,
  with no reduction of the table. (The summation order differs from a gathered embedding
  whose per-rank gradients are reduce-scattered: the same sum, other roundings.)

The engine treats the rows as an expert parameter (experts.py [Note: expert groups]) over an
expert mesh with EP = the data-parallel world and EDP = 1: nothing gathers or reduces them;
their gradient is divided by the data-parallel size like every other; the global gradient
norm sums them over the EP group; checkpoints save them as rows of the whole table under the
embedding's name, so they load at another world size (the vocabulary must divide it). Two
collectives of ``world x batch x seq x hidden`` replace two of ``vocab x hidden``: on a
32k-vocabulary, hidden-1024 GPT with one 1024-token sequence per rank, 4 MiB instead of 64.

Not supported (refused when asked): a vocabulary the group size does not divide (pad it, as
Megatron's ``make_vocab_size_divisible_by`` does), a weight tied to another module (an output
projection needs the whole table), ``max_norm`` and sparse gradients; and,
by ``fully_shard``, an expert mesh whose EP group is not the embedding's group (an EDP
group > 1 would shard the rows as copies of one another).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from graph_fsdp.fsdp.comm import all_gather_into, reduce_scatter_into
from graph_fsdp.fsdp.experts import EXPERT_ATTR, ExpertLayout


class _ReduceScatterTokens(torch.autograd.Function):
    """``[world, *shape]`` per rank -> this rank's ``shape``, summed over ``group``; backward
    all-gathers the gradient."""

    @staticmethod
    def forward(ctx, full: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        out = full.new_empty(full.shape[1:])
        reduce_scatter_into(out.view(-1), full.contiguous().view(-1), group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_gather(grad, ctx.group), None


def _all_gather(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``[world, *x.shape]``: every rank's ``x`` (flat buffers: gloo and NCCL alike)."""
    full = x.new_empty((dist.get_world_size(group), *x.shape))
    all_gather_into(full.view(-1), x.contiguous().view(-1), group)
    return full


class VocabParallelEmbedding(nn.Module):
    """Rows ``[rank * n, (rank + 1) * n)`` of a ``num_embeddings x embedding_dim`` table over
    ``group`` ([Note: vocab-parallel embedding]); ``forward(ids)`` equals ``nn.Embedding``'s
    on the whole table. Every rank of ``group`` must call it with ids of the same shape."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        group: dist.ProcessGroup,
        *,
        padding_idx: int | None = None,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        world = dist.get_world_size(group)
        if num_embeddings % world:
            raise ValueError(
                f"VocabParallelEmbedding: num_embeddings={num_embeddings} is not a multiple of "
                f"the group size {world}: pad the vocabulary to a multiple of it (Megatron's "
                "make_vocab_size_divisible_by) or keep a gathered nn.Embedding"
            )
        self.num_embeddings, self.embedding_dim, self.group = num_embeddings, embedding_dim, group
        self.rows = num_embeddings // world
        self.vocab_start = dist.get_rank(group) * self.rows
        self.padding_idx = padding_idx
        # nn.Embedding's padding row: its gradient stays zero, on the rank that holds it
        local_pad = None if padding_idx is None else padding_idx % num_embeddings - self.vocab_start
        self._local_padding_idx = (
            local_pad if local_pad is not None and 0 <= local_pad < self.rows else None
        )
        self.weight = nn.Parameter(
            torch.empty(self.rows, embedding_dim, device=device, dtype=dtype)
        )
        ranks = tuple(dist.get_process_group_ranks(group))
        setattr(self.weight, EXPERT_ATTR, ExpertLayout(partitioned_over=ranks))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = _all_gather(ids, self.group) - self.vocab_start
        mine = (local >= 0) & (local < self.rows)
        rows = F.embedding(torch.where(mine, local, 0), self.weight, self._local_padding_idx)
        rows = rows.masked_fill(~mine.unsqueeze(-1), 0)
        return _ReduceScatterTokens.apply(rows, self.group)

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, rows [{self.vocab_start}, "
            f"{self.vocab_start + self.rows})"
        )


def shard_embedding_by_vocab(
    model: nn.Module, fqn: str, group: dist.ProcessGroup
) -> VocabParallelEmbedding:
    """Replace the ``nn.Embedding`` at ``model.<fqn>`` by a :class:`VocabParallelEmbedding`
    holding this rank's rows of its weight (copied). Before ``fully_shard``; the unit that
    will hold it needs ``expert_mesh`` with EP = ``group`` and EDP = 1 (module docstring)."""
    parent_name, _, name = fqn.rpartition(".")
    parent = model.get_submodule(parent_name)
    old = getattr(parent, name, None)
    if not isinstance(old, nn.Embedding):
        raise TypeError(
            f"shard_embedding_by_vocab: {fqn} is {type(old).__name__}, not an nn.Embedding"
        )
    unsupported = {"max_norm": old.max_norm, "sparse": old.sparse or None}
    bad = {k: v for k, v in unsupported.items() if v is not None}
    if bad:
        raise ValueError(
            f"shard_embedding_by_vocab: {fqn} sets {bad}; a vocab-parallel embedding supports "
            "neither max_norm nor sparse gradients: keep it a gathered nn.Embedding"
        )
    if getattr(old.weight, "_graph_fsdp_sharded", False) or old.weight.device.type == "meta":
        raise ValueError(
            f"shard_embedding_by_vocab: {fqn}'s weight is "
            f"{'sharded already' if old.weight.device.type != 'meta' else 'on the meta device'}"
            ": call it on the materialised model, before fully_shard"
        )
    tied = [
        f"{m}.{n}".lstrip(".")
        for m, mod in model.named_modules(remove_duplicate=False)
        for n, p in mod.named_parameters(recurse=False)
        if p is old.weight and mod is not old
    ]
    if tied:
        raise ValueError(
            f"shard_embedding_by_vocab: {fqn}.weight is tied to {tied[:3]}; a vocab-parallel "
            "embedding holds only this rank's rows, and the tied module needs the whole table: "
            "untie the weights or keep a gathered nn.Embedding"
        )
    new = VocabParallelEmbedding(
        old.num_embeddings,
        old.embedding_dim,
        group,
        padding_idx=old.padding_idx,
        device=old.weight.device,
        dtype=old.weight.dtype,
    )
    with torch.no_grad():
        new.weight.copy_(old.weight[new.vocab_start : new.vocab_start + new.rows])
    new.weight.requires_grad_(old.weight.requires_grad)
    setattr(parent, name, new)
    return new
