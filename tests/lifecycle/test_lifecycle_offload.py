"""Offload/onload between and inside steps, weight export, chunk sync, teardown (gloo).

Every check runs on real 2-rank gloo groups: a run that offloads and onloads its parameters,
gradients and optimizer state must train bit-identically to one that does not.
"""

from __future__ import annotations

import gc
import inspect
import weakref

import pytest
import torch
import torch.distributed as dist
from graph_fsdp_testing import TINY_GPT, spawn_cases

from graph_fsdp import iter_full_params, synchronize_param_gather
from graph_fsdp.capture import FullIterationGraphs
from graph_fsdp.fsdp.checkpoint import full_state_dict
from graph_fsdp.fsdp.state import collect_states
from graph_fsdp.models import build_model, synthetic_batch
from graph_fsdp.training.train import TrainConfig, shard_model

TINY = TINY_GPT
CPU = torch.device("cpu")


def _build(strategy: str):
    cfg = TrainConfig(model=TINY, strategy=strategy)
    torch.manual_seed(0)
    model = shard_model(build_model(TINY, device=CPU), cfg)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)


def _expect_error(fn, match: str) -> str:
    with pytest.raises(RuntimeError, match=match) as info:
        fn()
    return str(info.value)


def _cycle(model, opt) -> dict:
    """Offload everything, check what is refused meanwhile, onload; returns the byte counts."""
    sizes = {
        "params": sum(g.main_flat.numel() * 4 for s in _states(model) for g in s.groups),
        "grads": sum(g.main_grad.numel() * 4 for s in _states(model) for g in s.groups),
    }
    out = {
        "params": model.offload_params(),
        "grads": model.offload_grads(),
        "optimizer": model.offload_optimizer(opt),
    }
    assert out["params"]["main_params"] == sizes["params"]
    assert out["grads"]["main_grads"] == sizes["grads"]
    x, y = synthetic_batch(TINY, 1, 0, device=CPU)
    _expect_error(lambda: model(x, y), r"onload_grads\(\) and onload_params\(\)")
    _expect_error(opt.step, "onload_optimizer")
    _expect_error(model.offload_params, "already offloaded")
    out["onload"] = [model.onload_params(), model.onload_grads(), model.onload_optimizer(opt)]
    _expect_error(model.onload_params, "without offload_params")
    _expect_error(lambda: model.onload_optimizer(opt), "without offload_optimizer")
    return out


def _states(model):
    return collect_states(model)


def _round_trip(rank: int, world_size: int, strategy: str) -> dict:
    ref, ref_opt = _build(strategy)
    model, opt = _build(strategy)
    params = list(model.parameters())
    opt_params = [p for g in opt.param_groups for p in g["params"]]
    losses, ref_losses, freed = [], [], []
    for step in range(4):
        for m, o, out in ((ref, ref_opt, ref_losses), (model, opt, losses)):
            x, y = synthetic_batch(TINY, 1, step, rank=rank, device=CPU)
            loss = m(x, y)
            loss.backward()
            if m is model and step == 1:
                freed.append(_cycle(model, opt))  # inside a step: grads pending, then step
            o.step()
            o.zero_grad(set_to_none=True)
            if m is model and step == 2:
                freed.append(_cycle(model, opt))  # between steps
            out.append(loss.item())
    assert list(model.parameters()) == params and all(a is b for a, b in zip(params, opt_params))
    for s in _states(model):
        for g in s.groups:
            base = g.main_flat.untyped_storage().data_ptr()
            assert all(r.sharded.untyped_storage().data_ptr() == base for r in g.params)
    ours, theirs = full_state_dict(model), full_state_dict(ref)
    ours_opt = {i: {k: v.clone() for k, v in opt.state[p].items()} for i, p in enumerate(params)}
    ref_params = list(ref.parameters())
    ref_opt_state = {i: dict(ref_opt.state[p]) for i, p in enumerate(ref_params)}
    same_opt = all(
        torch.equal(ours_opt[i][k], ref_opt_state[i][k]) for i in ours_opt for k in ours_opt[i]
    )
    return {
        "losses": losses,
        "ref_losses": ref_losses,
        "same_params": all(torch.equal(ours[k], theirs[k]) for k in theirs),
        "same_opt": same_opt and len(ours_opt) == len(ref_opt_state),
        "freed": freed,
    }


STRATEGIES = ["optim_grads_params", "optim"]


@pytest.fixture(scope="module")
def two_ranks():
    """Every check of this file in one spawned group; the shutdown guard's last, as it
    destroys the process group."""
    return spawn_cases(
        {
            **{f"round_trip:{s}": (_round_trip, s) for s in STRATEGIES},
            "suspend_on_offload": (_suspend_on_offload,),
            "export": (_export,),
            "two_chunks": (_two_chunks,),
            "collectable": (_collectable,),
            "shutdown_guard": (_guard,),
        },
        2,
    )


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_offload_onload_round_trip_is_bit_identical(two_ranks, strategy):
    for result in two_ranks[f"round_trip:{strategy}"]:
        assert result["losses"] == result["ref_losses"]
        assert result["same_params"] and result["same_opt"]
        for cycle in result["freed"]:
            assert cycle["params"]["total"] > 0 and cycle["grads"]["total"] > 0
            assert cycle["optimizer"]["total"] > 0  # AdamW's exp_avg and exp_avg_sq
            assert [c["total"] for c in cycle["onload"]] == [
                cycle["params"]["main_params"]
                + cycle["params"].get("compute_shard", 0)
                + cycle["params"].get("compute_full", 0),
                cycle["grads"]["total"],
                cycle["optimizer"]["total"],
            ]


def _export(rank: int, world_size: int) -> dict:
    model, opt = _build("optim_grads_params")
    initial = dict(iter_full_params(model))
    unsharded = build_model(TINY, device=CPU).state_dict()
    x, y = synthetic_batch(TINY, 1, 0, rank=rank, device=CPU)
    model(x, y).backward()
    opt.step()
    trained = dict(iter_full_params([model]))
    reference = full_state_dict(model)
    bf16 = dict(iter_full_params(model, dtype=torch.bfloat16))
    model.offload_params()
    offloaded = dict(iter_full_params(model))
    model.onload_params()
    # Export from inside a backward is refused (the units are mid-step).
    loss = model(x, y)
    loss.register_hook(lambda g: dict(iter_full_params(model)) and None)
    message = _expect_error(loss.backward, "iter_full_params during a backward")
    return {
        "initial_equal": initial.keys() == unsharded.keys()
        and all(torch.equal(initial[k], unsharded[k]) for k in unsharded),
        "trained_equal": trained.keys() == reference.keys()
        and all(torch.equal(trained[k], reference[k]) for k in reference),
        "changed": any(not torch.equal(trained[k], initial[k]) for k in initial),
        "bf16_equal": all(torch.equal(bf16[k], reference[k].bfloat16()) for k in reference),
        "offloaded_equal": all(torch.equal(offloaded[k], reference[k]) for k in reference),
        "message": message,
    }


def _two_chunks(rank: int, world_size: int) -> dict:
    chunks = [_build("optim")[0], _build("optim")[0]]
    x, y = synthetic_batch(TINY, 1, 0, rank=rank, device=CPU)
    with torch.no_grad():
        for chunk in chunks:
            chunk(x, y)  # compute weights (ZeRO-1 keeps them gathered) exist
            for i, p in enumerate(chunk.parameters()):
                p.add_(0.5 + i)  # main weights change; compute weights are now stale
    synchronize_param_gather(chunks)
    result = []
    for chunk in chunks:
        full = full_state_dict(chunk)
        ok = True
        for s in _states(chunk):
            for g in s.groups:
                ok &= not g.stale()
                for ref, offset in zip(g.params, g.layout.offsets):
                    got = g.persistent_full[offset : offset + ref.shape.numel()]
                    ok &= torch.equal(got.view(ref.shape), full[ref.fqn])
        result.append(ok)
    return {"synced": result}


def _collectable(rank: int, world_size: int) -> dict:
    model, opt = _build("optim_grads_params")
    x, y = synthetic_batch(TINY, 1, 0, rank=rank, device=CPU)
    model(x, y).backward()
    opt.step()
    opt.zero_grad()
    model_ref, opt_ref = weakref.ref(model), weakref.ref(opt)
    del model, opt
    gc.collect()
    return {"collected": model_ref() is None and opt_ref() is None}


def _suspend_on_offload(rank: int, world_size: int) -> dict:
    """offload_params suspends the graph runners registered with the model's units (an eager
    runner on CPU: its warmup count restarts), not another model's or a closed one's."""
    model, _ = _build("optim_grads_params")
    other, _ = _build("optim_grads_params")
    mine = FullIterationGraphs(model, warmup_steps=1, eager=True)
    theirs = FullIterationGraphs(other, warmup_steps=1, eager=True)
    closed = FullIterationGraphs(model, warmup_steps=1, eager=True)
    closed.close()
    for graphs, m in ((mine, model), (theirs, other)):

        def step_fn(x, y, m=m):
            loss = m(x, y)
            loss.backward()
            return loss.detach()

        graphs.before_step()
        graphs.capture(step_fn)(*synthetic_batch(TINY, 1, 0, rank=rank, device=CPU))
    registered = [{id(r) for r in s.graph_runners} for s in _states(model)]
    model.offload_params()
    return {
        "registered": registered == [{id(mine)}] * len(registered),
        "steps_seen": (mine.steps_seen, theirs.steps_seen),
    }


def test_offload_suspends_the_models_graph_runners(two_ranks):
    for result in two_ranks["suspend_on_offload"]:
        assert result["registered"]
        assert result["steps_seen"] == (0, 1)


def test_export_sync_and_collect(two_ranks):
    for result in two_ranks["export"]:
        assert result["initial_equal"], "export before training differs from the unsharded model"
        assert result["trained_equal"] and result["changed"] and result["bf16_equal"]
        assert result["offloaded_equal"]
        assert "between training steps" in result["message"]
    for result in two_ranks["two_chunks"]:
        assert result["synced"] == [True, True]
    for result in two_ranks["collectable"]:
        assert result["collected"], "a fully_shard-ed model stays alive after del + gc"


# ----------------------------------------------------------------- shutdown guard
from graph_fsdp.capture.teardown import RunnerLifecycle  # noqa: E402


class _Probe(RunnerLifecycle):
    """A runner without graphs (CPU): counts how often its graphs are freed."""

    def __init__(self, fail: bool = False) -> None:
        self.states, self.freed = [], 0
        if fail:  # as a runner refusing its model does, before it registers
            raise ValueError("refused")
        self._register_with_units()

    def _free_graphs(self) -> None:
        self.freed += 1


def _guard(rank: int, world_size: int) -> dict:
    import graph_fsdp.capture as capture

    capture.install_shutdown_guard()  # a second install must not wrap twice
    destroy = dist.destroy_process_group
    original = destroy.__wrapped__
    probe = _Probe()
    with _Probe() as scoped:
        live = probe in capture.live_runners() and scoped in capture.live_runners()
    with pytest.raises(ValueError, match="refused"):
        _Probe(fail=True)  # not live: destroy_process_group has nothing of it to close
    live = live and len(capture.live_runners()) == 1
    dist.barrier()
    dist.destroy_process_group()
    probe.close()  # idempotent
    return {
        "wrapped_once": getattr(destroy, "_graph_fsdp_shutdown_guard", False)
        and not getattr(original, "_graph_fsdp_shutdown_guard", False),
        "signature": inspect.signature(destroy) == inspect.signature(original)
        and destroy.__doc__ == original.__doc__,
        "live": live,
        "scoped": (scoped.closed, scoped.freed),
        "closed_by_destroy": (probe.closed, probe.freed),
        "destroyed": not dist.is_initialized(),
        "after": capture.live_runners(),
    }


def test_destroy_process_group_closes_live_runners(two_ranks):
    for result in two_ranks["shutdown_guard"]:
        assert result["wrapped_once"] and result["signature"] and result["live"]
        assert result["scoped"] == (True, 1)
        assert result["closed_by_destroy"] == (True, 1)
        assert result["destroyed"] and result["after"] == []
