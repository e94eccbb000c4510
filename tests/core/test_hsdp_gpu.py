"""HSDP on NCCL: graphed (layerwise and full_iteration) bit-identical to eager, timings.

2 GPUs: the degenerate meshes (2, 1) - replicas only, the replicate collectives on their own
stream inside the full_iteration graph - and (1, 2), with and without the optimizer sharded
over replicas; and exact equalities with 1-D runs that perform the same NCCL reductions.
4 GPUs: a 2x2 mesh, the same checks, plus step time and peak memory of 2x2 HSDP next to 1x4
(1-D) FSDP, eager and full_iteration, printed as one JSON line (run pytest with ``-s``).
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import statistics
import tempfile

import pytest
import torch
from graph_fsdp_testing import BF16_MP, bit_exact_gpu_run, gpu_gpt, profile_steps

from graph_fsdp.models import GPTConfig
from graph_fsdp.training.checkpoints import CheckpointPolicy
from graph_fsdp.training.processes import spawn
from graph_fsdp.training.train import TrainConfig, run

pytestmark = [pytest.mark.gpu]
needs_2 = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
needs_4 = pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 CUDA GPUs")

STEPS, SAVE_AT, EVAL = 12, 6, 4
SMALL = gpu_gpt()
TIMED = GPTConfig(
    vocab_size=32000, num_layers=8, hidden_size=1024, num_attention_heads=16, seq_length=1024
)
GRAPHED = {
    "layer": {"cuda_graph_impl": "torch", "cuda_graph_scope": []},
    "full_iteration": {"cuda_graph_impl": "torch", "cuda_graph_scope": ["full_iteration"]},
}


def _cfg(mesh: tuple[int, int] | None, over: bool = False, **kw) -> TrainConfig:
    base = bit_exact_gpu_run(
        SMALL,
        steps=STEPS,
        eval_interval=EVAL,
        lr=1e-3,
        mesh_shape=mesh,
        optim_over_replicas=over,
    )
    return dataclasses.replace(base, **kw)


def _graphed_vs_eager(rank: int, world: int, meshes: dict, ckpt_root: str) -> dict:
    """Per mesh: eager, each graphed variant, and a full_iteration run resumed mid-way."""
    out = {}
    for label, (mesh, over) in meshes.items():
        res = {"eager": run(rank, world, _cfg(mesh, over))}
        for name, graph_kw in GRAPHED.items():
            path = os.path.join(ckpt_root, f"{label}_{name}".replace("+", "_"))
            cfg = _cfg(
                mesh, over, checkpoint=CheckpointPolicy(save_path=path, save_at=SAVE_AT), **graph_kw
            )
            res[name] = run(rank, world, cfg)
            res[f"{name}_resumed"] = run(
                rank,
                world,
                dataclasses.replace(
                    cfg,
                    checkpoint=CheckpointPolicy(load_path=path),
                    start_step=SAVE_AT,
                    steps=STEPS - SAVE_AT,
                ),
            )
        out[label] = res
    return out


def _assert_same(a: dict, b: dict, what: str, start: int = 0) -> None:
    assert a["losses"] == b["losses"][start:], (
        f"{what}: losses differ {a['losses']} vs {b['losses'][start:]}"
    )
    if not start:
        assert a["eval_losses"] == b["eval_losses"], f"{what}: eval losses differ"
    differ = [n for n, v in b["params"].items() if not torch.equal(a["params"][n], v)]
    assert not differ, f"{what}: final params differ: {differ}"


def _check_graphed(results: dict) -> None:
    failures = []
    for label, res in results.items():
        eager = res["eager"]
        assert len(eager["losses"]) == STEPS and len(eager["eval_losses"]) == STEPS // EVAL
        for name in GRAPHED:
            try:
                for key in (name, f"{name}_resumed"):  # both graphed: replayed, never eagerly
                    report = res[key]["cuda_graphs"]
                    assert report["captures"] >= 1 and report["replays"] > 0, (key, report)
                    assert report["eager_fallbacks"] == 0, (key, report)
                _assert_same(res[name], eager, f"{label} {name}")
                _assert_same(res[f"{name}_resumed"], eager, f"{label} {name} resumed", SAVE_AT)
            except AssertionError as err:
                failures.append(str(err).splitlines()[0])
    assert not failures, "\n".join(failures)


# ----------------------------------------------------------------------------- 2 GPUs
MESHES_2 = {
    "2x1": ((2, 1), False),
    "2x1+optim_over_replicas": ((2, 1), True),
    "1x2": ((1, 2), False),
}


@pytest.fixture(scope="module")
def two_gpu_results():
    with tempfile.TemporaryDirectory() as root:
        return spawn(_graphed_vs_eager, 2, MESHES_2, root, backend="nccl", timeout=900)[0]


@needs_2
def test_degenerate_meshes_graphed_bit_identical_to_eager(two_gpu_results):
    _check_graphed(two_gpu_results)


def _same_reductions_as_1d(rank: int, world: int) -> dict:
    return {
        "1d:optim_grads_params": run(rank, world, _cfg(None)),
        "1d:no_shard": run(rank, world, _cfg(None, strategy="no_shard")),
        "1x2": run(rank, world, _cfg((1, 2))),
        "2x1+optim_over_replicas": run(rank, world, _cfg((2, 1), True)),
        "2x1": run(rank, world, _cfg((2, 1))),
    }


@needs_2
def test_degenerate_meshes_equal_1d_runs_with_the_same_collectives():
    """(1, 2) is 1-D ZeRO-3; (2, 1) with the optimizer over replicas reduce-scatters and
    all-gathers across the 2 replicas what 1-D ZeRO-3 does across 2 ranks; (2, 1) without it
    all-reduces the full gradient across replicas as 1-D no_shard (DDP) does."""
    res = spawn(_same_reductions_as_1d, 2, backend="nccl", timeout=600)[0]
    _assert_same(res["1x2"], res["1d:optim_grads_params"], "1x2 vs 1-D ZeRO-3")
    _assert_same(
        res["2x1+optim_over_replicas"], res["1d:optim_grads_params"], "2x1 over vs 1-D ZeRO-3"
    )
    _assert_same(res["2x1"], res["1d:no_shard"], "2x1 vs 1-D no_shard")


def _profile_replica_reduction(rank: int, world: int, over: bool) -> dict:
    """Kernel intervals of a GPU-bound eager step on a (2, 1) mesh, where every NCCL kernel is
    a replicate-dimension collective (the shard dimension has one rank: copies only)."""

    from graph_fsdp.models import build_model, synthetic_batch
    from graph_fsdp.training.train import shard_model

    model_cfg = dataclasses.replace(
        SMALL, hidden_size=2048, num_attention_heads=16, num_layers=4, seq_length=2048
    )
    cfg = TrainConfig(
        model=model_cfg, mp=BF16_MP, device="cuda", mesh_shape=(2, 1), optim_over_replicas=over
    )
    device = torch.device("cuda", rank)
    model = shard_model(build_model(cfg.model, device=device), cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x, y = synthetic_batch(cfg.model, 2, 0, rank=rank, device=device)
    prof = profile_steps(model, opt, x, y)
    reduction = "reducescatter" if over else "allreduce"
    comm, compute = [], []
    for e in prof.events():
        if e.device_type.name != "CUDA" or e.time_range.elapsed_us() <= 0:
            continue
        name, span = e.name.lower(), (e.time_range.start, e.time_range.end)
        if "nccl" not in name:
            compute.append(span)
        elif reduction in name:
            comm.append(span)
    overlapped = sum(max(0.0, min(c1, k1) - max(c0, k0)) for c0, c1 in comm for k0, k1 in compute)
    return {
        "comm_us": sum(c1 - c0 for c0, c1 in comm),
        "overlapped_us": overlapped,
        "n_comm": len(comm),
    }


@needs_2
@pytest.mark.parametrize("over", [False, True], ids=["all_reduce", "reduce_scatter"])
def test_replica_reduction_overlaps_backward(over):
    """The reduction across replicas runs on its own stream while backward computes (judged
    from kernel intervals: on the main stream the overlap would be exactly 0). The threshold
    is that of test_fully_shard_gpu's overlap test (NCCL time includes waiting for the peer)."""
    for s in spawn(_profile_replica_reduction, 2, over, backend="nccl"):
        assert s["n_comm"] >= 4, s  # at least one per step (one per unit expected)
        assert s["overlapped_us"] >= 0.02 * s["comm_us"], s


# ----------------------------------------------------------------------------- 4 GPUs
MESHES_4 = {"2x2": ((2, 2), False), "2x2+optim_over_replicas": ((2, 2), True)}


@needs_4
def test_2x2_graphed_bit_identical_to_eager():
    with tempfile.TemporaryDirectory() as root:
        results = spawn(_graphed_vs_eager, 4, MESHES_4, root, backend="nccl", timeout=900)[0]
    _check_graphed(results)


def _timed_runs(rank: int, world: int) -> dict:
    base = TrainConfig(
        model=TIMED,
        mp=BF16_MP,
        steps=15,
        micro_batch_size=1,
        device="cuda",
        allocator="double_buffer",
        persist_on_alloc_fail=True,
        return_params=False,
    )
    rows = {
        "1x4 FSDP (1-D)": {},
        "2x2 HSDP": {"mesh_shape": (2, 2)},
        "2x2 HSDP, optimizer over replicas": {"mesh_shape": (2, 2), "optim_over_replicas": True},
    }
    out = {}
    for label, kw in rows.items():
        for mode, graph_kw in (("eager", {}), ("full_iteration", GRAPHED["full_iteration"])):
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            res = run(rank, world, dataclasses.replace(base, **kw, **graph_kw))
            times = res["times"][5:]  # after warmup and capture
            out[f"{label}, {mode}"] = {
                "step_ms": round(statistics.median(times) * 1e3, 3),
                "peak_gib": round(res["peak_memory_bytes"] / 2**30, 3),
                "final_loss": res["losses"][-1],
                "graphs": {
                    k: (res.get("cuda_graphs") or {}).get(k)
                    for k in ("captures", "replays", "eager_fallbacks")
                },
            }
    return out


@needs_4
def test_2x2_hsdp_vs_1x4_fsdp_step_time():
    per_rank = spawn(_timed_runs, 4, backend="nccl", timeout=900)
    rows = per_rank[0]
    for row in rows.values():
        assert row["step_ms"] > 0 and row["peak_gib"] > 0
        assert torch.isfinite(torch.tensor(row["final_loss"]))
    for label, row in rows.items():  # the full_iteration rows replayed throughout
        if label.endswith(", full_iteration"):
            graphs = row["graphs"]
            assert graphs["replays"] and graphs["eager_fallbacks"] == 0, (label, graphs)
    peak = {k: max(r[k]["peak_gib"] for r in per_rank) for k in rows}
    print(
        json.dumps(
            {
                "hsdp_step_time": {
                    "gpus": torch.cuda.get_device_name(0),
                    "model": dataclasses.asdict(TIMED),
                    "rows": {k: {**v, "peak_gib_max_rank": peak[k]} for k, v in rows.items()},
                }
            }
        )
    )
