"""A Megatron-Core MoE GPT with expert parallelism under graph_fsdp on 4 CPU ranks (gloo).

Needs megatron-core (0.16 on Python 3.11, as CI installs it, or 0.19 on Python >= 3.12).

- EP = 2 (x EDP = 2) and EP = 4 train like EP = 1 (every rank's dense and expert parameters
  over one group) and like EP = 1 with expert groups: Megatron's allgather dispatcher
  dropless, and its alltoall dispatcher with drop-padding (the dispatcher the graphed EP runs
  use). Same global weights at the start (bit for bit, under their global names), then the
  same losses and weights within fp32 rounding: the experts see the same tokens, but in
  other groupings (one GEMM over both EP ranks' tokens vs one per rank) and the gradients
  are summed over other groups (EDP then the dispatch's backward vs DP), so the sums are
  rounded in another order.
- DCP checkpoints move between EP sizes: saved at EP = 2, loaded at EP = 1 (weights bit for
  bit; training goes on as it would have at EP = 2, within fp32 rounding, so the AdamW state
  came along), saved there and loaded at EP = 4 and into EP = 1 with expert groups.

Megatron-Core runs on CUDA; four details are bridged in the worker processes only
(graph_fsdp_testing.megatron_on_cpu), none of them in the code under test: its allocations
with ``device=torch.cuda.current_device()`` (communication outputs, the attention's buffer, the
router's weight) go to the CPU; megatron-core 0.16's router linear finds its TE-less branch;
the attention's dropout RNG fork (dropout is 0) is Megatron's no-op inference tracker; and the
alltoall dispatcher's CUDA stream for dropless host copies, which drop-padding never touches,
is a placeholder that fails if it is ever used.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import torch.distributed as dist
from graph_fsdp_testing import TINY_MCORE_SHAPE, megatron_on_cpu

from graph_fsdp.training.processes import spawn

# Three spawned 4-rank groups of about a minute each: the long set (docs/testing.md).
pytestmark = pytest.mark.slow

try:
    from graph_fsdp.integrations.megatron import moe  # noqa: F401 - imports megatron-core
except ImportError as err:
    pytest.skip(f"megatron-core does not import ({err})", allow_module_level=True)

WORLD, STEPS, LR = 4, 4, 1e-2
FP32 = dict(rtol=1e-5, atol=1e-6)
"""Losses: fp32 sums over other groupings (module docstring), differences of a few ulps."""
WEIGHTS = dict(rtol=1e-5, atol=1e-5)
"""Weights after the AdamW steps: its normalised update m / sqrt(v) turns a rounding-level
difference of a near-zero gradient into a larger one (1.4e-6 seen at EP = 4), while a real
error - a gradient summed over the wrong group or scaled wrongly - moves weights by ~LR."""


def _model(**kw):
    from graph_fsdp.integrations import megatron as gm

    base = dict(
        TINY_MCORE_SHAPE,
        num_experts=4,
        moe_router_topk=2,
        moe_shared_expert_intermediate_size=32,
        moe_aux_loss_coeff=1e-2,
        transformer_impl="local",
    )
    base.update(kw)
    return gm.MCoreGPTConfig(**base)


FAMILIES = {
    "dropless allgather": dict(moe_token_dispatcher_type="allgather"),
    "drop-padding alltoall": dict(
        moe_token_dispatcher_type="alltoall",
        moe_expert_capacity_factor=1.0,
        moe_pad_expert_input_to_capacity=True,
    ),
}
VARIANTS = {"ep1": (1, None), "ep1 expert groups": (1, True), "ep2": (2, None), "ep4": (4, None)}
"""label -> (expert_model_parallel_size, shard_gpt's expert_groups)."""


def _build(cfg, ep: int, expert_groups: bool | None, seed: int | None = None):
    from megatron.core.tensor_parallel.random import initialize_rng_tracker

    from graph_fsdp.integrations import megatron as gm

    gm.init_parallel_state(expert_model_parallel_size=ep)
    cfg = dataclasses.replace(cfg, expert_model_parallel_size=ep, seed=seed or cfg.seed)
    lm = gm.build_gpt(cfg, "cpu")
    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    gm.shard_gpt(lm, expert_groups=expert_groups)
    return lm, torch.optim.AdamW(lm.parameters(), lr=LR)


def _batch(step: int, rank: int, cfg) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    seq = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length + 1), generator=g)
    return seq[:, :-1], seq[:, 1:].contiguous()


def _train(lm, opt, cfg, steps: range, rank: int) -> list[float]:
    from graph_fsdp.capture.step import eager_forward_backward

    losses = []
    for step in steps:
        x, y = _batch(step, rank, cfg)
        loss = eager_forward_backward(lm, x, y, 1).detach()
        opt.step()
        opt.zero_grad(set_to_none=True)
        dist.all_reduce(loss)
        losses.append(loss.item() / dist.get_world_size())
    return losses


def _state(lm) -> dict[str, torch.Tensor]:
    from graph_fsdp.fsdp.checkpoint import full_state_dict

    return {k: v.clone() for k, v in full_state_dict(lm).items()}


def _ep_training(rank: int, world: int) -> dict:
    megatron_on_cpu()
    out: dict = {}
    for family, kw in FAMILIES.items():
        cfg = _model(**kw)
        for label, (ep, groups) in VARIANTS.items():
            lm, opt = _build(cfg, ep, groups)
            start = _state(lm)
            losses = _train(lm, opt, cfg, range(STEPS), rank)
            res = {"start": start, "losses": losses, "end": _state(lm)}
            # The sizes of the groups expert parameters are sharded over (none: dense groups).
            groups = {getattr(p, "_graph_fsdp_group", None) for p in lm.parameters()}
            res["expert_groups"] = sorted(
                {g.comm.world_size for g in groups if g is not None and g.expert is not None}
            )
            out[(family, label)] = res if rank == 0 else None
    return out


def _assert_close_states(a: dict, b: dict, what: str, exact: bool) -> None:
    """Bit for bit, or within :data:`WEIGHTS`."""
    assert a.keys() == b.keys(), (what, sorted(a.keys() ^ b.keys())[:6])
    for k, v in a.items():
        if exact:
            assert torch.equal(v, b[k]), (what, k, (v - b[k]).abs().max().item())
        else:
            torch.testing.assert_close(b[k], v, **WEIGHTS, msg=lambda m, k=k: f"{what} {k}: {m}")


def test_expert_parallel_trains_like_ep1() -> None:
    out = spawn(_ep_training, WORLD, timeout=900)[0]
    for family in FAMILIES:
        ref = out[(family, "ep1")]
        names = [k for k in ref["start"] if ".mlp.experts." in k]
        # Global names: every expert of the 4, whatever the EP size.
        assert any("local_experts.3." in k for k in names), names
        assert len(ref["losses"]) == STEPS
        # The steps moved every expert weight (their gradients reached the optimizer).
        assert all(not torch.equal(ref["start"][k], ref["end"][k]) for k in names)
        for label in VARIANTS:
            got = out[(family, label)]
            what = f"{family}, {label}"
            _assert_close_states(ref["start"], got["start"], f"{what} start", exact=True)
            torch.testing.assert_close(got["losses"], ref["losses"], **FP32)
            _assert_close_states(ref["end"], got["end"], f"{what} end", exact=False)
        # Each expert parameter lives in a group over its EDP ranks: world / EP of them.
        assert out[(family, "ep2")]["expert_groups"] == [2]
        assert out[(family, "ep4")]["expert_groups"] == [1]
        assert out[(family, "ep1 expert groups")]["expert_groups"] == [4]
        assert out[(family, "ep1")]["expert_groups"] == []


def _ep_checkpoints(rank: int, world: int, root: str) -> dict:
    from graph_fsdp.fsdp import checkpoint as ckpt

    megatron_on_cpu()
    cfg = _model(**FAMILIES["dropless allgather"])
    a, b = os.path.join(root, "at_ep2"), os.path.join(root, "at_ep1")
    lm, opt = _build(cfg, 2, None)
    _train(lm, opt, cfg, range(2), rank)
    ckpt.save(a, lm, opt)
    saved_a = _state(lm)
    ep2_after = _train(lm, opt, cfg, range(2, 4), rank)
    out = {}
    # Another seed: the loaded weights, not the init, must be what the model holds.
    lm, opt = _build(cfg, 1, None, seed=99)
    out["ep1 differs before load"] = not torch.equal(
        _state(lm)["module.decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight"],
        saved_a["module.decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight"],
    )
    ckpt.load(a, lm, opt)
    out["ep1 loaded"] = (saved_a, _state(lm))
    out["ep1 continues"] = (ep2_after, _train(lm, opt, cfg, range(2, 4), rank))
    ckpt.save(b, lm, opt)
    saved_b = _state(lm)
    for label, ep, groups in (("ep4", 4, None), ("ep1 expert groups", 1, True)):
        lm, opt = _build(cfg, ep, groups, seed=99)
        ckpt.load(b, lm, opt)
        out[f"{label} loaded"] = (saved_b, _state(lm))
    lm, opt = _build(cfg, 2, None, seed=99)
    ckpt.load(b, lm, opt)
    out["back at ep2"] = (saved_b, _state(lm))
    refusals = _parallel_state_refusals(cfg)
    return {**out, "refusals": refusals} if rank == 0 else {}


def _parallel_state_refusals(cfg) -> dict:
    from megatron.core import parallel_state as ps

    from graph_fsdp.integrations import megatron as gm

    out = {}
    for name, call in (
        ("ep3", lambda: gm.init_parallel_state(expert_model_parallel_size=3)),
        ("model at ep1", lambda: gm.build_gpt(cfg, "cpu")),  # the state is at EP = 2
    ):
        try:
            call()
        except ValueError as err:
            out[name] = str(err)
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(expert_model_parallel_size=4)  # someone else's state
    try:
        gm.init_parallel_state(expert_model_parallel_size=2)
    except ValueError as err:
        out["initialised elsewhere"] = str(err)
    gm.init_parallel_state()  # None keeps it
    out["kept"] = ps.get_expert_model_parallel_world_size()
    return out


def test_checkpoints_move_between_ep_sizes(tmp_path) -> None:
    out = spawn(_ep_checkpoints, WORLD, str(tmp_path), timeout=900)[0]
    refusals = out.pop("refusals")
    assert "expert_model_parallel_size=3 does not divide the world size 4" in refusals["ep3"]
    assert (
        "configured for expert_model_parallel_size=1, but Megatron's parallel state has 2"
        in (refusals["model at ep1"])
    )
    assert (
        "initialised elsewhere with expert_model_parallel_size=4"
        in (refusals["initialised elsewhere"])
    )
    assert refusals["kept"] == 4
    assert out.pop("ep1 differs before load")
    ref, got = out.pop("ep1 continues")
    torch.testing.assert_close(got, ref, **FP32)
    for what, (saved, loaded) in out.items():
        _assert_close_states(saved, loaded, what, exact=True)


def _grouped_mm_at_ep1(rank: int, world: int, root: str) -> dict:
    """graph_fsdp's stacked grouped_mm experts at EP = 1, in the layers' dense groups and in
    expert groups: one model, and one checkpoint format."""
    from graph_fsdp.fsdp import checkpoint as ckpt

    megatron_on_cpu()
    cfg = _model(moe_token_dispatcher_type="allgather", moe_experts_impl="grouped_mm")
    out = {}
    for label, groups in (("dense groups", None), ("expert groups", True)):
        lm, opt = _build(cfg, 1, groups)
        start = _state(lm)
        out[label] = (start, _train(lm, opt, cfg, range(3), rank), _state(lm))
        path = os.path.join(root, label.replace(" ", "_"))
        ckpt.save(path, lm, opt)
    lm, opt = _build(cfg, 1, None, seed=99)
    ckpt.load(os.path.join(root, "expert_groups"), lm, opt)
    out["loaded"] = _state(lm)
    return out


def test_grouped_mm_experts_shard_at_ep1(tmp_path) -> None:
    """One rank: no reduction, so the two groupings give the same bits."""
    out = spawn(_grouped_mm_at_ep1, 1, str(tmp_path), timeout=600)[0]
    dense, grouped = out["dense groups"], out["expert groups"]
    key = "module.decoder.layers.0.mlp.experts.linear_fc1.weight"
    assert dense[0][key].shape == (4, 64, 32)  # stacked: [experts, ffn, hidden]
    assert dense[1] == grouped[1]
    _assert_close_states(dense[2], grouped[2], "grouped_mm end", exact=True)
    _assert_close_states(grouped[2], out["loaded"], "grouped_mm loaded", exact=True)
