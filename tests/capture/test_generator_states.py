"""Which generator states every graph registers before its capture (diagnosis.py [Note:
generator states of a graph]): Megatron-Core's graph-safe RNG tracker's, read from the loaded
module without importing it. A stand-in module checks the rule on CPU; the real tracker runs
under capture in tests/core/test_tensor_parallel_gpu.py (Megatron-Core TP 2, TransformerEngine
attention drawing from the tracker's model-parallel state)."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from graph_fsdp.capture.diagnosis import (
    megatron_generator_states,
    restore_generator_states,
    snapshot_generator_states,
)

MODULE = "megatron.core.tensor_parallel.random"


def _stand_in(*, initialized: bool, graph_safe: bool, states: dict) -> types.ModuleType:
    random = types.ModuleType(MODULE)
    random._CUDA_RNG_STATE_TRACKER_INITIALIZED = initialized
    random.get_cuda_rng_tracker = lambda: "tracker"
    random.is_graph_safe_cuda_rng_tracker = lambda tracker: graph_safe and tracker == "tracker"
    random.get_all_rng_states = lambda: states
    return random


@pytest.mark.parametrize(
    ("initialized", "graph_safe", "expected"),
    [(True, True, ["a", "b"]), (True, False, []), (False, True, [])],
)
def test_registers_the_graph_safe_tracker_states_only(
    monkeypatch, initialized, graph_safe, expected
):
    states = {"model-parallel-rng": "a", "expert-parallel-rng": "b"}
    monkeypatch.setitem(
        sys.modules,
        MODULE,
        _stand_in(initialized=initialized, graph_safe=graph_safe, states=states),
    )
    assert megatron_generator_states() == expected


def test_nothing_without_megatron_loaded(monkeypatch):
    monkeypatch.delitem(sys.modules, MODULE, raising=False)
    assert megatron_generator_states() == []
    assert MODULE not in sys.modules  # read, never imported


def test_tracker_states_are_put_back_after_a_step_ran_twice(monkeypatch):
    """What verification and layerwise warmups do around a second run of a step: the
    tracker's generators draw the same numbers again after a restore."""
    states = {"model-parallel-rng": torch.Generator().manual_seed(1), "data-rng": torch.Generator()}
    monkeypatch.setitem(
        sys.modules, MODULE, _stand_in(initialized=True, graph_safe=True, states=states)
    )
    snapshot = snapshot_generator_states()
    first = [torch.rand(4, generator=g) for g in states.values()]
    restore_generator_states(snapshot)
    again = [torch.rand(4, generator=g) for g in states.values()]
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not torch.equal(first[0], torch.rand(4, generator=states["model-parallel-rng"]))
