"""HuggingFace decoders nobody here wrote, sharded per decoder layer + root on real gloo
groups, train as the unsharded model does: losses and final weights after AdamW steps with
torch's own gradient clipping (routed to the global norm, grad_norm.py)."""

from __future__ import annotations

import pytest
import torch

from graph_fsdp.fsdp.checkpoint import full_state_dict
from graph_fsdp.fsdp.fully_shard import fully_shard
from graph_fsdp.models.hf import HF_DECODERS, hf_decoder, hf_decoder_layers, hf_family_available
from graph_fsdp.training.processes import spawn

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, STEPS, WORLD, MAX_NORM = 64, 16, 3, 2, 0.05  # Cohere scales its logits by 1/16
FAMILIES = tuple(HF_DECODERS)  # dense, MoE, tied, fused projections, latent attention, ...
NO_DROPOUT = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "dropout": 0.0}


def _model(family: str):
    # GPT-2, GPTBigCode and OPT default to dropout: both runs must compute the same function
    return hf_decoder(
        family, vocab=VOCAB, hidden=32, intermediate=64, layers=2, heads=4, seq=SEQ, **NO_DROPOUT
    )


def _loss(model, step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    return model(input_ids=x, labels=x, use_cache=False).loss


def _train(model, ranks) -> tuple[list[float], list[float]]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, norms = [], []
    for step in range(STEPS):
        loss = sum(_loss(model, step, r) for r in ranks) / len(ranks)
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, norms


def _sharded(rank: int, world: int, family: str):
    model = _model(family)
    for layer in hf_decoder_layers(model):
        fully_shard(layer)
    fully_shard(model)
    return _train(model, [rank]), full_state_dict(model)


def _all_families(rank: int, world: int) -> dict:
    return {
        family: _sharded(rank, world, family) for family in FAMILIES if hf_family_available(family)
    }


@pytest.fixture(scope="module")
def sharded_runs() -> list[dict]:
    return spawn(_all_families, WORLD)  # one launch for every family


@pytest.mark.parametrize("family", FAMILIES)
def test_sharded_huggingface_decoder_trains_as_the_unsharded_one(family, sharded_runs):
    if not hf_family_available(family):
        pytest.skip(f"transformers {transformers.__version__} has no {family}")
    ref = _model(family)
    ref_losses, ref_norms = _train(ref, range(WORLD))
    assert min(ref_norms) > MAX_NORM  # every step clips
    results = [run[family] for run in sharded_runs]
    mean = [sum(s) / WORLD for s in zip(*(losses for (losses, _), _ in results))]
    assert mean == pytest.approx(ref_losses, abs=1e-5)
    expected = dict(ref.named_parameters())  # one name per tensor, as full_state_dict
    for (_, norms), params in results:
        assert norms == pytest.approx(ref_norms, rel=1e-5)  # the global norm on every rank
        assert sorted(params) == sorted(expected)
        for name, value in expected.items():
            diff = (params[name] - value.detach()).abs().max().item()
            assert diff <= 1e-5, f"{family} {name}: max abs diff {diff}"
