"""A Megatron-Core hybrid model (``*-E-``: attention, MLP, MoE, MLP) under graph_fsdp on 2 CPU
ranks (gloo, local spec).

Needs megatron-core (0.16's ``MambaModel`` on Python 3.11, as CI installs it, or 0.19's
``HybridModel`` on Python >= 3.12).

- Sharded training: ``shard_gpt`` puts a ``fully_shard`` on every decoder layer; 3 AdamW steps
  on 2 ranks against the same model unsharded on the global batch (both ranks' microbatches
  as one batch), for Megatron's dropless experts (allgather dispatcher) and graph_fsdp's
  grouped_mm experts: the same weights at the start (bit for bit), then the same losses and
  weights within fp32 rounding (the mean over 4 sequences is summed in another order).
- Checkpoints: a DCP checkpoint (graph_fsdp.fsdp.checkpoint) of the sharded model, loaded into
  a model built from another seed: the same weights bit for bit, and the next steps give the
  same losses as the run that saved it.
- Scopes: which modules ``attn``, ``mlp``, ``moe`` and ``moe_router`` pick in the built model
  (the layers' ``IdentityOp`` halves are never picked).

Megatron's CUDA-only details are bridged in the workers (graph_fsdp_testing.megatron_on_cpu).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from graph_fsdp_testing import TINY_MCORE_SHAPE, megatron_on_cpu

from graph_fsdp.training.processes import spawn

try:
    from graph_fsdp.integrations.megatron import versions  # noqa: F401 - imports megatron-core
except ImportError as err:
    pytest.skip(f"megatron-core does not import ({err})", allow_module_level=True)

WORLD, STEPS, LR = 2, 3, 1e-2
PATTERN = "*-E-"
FP32 = dict(rtol=1e-5, atol=1e-6)
"""Losses: one mean over the global batch vs the mean of two ranks' means."""
WEIGHTS = dict(rtol=1e-5, atol=1e-5)
"""Weights after AdamW steps: m / sqrt(v) enlarges a rounding-level gradient difference
(test_megatron_ep_gloo.py), while a wrongly reduced gradient moves weights by ~LR."""
FAMILIES = {
    "megatron allgather": dict(moe_token_dispatcher_type="allgather"),
    "grouped_mm": dict(moe_token_dispatcher_type="allgather", moe_experts_impl="grouped_mm"),
}


def _cfg(**kw):
    from graph_fsdp.integrations import megatron as gm

    return gm.MCoreGPTConfig(
        **TINY_MCORE_SHAPE,
        hybrid_layer_pattern=PATTERN,
        num_experts=4,
        moe_router_topk=2,
        transformer_impl="local",
        **kw,
    )


def _build(cfg, *, shard: bool):
    from megatron.core.tensor_parallel.random import initialize_rng_tracker

    from graph_fsdp.integrations import megatron as gm

    gm.init_parallel_state()
    lm = gm.build_hybrid(cfg, "cpu")
    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    if shard:
        gm.shard_gpt(lm)
    return lm, torch.optim.AdamW(lm.parameters(), lr=LR)


def _batch(step: int, rank: int, cfg) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    seq = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length + 1), generator=g)
    return seq[:, :-1], seq[:, 1:].contiguous()


def _train_sharded(lm, opt, cfg, steps: range, rank: int) -> list[float]:
    losses = []
    for step in steps:
        x, y = _batch(step, rank, cfg)
        loss = lm(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss = loss.detach()
        dist.all_reduce(loss)
        losses.append(loss.item() / dist.get_world_size())
    return losses


def _train_reference(lm, opt, cfg, steps: range) -> list[float]:
    """The unsharded model on the global batch: every rank's microbatch as one batch."""
    losses = []
    for step in steps:
        batches = [_batch(step, r, cfg) for r in range(WORLD)]
        x, y = (torch.cat(t) for t in zip(*batches))
        loss = lm(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def _state(lm) -> dict[str, torch.Tensor]:
    from graph_fsdp.fsdp.checkpoint import full_state_dict

    return {k: v.clone() for k, v in full_state_dict(lm).items()}


def _params(lm) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in lm.named_parameters()}


def _scopes(lm) -> dict[str, list[str]]:
    from graph_fsdp.capture.scopes import select_targets

    units = [(f"module.decoder.layers.{i}", m) for i, m in enumerate(lm.module.decoder.layers)]
    out = {" ".join(s): [t.name for t in select_targets(units, s)] for s in SCOPE_SETS}
    out["layer kinds"] = [  # Megatron's class under fully_shard's FSDP<class> subclass
        next(c.__name__ for c in type(m).__mro__ if c.__module__.startswith("megatron"))
        for _, m in units
    ]
    return out


SCOPE_SETS = (["attn", "mlp", "moe_router"], ["moe"], ["attn"])


def _worker(rank: int, world: int, root: str) -> dict:
    from graph_fsdp.fsdp import checkpoint as ckpt

    megatron_on_cpu()
    out: dict = {}
    for family, kw in FAMILIES.items():
        cfg = _cfg(**kw)
        if rank == 0:  # the reference: no collectives (TP = EP = 1 groups of one rank)
            ref, ref_opt = _build(cfg, shard=False)
            start = _params(ref)
            out[family, "reference"] = (start, _train_reference(ref, ref_opt, cfg, range(STEPS)))
            out[family, "reference end"] = _params(ref)
        lm, opt = _build(cfg, shard=True)
        start = _state(lm)
        losses = _train_sharded(lm, opt, cfg, range(STEPS), rank)
        out[family, "sharded"] = (start, losses)
        out[family, "sharded end"] = _state(lm)
    # Checkpoints (Megatron's dropless experts).
    cfg = _cfg(**FAMILIES["megatron allgather"])
    path = os.path.join(root, "hybrid")
    lm, opt = _build(cfg, shard=True)
    _train_sharded(lm, opt, cfg, range(STEPS), rank)
    ckpt.save(path, lm, opt)
    saved = _state(lm)
    out["saver continues"] = _train_sharded(lm, opt, cfg, range(STEPS, STEPS + 2), rank)
    lm, opt = _build(_cfg(**FAMILIES["megatron allgather"], seed=99), shard=True)
    out["differs before load"] = any(not torch.equal(v, saved[k]) for k, v in _state(lm).items())
    ckpt.load(path, lm, opt)
    out["loaded"] = (saved, _state(lm))
    out["loader continues"] = _train_sharded(lm, opt, cfg, range(STEPS, STEPS + 2), rank)
    out["scopes"] = _scopes(lm)
    return out if rank == 0 else {}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    return spawn(_worker, WORLD, str(tmp_path_factory.mktemp("mcore_hybrid")), timeout=900)[0]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_sharded_hybrid_trains_like_the_unsharded_model(results, family):
    ref_start, ref_losses = results[family, "reference"]
    start, losses = results[family, "sharded"]
    end, ref_end = results[family, "sharded end"], results[family, "reference end"]
    assert set(ref_start) <= set(start), sorted(set(ref_start) - set(start))[:4]
    experts = [k for k in ref_start if ".mlp.experts." in k]
    assert experts and all(k.startswith("module.decoder.layers.2.") for k in experts)
    for k, v in ref_start.items():
        assert torch.equal(start[k], v), k
    assert len(losses) == STEPS
    torch.testing.assert_close(losses, ref_losses, **FP32)
    for k, v in ref_end.items():
        assert not torch.equal(v, ref_start[k]), f"{k} did not move"
        torch.testing.assert_close(end[k], v, **WEIGHTS, msg=lambda m, k=k: f"{k}: {m}")


def test_checkpoint_reloads_a_sharded_hybrid(results):
    assert results["differs before load"]
    saved, loaded = results["loaded"]
    assert saved.keys() == loaded.keys()
    for k, v in saved.items():
        assert torch.equal(loaded[k], v), k
    assert results["loader continues"] == results["saver continues"]


def test_scopes_pick_megatrons_modules_per_layer_kind(results):
    scopes = results["scopes"]
    assert scopes["layer kinds"] == [
        "TransformerLayer",
        "MLPLayer",
        "MoETransformerLayer",
        "MLPLayer",
    ]
    assert scopes["attn mlp moe_router"] == [
        "module.decoder.layers.0.self_attention",
        "module.decoder.layers.1.mlp",
        "module.decoder.layers.2.mlp.router",
        "module.decoder.layers.3.mlp",
    ]
    assert scopes["moe"] == ["module.decoder.layers.2.mlp"]
    assert scopes["attn"] == ["module.decoder.layers.0.self_attention"]
