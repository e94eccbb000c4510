"""Clear failures: bad checkpoints are refused whole, a dead rank never hangs the others."""

from __future__ import annotations

import dataclasses
import glob
import os
import time

import pytest
import torch
import torch.distributed as dist
from graph_fsdp_testing import TINY_GPT, CaseResults, spawn_cases

from graph_fsdp.fsdp import checkpoint as ckpt
from graph_fsdp.fsdp.checkpoint import CheckpointError
from graph_fsdp.models import GPTConfig, build_model, synthetic_batch
from graph_fsdp.training.processes import spawn
from graph_fsdp.training.train import TrainConfig, shard_model

TINY = TINY_GPT
CPU = torch.device("cpu")


def _build(model_cfg: GPTConfig = TINY):
    torch.manual_seed(0)
    model = shard_model(build_model(model_cfg, device=CPU), TrainConfig(model=model_cfg))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train(model, opt, rank: int, steps: int = 1) -> None:
    for step in range(steps):
        x, y = synthetic_batch(TINY, 1, step, rank=rank, device=CPU)
        model(x, y).backward()
        opt.step()
        opt.zero_grad()


WIDE = dataclasses.replace(TINY, hidden_size=48)
"""Another model shape (its checkpoint must not load into TINY)."""


def _refused(fn) -> str:
    try:
        fn()
    except CheckpointError as exc:
        return str(exc)
    raise AssertionError("the load was not refused")


def _checkpoints(rank: int, world_size: int, root: str) -> dict:
    good, wide, bad = (os.path.join(root, n) for n in ("good", "wide", "truncated"))
    model, opt = _build()
    _train(model, opt, rank)
    ckpt.save(good, model, opt)
    ckpt.save(bad, model, opt)
    saved = ckpt.full_state_dict(model)
    other, other_opt = _build(WIDE)
    ckpt.save(wide, other, other_opt)
    dist.barrier()
    if rank == 0:
        files = sorted(glob.glob(os.path.join(bad, "*.distcp")))
        with open(files[0], "r+b") as f:
            f.truncate(os.path.getsize(files[0]) // 2)
    dist.barrier()

    fresh, fresh_opt = _build()
    before = ckpt.full_state_dict(fresh)
    messages = {
        "truncated": _refused(lambda: ckpt.load(bad, fresh, fresh_opt)),
        "shape": _refused(lambda: ckpt.load(wide, fresh, fresh_opt)),
        "missing": _refused(lambda: ckpt.load(os.path.join(root, "nope"), fresh, fresh_opt)),
    }
    unchanged = all(torch.equal(v, before[k]) for k, v in ckpt.full_state_dict(fresh).items())

    # A save that fails half-way leaves the previous checkpoint whole.
    meta_mtime = os.path.getmtime(os.path.join(good, ".metadata"))
    _train(model, opt, rank, steps=1)
    opt.param_groups[0]["unpicklable"] = lambda: None  # DCP cannot write this group
    try:
        ckpt.save(good, model, opt)
        failed = ""
    except CheckpointError as exc:  # DCP reports the writer's failure on every rank
        failed = str(exc)
    del opt.param_groups[0]["unpicklable"]
    dist.barrier()
    ckpt.load(good, fresh, fresh_opt)
    restored = ckpt.full_state_dict(fresh)
    return {
        "messages": messages,
        "unchanged": unchanged,
        "failed": failed,
        "previous_intact": os.path.getmtime(os.path.join(good, ".metadata")) == meta_mtime
        and all(torch.equal(restored[k], v) for k, v in saved.items()),
        "file": os.path.basename(sorted(glob.glob(os.path.join(bad, "*.distcp")))[0]),
    }


def test_bad_checkpoints_are_refused_and_saves_are_atomic(tmp_path):
    for r in spawn(_checkpoints, 2, str(tmp_path)):
        msgs = r["messages"]
        assert "truncated" in msgs["truncated"] and r["file"] in msgs["truncated"]
        assert "layers." in msgs["truncated"] or "embed" in msgs["truncated"]  # a param named
        assert "another model shape" in msgs["shape"] and "parameter " in msgs["shape"]
        assert "no checkpoint" in msgs["missing"]
        assert r["unchanged"], "a refused load changed the model"
        assert "previous checkpoint there is untouched" in r["failed"]
        assert r["previous_intact"]


def _die_mid_step(rank: int, world_size: int) -> None:
    model, opt = _build()
    _train(model, opt, rank)
    x, y = synthetic_batch(TINY, 1, 1, rank=rank, device=CPU)
    loss = model(x, y)
    if rank == 1:
        os._exit(17)  # dies between forward and backward, without a word
    loss.backward()  # all-gathers and reduce-scatters with the dead peer
    opt.step()
    dist.barrier()


def test_a_dead_rank_fails_the_others_quickly():
    start = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        spawn(_die_mid_step, 2, pg_timeout_s=20)
    elapsed = time.monotonic() - start
    message = str(info.value)
    assert "rank 1" in message and "exited with code 17" in message
    assert "rank 0 failed" in message, f"the surviving rank did not raise:\n{message}"
    assert elapsed < 60 + 30, f"took {elapsed:.0f} s (bound: 60 s after start-up)"
    print(f"dead-rank failure reported after {elapsed:.1f} s")


def _world(rank: int, world_size: int) -> int:
    t = torch.ones(1)
    dist.all_reduce(t)
    return int(t.item())


@pytest.mark.slow
def test_spawn_retries_when_its_port_was_taken(monkeypatch):
    import socket

    import graph_fsdp.training.processes as launch

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = [taken.getsockname()[1]]
    real = launch.free_port
    monkeypatch.setattr(launch, "free_port", lambda: ports.pop() if ports else real())
    start = time.monotonic()
    try:
        assert spawn(_world, 2) == [2, 2]
    finally:
        taken.close()
    assert not ports, "the first launch used the taken port"
    assert time.monotonic() - start < 60, "the failed launch was not cut short"


def _pid_and_world(rank: int, world_size: int) -> tuple[int, int]:
    return os.getpid(), _world(rank, world_size)


def _first_random(rank: int, world_size: int) -> float:
    return torch.rand(1).item()


def _fails_on(rank: int, world_size: int, bad_rank: int) -> int:
    if rank == bad_rank:
        raise ValueError("this case fails on purpose")
    return rank


def test_spawn_cases_runs_every_case_in_one_group_and_reports_each():
    results = spawn_cases(
        {
            "first": (_pid_and_world,),
            "rng_a": (_first_random,),
            "rng_b": (_first_random,),
            "again": (_pid_and_world,),
            "broken": (_fails_on, 1),
            "after": (_fails_on, -1),
        },
        2,
    )
    assert list(results) == ["first", "rng_a", "rng_b", "again", "broken", "after"]
    assert results["first"] == results["again"], "the cases ran in different processes"
    assert [world for _, world in results["first"]] == [2, 2]
    assert results["rng_a"] == results["rng_b"], "a case did not start from a fresh RNG state"
    with pytest.raises(AssertionError, match="(?s)case 'broken': rank 1 failed:.*on purpose"):
        results["broken"]
    # Rank 0 ran on (no collective waited for rank 1), rank 1 stopped at its failure.
    with pytest.raises(AssertionError, match="rank 1 did not run it: case 'broken' failed"):
        results["after"]
    with pytest.raises(KeyError, match="no case 'missing'"):
        results["missing"]


def test_case_results_of_two_groups_join_and_keep_their_world_sizes():
    one = CaseResults({"solo": ()}, [{"solo": ("ok", 1)}])
    two = CaseResults({"pair": (), "late": ()}, [{"pair": ("ok", 2)}, {"pair": ("ok", 3)}])
    both = one | two
    assert list(both) == ["solo", "pair", "late"] and len(both) == 3
    assert both["solo"] == [1] and both["pair"] == [2, 3]
    with pytest.raises(AssertionError, match="rank 0 did not run it: no failure reported"):
        both["late"]


def _env_and_parent(rank: int, world_size: int, name: str) -> tuple[str | None, int]:
    return os.environ.get(name), os.getppid()


def test_ranks_see_the_environment_of_the_spawn_call(monkeypatch):
    """Under the suite's forkserver ([Note: forkserver ranks]) the ranks' environment is the
    caller's at the call, not the server's from when it started."""
    name = "GRAPH_FSDP_TEST_SPAWN_MARK"
    for value in ("first", "second"):  # the second call reuses the server
        monkeypatch.setenv(name, value)
        results = spawn(_env_and_parent, 2, name)
        assert [env for env, _ in results] == [value, value]
    monkeypatch.delenv(name)
    assert [env for env, _ in spawn(_env_and_parent, 2, name)] == [None, None]


def test_start_method_is_one_of_the_known():
    from graph_fsdp.training.processes import set_start_method

    with pytest.raises(ValueError, match=r"set_start_method\('fork'\): one of"):
        set_start_method("fork")
