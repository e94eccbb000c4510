"""Gradient clipping by the global norm (grad_norm.py [Note: global gradient norm]): torch's
own ``clip_grad_norm_`` on a sharded model clips as on the unsharded one, for every norm
type and strategy, on real gloo process groups."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from graph_fsdp_testing import spawn_cases
from torch import nn

import graph_fsdp
from graph_fsdp.fsdp.checkpoint import full_state_dict
from graph_fsdp.fsdp.fully_shard import fully_shard

VOCAB, HIDDEN, STEPS, MAX_NORM = 32, 16, 3, 0.05


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Embedding(VOCAB, HIDDEN),
        *(nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.Tanh()) for _ in range(2)),
        nn.Linear(HIDDEN, VOCAB),
    )


def _loss(model: nn.Module, step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randint(0, VOCAB, (2, 8), generator=g)
    return nn.functional.cross_entropy(model(x).flatten(0, 1), x.roll(-1, 1).flatten())


def _train(model, world: int, rank: int | None, norm_type: float) -> list[float]:
    """``rank`` None: the unsharded reference over every rank's batch."""
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    norms = []
    for step in range(STEPS):
        ranks = range(world) if rank is None else [rank]
        (sum(_loss(model, step, r) for r in ranks) / len(ranks)).backward()
        # torch's function, as a loop written for DDP or FSDP2 calls it
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM, norm_type).item())
        opt.step()
        opt.zero_grad()
    return norms


NORM_TYPES = (2.0, math.inf, 1.0)


def _sharded_all(rank: int, world: int, strategy: str) -> dict:
    return {norm_type: _sharded(rank, world, strategy, norm_type) for norm_type in NORM_TYPES}


def _sharded(rank: int, world: int, strategy: str, norm_type: float) -> tuple:
    """Per-step norms, final weights, whether torch's function is routed, and the global
    norm by graph_fsdp.clip_grad_norm_ and by the model's method."""
    model = _model()
    for block in list(model)[1:3]:
        fully_shard(block, strategy=strategy)
    fully_shard(model, strategy=strategy)
    norms = _train(model, world, rank, norm_type)
    routed = getattr(torch.nn.utils.clip_grad_norm_, "_graph_fsdp_routed", False)
    # graph_fsdp's own function and the model's method give the same global norm
    _loss(model, 0, rank).backward()
    same = [graph_fsdp.clip_grad_norm_(model.parameters(), 1e9, norm_type).item()]
    same.append(model.clip_grad_norm_(1e9, norm_type).item())
    dist.barrier()
    return norms, {k: v.clone() for k, v in full_state_dict(model).items()}, routed, same


STRATEGIES = ["optim_grads_params", "optim", "no_shard"]


@pytest.fixture(scope="module")
def two_ranks():
    """Every strategy and norm type in one spawned group."""
    return spawn_cases({s: (_sharded_all, s) for s in STRATEGIES}, 2)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_torch_clip_grad_norm_clips_by_the_global_norm(two_ranks, strategy):
    results = two_ranks[strategy]
    for norm_type in NORM_TYPES:
        ref = _model()
        ref_norms = _train(ref, 2, None, norm_type)
        assert min(ref_norms) > MAX_NORM  # every step clips
        for norms, params, routed, same in (res[norm_type] for res in results):
            assert routed
            assert norms == pytest.approx(ref_norms, rel=1e-5), norm_type
            assert same[0] == pytest.approx(same[1], rel=1e-6), norm_type
            for name, value in ref.state_dict().items():
                assert torch.allclose(params[name], value, atol=1e-6), (norm_type, name)


def test_other_parameters_keep_torchs_clipping():
    model = nn.Linear(4, 4)
    model(torch.ones(2, 4)).sum().backward()
    expected = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in model.parameters()]))
    fn = torch.nn.utils.clip_grad_norm_
    assert torch.allclose(fn(model.parameters(), 1e9), expected)
    with pytest.raises(ValueError, match="norm_type must be positive"):
        graph_fsdp.clip_grad_norm_(model.parameters(), 1.0, norm_type=0)


def test_early_reductions_split_every_group_but_the_last():
    """grad_norm.py [Note: the norm beside the last reduction]: the groups reduced before the
    last one, and the event after the last of them; nothing to split without a stream, with
    fewer than two reductions, or where one has no event (HSDP's replica stream)."""
    from graph_fsdp.fsdp.grad_norm import EarlyReductions

    a, b, c = object(), object(), object()
    ea, eb, ec = "event a", "event b", "event c"  # what the side stream waits on
    early = EarlyReductions.of([(a, ea), (b, eb), (c, ec)], stream="side")
    assert early.groups == {id(a), id(b)} and early.event == eb and early.stream == "side"
    assert EarlyReductions.of([(a, ea), (b, eb)], stream=None) is None
    assert EarlyReductions.of([(a, ea)], stream="side") is None
    assert EarlyReductions.of([(a, ea), (b, None)], stream="side") is None
