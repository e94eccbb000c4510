"""DCP save/load: resume is bit-identical; a checkpoint loads onto another world size."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed.checkpoint as dcp
from graph_fsdp_testing import TINY_GPT, CaseResults, full_optimizer_state, spawn_cases

from graph_fsdp.fsdp import checkpoint as ckpt
from graph_fsdp.models import build_model, synthetic_batch
from graph_fsdp.training.checkpoints import CheckpointPolicy
from graph_fsdp.training.train import TrainConfig, run, shard_model

TINY = TINY_GPT
CPU = torch.device("cpu")
EVAL_STEP = 10**6
"""Data position of the batch used to check the compute weights after a load."""


def test_resume_is_bit_identical(spawned):
    _, results = spawned
    full, resumed = results["resume:full"], results["resume:resumed"]
    assert resumed[0]["losses"] == full[0]["losses"][2:]
    for name, value in full[0]["params"].items():
        assert (resumed[0]["params"][name] == value).all(), name


# ----------------------------------------------------------------- other world size / strategy
def _build(cfg: TrainConfig):
    torch.manual_seed(cfg.model.seed)
    model = shard_model(build_model(cfg.model, device=CPU), cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    return model, optimizer


def _train_step(model, optimizer, cfg: TrainConfig, step: int, rank: int) -> float:
    x, y = synthetic_batch(cfg.model, cfg.micro_batch_size, step, rank=rank, device=CPU)
    loss = model(x, y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def _train_and_save(rank: int, world_size: int, cfg: TrainConfig, steps: int, path: str):
    model, optimizer = _build(cfg)
    for step in range(steps):
        _train_step(model, optimizer, cfg, step, rank)
    ckpt.save(path, model, optimizer)
    return {
        "params": ckpt.full_state_dict(model),
        "optim": full_optimizer_state(model, optimizer),
        "hparams": [(g["lr"], g["weight_decay"]) for g in optimizer.param_groups],
    }


def _load(rank: int, world_size: int, cfg: TrainConfig, path: str, start_step: int):
    # cfg's lr/weight_decay deliberately differ from the checkpoint's: load restores them.
    model, optimizer = _build(cfg)
    x, y = synthetic_batch(cfg.model, 1, EVAL_STEP, rank=0, device=CPU)
    with torch.no_grad():
        model(x, y)  # compute weights exist before the load: it must refresh them
    ckpt.load(path, model, optimizer)
    with torch.no_grad():
        eval_loss = model(x, y).item()
    out = {
        "params": ckpt.full_state_dict(model),
        "optim": full_optimizer_state(model, optimizer),
        "hparams": [(g["lr"], g["weight_decay"]) for g in optimizer.param_groups],
        "eval_loss": eval_loss,
    }
    # Training continues from the loaded state.
    out["loss"] = _train_step(model, optimizer, cfg, start_step, rank)
    out["params_after_step"] = ckpt.full_state_dict(model)
    return out


MOVES = [
    (2, "optim_grads_params", 4, "optim_grads"),  # 2 -> 4 ranks, ZeRO-3 -> ZeRO-2
    (4, "optim_grads_params", 2, "optim"),  # 4 -> 2 ranks, ZeRO-3 -> ZeRO-1
]


@pytest.fixture(scope="module")
def spawned(tmp_path_factory) -> tuple[dict, CaseResults]:
    """Three spawned groups, in the order the checkpoints need: 2 ranks (the resume, the
    2-rank save), 4 ranks (its load, the 4-rank save), 2 ranks (that one's load)."""
    root = tmp_path_factory.mktemp("checkpoints")
    resume = str(root / "resume")
    paths = {move: str(root / "-".join(map(str, move))) for move in MOVES}
    saves: dict[int, dict] = {2: {}, 4: {}}
    loads: dict[int, dict] = {2: {}, 4: {}}
    for move in MOVES:
        save_world, save_strategy, load_world, load_strategy = move
        save_cfg = TrainConfig(model=TINY, strategy=save_strategy)
        # lr/weight_decay deliberately differ from the checkpoint's: load restores them.
        load_cfg = TrainConfig(model=TINY, strategy=load_strategy, lr=0.0, weight_decay=0.0)
        saves[save_world][f"save:{move}"] = (_train_and_save, save_cfg, 2, paths[move])
        loads[load_world][f"load:{move}"] = (_load, load_cfg, paths[move], 2)
    first = spawn_cases(
        {
            "resume:full": (
                run,
                TrainConfig(
                    model=TINY, steps=4, checkpoint=CheckpointPolicy(save_path=resume, save_at=2)
                ),
            ),
            "resume:resumed": (
                run,
                TrainConfig(
                    model=TINY, steps=2, checkpoint=CheckpointPolicy(load_path=resume), start_step=2
                ),
            ),
            **saves[2],
        },
        2,
    )
    four = spawn_cases({**loads[4], **saves[4]}, 4)
    last = spawn_cases(loads[2], 2)
    return paths, first | four | last


@pytest.mark.parametrize(("save_world", "save_strategy", "load_world", "load_strategy"), MOVES)
def test_load_onto_other_world_size_and_strategy(
    spawned, save_world, save_strategy, load_world, load_strategy
):
    move = (save_world, save_strategy, load_world, load_strategy)
    paths, results = spawned
    path = paths[move]
    saved = results[f"save:{move}"][0]
    # The checkpoint holds parameters split across the saving ranks (several DCP chunks).
    metadata = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    assert any(
        len(md.chunks) > 1 for key, md in metadata.items() if key.startswith(("model.", "optim."))
    )

    loaded = results[f"load:{move}"]
    for result in loaded:  # every rank gathers the same full state
        assert result["hparams"] == saved["hparams"]
        assert result["params"].keys() == saved["params"].keys()
        for name, value in saved["params"].items():
            assert torch.equal(result["params"][name], value), name
        assert result["optim"].keys() == saved["optim"].keys()
        for key, value in saved["optim"].items():
            assert torch.equal(result["optim"][key], value), key

    # The compute weights are the loaded ones (not those gathered before the load).
    reference = build_model(TINY, device=CPU)
    missing, unexpected = reference.load_state_dict(saved["params"], strict=False)
    assert not unexpected and not set(missing) & {n for n, _ in reference.named_parameters()}
    x, y = synthetic_batch(TINY, 1, EVAL_STEP, rank=0, device=CPU)
    with torch.no_grad():
        expected = reference(x, y).item()
    assert loaded[0]["eval_loss"] == pytest.approx(expected, rel=1e-5)

    assert all(math.isfinite(r["loss"]) for r in loaded)
    moved = loaded[0]["params_after_step"]
    assert any(not torch.equal(moved[n], v) for n, v in saved["params"].items())
