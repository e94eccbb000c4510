"""HSDP on real gloo process groups: 2-D (replicate, shard) meshes match the reference.

Four ranks as a 2x2 mesh and the degenerate 1x4 / 4x1 meshes, every strategy, with the
optimizer sharded over the shard dimension only or over both (``optim_over_replicas``). All
cases train in one spawned group of 4 processes, the error checks after them (each spawn
costs seconds; a case costs ~0.5 s).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from graph_fsdp_testing import TINY_GPT, CaseResults, error_of, spawn_cases
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from graph_fsdp import fully_shard
from graph_fsdp.fsdp.api import MixedPrecisionPolicy
from graph_fsdp.fsdp.checkpoint import full_state_dict
from graph_fsdp.models import build_model
from graph_fsdp.training.train import TrainConfig, run

TINY = TINY_GPT
STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
BASE = TrainConfig(model=TINY, steps=3)
ACCUM = dataclasses.replace(BASE, grad_accum=2)


def _case(mesh: tuple[int, int] | None, strategy: str, over: bool = False, **kw) -> TrainConfig:
    return dataclasses.replace(
        BASE, mesh_shape=mesh, strategy=strategy, optim_over_replicas=over, **kw
    )


CASES: dict[str, TrainConfig] = {
    f"{r}x{s}:{strategy}": _case((r, s), strategy)
    for r, s in ((2, 2), (1, 4), (4, 1))
    for strategy in STRATEGIES
}
CASES.update(
    {
        f"{r}x{s}:{strategy}+optim_over_replicas": _case((r, s), strategy, True)
        for r, s in ((2, 2), (4, 1))
        for strategy in STRATEGIES[1:]
    }
)
EXTRA: dict[str, TrainConfig] = {
    # no_sync accumulation, then the two-step reduction of the last microbatch.
    "2x2:optim_grads_params+optim_over_replicas+accum": dataclasses.replace(
        _case((2, 2), "optim_grads_params", True), grad_accum=2
    ),
    # static slots for the reduce-scatter outputs of both dims (grad_comm_dtype below).
    "2x2:optim_grads_params+optim_over_replicas+double_buffer": _case(
        (2, 2), "optim_grads_params", True, allocator="double_buffer", eval_interval=1
    ),
    "2x2:optim_grads_params+optim_over_replicas+dynamic": _case(
        (2, 2), "optim_grads_params", True, eval_interval=1
    ),
    # ZeRO-1 over replicas: full gradients all-reduced over both dims, planned pool.
    "2x2:optim+optim_over_replicas+trace_pool": _case(
        (2, 2), "optim", True, allocator="trace_pool"
    ),
    # bf16 reduction: the reduced shards go through the comm-dtype buffers of both dims.
    **{
        f"{name}:optim_grads_params{'+optim_over_replicas' if over else ''}+bf16_comm": _case(
            mesh,
            "optim_grads_params",
            over,
            mp=MixedPrecisionPolicy(grad_comm_dtype=torch.bfloat16),
        )
        for name, mesh, over in (
            ("1d", None, False),
            ("4x1", (4, 1), True),
            ("2x2", (2, 2), True),
            ("2x2", (2, 2), False),
        )
    },
    "1d:optim_grads_params": _case(None, "optim_grads_params"),
}


def _train_all(rank: int, world: int, cases: dict[str, TrainConfig]) -> dict:
    return {label: run(rank, world, cfg) for label, cfg in cases.items()}


@pytest.fixture(scope="module")
def four_ranks() -> CaseResults:
    """The trainings, then the error and meta-init checks, in one spawned group."""
    return spawn_cases(
        {"train": (_train_all, {**CASES, **EXTRA}), "errors": (_errors_and_meta_init,)}, 4
    )


@pytest.fixture(scope="module")
def results(four_ranks) -> dict:
    return {
        "ranks": four_ranks["train"],
        "reference": run(0, 4, dataclasses.replace(BASE, mode="reference")),
        "reference_accum": run(0, 4, dataclasses.replace(ACCUM, mode="reference")),
    }


def _max_diffs(res: dict, ref: dict) -> tuple[float, float]:
    loss = max(abs(a - b) for a, b in zip(res["losses"], ref["losses"]))
    param = max((res["params"][n] - v).abs().max().item() for n, v in ref["params"].items())
    return loss, param


@pytest.mark.parametrize("label", list(CASES))
def test_meshes_and_strategies_match_reference(results, label):
    for rank, per_rank in enumerate(results["ranks"]):
        loss, param = _max_diffs(per_rank[label], results["reference"])
        assert loss <= 1e-6 and param <= 1e-6, f"{label} rank {rank}: {loss=} {param=}"
        assert len(per_rank[label]["losses"]) == BASE.steps


def test_accumulation_matches_reference(results):
    label = "2x2:optim_grads_params+optim_over_replicas+accum"
    for per_rank in results["ranks"]:
        loss, param = _max_diffs(per_rank[label], results["reference_accum"])
        assert loss <= 1e-6 and param <= 1e-6, (loss, param)


@pytest.mark.parametrize(
    ("static_label", "dynamic_label"),
    [
        (
            "2x2:optim_grads_params+optim_over_replicas+double_buffer",
            "2x2:optim_grads_params+optim_over_replicas+dynamic",
        ),
        ("2x2:optim+optim_over_replicas+trace_pool", "2x2:optim+optim_over_replicas"),
    ],
)
def test_static_allocators_bit_identical_to_dynamic(results, static_label, dynamic_label):
    for per_rank in results["ranks"]:
        static, dynamic = per_rank[static_label], per_rank[dynamic_label]
        assert static["losses"] == dynamic["losses"]
        assert static["eval_losses"] == dynamic["eval_losses"]
        for name, value in dynamic["params"].items():
            assert torch.equal(static["params"][name], value), name


def test_bf16_gradient_reduction_paths_are_exact(results):
    """bf16 sums round differently from the fp32 reference, so these compare runs that must
    perform the same bf16 reductions: a 4x1 mesh reduce-scatters across the 4 replicas what
    1-D reduce-scatters across 4 ranks, and a 2x2 mesh sums two bf16 partial sums across
    replicas with a reduce-scatter (optimizer over replicas) or an all-reduce."""
    pairs = (
        ("4x1:optim_grads_params+optim_over_replicas", "1d:optim_grads_params"),
        ("2x2:optim_grads_params+optim_over_replicas", "2x2:optim_grads_params"),
    )
    for per_rank in results["ranks"]:
        for a, b in pairs:
            ra, rb = per_rank[f"{a}+bf16_comm"], per_rank[f"{b}+bf16_comm"]
            assert ra["losses"] == rb["losses"], (a, b)
            for name, value in rb["params"].items():
                assert torch.equal(ra["params"][name], value), (a, b, name)
        # ... and the bf16 rounding is really there (these are not fp32 runs).
        loss, param = _max_diffs(per_rank["2x2:optim_grads_params+bf16_comm"], results["reference"])
        assert param > 1e-6, param


def test_replicate_size_one_is_bit_identical_to_1d(results):
    for per_rank in results["ranks"]:
        one_d, degenerate = per_rank["1d:optim_grads_params"], per_rank["1x4:optim_grads_params"]
        assert one_d["losses"] == degenerate["losses"]
        for name, value in one_d["params"].items():
            assert torch.equal(degenerate["params"][name], value), name


# ----------------------------------------------------------------- errors and meta-device init
def _model() -> nn.Module:
    torch.manual_seed(0)
    return build_model(TINY, device=torch.device("cpu"))


def _shard_layers_then_root(layer_mesh, root_mesh) -> None:
    model = _model()
    for layer in model.layers:
        fully_shard(layer, mesh=layer_mesh)
    fully_shard(model, mesh=root_mesh)


def _errors_and_meta_init(rank: int, world: int) -> dict:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    flat = init_device_mesh("cpu", (1, 4), mesh_dim_names=("replicate", "shard"))
    out = {
        "3d": error_of(lambda: fully_shard(_model(), mesh=init_device_mesh("cpu", (1, 2, 2)))),
        "replicate_1": error_of(lambda: fully_shard(_model(), mesh=flat, optim_over_replicas=True)),
        "no_mesh": error_of(lambda: fully_shard(_model(), optim_over_replicas=True)),
        "no_shard": error_of(
            lambda: fully_shard(_model(), mesh=mesh, strategy="no_shard", optim_over_replicas=True)
        ),
        "swapped": error_of(
            lambda: fully_shard(
                _model(),
                mesh=init_device_mesh("cpu", (2, 2), mesh_dim_names=("shard", "replicate")),
            )
        ),
        "size": error_of(lambda: fully_shard(_model(), mesh=DeviceMesh("cpu", [0, 1, 2]))),
        "device": error_of(
            lambda: fully_shard(
                _model(), mesh=DeviceMesh("meta", [[0, 1], [2, 3]], mesh_dim_names=("r", "s"))
            )
        ),
        "mismatch": error_of(lambda: _shard_layers_then_root(mesh, flat)),
        "train_shape": error_of(
            lambda: run(rank, world, dataclasses.replace(BASE, mesh_shape=(3, 2)))
        ),
    }
    # Meta-device init: every rank draws different values; after the broadcast over both
    # mesh dims every rank (replicas included) holds rank 0's.
    states = {}
    for over in (False, True):
        torch.manual_seed(100 + rank)
        model = build_model(TINY, device=torch.device("meta"))
        for layer in model.layers:
            fully_shard(layer, mesh=mesh, optim_over_replicas=over)
        fully_shard(model, mesh=mesh, optim_over_replicas=over)
        state = full_state_dict(model)
        gathered: list = [None] * world
        dist.all_gather_object(gathered, state)
        states[over] = all(torch.equal(g[name], state[name]) for g in gathered for name in state)
    out["meta_same_on_every_rank"] = states
    out["grad_norms"] = _grad_norms(rank, mesh)
    return out


def _grad_norms(rank: int, mesh) -> dict:
    """clip_grad_norm_'s global norm of one backward, for meshes that shard the optimizer
    differently (it must sum each element once: over replicas only where they differ)."""
    from graph_fsdp.models import synthetic_batch

    placements = {
        "1d": {},
        "2x2": {"mesh": mesh},
        "2x2+optim_over_replicas": {"mesh": mesh, "optim_over_replicas": True},
        "2x2:optim+optim_over_replicas": {
            "mesh": mesh,
            "optim_over_replicas": True,
            "strategy": "optim",
        },
        "2x2:no_shard": {"mesh": mesh, "strategy": "no_shard"},
    }
    norms = {}
    for label, kw in placements.items():
        model = _model()
        for layer in model.layers:
            fully_shard(layer, **kw)
        fully_shard(model, **kw)
        x, y = synthetic_batch(TINY, 1, 0, rank=rank, device=torch.device("cpu"))
        model(x, y).backward()
        norms[label] = model.clip_grad_norm_(1e9).item()
    return norms


def test_clear_errors_meta_init_and_grad_norm_over_both_dims(four_ranks):
    results = four_ranks["errors"]
    expected = {
        "3d": ["got a 3-D mesh", "2-D (replicate, shard)"],
        "replicate_1": ["replicate size 1", "use a 1-D mesh"],
        "no_mesh": ["optim_over_replicas=True", "no mesh", "init_device_mesh"],
        "no_shard": ["'no_shard' does not shard the optimizer", "optim_grads_params"],
        "swapped": ["(replicate, shard)", "('shard', 'replicate')"],
        "size": ["(3,)", "world of 4 ranks", "replicas x shard_size = 4"],
        "device": ["mesh device type 'meta'", "init_device_mesh('cpu'"],
        "mismatch": ["'layers.0'", "replicate 2 x shard 2", "same DeviceMesh"],
        "train_shape": ["mesh_shape=(3, 2)", "world size 4"],
    }
    for rank, res in enumerate(results):
        for key, fragments in expected.items():
            for fragment in fragments:
                assert fragment in res[key], f"rank {rank} {key}: {fragment!r} not in {res[key]!r}"
        assert res["meta_same_on_every_rank"] == {False: True, True: True}
        norms = res["grad_norms"]
        for label, norm in norms.items():
            assert norm == pytest.approx(norms["1d"], rel=1e-5), (label, norms)
