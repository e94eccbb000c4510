"""full_iteration's main gradients live in the graph's pool (full_iteration.py [Note: main
gradients in the step's pool]), on one GPU: a ZeRO-3 GPT trained 8 steps with
``FullIterationGraphs`` equals its eager twin bit for bit; after the capture every group's main
gradients lie inside a segment of the runner's pool and are pinned; after ``close()`` they are
unpinned and the next forward releases them. Each run's own peak allocated and reserved bytes
are printed as a JSON line (``-s``); the graphed run's peak reserved is at most 1.10x the
eager run's plus one 20 MiB segment. On CPU (gloo): pins are counted per holder. And
``release_for_capture`` frees no allocated byte while a graph lives: a graph captured after a
warmup on its stream replays its matmuls into the cuBLAS workspace that warmup made (pools.py
[Note: capture memory]).

    GRAPH_FSDP_GPU_TEST_WORLD=1 python -m pytest -q -s -m gpu tests/capture/test_full_iteration_pool_gpu.py
"""

from __future__ import annotations

import functools
import gc
import json

import pytest
import torch
from graph_fsdp_testing import needs_gpus

from graph_fsdp.models import GPTConfig
from graph_fsdp.training.processes import spawn

CFG = GPTConfig(
    vocab_size=1024, num_layers=4, hidden_size=256, num_attention_heads=4, seq_length=128
)
STEPS = 8


def _build(device: torch.device):
    from graph_fsdp import BufferPolicy, MixedPrecisionPolicy, fully_shard
    from graph_fsdp.models import build_model
    from graph_fsdp.models.gpt import sharding_units

    policy = BufferPolicy(allocator="double_buffer", persist_on_alloc_fail=True)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    model = build_model(CFG, device=device)
    for unit, reshard in sharding_units(model):
        fully_shard(unit, mp_policy=mp, buffer_policy=policy, reshard_after_forward=reshard)
    fully_shard(model, mp_policy=mp, buffer_policy=policy)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)


def _train(graphed: bool, device: torch.device, rank: int) -> dict:
    from graph_fsdp.bench.verdicts import CudaCounters, RowMemory
    from graph_fsdp.capture import FullIterationGraphs
    from graph_fsdp.fsdp.state import collect_states
    from graph_fsdp.models import synthetic_batch

    # Each run pays for the cuBLAS workspaces it makes, as in a process of its own, like a
    # bench row (no graph lives here: bench/verdicts.py [Note: a row's own peak]).
    counters = CudaCounters(device)
    memory = RowMemory.start(counters)
    model, opt = _build(device)
    graphs = FullIterationGraphs(model, warmup_steps=2, eager=not graphed)
    groups = [g for s in collect_states(model) for g in s.groups]
    losses = []
    for step in range(STEPS):
        x, y = synthetic_batch(CFG, 2, step, rank=rank, device=device)
        graphs.before_step()
        losses.append(graphs.forward_backward(0, x, y, 1.0).item())
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    own_allocated, own_reserved = memory.stop(counters).values()[:2]
    out = {
        "losses": losses,
        "own_peak_allocated": own_allocated,
        "own_peak_reserved": own_reserved,
        "replays": graphs.report()["replays"],
        "eager_fallbacks": graphs.report()["eager_fallbacks"],
    }
    if graphed:
        segments = [
            s
            for s in torch.cuda.memory_snapshot()
            if tuple(s["segment_pool_id"]) == tuple(graphs._pool)
        ]

        def in_pool(t: torch.Tensor) -> bool:
            ptr = t.data_ptr()
            return any(s["address"] <= ptr < s["address"] + s["total_size"] for s in segments)

        out["in_pool"] = [in_pool(g.main_grad) for g in groups]
        # address_keeping.py [Note: growing capture segments]: the pool grew by expandable
        # segments, and the setting is off again after the capture.
        out["pool_expandable"] = [bool(s.get("is_expandable")) for s in segments]
        after = torch.empty(64 * 2**20, dtype=torch.uint8, device=device)
        out["later_expandable"] = [
            bool(s.get("is_expandable"))
            for s in torch.cuda.memory_snapshot()
            if s["address"] <= after.data_ptr() < s["address"] + s["total_size"]
        ]
        del after
        out["pinned"] = [g.main_grad_pinned for g in groups]
        graphs.close()
        out["pinned_after_close"] = [g.main_grad_pinned for g in groups]
        x, y = synthetic_batch(CFG, 2, STEPS, rank=rank, device=device)
        with torch.no_grad():
            model(x, y)  # an eager forward: releasable main gradients go
        out["bytes_after_forward"] = [g.main_grad.untyped_storage().nbytes() for g in groups]
    else:
        graphs.close()
    del model, opt, graphs
    return out


def _run(rank: int, world: int) -> dict:
    torch.use_deterministic_algorithms(True)
    device = torch.device("cuda", torch.cuda.current_device())
    return {"eager": _train(False, device, rank), "graphed": _train(True, device, rank)}


@functools.cache
def _results() -> dict:
    (res,) = spawn(_run, 1, backend="nccl", timeout=600)
    return res


@pytest.mark.gpu
@needs_gpus(1)
def test_full_iteration_main_grads_live_in_the_pool():
    res = _results()
    eager, graphed = res["eager"], res["graphed"]
    print(
        json.dumps(
            {
                "test": "full_iteration_pool_main_grads",
                **{
                    f"{k}_{m}": r[m]
                    for k, r in res.items()
                    for m in ("own_peak_allocated", "own_peak_reserved")
                },
            }
        )
    )
    assert graphed["losses"] == eager["losses"]
    assert graphed["replays"] == STEPS - 2, graphed["replays"]
    assert graphed["eager_fallbacks"] == 0, graphed["eager_fallbacks"]
    assert all(graphed["in_pool"]) and all(graphed["pinned"]), graphed
    assert graphed["pool_expandable"] and all(graphed["pool_expandable"]), graphed
    assert graphed["later_expandable"] == [False], graphed["later_expandable"]
    assert not any(graphed["pinned_after_close"]), graphed["pinned_after_close"]
    assert not any(graphed["bytes_after_forward"]), graphed["bytes_after_forward"]


@pytest.mark.gpu
@needs_gpus(1)
def test_full_iteration_reserves_at_most_1_10x_eager_plus_one_20_mib_segment():
    """The graphed run's own peak reserved bytes (the pool included) within 1.10x of the eager
    run's (pools.py [Note: capture memory]) plus one 20 MiB segment - on this model about 1.24x
    of eager's 146 MiB, not a tenth more: on a model this small the
    graph's private pool maps a 20 MiB segment (the caching allocator's large-segment size)
    for about 4 MiB of slots that the eager run keeps in the spare room of its main weights'
    segments, which no pool can lend another. Measured on one H200, each run in a window of
    its own (RowMemory: the earlier run's garbage collected first): 174 MiB against 146
    (1.19x; 170 against 146 with each run in a process of its own); the window without that
    collection, where the graphed run reused the eager run's uncollected blocks, said 150.
    The run replayed every step after its warmup with no eager fallback (checked above)."""
    res = _results()
    eager, graphed = res["eager"]["own_peak_reserved"], res["graphed"]["own_peak_reserved"]
    assert graphed <= 1.10 * eager + 20 * 2**20, (
        f"full_iteration reserved {graphed / 2**20:.1f} MiB, eager {eager / 2**20:.1f} MiB "
        f"({graphed / eager:.3f}x; target <= 1.10x plus one 20 MiB segment)"
    )


def _release_with_a_graph_alive(rank: int, world: int) -> dict:
    from graph_fsdp.capture.pools import release_for_capture
    from graph_fsdp.training.loop import use_deterministic_kernels

    use_deterministic_kernels()
    device = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator(device).manual_seed(0)
    a, b = (torch.randn(512, 512, device=device, generator=gen) for _ in range(2))
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # the warmup: this stream's workspace, outside a capture
        expected = a @ b
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        out = a @ b
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    release_for_capture(())  # what the next layer's capture does first
    after = torch.cuda.memory_allocated()
    filler = torch.full((2**24,), float("nan"), device=device)  # takes what went back
    graph.replay()
    torch.cuda.synchronize()
    del filler
    return {"before": before, "after": after, "replay_equal": torch.equal(out, expected)}


@pytest.mark.gpu
@needs_gpus(1)
def test_release_for_capture_frees_nothing_a_live_graph_addresses():
    """Clearing cuBLAS's workspaces here freed the one a layer's graph replays into: the
    16-layer GPT's layerwise graphs then failed with "unspecified launch failure" (2 H200s)."""
    (res,) = spawn(_release_with_a_graph_alive, 1, backend="nccl", timeout=300)
    assert res["after"] == res["before"], res
    assert res["replay_equal"], res


def _pins(rank: int, world: int) -> dict:
    from graph_fsdp.capture.pools import MainGradPins
    from graph_fsdp.fsdp.state import collect_states
    from graph_fsdp.models import synthetic_batch

    model, opt = _build(torch.device("cpu"))
    groups = [g for s in collect_states(model) for g in s.groups]
    x, y = synthetic_batch(CFG, 2, 0, rank=rank)

    def step_then_forward() -> list[int]:
        model(x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            model(x, y)  # the forward that releases unpinned main gradients
        return [g.main_grad.untyped_storage().nbytes() for g in groups]

    class Runner:  # what holds the pins: a runner, collected or closed
        pass

    out = {"unpinned": step_then_forward()}
    runners = [Runner(), Runner()]
    pins = [MainGradPins(r) for r in runners]  # two holders (two runners' graphs)
    for holder in pins:
        holder.pin(groups)
        holder.pin(groups[:1])  # a later capture of the same runner: no second pin
    out["counts"] = [g._main_grad_pins for g in groups]
    out["two_pins"] = step_then_forward()
    pins[0].unpin()  # the first runner dropped its graphs
    pins[0].unpin()  # again: nothing left to take back
    out["one_pin"] = step_then_forward()
    del runners[1]  # the second one collected without close(): its finalizer unpins
    gc.collect()
    out["no_pin"] = step_then_forward()
    out["holders_emptied"] = [len(holder.groups) for holder in pins]
    try:
        groups[0].unpin_main_grad()
        out["extra_unpin"] = None
    except RuntimeError as err:
        out["extra_unpin"] = str(err)
    return out


def test_main_grad_pins_are_counted_per_holder():
    """A runner that drops its graphs takes back only its own pin (``MainGradPins``, which
    both graph runners hold): main gradients another holder's graphs still write keep their
    bytes through the forward that releases them; a holder pins a group once however often
    it captures, and a runner collected without ``close()`` takes its pins back."""
    (res,) = spawn(_pins, 1)
    assert res["counts"] == [2] * len(res["counts"]), res
    assert not any(res["unpinned"]) and not any(res["no_pin"]), res
    assert all(res["two_pins"]) and all(res["one_pin"]), res
    assert res["holders_emptied"] == [0, 0], res
    assert "without a pin_main_grad()" in res["extra_unpin"]
