"""The parameters fully_shard replaces by sharded ones: tied parameters (one tensor used by two
modules, e.g. a tied embedding and output layer) train as one inside a unit and are refused
across units (fully_shard.py [Note: tied parameters]); an optimizer over the replaced
originals is refused at its first step instead of silently training nothing; a full-shape
state dict loads into the sharded parameters."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from graph_fsdp_testing import spawn_cases
from torch import nn

from graph_fsdp.fsdp.checkpoint import full_state_dict
from graph_fsdp.fsdp.fully_shard import fully_shard

VOCAB, HIDDEN, LAYERS, STEPS = 32, 16, 2, 3


class TiedLM(nn.Module):
    """Embedding and output projection share one weight (HuggingFace ``tie_word_embeddings``)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.Tanh()) for _ in range(LAYERS)
        )
        self.norm = nn.LayerNorm(HIDDEN)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.lm_head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = h + layer(h)
        logits = self.lm_head(self.norm(h))
        return nn.functional.cross_entropy(logits.flatten(0, 1), tokens.roll(-1, 1).flatten())


def _batch(step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, VOCAB, (2, 8), generator=g)


def _train(model: nn.Module, world: int, rank: int | None) -> tuple[list[float], nn.Module]:
    """``rank`` None: the single-process reference over every rank's batch (mean of the
    per-rank losses, as the data-parallel gradient average)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        ranks = range(world) if rank is None else [rank]
        loss = sum(model(_batch(step, r)) for r in ranks) / len(ranks)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model


def _sharded(rank: int, world: int) -> tuple[list[float], dict]:
    torch.manual_seed(0)
    model = TiedLM()
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)  # the root holds both uses of the tied weight
    losses, model = _train(model, world, rank)
    return losses, full_state_dict(model)


@pytest.fixture(scope="module")
def two_ranks():
    """Every 2-rank check of this file in one spawned group."""
    return spawn_cases(
        {
            "tied_in_one_unit": (_sharded,),
            "refusals": (_refusals,),
            "early_optimizer": (_early_optimizer,),
            "load_full": (_load_full,),
        },
        2,
    )


def test_tied_embedding_and_output_layer_in_one_unit_match_the_reference(two_ranks):
    torch.manual_seed(0)
    ref_losses, ref = _train(TiedLM(), 2, None)
    assert ref.lm_head.weight is ref.embed.weight
    results = two_ranks["tied_in_one_unit"]
    mean = [sum(step) / len(step) for step in zip(*(losses for losses, _ in results))]
    assert mean == pytest.approx(ref_losses, abs=1e-5)
    for _, params in results:
        assert "lm_head.weight" not in params  # one tensor, saved once under its first name
        for name, value in ref.state_dict().items():
            if name != "lm_head.weight":
                assert torch.allclose(params[name], value, atol=1e-6), name


def _refusals(rank: int, world: int) -> list[str]:
    out = []
    for first in ("lm_head", "embed"):
        model = TiedLM()
        fully_shard(getattr(model, first))
        other = "embed" if first == "lm_head" else "lm_head"
        with pytest.raises(ValueError) as err:
            fully_shard(model)
        out.append(str(err.value))
        # The untouched copy is refused as well when its own module is sharded next.
        model = TiedLM()
        fully_shard(getattr(model, first))
        with pytest.raises(ValueError) as err:
            fully_shard(getattr(model, other))
        out.append(str(err.value))
    dist.barrier()
    return out


def test_tied_parameters_across_units_are_refused_with_both_names_and_the_fix(two_ranks):
    messages = two_ranks["refusals"][0]
    head_first, embed_after_head, embed_first, head_after_embed = messages
    assert "embed.weight of TiedLM is the same tensor as lm_head.weight (tied" in head_first
    assert "lm_head.weight of TiedLM is the same tensor as embed.weight (tied" in embed_first
    assert "weight of Embedding is the same tensor as weight of Linear (tied" in embed_after_head
    assert "weight of Linear is the same tensor as weight of Embedding (tied" in head_after_embed
    for msg in messages:
        assert "must belong to one unit" in msg and "leave both to the root's fully_shard" in msg


def _early_optimizer(rank: int, world: int) -> str:
    model = TiedLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)  # over the originals
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    model(_batch(0, rank)).backward()
    with pytest.raises(RuntimeError) as err:
        opt.step()
    dist.barrier()
    return str(err.value)


def test_an_optimizer_created_before_fully_shard_is_refused_at_its_step(two_ranks):
    msg = two_ranks["early_optimizer"][0]
    assert "AdamW holds 7 parameter(s) that fully_shard replaced by sharded ones" in msg
    assert "embed.weight of TiedLM" in msg and "0.weight of Sequential" in msg
    assert "Create the optimizer after fully_shard" in msg


def _load_full(rank: int, world: int) -> tuple[list[float], dict, dict]:
    torch.manual_seed(0)
    model = TiedLM()
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    _train(model, world, rank)  # a step first: the compute weights exist and must refresh
    torch.manual_seed(1)
    model.load_state_dict(TiedLM().state_dict())  # full shapes, on every rank
    loaded = full_state_dict(model)
    own = {k: v.clone() for k, v in model.state_dict().items()}  # this rank's pieces
    model.load_state_dict(own)  # the shards of the same sharding load as they are
    losses, model = _train(model, world, rank)
    return losses, loaded, full_state_dict(model)


def test_a_full_state_dict_loads_into_the_sharded_model(two_ranks):
    torch.manual_seed(1)
    ref = TiedLM()
    initial = {k: v.clone() for k, v in ref.state_dict().items()}
    ref_losses, ref = _train(ref, 2, None)
    results = two_ranks["load_full"]
    mean = [sum(step) / len(step) for step in zip(*(losses for losses, _, _ in results))]
    assert mean == pytest.approx(ref_losses, abs=1e-5)
    for _, loaded, trained in results:
        for name, value in ref.state_dict().items():
            if name != "lm_head.weight":
                assert torch.equal(loaded[name], initial[name]), name
                assert torch.allclose(trained[name], value, atol=1e-6), name
