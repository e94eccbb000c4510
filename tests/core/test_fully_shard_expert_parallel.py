"""Expert parallelism on real gloo process groups: dense parameters sharded over the
data-parallel group, expert parameters over the expert-data-parallel group, in one unit.

A 3-layer MoE GPT (layers 0 and 2 MoE, 4 experts top-2) with its experts partitioned over
EP groups (an all-to-all dispatch, graph_fsdp/parallel/ep_dispatch.py) trains on 4 ranks -
EP = 2 x EDP = 2, EP = 1 x EDP = 4, EP = 4 x EDP = 1 - and matches the unsharded
single-process reference on the global batch. Tolerance 1e-6 (fp32), as every reference
comparison of the suite: the sharded runs sum the ranks' gradients in the collectives' order,
the reference in autograd's, and an expert's GEMM sees every EP rank's tokens in one product
where the reference runs one product per rank. Runs that must do the same arithmetic (static
allocators vs dynamic) are compared bit for bit. Checkpoints written at one EP size load at
others (and on 2 ranks). Everything runs in one spawn of 4 processes and one of 2.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import types

import pytest
import torch
import torch.distributed as dist
from graph_fsdp_testing import error_of, tiny_gpt
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from graph_fsdp import (
    expert_mesh_from_groups,
    fully_shard,
    init_expert_mesh,
    iter_full_params,
    mark_expert_params,
)
from graph_fsdp.fsdp import checkpoint as ckpt
from graph_fsdp.fsdp import reduce as reduction
from graph_fsdp.models import build_model, partition_experts, synthetic_batch
from graph_fsdp.training.checkpoints import CheckpointPolicy
from graph_fsdp.training.processes import spawn
from graph_fsdp.training.train import TrainConfig, run, shard_model

MOE = tiny_gpt(num_layers=3, num_experts=4, moe_layer_freq=2)
BASE = TrainConfig(model=MOE, steps=4, eval_interval=2)
TOL = 1e-6
SAVE_AT = 2
CPU = torch.device("cpu")


def _case(ep: int | None, strategy: str = "optim_grads_params", **kw) -> TrainConfig:
    return dataclasses.replace(BASE, expert_parallel=ep, strategy=strategy, **kw)


CASES: dict[str, TrainConfig] = {
    **{f"ep2:{s}": _case(2, s) for s in ("no_shard", "optim", "optim_grads", "optim_grads_params")},
    "ep1:optim_grads_params": _case(1),
    "ep1:optim": _case(1, "optim"),
    "ep4:optim_grads_params": _case(4),
    "ep2:optim_grads_params+hsdp": _case(2, mesh_shape=(2, 2)),
    "ep2:optim_grads_params+recompute": _case(2, recompute=True),
    "ep2:optim_grads_params+double_buffer": _case(2, allocator="double_buffer"),
    "ep2:optim_grads_params+trace_pool": _case(2, allocator="trace_pool"),
    "ep2:optim+double_buffer": _case(2, "optim", allocator="double_buffer"),
    "no_ep:optim_grads_params": _case(None),
}
ACCUM = {"ep2:optim_grads_params+accum": _case(2, grad_accum=2)}
CLIP = {"ep2:optim_grads_params+clip": _case(2, clip_grad=0.05)}


def _resume_cases(root: str) -> dict[str, TrainConfig]:
    """Save at step 2 under one EP size, resume under another (optimizer state included)."""
    saved = {"ep2": _case(2), "ep1": _case(1, "optim")}
    out: dict[str, TrainConfig] = {}
    for name, cfg in saved.items():
        out[f"save:{name}"] = dataclasses.replace(
            cfg,
            steps=SAVE_AT,
            eval_interval=0,
            checkpoint=CheckpointPolicy(save_path=os.path.join(root, name), save_at=SAVE_AT),
        )
    for src, dst, ep, strategy in (
        ("ep2", "ep1", 1, "optim_grads_params"),
        ("ep1", "ep2", 2, "optim"),
        ("ep2", "ep4", 4, "optim_grads_params"),
        ("ep2", "no_ep", None, "optim_grads_params"),
    ):
        out[f"resume:{src}->{dst}"] = dataclasses.replace(
            _case(ep, strategy),
            eval_interval=0,
            checkpoint=CheckpointPolicy(load_path=os.path.join(root, src)),
            start_step=SAVE_AT,
            steps=BASE.steps - SAVE_AT,
        )
    return out


def _train_all(rank: int, world: int, cases: dict[str, TrainConfig]) -> dict:
    return {label: run(rank, world, cfg) for label, cfg in cases.items()}


def _load_on_two_ranks(rank: int, world: int, root: str) -> dict:
    """The EP = 2 checkpoint of 4 ranks loaded on 2: EP = 2 x EDP = 1, EP = 1, no EP."""
    out = {}
    for ep in (2, 1, None):
        load = CheckpointPolicy(load_path=os.path.join(root, "ep2"))
        cfg = _case(ep, checkpoint=load, start_step=SAVE_AT, steps=0)
        out[ep] = run(rank, world, cfg)["params"]
    return out


def _four_ranks(rank: int, world: int, cases: dict[str, TrainConfig], root: str) -> dict:
    return {
        "train": _train_all(rank, world, cases),
        "engine": _groups_grads_errors(rank, world, root),
    }


@pytest.fixture(scope="module")
def spawned(tmp_path_factory) -> dict:
    """Every 4-rank case in one spawn, then the 2-rank loads in another."""
    root = str(tmp_path_factory.mktemp("ep_ckpt"))
    cases = {**CASES, **ACCUM, **CLIP, **_resume_cases(root)}
    per_rank = spawn(_four_ranks, 4, cases, root)
    return {
        "ranks": [r["train"] for r in per_rank],
        "engine": [r["engine"] for r in per_rank],
        "two": spawn(_load_on_two_ranks, 2, root),
    }


@pytest.fixture(scope="module")
def results(spawned) -> dict:
    reference = {
        "base": run(0, 4, dataclasses.replace(BASE, mode="reference")),
        "accum": run(0, 4, dataclasses.replace(ACCUM[next(iter(ACCUM))], mode="reference")),
        "clip": run(0, 4, dataclasses.replace(CLIP[next(iter(CLIP))], mode="reference")),
    }
    return {**spawned, "reference": reference}


def _max_diffs(res: dict, ref: dict, *, steps: slice = slice(None)) -> tuple[float, float]:
    assert sorted(res["params"]) == sorted(ref["params"])  # global names, every expert
    loss = max(abs(a - b) for a, b in zip(res["losses"], ref["losses"][steps], strict=True))
    param = max((res["params"][n] - v).abs().max().item() for n, v in ref["params"].items())
    return loss, param


@pytest.mark.parametrize("label", [*CASES, *ACCUM, *CLIP])
def test_expert_parallel_matches_reference(results, label):
    ref = results["reference"]
    ref = ref["accum"] if label in ACCUM else ref["clip"] if label in CLIP else ref["base"]
    for rank, per_rank in enumerate(results["ranks"]):
        res = per_rank[label]
        loss, param = _max_diffs(res, ref)
        assert loss <= TOL and param <= TOL, f"{label} rank {rank}: {loss=} {param=}"
        expert = res["params"]["layers.0.moe.experts.w1"]
        assert expert.shape == (MOE.num_experts, MOE.hidden_size, MOE.ffn_hidden_size)
    if label in CLIP:  # it clips: the run differs from an unclipped one
        unclipped = results["ranks"][0]["ep2:optim_grads_params"]["params"]
        moved = max(
            (results["ranks"][0][label]["params"][n] - v).abs().max().item()
            for n, v in unclipped.items()
        )
        assert moved > 1e-4, moved


@pytest.mark.parametrize(
    ("static", "dynamic"),
    [
        ("ep2:optim_grads_params+double_buffer", "ep2:optim_grads_params"),
        ("ep2:optim_grads_params+trace_pool", "ep2:optim_grads_params"),
        ("ep2:optim+double_buffer", "ep2:optim"),
    ],
)
def test_static_allocators_bit_identical_to_dynamic(results, static, dynamic):
    for per_rank in results["ranks"]:
        a, b = per_rank[static], per_rank[dynamic]
        assert a["losses"] == b["losses"] and a["eval_losses"] == b["eval_losses"]
        for name, value in b["params"].items():
            assert torch.equal(a["params"][name], value), name


@pytest.mark.parametrize("label", ["resume:ep2->ep1", "resume:ep1->ep2", "resume:ep2->ep4"])
def test_checkpoint_round_trip_across_ep_sizes(results, label):
    """A checkpoint saved at step 2 under one EP size resumes under another - weights and
    AdamW state - and the run ends where the reference does."""
    ref = results["reference"]["base"]
    for rank, per_rank in enumerate(results["ranks"]):
        loss, param = _max_diffs(per_rank[label], ref, steps=slice(SAVE_AT, None))
        assert loss <= TOL and param <= TOL, f"{label} rank {rank}: {loss=} {param=}"


def test_expert_parallel_checkpoint_loads_without_ep_and_on_two_ranks(results):
    """The same global names and offsets load into a model without expert parallelism, and
    on another world size, bit for bit."""
    saved = results["ranks"][0]["save:ep2"]["params"]
    ref = results["reference"]["base"]
    for per_rank in results["ranks"]:
        loss, param = _max_diffs(per_rank["resume:ep2->no_ep"], ref, steps=slice(SAVE_AT, None))
        assert loss <= TOL and param <= TOL, (loss, param)
    for rank, per_ep in enumerate(results["two"]):
        for ep, params in per_ep.items():
            assert sorted(params) == sorted(saved)
            for name, value in saved.items():
                assert torch.equal(params[name], value), (rank, ep, name)


# ----------------------------------------------------------------- groups, gradients, errors
def _ep_model(ep: int, strategy: str = "optim_grads_params"):
    torch.manual_seed(0)
    cfg = _case(ep, strategy)
    return shard_model(build_model(MOE, device=CPU), cfg)


def _reference_grads(world: int) -> dict[str, torch.Tensor]:
    """Gradients of the unsharded model on the global batch (each rank's microbatch, mean)."""
    model = build_model(MOE, device=CPU)
    for r in range(world):
        x, y = synthetic_batch(MOE, 1, 0, rank=r, device=CPU)
        (model(x, y) / world).backward()
    return {n: p.grad for n, p in model.named_parameters()}


def _reductions(rank: int, world: int) -> dict:
    """Which ranks each group's gradients were reduced over (real collectives, recorded)."""
    seen: dict[str, set] = {}
    originals = reduction.reduce_scatter, reduction.all_reduce

    def record(fn):
        def wrapped(*args, over_replicas=False):  # (out, full | full), ctx, fqn
            ctx, fqn = args[-2:]
            group = ctx.replicate_group if over_replicas else ctx.group
            seen.setdefault(fqn, set()).add(tuple(dist.get_process_group_ranks(group)))
            return fn(*args, over_replicas=over_replicas)

        return wrapped

    out = {}
    reduction.reduce_scatter, reduction.all_reduce = record(originals[0]), record(originals[1])
    try:
        for strategy in ("optim_grads_params", "no_shard"):
            seen.clear()
            model = _ep_model(2, strategy)
            x, y = synthetic_batch(MOE, 1, 0, rank=rank, device=CPU)
            model(x, y).backward()
            out[strategy] = {k: sorted(v) for k, v in seen.items()}
    finally:
        reduction.reduce_scatter, reduction.all_reduce = originals
    return out


def _grads_and_norms(rank: int, world: int) -> dict:
    """EP = 2, no_shard: each rank's expert gradients are its experts' rows of the reference
    gradients (summed over EDP, divided by DP); and the global norm counts every element once."""
    ref = _reference_grads(world)
    ref_norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in ref.values()])).item()
    out = {"grad_diff": 0.0, "norms": {}}
    model = _ep_model(2, "no_shard")
    x, y = synthetic_batch(MOE, 1, 0, rank=rank, device=CPU)
    model(x, y).backward()
    ep_rank = rank % 2  # init_expert_mesh: consecutive ranks form an EP group
    for name, p in model.named_parameters():
        expected = ref[name]
        if ".experts." in name:
            local = MOE.num_experts // 2
            expected = expected[ep_rank * local : (ep_rank + 1) * local]
        diff = (p.grad - expected.reshape(-1)).abs().max().item()
        out["grad_diff"] = max(out["grad_diff"], diff)
    out["norms"]["ep2:no_shard"] = model.clip_grad_norm_(1e9).item()
    for ep, strategy in ((2, "optim_grads_params"), (1, "optim_grads_params"), (4, "optim")):
        model = _ep_model(ep, strategy)
        model(x, y).backward()
        out["norms"][f"ep{ep}:{strategy}"] = torch.nn.utils.clip_grad_norm_(
            model.parameters(), 1e9
        ).item()
    out["ref_norm"] = ref_norm
    return out


def _equal(a: dict, b: dict) -> bool:
    return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def _export_and_offload(rank: int, world: int) -> dict:
    """iter_full_params yields the global expert tensors under global names (like
    full_state_dict), also while the parameters are offloaded; a step after onload trains."""
    model = _ep_model(2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = synthetic_batch(MOE, 1, 0, rank=rank, device=CPU)
    model(x, y).backward()
    opt.step()
    opt.zero_grad()
    full = ckpt.full_state_dict(model)
    same = {n: torch.equal(t, full[n]) for n, t in iter_full_params(model)}
    freed = model.offload_params()
    while_offloaded = {n: torch.equal(t, full[n]) for n, t in iter_full_params(model)}
    model.onload_params()
    loss = model(x, y)
    loss.backward()
    report = model.fsdp_memory_report()
    groups = [g for s in model._fsdp_state.root.states for g in s.groups]
    # Meta-device init (each rank materialises its experts, broadcast over EDP), and a global
    # unsharded state dict (all experts) through load_state_dict: both give the model's values.
    ep2 = init_expert_mesh("cpu", 2)
    meta = partition_experts(build_model(MOE, device="meta"), ep2["ep"].get_group())
    for layer in meta.layers:
        fully_shard(layer, expert_mesh=ep2)
    fully_shard(meta)
    fresh = _ep_model(2)
    fresh.load_state_dict(build_model(MOE, device=CPU).state_dict())
    initial = build_model(MOE, device=CPU).state_dict()
    return {
        "meta_equal": _equal(ckpt.full_state_dict(meta), initial),
        "loaded_equal": _equal(ckpt.full_state_dict(fresh), initial),
        "same": same,
        "names": sorted(full),
        "while_offloaded": while_offloaded,
        "freed": freed["main_params"],
        "main_bytes": sum(g.main_flat.untyped_storage().nbytes() for g in groups),
        "report_main": report["persistent_bytes"]["main_params"],
        "expert_groups": [g.fqn for g in groups if g.expert is not None],
        "loss_finite": bool(torch.isfinite(loss)),
    }


class _Grouped(nn.Module):
    """Parameters named like TransformerEngine's GroupedLinear: ``weight0 .. weight{n-1}``."""

    def __init__(self, n: int, first: int) -> None:
        super().__init__()
        self.num_gemms = n
        for i in range(n):
            p = nn.Parameter(torch.full((3, 5), float(first + i)))
            p.allreduce = False  # Megatron's expert mark
            self.register_parameter(f"weight{i}", p)


class _PerExpertModel(nn.Module):
    """Three kinds of per-expert parameters: Megatron's ``local_experts.<i>`` and grouped
    ``weight<i>`` (found by name), and a ModuleList marked with per_expert_children."""

    def __init__(self, num_local: int, first: int) -> None:
        super().__init__()
        self.local_experts = nn.ModuleList(nn.Linear(4, 6, bias=False) for _ in range(num_local))
        for i, expert in enumerate(self.local_experts):
            expert.weight.data.fill_(first + i)
            expert.weight.allreduce = False
        self.grouped = _Grouped(num_local, first)
        self.experts = nn.ModuleList(nn.Linear(2, 3) for _ in range(num_local))
        for i, expert in enumerate(self.experts):
            expert.weight.data.fill_(10 * (first + i))
            expert.bias.data.fill_(-(first + i))
        mark_expert_params(self.experts, per_expert_children=True)
        self.dense = nn.Linear(4, 4)
        self.dense.weight.data.fill_(7.0)


def _per_expert_round_trip(rank: int, world: int, root: str) -> dict:
    """Save at EP = 2 (2 local experts), load at EP = 1 (4) and at EP = 4 (1): local expert i
    of EP rank r is global expert r * n + i."""
    out = {}
    for name, ep_save, ep_load in (("2to1", 2, 1), ("1to4", 1, 4)):
        path = os.path.join(root, f"per_expert_{name}")
        meshes = {ep: init_expert_mesh("cpu", ep) for ep in (ep_save, ep_load)}
        models = {}
        for ep in (ep_save, ep_load):
            local = 4 // ep
            ep_rank = meshes[ep]["ep"].get_local_rank()
            filled = _PerExpertModel(local, ep_rank * local if ep == ep_save else 100)
            models[ep] = fully_shard(filled, expert_mesh=meshes[ep])
        keys = sorted(ckpt.sharded_state_dict(models[ep_save]))
        ckpt.save(path, models[ep_save])
        ckpt.load(path, models[ep_load])
        full = ckpt.full_state_dict(models[ep_load])
        out[name] = {"keys": keys, "full": {k: v.clone() for k, v in full.items()}}
    return out


def _stub_megatron(ep: int):
    stub = types.ModuleType("megatron.core.parallel_state")
    stub.model_parallel_is_initialized = lambda: True
    stub.get_expert_model_parallel_world_size = lambda: ep
    return stub


def _megatron_marks(rank: int) -> dict:
    """Megatron's ``allreduce=False`` marks: refused without an expert mesh, and an expert
    mesh of another EP size than Megatron's parallel state (stubbed: megatron-core is not
    installed in CI) is refused."""
    model = _PerExpertModel(2, 0)
    del model.experts  # only Megatron-marked experts
    out = {"no_mesh": error_of(lambda: fully_shard(model))}
    name = "megatron.core.parallel_state"
    if name in sys.modules:
        return out
    try:
        sys.modules[name] = _stub_megatron(4)
        out["mismatch"] = error_of(
            lambda: fully_shard(_PerExpertModel(2, 0), expert_mesh=init_expert_mesh("cpu", 2))
        )
        sys.modules[name] = _stub_megatron(2)
        out["match"] = error_of(
            lambda: fully_shard(_PerExpertModel(2, 0), expert_mesh=init_expert_mesh("cpu", 2))
        )
    finally:
        sys.modules.pop(name, None)
    return out


def _errors(rank: int, world: int) -> dict:
    def marked_without_mesh():
        model = partition_experts(
            build_model(MOE, device=CPU), init_expert_mesh("cpu", 2)["ep"].get_group()
        )
        fully_shard(model.layers[0])

    def with_mesh(mesh):
        model = build_model(MOE, device=CPU)
        mark_expert_params(model.layers[0].moe.experts)
        fully_shard(model.layers[0], expert_mesh=mesh)

    def mark_after():
        model = build_model(MOE, device=CPU)
        fully_shard(model)
        mark_expert_params(model.layers[0].moe.experts)

    ep1 = init_expert_mesh("cpu", 1)

    def unknown_layout(export: bool):
        model = build_model(MOE, device=CPU)
        model.layers[1].mlp.fc1.weight.allreduce = False  # an expert mark, layout unknown
        for layer in model.layers:
            fully_shard(layer, expert_mesh=ep1)
        fully_shard(model)
        if export:
            ckpt.full_state_dict(model)
        else:
            ckpt.save("/nonexistent/never_written", model)

    six = dataclasses.replace(MOE, num_experts=6)
    return {
        "no_mesh": error_of(marked_without_mesh),
        "mesh_1d": error_of(
            lambda: with_mesh(init_device_mesh("cpu", (4,), mesh_dim_names=("edp",)))
        ),
        "mesh_names": error_of(
            lambda: with_mesh(
                init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
            )
        ),
        "mesh_ranks": error_of(
            lambda: with_mesh(DeviceMesh("cpu", [[0, 1]], mesh_dim_names=("edp", "ep")))
        ),
        "mesh_type": error_of(lambda: with_mesh(42)),
        "ep_divisor": error_of(lambda: init_expert_mesh("cpu", 3)),
        "partition": error_of(
            lambda: partition_experts(
                build_model(six, device=CPU), init_expert_mesh("cpu", 4)["ep"].get_group()
            )
        ),
        "mark_after": error_of(mark_after),
        "children": error_of(lambda: mark_expert_params(nn.Linear(2, 2), per_expert_children=True)),
        "dense_model": error_of(
            lambda: run(rank, world, _case(2, model=dataclasses.replace(MOE, num_experts=None)))
        ),
        "unknown_layout_save": error_of(lambda: unknown_layout(False)),
        "unknown_layout_export": error_of(lambda: unknown_layout(True)),
        "megatron": _megatron_marks(rank),
    }


def _one_step(mesh) -> tuple[float, dict]:
    model = partition_experts(build_model(MOE, device=CPU), mesh["ep"].get_group())
    for layer in model.layers:
        fully_shard(layer, expert_mesh=mesh)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = synthetic_batch(MOE, 1, 0, rank=dist.get_rank(), device=CPU)
    loss = model(x, y)
    loss.backward()
    opt.step()
    return loss.item(), ckpt.full_state_dict(model)


def _from_groups(rank: int, world: int) -> dict:
    """A mesh made of existing groups (as Megatron's parallel state holds them) trains as the
    one init_expert_mesh builds, bit for bit."""
    ep_groups = [dist.new_group(r) for r in ([0, 1], [2, 3])]
    edp_groups = [dist.new_group(r) for r in ([0, 2], [1, 3])]
    ep, edp = ep_groups[rank // 2], edp_groups[rank % 2]
    mesh = expert_mesh_from_groups("cpu", ep_group=ep, edp_group=edp)
    loss, params = _one_step(mesh)
    expected_loss, expected = _one_step(init_expert_mesh("cpu", 2))
    return {
        "mesh": mesh.mesh.tolist(),
        "same": loss == expected_loss and _equal(params, expected),
        "untiled": error_of(
            lambda: expert_mesh_from_groups("cpu", ep_group=ep, edp_group=dist.group.WORLD)
        ),
    }


def _groups_grads_errors(rank: int, world: int, root: str) -> dict:
    return {
        "from_groups": _from_groups(rank, world),
        "reductions": _reductions(rank, world),
        "grads": _grads_and_norms(rank, world),
        "export": _export_and_offload(rank, world),
        "per_expert": _per_expert_round_trip(rank, world, root),
        "errors": _errors(rank, world),
    }


@pytest.fixture(scope="module")
def engine(spawned) -> list[dict]:
    return spawned["engine"]


def test_expert_gradients_are_reduced_over_the_expert_data_parallel_group_only(engine):
    for rank, res in enumerate(engine):
        edp = [rank % 2, rank % 2 + 2]  # ranks holding the same experts
        for strategy, seen in res["reductions"].items():
            experts = {k: v for k, v in seen.items() if k.endswith(".experts")}
            dense = {k: v for k, v in seen.items() if not k.endswith(".experts")}
            assert sorted(experts) == ["layers.0.experts", "layers.2.experts"], (strategy, seen)
            assert all(v == [tuple(edp)] for v in experts.values()), (strategy, experts)
            assert dense and all(v == [(0, 1, 2, 3)] for v in dense.values()), (strategy, dense)


def test_expert_gradients_and_global_norm_match_the_reference(engine):
    for res in engine:
        grads = res["grads"]
        assert grads["grad_diff"] <= TOL, grads["grad_diff"]
        for label, norm in grads["norms"].items():
            assert abs(norm - grads["ref_norm"]) <= TOL * grads["ref_norm"], (label, norm)


def test_export_offload_init_and_load_cover_expert_groups(engine):
    for res in engine:
        export = res["export"]
        assert export["expert_groups"] == ["layers.0.experts", "layers.2.experts"]
        assert "layers.2.moe.experts.w2" in export["names"]
        assert all(export["same"].values()) and sorted(export["same"]) == export["names"]
        assert all(export["while_offloaded"].values())
        assert export["freed"] == export["main_bytes"] == export["report_main"]
        assert export["loss_finite"]
        assert export["meta_equal"] and export["loaded_equal"]


def test_per_expert_layouts_round_trip_across_ep_sizes(engine):
    """Megatron's ``local_experts.<i>`` and ``weight<i>`` and a marked ModuleList: saved
    under global expert indices, loaded at another EP size into the right local experts."""
    for rank, res in enumerate(engine):
        for name, ep_save in (("2to1", 2), ("1to4", 1)):
            got = res["per_expert"][name]
            local = 4 // ep_save
            mine = range((rank % ep_save) * local, (rank % ep_save + 1) * local)
            saved = {k for k in got["keys"] if k.startswith("model.local_experts.")}
            assert saved == {f"model.local_experts.{g}.weight" for g in mine}, (name, saved)
            full = got["full"]
            assert set(full) == {
                *(f"local_experts.{g}.weight" for g in range(4)),
                *(f"grouped.weight{g}" for g in range(4)),
                *(f"experts.{g}.{p}" for g in range(4) for p in ("weight", "bias")),
                "dense.weight",
                "dense.bias",
            }, sorted(full)
            for g in range(4):
                assert torch.all(full[f"local_experts.{g}.weight"] == g), (name, g)
                assert torch.all(full[f"grouped.weight{g}"] == g), (name, g)
                assert torch.all(full[f"experts.{g}.weight"] == 10 * g), (name, g)
                assert torch.all(full[f"experts.{g}.bias"] == -g), (name, g)
            assert torch.all(full["dense.weight"] == 7.0)


def test_expert_mesh_from_existing_groups(engine):
    for res in engine:
        got = res["from_groups"]
        assert got["mesh"] == [[0, 1], [2, 3]] and got["same"]
        assert "cannot tile the 4 ranks" in got["untiled"], got["untiled"]


def test_clear_errors(engine):
    expected = {
        "no_mesh": ["were marked by mark_expert_params", "no expert_mesh", "init_expert_mesh"],
        "mesh_1d": ["must be 2-D", "'edp'", "'ep'"],
        "mesh_names": ["must be 2-D", "('replicate', 'shard')"],
        "mesh_ranks": ["covers ranks [0, 1]", "data-parallel mesh covers [0, 1, 2, 3]"],
        "mesh_type": ["expected a DeviceMesh", "init_expert_mesh"],
        "ep_divisor": ["ep_size=3", "divisor of the world size 4"],
        "partition": ["6 experts", "4 ranks", "multiple of the EP size"],
        "mark_after": ["after fully_shard"],
        "children": ["per_expert_children=True", "named 0..n-1"],
        "dense_model": ["expert_parallel=2", "GPTConfig.num_experts"],
        "unknown_layout_save": ["layers.1.mlp.fc1.weight", "mark_expert_params"],
        "unknown_layout_export": ["layers.1.mlp.fc1.weight", "no known global layout"],
    }
    for res in engine:
        errors = res["errors"]
        for key, parts in expected.items():
            for part in parts:
                assert part in errors[key], (key, errors[key])
        megatron = errors["megatron"]
        assert "Megatron-Core expert parameters (allreduce=False" in megatron["no_mesh"]
        assert "local_experts.0.weight" in megatron["no_mesh"]
        if "mismatch" in megatron:
            assert "expert_model_parallel_size 4" in megatron["mismatch"]
            assert megatron["match"] == "no error"
