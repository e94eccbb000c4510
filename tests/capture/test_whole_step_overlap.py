"""The one-graph step with the next step's gathers queued under its optimizer step
(``StepPolicy(overlap_next_gather=True)``, capture/next_gather.py), eager path on gloo.

Each case trains the same model twice - the switch off, then on - through
``WholeStepGraph(..., eager=True)`` (the graphed step's bit-exact twin), with the traps between
steps that must make the next step gather again: an eval forward, a checkpoint saved and
loaded back over newer weights, ``drop()``, and an Inf/NaN-skipped step. Losses, norms, skip
flags, eval outputs, final weights and optimizer state must be bit-identical; and the gathers
each step's first forward ran tell whether it found the next units gathered (two fewer than
without the switch) or gathered them again (the same number) - so a prefetch that is never
used, or a stale one that is used, fails.
"""

from __future__ import annotations

import math

import pytest
import torch
from graph_fsdp_testing import SMALLEST_GPT, shard_layers, spawn_cases

from graph_fsdp.capture.step_optimizer import step_optimizer
from graph_fsdp.capture.whole_step import StepPolicy, WholeStepGraph
from graph_fsdp.fsdp import checkpoint
from graph_fsdp.fsdp.api import BufferPolicy, MixedPrecisionPolicy
from graph_fsdp.fsdp.checkpoint import full_state_dict
from graph_fsdp.fsdp.param_group import FlatParamGroup
from graph_fsdp.training.data import batch_for
from graph_fsdp.training.train import TrainConfig, build_for, shard_model

CPU = torch.device("cpu")
STEPS = 9
SAVE_BEFORE, EVAL_BEFORE, INF_STEP, DROP_BEFORE, LOAD_BEFORE = 2, 3, 4, 6, 7
PREFETCH_USED = (1, 2, 4, 5, 8)
"""Steps whose first forward finds the next units gathered by the step before: none before
step 1, and each trap (eval under ZeRO-3, drop, load) makes the step after it gather again."""


def _cfg(**kw) -> TrainConfig:
    return TrainConfig(model=SMALLEST_GPT, micro_batch_size=2, device="cpu", **kw)


CASES = {
    # ZeRO-3, bf16 compute, 2 microbatches (no_sync), weight slots of the double buffer
    "zero3_bf16_accum2": (
        _cfg(grad_accum=2, bf16=True, buffers=BufferPolicy(allocator="double_buffer")),
        False,
    ),
    # ZeRO-3 with every unit kept gathered from its forward to its backward
    "zero3_keep_gathered": (_cfg(grad_accum=1, bf16=True), True),
    "zero2_bf16": (_cfg(grad_accum=1, bf16=True, strategy="optim_grads"), False),
    "zero1_fp32_accum2": (_cfg(grad_accum=2, strategy="optim"), False),
}


def _model(cfg: TrainConfig, keep_gathered: bool):
    if not keep_gathered:
        return shard_model(build_for(cfg, CPU), cfg)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    return shard_layers(
        build_for(cfg, CPU),
        strategy=cfg.strategy,
        mp_policy=mp,
        buffer_policy=BufferPolicy(allocator="double_buffer"),
        reshard_after_forward=False,
    )


def _poison(step: int, micro: int, rank: int) -> torch.Tensor:
    return torch.tensor(math.inf if (step, micro, rank) == (INF_STEP, 0, 0) else 1.0)


def _run(rank: int, world: int, cfg: TrainConfig, keep: bool, overlap: bool, path: str) -> dict:
    model = _model(cfg, keep)
    opt = torch.optim.AdamW(
        model.parameters(), lr=torch.tensor(1e-2), weight_decay=0.01, fused=True
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 1.0 / (1.0 + e))
    policy = StepPolicy(clip_grad=0.05, overlap_next_gather=overlap)
    runner = WholeStepGraph(model, opt, policy=policy, eager=True)
    gathers = [0]
    first_forward = []

    def step_fn(x, y, poison, *, n, m):
        before = gathers[0]
        loss = model(x, y) / n * poison
        if m == 0:
            first_forward.append(gathers[0] - before)
        loss.backward()
        return loss.detach()

    original = FlatParamGroup._gather_into

    def counted(group, full):
        gathers[0] += 1
        return original(group, full)

    FlatParamGroup._gather_into = counted
    out = {"losses": [], "norms": [], "skipped": [], "evals": [], "held": []}
    try:
        step = runner.capture(step_fn)
        for i in range(STEPS):
            if i == SAVE_BEFORE:
                checkpoint.save(path, model, opt)
            if i == EVAL_BEFORE:
                with torch.no_grad():
                    out["evals"].append(model(*batch_for(cfg, 0, rank, CPU, eval=True)))
            if i == DROP_BEFORE:
                runner.drop()
            if i == LOAD_BEFORE:  # back to older weights than the ones gathered
                checkpoint.load(path, model, opt)
            mbs = [
                {"x": x, "y": y, "poison": _poison(i, m, rank), "m": m}
                for m, (x, y) in enumerate(
                    batch_for(cfg, i * cfg.grad_accum + m, rank, CPU) for m in range(cfg.grad_accum)
                )
            ]
            res = step(mbs, n=cfg.grad_accum)
            sched.step()
            out["losses"] += res.outputs
            out["norms"].append(res.grad_norm)
            out["skipped"].append(float(res.skipped))
            held = runner.next_gather.held if runner.next_gather is not None else []
            out["held"].append([s.fqn for s in held])
        with torch.no_grad():
            out["evals"].append(model(*batch_for(cfg, 1, rank, CPU, eval=True)))
    finally:
        FlatParamGroup._gather_into = original
    out["first_forward_gathers"] = first_forward
    out["weights"] = {k: v.clone() for k, v in full_state_dict(model).items()}
    out["opt"] = {
        f"{i}.{k}": v.clone()
        for i, p in enumerate(p for g in opt.param_groups for p in g["params"])
        for k, v in opt.state.get(p, {}).items()
        if torch.is_tensor(v)
    }
    return out


def _case(rank: int, world: int, cfg: TrainConfig, keep: bool, path: str) -> dict:
    return {
        "off": _run(rank, world, cfg, keep, False, f"{path}_off"),
        "on": _run(rank, world, cfg, keep, True, f"{path}_on"),
    }


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = {}
    for world in (1, 2):
        root = tmp_path_factory.mktemp(f"world{world}")
        cases = {
            f"{name}_w{world}": (_case, cfg, keep, str(root / name))
            for name, (cfg, keep) in CASES.items()
        }
        out[world] = spawn_cases(cases, world_size=world)
    return out


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.contiguous().view(ints), b.contiguous().view(ints))


def _differing(a: dict, b: dict) -> list[str]:
    assert a.keys() == b.keys()
    return [k for k in a if not _same_bits(a[k], b[k])]


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("case", list(CASES))
def test_overlap_is_bit_identical_and_used(results, case, world):
    for rank, r in enumerate(results[world][f"{case}_w{world}"]):
        off, on = r["off"], r["on"]
        where = f"{case} world {world} rank {rank}"
        for key in ("losses", "norms", "evals"):
            assert len(off[key]) == len(on[key])
            for i, (a, b) in enumerate(zip(off[key], on[key])):
                assert _same_bits(a, b), (where, key, i, a, b)
        assert off["skipped"] == on["skipped"] == [float(i == INF_STEP) for i in range(STEPS)]
        assert not torch.isfinite(on["norms"][INF_STEP])
        assert _differing(off["weights"], on["weights"]) == [], where
        assert _differing(off["opt"], on["opt"]) == [], where
        # The step left the root and the unit it prefetches gathered for the next one.
        assert all(h[:1] == ["root"] and len(h) == 2 for h in on["held"]), on["held"]
        assert all(h == [] for h in off["held"])
        # Each step's first forward gathered two units fewer where the prefetch was valid,
        # and as many as without it after every trap (eval, drop, load) and at step 0.
        n_off, n_on = off["first_forward_gathers"], on["first_forward_gathers"]
        zero3 = "zero3" in case
        for i in range(STEPS):
            expected = n_off[i] - 2 if i in PREFETCH_USED else n_off[i]
            assert n_on[i] == expected, (where, i, n_off, n_on)
        if zero3:  # every unit is gathered at every step without the switch
            assert n_off[1] == n_off[0] > 2, n_off


def test_optimizer_over_subsets_writes_the_bits_of_one_call():
    torch.manual_seed(0)
    shapes = [(7, 5), (3,), (0,), (11,), (4, 4)]

    def make():
        g = torch.Generator().manual_seed(1)
        ps = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g)
        opt = torch.optim.AdamW(
            [{"params": ps[:3]}, {"params": ps[3:], "weight_decay": 0.0}],
            lr=torch.tensor(1e-2),
            fused=True,
        )
        return ps, opt

    one_ps, one = make()
    parts_ps, parts = make()
    for found in (0.0, 1.0, 0.0):
        found_inf = torch.tensor(found)
        step_optimizer(one, found_inf)
        step_optimizer(parts, found_inf, params=[parts_ps[3], parts_ps[0]])
        step_optimizer(parts, found_inf, exclude={id(parts_ps[3]), id(parts_ps[0])})
    groups = [len(g["params"]) for g in parts.param_groups]
    assert groups == [3, 2]  # the optimizer's own groups are back
    for a, b in zip(one_ps, parts_ps):
        assert _same_bits(a.detach(), b.detach())
        for key in one.state.get(a, {}):
            assert _same_bits(one.state[a][key], parts.state[b][key]), key


def test_next_gather_units_must_be_positive():
    with pytest.raises(ValueError, match="next_gather_units=0"):
        StepPolicy(next_gather_units=0)
