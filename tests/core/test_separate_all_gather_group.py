"""The units' all-gathers on a process group of their own (``separate_all_gather_group``),
on real gloo process groups.

comm.py [Note: a communicator for the all-gathers]: the twin group runs the same collective
over the same ranks in the same rank order, so every run is bit-identical to the one with a
single group - and every unit all-gather must actually go through the twin (a twin that
nothing uses would pass the first check alone). Cases: 1-D ZeRO-3 and ZeRO-1 over the world
(2 ranks), HSDP 2 x 2 (each shard group's twin made by its members only), and an MoE GPT at
EP 2 x EDP 2 (the expert-data-parallel groups' twins), all in one spawn per world size.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from graph_fsdp_testing import TINY_GPT, error_of, spawn_cases, tiny_gpt

from graph_fsdp.fsdp import comm as comm_mod
from graph_fsdp.fsdp.api import BufferPolicy
from graph_fsdp.training.train import TrainConfig, run

BASE = TrainConfig(model=TINY_GPT, steps=3, eval_interval=2)
MOE = dataclasses.replace(
    BASE, model=tiny_gpt(num_layers=3, num_experts=4, moe_layer_freq=2), expert_parallel=2
)


def _gathers(rank: int, world: int, cfg: TrainConfig) -> dict:
    """``cfg`` trained, and the process groups the units' all-gathers ran over: whether each
    was a group made for them (not the world, the mesh's shard group or the expert group)."""
    seen: list[tuple[tuple[int, ...], bool]] = []
    original = comm_mod.all_gather_into
    known = {id(dist.group.WORLD), id(dist.distributed_c10d._get_default_group())}

    def recording(out, shard, group):
        ranks = tuple(dist.get_process_group_ranks(group))
        desc = getattr(group, "group_desc", "")
        seen.append((ranks, id(group) not in known and desc == "graph_fsdp_all_gather"))
        return original(out, shard, group)

    comm_mod.all_gather_into = recording
    try:
        result = run(rank, world, cfg)
    finally:
        comm_mod.all_gather_into = original
    return {
        "losses": result["losses"],
        "eval": result["eval_losses"],
        "params": result["params"],
        "gathers": seen,
    }


def _pair(cfg: TrainConfig) -> dict[str, tuple]:
    return {
        "shared": (_gathers, cfg),
        "separate": (_gathers, dataclasses.replace(cfg, separate_all_gather_group=True)),
    }


CASES_2 = {
    f"{name}:{kind}": case
    for name, cfg in (
        ("zero3", BASE),
        ("zero1", dataclasses.replace(BASE, strategy="optim")),
        (
            "zero3+double_buffer",
            dataclasses.replace(BASE, buffers=BufferPolicy(allocator="double_buffer")),
        ),
    )
    for kind, case in _pair(cfg).items()
}
CASES_4 = {
    f"{name}:{kind}": case
    for name, cfg in (
        ("hsdp2x2", dataclasses.replace(BASE, mesh_shape=(2, 2))),
        ("ep2xedp2", MOE),
    )
    for kind, case in _pair(cfg).items()
}


@pytest.fixture(scope="module")
def results():
    return spawn_cases(CASES_2, world_size=2) | spawn_cases(CASES_4, world_size=4)


def _check(results, name: str) -> None:
    shared, separate = results[f"{name}:shared"], results[f"{name}:separate"]
    for rank, (a, b) in enumerate(zip(shared, separate, strict=True)):
        assert a["losses"] == b["losses"], (rank, a["losses"], b["losses"])
        assert a["eval"] == b["eval"], rank
        assert a["params"].keys() == b["params"].keys()
        for key, value in a["params"].items():
            assert torch.equal(value, b["params"][key]), (rank, key)
        assert a["gathers"] and b["gathers"], rank  # ZeRO-1/2: the updated weights' gathers
        assert not any(own for _, own in a["gathers"]), (rank, "shared runs made a twin")
        assert all(own for _, own in b["gathers"]), (rank, b["gathers"][:4])
        # The twin covers the ranks the shared run gathered over, in the same order.
        assert {r for r, _ in a["gathers"]} == {r for r, _ in b["gathers"]}, rank


@pytest.mark.parametrize("name", ["zero3", "zero1", "zero3+double_buffer", "hsdp2x2", "ep2xedp2"])
def test_all_gathers_on_their_own_group_same_bits(results, name):
    _check(results, name)


def _refusal(rank: int, world: int) -> str:
    half = dist.new_group([0, 1])
    dist.new_group([2, 3])
    if rank >= 2:
        return ""
    c10d = dist.distributed_c10d
    original = c10d._get_default_group
    # What init_process_group(device_id=...) leaves: a default group bound to a device.
    bound = SimpleNamespace(bound_device_id=torch.device("cuda", 0), size=lambda: world)
    c10d._get_default_group = lambda: bound
    try:
        return error_of(lambda: comm_mod.twin_group(half))
    finally:
        c10d._get_default_group = original


def test_sub_group_twin_refused_with_an_eagerly_bound_default_group():
    message = spawn_cases({"refusal": (_refusal,)}, world_size=4)["refusal"][0]
    assert "ranks [0, 1]" in message and "device_id" in message, message
