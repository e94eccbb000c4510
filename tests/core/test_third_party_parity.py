"""HuggingFace decoders nobody here wrote, sharded per decoder layer + root on real gloo
groups, train as the unsharded model does: losses and final weights after AdamW steps with
torch's own gradient clipping (routed to the global norm, grad_norm.py)."""

from __future__ import annotations

import pytest
import torch

from graph_fsdp.checkpoint import full_state_dict
from graph_fsdp.fully_shard import fully_shard
from graph_fsdp.testing import spawn

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, STEPS, WORLD, MAX_NORM = 64, 16, 3, 2, 0.5
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", {}),  # Conv1D, learned positions, tied
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", {}),  # parallel residual
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4}),  # top-2 MoE
}


def _model(family: str):
    config_cls, model_cls, extra = FAMILIES[family]
    config = getattr(transformers, config_cls)(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        attn_implementation="sdpa",
        # GPT-2 and GPT-NeoX default to dropout: both runs must compute the same function
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        **extra,
    )
    torch.manual_seed(0)
    return getattr(transformers, model_cls)(config)


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
    base = model.base_model
    for layer in base.h if hasattr(base, "h") else base.layers:
        fully_shard(layer)
    fully_shard(model)
    return _train(model, [rank]), full_state_dict(model)


def _all_families(rank: int, world: int) -> dict:
    return {family: _sharded(rank, world, family) for family in FAMILIES}


@pytest.fixture(scope="module")
def sharded_runs() -> list[dict]:
    return spawn(_all_families, WORLD)  # one launch for every family


@pytest.mark.parametrize("family", list(FAMILIES))
def test_sharded_huggingface_decoder_trains_as_the_unsharded_one(family, sharded_runs):
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
