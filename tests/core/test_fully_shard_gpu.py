"""GPU tests (NCCL, 2 GPUs): bf16 parity, comm/compute overlap, static addresses."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from graph_fsdp_testing import BF16_MP, needs_gpus, profile_steps
from graph_fsdp_testing import GPU_TEST_WORLD as WORLD

from graph_fsdp.models import GPTConfig
from graph_fsdp.training.processes import spawn
from graph_fsdp.training.train import TrainConfig, run

pytestmark = [
    pytest.mark.gpu,
    needs_gpus(),
]

SMALL = GPTConfig(
    vocab_size=1024, num_layers=4, hidden_size=256, num_attention_heads=4, seq_length=256
)


def test_bf16_parity_with_single_gpu_reference():
    cfg = TrainConfig(model=SMALL, mp=BF16_MP, steps=5, device="cuda", micro_batch_size=2)
    ref = run(0, WORLD, dataclasses.replace(cfg, mode="reference"))
    res = spawn(run, WORLD, cfg, backend="nccl")
    # bf16 compute: the reference accumulates both microbatches' grads in bf16, FSDP
    # reduces them in fp32, so agreement is to bf16 rounding, not bitwise.
    for a, b in zip(res[0]["losses"], ref["losses"]):
        assert abs(a - b) <= 2e-2 * abs(b), (res[0]["losses"], ref["losses"])
    for name, value in ref["params"].items():
        assert (res[0]["params"][name] - value).abs().max() <= 1e-2, name


def _profile_overlap(rank: int, world: int) -> dict:

    from graph_fsdp.models import build_model, synthetic_batch
    from graph_fsdp.training.train import shard_model

    cfg = TrainConfig(
        model=dataclasses.replace(
            SMALL, hidden_size=2048, num_attention_heads=16, num_layers=4, seq_length=2048
        ),
        mp=BF16_MP,
    )
    model = build_model(cfg.model, device=torch.device("cuda", rank))
    shard_model(model, cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    # GPU-bound (~5 ms of compute per layer): at hidden 1024 the eager step is host-bound,
    # every kernel runs as soon as it is issued and nothing is left to overlap.
    x, y = synthetic_batch(cfg.model, 2, 0, rank=rank, device=torch.device("cuda", rank))
    prof = profile_steps(model, opt, x, y)
    comm, compute = [], []
    for e in prof.events():
        if e.device_type.name != "CUDA" or e.time_range.elapsed_us() <= 0:
            continue
        span = (e.time_range.start, e.time_range.end)
        (comm if "nccl" in e.name.lower() else compute).append(span)
    overlapped = 0.0
    for c0, c1 in comm:
        for k0, k1 in compute:
            overlapped += max(0.0, min(c1, k1) - max(c0, k0))
    total_comm = sum(c1 - c0 for c0, c1 in comm)
    return {"comm_us": total_comm, "overlapped_us": overlapped, "n_comm": len(comm)}


@pytest.mark.skipif(WORLD < 2, reason="one rank issues no collectives to overlap")
def test_all_gather_and_reduce_scatter_overlap_compute():
    stats = spawn(_profile_overlap, WORLD, backend="nccl")
    for s in stats:
        assert s["n_comm"] > 0
        # Judged from kernel intervals, not wall clock. With every collective on the main
        # stream this is exactly 0 (kernels of one stream never overlap). Measured on 2x
        # H200 (2026-11-21) at this shape: 6% to 31% of NCCL kernel time overlapped compute
        # from run to run - NCCL kernel time includes waiting for the peer rank, which
        # depends on the two hosts' timing. This guards the mechanism (prefetch and
        # reductions on side streams); the speed it buys is measured by graph-fsdp bench.
        assert s["overlapped_us"] >= 0.02 * s["comm_us"], s


def _addresses(rank: int, world: int, allocator: str, pin: bool) -> dict:
    from graph_fsdp.fsdp.state import collect_states
    from graph_fsdp.models import build_model, synthetic_batch
    from graph_fsdp.training.train import shard_model

    cfg = TrainConfig(
        model=dataclasses.replace(SMALL, num_experts=4, moe_layer_freq=2),
        mp=BF16_MP,
        allocator=allocator,
        persist_on_alloc_fail=True,
    )
    dev = torch.device("cuda", rank)
    model = build_model(cfg.model, device=dev)
    shard_model(model, cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    losses, ptrs, held = [], [], []
    root_state = collect_states(model)[0]
    for step in range(22):
        for micro in range(2):
            model.set_requires_gradient_sync(micro == 1)
            x, y = synthetic_batch(cfg.model, 2, 2 * step + micro, rank=rank, device=dev)
            loss = model(x, y)
            loss.backward()
        if step == 0 and pin:  # as layerwise graphs do before capture
            root_state.root.allocator.pin_roles(("param", "grad"))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if step % 5 == 0:
            with torch.no_grad():
                model(x, y)
        seen = []
        for state in collect_states(model):
            for g in state.groups:
                seen.append((g.full.data_ptr(), g.grad_full.data_ptr()))
                if step % 5:  # an eval forward leaves weight slots until the next boundary
                    held.append(
                        g.full.untyped_storage().nbytes() + g.grad_full.untyped_storage().nbytes()
                    )
        ptrs.append(seen)
    return {"losses": losses, "ptrs": ptrs, "held": held}


@pytest.mark.parametrize(
    "allocator,pin", [("double_buffer", True), ("trace_pool", True), ("double_buffer", False)]
)
def test_static_allocator_bit_identical_and_addresses_constant(allocator, pin):
    dynamic = spawn(_addresses, WORLD, "dynamic", False, backend="nccl")
    static = spawn(_addresses, WORLD, allocator, pin, backend="nccl")
    assert dynamic[0]["losses"] == static[0]["losses"]
    steady = static[0]["ptrs"][2:]  # the trace pool plans after its first step
    if pin:  # what graphs pin keeps its address (and its bytes)
        assert all(p == steady[0] for p in steady)
    else:  # unpinned weight and gradient slots hold no bytes between steps
        assert not any(static[0]["held"][len(steady[0]) :]), static[0]["held"]
