"""Communication graphs replayed as real CUDA graphs (comm_graphs.py [Note: communication
graphs]), NCCL, at any world size (1 GPU included).

The reference GPT (bf16, double buffer, deterministic) trains 6 steps eagerly, then again
with a ``CommGraphs`` lent to every unit after the first step - what a layerwise runner does
once its graphs are captured, which it only does on 2+ ranks; lending it by hand runs the
same calls at world size 1 too (there a gather or reduction is the cast, copy and scaling
kernels without an NCCL call; on 2+ ranks the NCCL collectives are in the graphs). Asserted:
every loss and final parameter bit-identical to eager; graphs captured and replayed, none
failed; and a replay runs no Python - the gather/reduction functions ran only at their
captures and for the calls that stayed eager, never at a replay.
"""

from __future__ import annotations

import os

import pytest
import torch
from graph_fsdp_testing import BF16_MP, needs_gpus
from graph_fsdp_testing import GPU_TEST_WORLD as WORLD

from graph_fsdp.training.loop import use_deterministic_kernels
from graph_fsdp.training.processes import spawn

for _var, _value in (
    ("NCCL_NVLS_ENABLE", "0"),
    ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
    ("NVSHMEM_DISABLE_NVLS", "1"),
):
    os.environ.setdefault(_var, _value)

pytestmark = [pytest.mark.gpu, needs_gpus()]

STEPS = 6


def _train(rank: int, lend: bool, accumulate: bool) -> dict:
    from graph_fsdp.capture.comm_graphs import CommGraphs
    from graph_fsdp.models import GPTConfig
    from graph_fsdp.training.data import batch_for
    from graph_fsdp.training.train import TrainConfig, build_for, shard_model

    cfg = TrainConfig(
        model=GPTConfig(
            vocab_size=1024, num_layers=4, hidden_size=256, num_attention_heads=4, seq_length=128
        ),
        mp=BF16_MP,
        micro_batch_size=2,
        device="cuda",
        allocator="double_buffer",
        persist_on_alloc_fail=True,
    )
    device = torch.device("cuda", rank)
    model = shard_model(build_for(cfg, device), cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    comm = CommGraphs(torch.cuda.graph_pool_handle())
    executed = [0]
    run = comm.run

    def counted(key, owner, fn):
        def body():
            executed[0] += 1
            fn()

        run(key, owner, body)

    comm.run = counted
    losses = []
    for step in range(STEPS):
        root = model._fsdp_state.root  # set by the first forward (lazy init)
        if lend and step == 1:  # after an eager step, as a layerwise runner lends them
            root.allocator.pin_roles(("param", "grad", "grad_comm", "rs_out"))
            root.capture.lend_comm_graphs(comm)
            for state in root.states:
                for group in state.groups:
                    group.pin_main_grad()
        micro = 2 if accumulate else 1
        total = torch.zeros((), device=device)
        for m in range(micro):
            model.set_requires_gradient_sync(m == micro - 1)
            x, y = batch_for(cfg, step * micro + m, rank, device)
            loss = model(x, y) / micro
            loss.backward()
            total += loss.detach()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total.item())
    torch.cuda.synchronize()
    report = comm.report()
    captures = sum(comm.captures.values())
    root.capture.take_comm_graphs_back()
    comm.reset()
    return {
        "losses": losses,
        "params": [p.detach().float().cpu() for p in model.parameters()],
        "report": report,
        "captures": captures,
        "executed": executed[0],
    }


def _both(rank: int, world: int, accumulate: bool) -> dict:
    use_deterministic_kernels()
    return {"eager": _train(rank, False, accumulate), "lent": _train(rank, True, accumulate)}


@pytest.mark.parametrize("accumulate", [False, True], ids=["one microbatch", "no_sync + 2"])
def test_communication_graphs_replay_bit_identically_without_python(accumulate: bool) -> None:
    for rank, r in enumerate(spawn(_both, WORLD, accumulate, backend="nccl", timeout=600)):
        eager, lent = r["eager"], r["lent"]
        assert lent["losses"] == eager["losses"], (rank, lent["losses"], eager["losses"])
        assert all(torch.equal(a, b) for a, b in zip(lent["params"], eager["params"])), rank
        rep = lent["report"]
        assert rep["failed"] is None and rep["graphs"] > 0 and rep["replays"] > 0, rep
        # Each call ran its function once at most: at its capture, or eagerly - a replay
        # runs the recorded kernels only.
        assert lent["executed"] == lent["captures"] + rep["eager_calls"], (lent, rep)
        print(f"rank {rank}: {rep}, functions run {lent['executed']} times", flush=True)
