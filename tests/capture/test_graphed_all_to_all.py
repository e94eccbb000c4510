"""capture/step.py [Note: NCCL graph registration and the all-to-all] on real gloo groups:
while a full_iteration or whole-step graph is captured, an NCCL all-to-all over more than one
rank is refused unless NCCL_GRAPH_REGISTER=0, whoever issues it - FSDP's gradient reduction
with fp32 accumulation, or a model's expert dispatch. Gloo cannot capture, so the groups'
backend is reported as NCCL for the case the guard exists for; the GPU tests run it on real
NCCL (tests/capture/test_whole_step_gpu.py, tests/core/test_expert_parallel_gpu.py)."""

from __future__ import annotations

import os
from collections import OrderedDict
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from graph_fsdp_testing import TINY_GPT, shard_layers, spawn_cases
from torch import nn

from graph_fsdp import MixedPrecisionPolicy
from graph_fsdp.capture import step
from graph_fsdp.capture.diagnosis import ModuleTracker
from graph_fsdp.capture.scopes import GraphConfigError
from graph_fsdp.models import build_model, synthetic_batch
from graph_fsdp.parallel.ep_dispatch import _AllToAll

TINY = TINY_GPT
ENVS = (None, "1", "0")


class _Dispatch(nn.Module):
    """The reference MoE's token exchange alone (models/ep_dispatch.py), over ``group``."""

    def __init__(self, group) -> None:
        super().__init__()
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _AllToAll.apply(x, self.group)


def _sharded(fp32_accumulation: bool) -> nn.Module:
    model = build_model(TINY, device="cpu")
    mp = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_scatter_fp32_accumulation=fp32_accumulation
    )
    return shard_layers(model, mp_policy=mp)


def _guarded(model: nn.Module, backend: str, env: str | None, body) -> tuple[str, object]:
    """``(refusal or "", body's result)``: ``body()`` under the guard, the groups reported as
    ``backend`` and NCCL_GRAPH_REGISTER as ``env``."""
    tracker = ModuleTracker.for_model(model)
    with (
        mock.patch.dict(os.environ),  # restored on exit
        mock.patch.object(dist, "get_backend", lambda group=None: backend),
    ):
        os.environ.pop(step.GRAPH_REGISTER_ENV, None)
        if env is not None:
            os.environ[step.GRAPH_REGISTER_ENV] = env
        try:
            with tracker.active(), step.refusing_registered_all_to_all(tracker, "a test graph"):
                return "", body()
        except GraphConfigError as err:
            return str(err), None


def _cases(rank: int, world: int) -> dict:
    singles = [dist.new_group([r]) for r in range(world)]  # every rank makes every group
    c10d = dist.distributed_c10d
    before = [dist.all_to_all_single, dist.all_to_all, c10d.all_to_all_single, c10d.all_to_all]
    x, y = synthetic_batch(TINY, micro_batch_size=2, step=rank, device="cpu")
    out = {}
    for backend in ("gloo", "nccl"):
        for env in ENVS:
            for label, fp32 in (("plain", False), ("fp32_accumulation", True)):
                model = _sharded(fp32)
                refused, _ = _guarded(model, backend, env, lambda m=model: m(x, y).backward())
                out[(label, backend, env)] = refused
            for label, group in (("dispatch", None), ("dispatch_one_rank", singles[rank])):
                model = nn.Sequential(OrderedDict(moe=_Dispatch(group)))
                sent = torch.arange(4.0) + 10 * rank
                refused, got = _guarded(model, backend, env, lambda m=model: m(sent))
                out[(label, backend, env)] = refused
                out[(label, backend, env, "exchanged")] = None if got is None else got.tolist()
    after = [dist.all_to_all_single, dist.all_to_all, c10d.all_to_all_single, c10d.all_to_all]
    out["restored"] = all(a is b for a, b in zip(before, after))
    return out


@pytest.fixture(scope="module")
def results():
    return spawn_cases({"cases": (_cases,)}, 2)["cases"]


def test_only_nccl_all_to_alls_over_ranks_with_registration_on_are_refused(results):
    """Refused: the gradients' all-to-all (fp32 accumulation) and a model's dispatch, over
    2 NCCL ranks, NCCL_GRAPH_REGISTER unset or 1. Not refused: gloo, NCCL_GRAPH_REGISTER=0, a
    one-rank group, a model without an all-to-all. The guard is gone after its block."""
    for rank, out in enumerate(results):
        refused = {key for key, verdict in out.items() if len(key) == 3 and verdict}
        expected = {
            (label, "nccl", env) for label in ("fp32_accumulation", "dispatch") for env in ENVS[:2]
        }
        assert refused == expected, (rank, refused)
        assert out["restored"], rank


def test_the_refusal_names_the_caller_the_value_and_the_fixes(results):
    out = results[0]
    for env, shown in ((None, "unset"), ("1", "1")):
        for label in ("fp32_accumulation", "dispatch"):
            err = out[(label, "nccl", env)]
            assert "all_to_all_single over 2 NCCL ranks" in err, err
            assert f"(NCCL_GRAPH_REGISTER={shown}): its replay hangs" in err, err
            assert "Set NCCL_GRAPH_REGISTER=0" in err and "layerwise scopes" in err, err
            assert "is captured into a test graph" in err, err
        fp32 = out[("fp32_accumulation", "nccl", env)]
        assert fp32.startswith("FSDP's gradient reduction with reduce_scatter_fp32_accumulation")
        assert "in the backward of" in fp32 and "drop reduce_scatter_fp32_accumulation" in fp32
        dispatch = out[("dispatch", "nccl", env)]
        assert "ep_dispatch.py:" in dispatch and "in the forward of moe" in dispatch, dispatch


def test_an_all_to_all_the_guard_lets_through_runs(results):
    """Not refused, the call is the real all-to-all: rank r receives element r of each rank."""
    for rank, out in enumerate(results):
        for backend in ("gloo", "nccl"):
            for env in ENVS:
                if backend == "gloo" or env == "0":
                    assert out[("dispatch", backend, env, "exchanged")] == [
                        2 * rank + 0.0,
                        2 * rank + 1.0,
                        10 + 2 * rank + 0.0,
                        10 + 2 * rank + 1.0,
                    ]
                one = out[("dispatch_one_rank", backend, env, "exchanged")]
                assert one == [10.0 * rank + i for i in range(4)], one
