"""CPU optimizer offload: bit-identical to the plain optimizer, checkpoints in and out of it."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from graph_fsdp_testing import TINY_GPT, CaseResults, full_optimizer_state, spawn_cases

from graph_fsdp.fsdp import checkpoint as ckpt
from graph_fsdp.fsdp.optim_offload import CPUOffloadOptimizer, check_offload_config, offloaded_bytes
from graph_fsdp.models import build_model, synthetic_batch
from graph_fsdp.training.train import TrainConfig, run, shard_model

TINY = TINY_GPT
CPU = torch.device("cpu")
HPARAMS = {"lr": 1e-2, "weight_decay": 0.01, "betas": (0.9, 0.95)}


def _model(strategy: str = "optim_grads_params"):
    torch.manual_seed(0)
    return shard_model(build_model(TINY, device=CPU), TrainConfig(model=TINY, strategy=strategy))


def _optimizer(model, fraction: float | None):
    if fraction is None:
        return torch.optim.AdamW(model.parameters(), **HPARAMS)
    return CPUOffloadOptimizer(
        model.parameters(), torch.optim.AdamW, offload_fraction=fraction, num_buckets=3, **HPARAMS
    )


def _step(model, opt, step: int, rank: int) -> float:
    x, y = synthetic_batch(TINY, 1, step, rank=rank, device=CPU)
    loss = model(x, y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _versus_plain(rank: int, world_size: int, fraction: float) -> dict:
    plain, offl = _model(), _model()
    opt_plain, opt_off = _optimizer(plain, None), _optimizer(offl, fraction)
    sched = torch.optim.lr_scheduler.StepLR(opt_off, step_size=2, gamma=0.5)
    sched_plain = torch.optim.lr_scheduler.StepLR(opt_plain, step_size=2, gamma=0.5)
    losses = [[], []]
    for step in range(5):
        losses[0].append(_step(plain, opt_plain, step, rank))
        losses[1].append(_step(offl, opt_off, step, rank))
        sched.step()
        sched_plain.step()
    split = offloaded_bytes(opt_off)
    return {
        "losses": losses,
        "params": _equal(ckpt.full_state_dict(plain), ckpt.full_state_dict(offl)),
        "state": _equal(
            full_optimizer_state(plain, opt_plain), full_optimizer_state(offl, opt_off)
        ),
        "cpu_params": sum(len(b.params) for b in opt_off.buckets),
        "device_params": len(opt_off.device_params),
        "split": split,
    }


FRACTIONS = [1.0, 0.5, 0.0]


@pytest.mark.parametrize("fraction", FRACTIONS)
def test_offloaded_optimizer_equals_plain_bit_for_bit(spawned, fraction):
    _, results = spawned
    for r in results[f"versus_plain:{fraction}"]:
        assert r["losses"][0] == r["losses"][1]
        assert r["params"] and r["state"]
        if fraction == 1.0:
            assert r["device_params"] == 0 and r["cpu_params"] > 0
        elif fraction == 0.0:
            assert r["cpu_params"] == 0 and r["device_params"] > 0
        else:
            assert r["cpu_params"] > 0 and r["device_params"] > 0


def _save(rank: int, world_size: int, fraction: float | None, path: str) -> dict:
    model = _model()
    opt = _optimizer(model, fraction)
    for step in range(3):
        _step(model, opt, step, rank)
    ckpt.save(path, model, opt)
    return {
        "params": ckpt.full_state_dict(model),
        "optim": full_optimizer_state(model, opt),
        "loss": _step(model, opt, 3, rank),
        "after": ckpt.full_state_dict(model),
    }


def _load_both(rank: int, world_size: int, fractions: list, path: str) -> dict:
    out = []
    for fraction in fractions:
        model = _model("optim_grads")  # another strategy too
        opt = _optimizer(model, fraction)
        ckpt.load(path, model, opt)
        loaded = {
            "params": ckpt.full_state_dict(model),
            "optim": full_optimizer_state(model, opt),
        }
        loaded["loss"] = _step(model, opt, 3, rank)
        loaded["after"] = ckpt.full_state_dict(model)
        out.append(loaded)
    return out


MOVES = [(2, 0.5, 4), (4, None, 2)]
LOAD_FRACTIONS = [None, 1.0, 0.3]  # plain, all offloaded, another split
RUN = TrainConfig(model=TINY, steps=3)


def _refused(rank: int, world_size: int, cfg: TrainConfig) -> str | None:
    try:
        run(rank, world_size, cfg)
    except ValueError as err:
        return str(err)
    return None


@pytest.fixture(scope="module")
def spawned(tmp_path_factory) -> tuple[dict, CaseResults]:
    """Three spawned groups, in the order the checkpoints need: 2 ranks (every 2-rank check,
    the 2-rank save), 4 ranks (its load, the 4-rank save), 2 ranks (that one's load)."""
    root = tmp_path_factory.mktemp("optim_offload")
    paths = {move: str(root / "-".join(map(str, move))) for move in MOVES}
    saves: dict[int, dict] = {2: {}, 4: {}}
    loads: dict[int, dict] = {2: {}, 4: {}}
    for move in MOVES:
        save_world, save_fraction, load_world = move
        saves[save_world][f"save:{move}"] = (_save, save_fraction, paths[move])
        loads[load_world][f"load:{move}"] = (_load_both, LOAD_FRACTIONS, paths[move])
    offloaded = dataclasses.replace(RUN, optimizer_offload_fraction=0.5)
    first = spawn_cases(
        {
            **{f"versus_plain:{f}": (_versus_plain, f) for f in FRACTIONS},
            "run:plain": (run, RUN),
            "run:offloaded": (run, offloaded),
            "run:offloaded+recompute": (_refused, dataclasses.replace(offloaded, recompute=True)),
            **saves[2],
        },
        2,
    )
    four = spawn_cases({**loads[4], **saves[4]}, 4)
    last = spawn_cases(loads[2], 2)
    return paths, first | four | last


@pytest.mark.parametrize(("save_world", "save_fraction", "load_world"), MOVES)
def test_checkpoint_round_trip_with_and_without_offload(
    spawned, save_world, save_fraction, load_world
):
    move = (save_world, save_fraction, load_world)
    _, results = spawned
    saved = results[f"save:{move}"][0]
    loaded = results[f"load:{move}"]
    for rank_result in loaded:
        for variant in rank_result:
            assert _equal(variant["params"], saved["params"])
            assert _equal(variant["optim"], saved["optim"])
        # The next step is the same whichever side holds the state.
        plain = rank_result[0]
        for variant in rank_result[1:]:
            assert variant["loss"] == plain["loss"]
            assert _equal(variant["after"], plain["after"])
    if save_world == load_world:  # same data split: continues the saving run exactly
        assert _equal(loaded[0][0]["after"], saved["after"])


def test_offload_config_rule():
    check_offload_config(recompute=False, pipeline_parallel_size=1)
    with pytest.raises(ValueError, match="recompute"):
        check_offload_config(recompute=True)
    with pytest.raises(ValueError, match="pipeline_parallel_size=2"):
        check_offload_config(recompute=False, pipeline_parallel_size=2)
    with pytest.raises(ValueError, match=r"offload_fraction=1.5"):
        CPUOffloadOptimizer([torch.zeros(2, requires_grad=True)], offload_fraction=1.5)


def test_train_run_with_optimizer_offload_matches_and_checks_recompute(spawned):
    _, results = spawned
    plain, offloaded = results["run:plain"][0], results["run:offloaded"][0]
    assert offloaded["losses"] == plain["losses"]
    assert all(torch.equal(offloaded["params"][k], v) for k, v in plain["params"].items())
    for message in results["run:offloaded+recompute"]:
        assert message is not None and "activation recompute" in message, message


def test_cpu_kwargs_reach_only_the_cpu_buckets_and_survive_lr_changes():
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(64)) for _ in range(4)]
    opt = CPUOffloadOptimizer(
        params, torch.optim.AdamW, offload_fraction=0.5, cpu_kwargs={"fused": True}, lr=1e-3
    )
    ref_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    ref = torch.optim.AdamW(ref_params, lr=1e-3, fused=True)
    for step in range(3):
        for p, q in zip(params, ref_params):
            p.grad = torch.full_like(p, 0.1 * (step + 1))
            q.grad = p.grad.clone()
        opt.param_groups[0]["lr"] = ref.param_groups[0]["lr"] = 1e-3 / (step + 1)
        opt.step()
        ref.step()
    assert all(g["fused"] for b in opt.buckets for g in b.optimizer.param_groups)
    assert not any(g["fused"] for g in opt.device_optimizer.param_groups)
    # Offloaded params follow fused AdamW exactly (CPU here, so the device half runs the
    # default CPU kernels: equal to within rounding).
    for p, q in zip(params[:2], ref_params[:2]):
        assert torch.equal(p, q)
    for p, q in zip(params[2:], ref_params[2:]):
        assert torch.allclose(p, q, rtol=0, atol=1e-6)
