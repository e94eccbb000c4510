"""Profile summaries from Chrome traces: interval math, steps, busy time, exposed comm."""

from __future__ import annotations

import pytest

from graph_fsdp.bench.trace import clip, format_summary, merge, subtract, summarize_trace, total


def ev(name: str, cat: str, ts: float, dur: float, tid: int = 1) -> dict:
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "pid": 0, "tid": tid}


def test_interval_math() -> None:
    assert merge([(5, 7), (0, 2), (1, 3), (3, 4), (9, 9)]) == [(0, 4), (5, 7)]
    assert total([(0, 4), (5, 7)]) == 6
    assert clip([(0, 4), (5, 7)], 3, 6) == [(3, 4), (5, 6)]
    assert subtract([(0, 10)], [(2, 3), (5, 7)]) == [(0, 2), (3, 5), (7, 10)]
    assert subtract([(0, 2), (4, 6)], [(1, 5)]) == [(0, 1), (5, 6)]
    assert subtract([(0, 2)], []) == [(0, 2)]
    assert subtract([(0, 2)], [(0, 3)]) == []


def test_gpu_trace_exposed_communication_is_nccl_not_under_compute() -> None:
    # Two steps of 100 us. Step 0: nccl 10..40 overlaps compute 0..30 -> 10 us exposed.
    # Step 1: nccl 150..170 with no compute at all -> fully exposed.
    trace = {
        "traceEvents": [
            ev("graph_fsdp/step/0", "user_annotation", 0, 100),
            ev("graph_fsdp/step/1", "user_annotation", 100, 100),
            ev("graph_fsdp/forward/layers.0", "user_annotation", 110, 5),
            ev("sm90_gemm", "kernel", 0, 30, tid=7),
            ev("ncclDevKernel_AllGather_RING_LL", "kernel", 10, 30, tid=8),
            ev("Memcpy HtoD", "gpu_memcpy", 60, 10, tid=7),
            ev("ncclDevKernel_ReduceScatter_Sum_f32", "kernel", 150, 20, tid=8),
            ev("cudaLaunchKernel", "cuda_runtime", 0, 1),
        ]
    }
    s = summarize_trace(trace)
    assert s["device"] == "cuda"
    step0, step1 = s["steps"]
    assert step0["wall_ms"] == pytest.approx(0.1)
    assert step0["busy_pct"] == pytest.approx(50.0)  # 0..40 kernels + 60..70 memcpy
    assert step0["comm_ms"] == pytest.approx(0.03) and step0["exposed_comm_ms"] == pytest.approx(
        0.01
    )
    assert step1["busy_pct"] == pytest.approx(20.0) and step1["exposed_comm_ms"] == pytest.approx(
        0.02
    )
    assert s["exposed_comm_pct"] == pytest.approx(60.0)
    assert s["ranges"][0]["name"] == "graph_fsdp/forward/layers.0"
    assert [c["name"] for c in s["collectives"]][0].startswith("ncclDevKernel_AllGather")
    text = format_summary(s, title="rank 0")
    assert "GPU busy %" in text and "exposed" in text
    # By kind, per step: the all-gather 30 us (10 exposed) in step 0, the reduce-scatter 20 us
    # (all exposed) in step 1.
    kinds = {r["kind"]: r for r in s["exposed_by_kind"]}
    assert list(kinds) == ["reduce-scatter", "all-gather"]  # most exposed first
    assert kinds["all-gather"]["calls_per_step"] == pytest.approx(0.5)
    assert kinds["all-gather"]["comm_ms_per_step"] == pytest.approx(0.015)
    assert kinds["all-gather"]["exposed_ms_per_step"] == pytest.approx(0.005)
    assert kinds["reduce-scatter"]["exposed_ms_per_step"] == pytest.approx(0.01)
    assert "collectives by kind, per step" in text and "reduce-scatter" in text


def test_each_collective_position_says_how_long_compute_waited_for_it() -> None:
    # Two steps of 100 us; in each, the 0th collective runs under compute, the 1st after it:
    # 20 us exposed in step 0, 10 us in step 1 -> 15 us on average, first in the list.
    trace = {
        "traceEvents": [
            ev("graph_fsdp/step/0", "user_annotation", 0, 100),
            ev("graph_fsdp/step/1", "user_annotation", 100, 100),
            ev("sm90_gemm", "kernel", 0, 30, tid=7),
            ev("ncclDevKernel_AllGather", "kernel", 5, 10, tid=8),
            ev("ncclDevKernel_ReduceScatter", "kernel", 40, 20, tid=8),
            ev("sm90_gemm", "kernel", 106, 30, tid=7),
            ev("ncclDevKernel_AllGather", "kernel", 110, 10, tid=8),
            ev("ncclDevKernel_ReduceScatter", "kernel", 140, 10, tid=8),
        ]
    }
    s = summarize_trace(trace)
    last, first = s["exposed_by_position"]
    assert last["position"] == 1 and last["name"] == "ncclDevKernel_ReduceScatter"
    assert last["steps"] == 2 and last["exposed_us"] == pytest.approx(15.0)
    assert last["at_ms"] == pytest.approx(0.04) and last["duration_us"] == pytest.approx(15.0)
    assert first["position"] == 0 and first["exposed_us"] == 0.0
    assert [st["first_gpu_op_ms"] for st in s["steps"]] == pytest.approx([0.0, 0.006])
    assert s["mean_first_gpu_op_ms"] == pytest.approx(0.003)
    text = format_summary(s, title="rank 0")
    assert "#1 ncclDevKernel_ReduceScatter" in text and "#0 " not in text  # nothing exposed
    assert "first operation of a step began 0.003 ms" in text


def test_cpu_trace_ops_inside_collectives_are_not_compute() -> None:
    trace = {
        "traceEvents": [
            ev("graph_fsdp/step/0", "user_annotation", 0, 100),
            ev("aten::mm", "cpu_op", 0, 20),
            ev("c10d::_allgather_base_", "cpu_op", 30, 40),
            ev("aten::empty", "cpu_op", 35, 5),  # inside the collective: not compute
            ev("aten::add", "cpu_op", 50, 30, tid=2),  # another thread: real overlap (50..70)
            ev("gloo:all_gather", "user_annotation", 30, 40, tid=3),
        ]
    }
    s = summarize_trace(trace)
    assert s["device"] == "cpu"
    (step,) = s["steps"]
    assert step["comm_ms"] == pytest.approx(0.04)
    assert step["exposed_comm_ms"] == pytest.approx(0.02)  # 30..50 is not under compute
    assert step["busy_pct"] == pytest.approx(70.0)  # cpu ops cover 0..20 and 30..80
    assert {c["name"] for c in s["collectives"]} == {"c10d::_allgather_base_", "gloo:all_gather"}
    assert "CPU op busy %" in format_summary(s, title="rank 0")


def test_collective_kinds_by_name() -> None:
    from graph_fsdp.bench.trace import collective_kind

    names = {
        "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)": "all-gather",
        "ncclDevKernel_ReduceScatter_Sum_f32_RING_LL": "reduce-scatter",
        "ncclDevKernel_AllReduce_Sum_f32_RING_LL": "all-reduce",
        "ncclDevKernel_SendRecv": "all-to-all",
        "c10d::allgather_": "all-gather",
        "c10d::reduce_scatter_tensor_coalesced_": "reduce-scatter",
        "gloo:all_reduce": "all-reduce",
        "c10d::alltoall_base_": "all-to-all",
        "ncclDevKernel_Broadcast_RING_LL": "other",
    }
    assert {n: collective_kind(n) for n in names} == names


def test_optimizer_ranges_delimit_steps_when_there_are_no_step_ranges() -> None:
    trace = {
        "traceEvents": [
            ev("aten::mm", "cpu_op", 0, 10),
            ev("Optimizer.step#AdamW.step", "user_annotation", 40, 10),
            ev("aten::mm", "cpu_op", 60, 10),
            ev("Optimizer.step#AdamW.step", "user_annotation", 80, 20),
        ]
    }
    s = summarize_trace(trace, skip_steps=1)
    assert [(x["name"], x["wall_ms"]) for x in s["steps"]] == [("step 0", 0.05), ("step 1", 0.05)]
    assert s["skipped_steps"] == 1 and s["mean_step_ms"] == pytest.approx(0.05)
    assert "(warmup, excluded)" in format_summary(s, title="t")


def test_the_training_loop_names_each_step_for_the_profiler(tmp_path) -> None:
    # loop.py wraps every step in graph_fsdp/step/<i> while the torch profiler records, so a
    # graphed step (its optimizer inside a replay, no Optimizer.step range) has a window; the
    # loop runs here on CPU (the unsharded reference, one process), the windows are the same.
    import json

    import torch

    from graph_fsdp.cuda_streams import STEP_RANGE_PREFIX, step_range
    from graph_fsdp.models import GPTConfig
    from graph_fsdp.training.train import TrainConfig, run

    model = GPTConfig(
        vocab_size=64, num_layers=1, hidden_size=16, num_attention_heads=2, seq_length=8
    )
    cfg = TrainConfig(model=model, micro_batch_size=1, steps=3, mode="reference")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        run(0, 1, cfg)
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    s = summarize_trace(json.loads(path.read_text()), skip_steps=1)
    assert [x["name"] for x in s["steps"]] == [f"{STEP_RANGE_PREFIX}{i}" for i in range(3)]
    assert s["skipped_steps"] == 1
    # Outside a profile (and without NVTX) the range costs nothing: a shared no-op context.
    assert step_range(0) is step_range(1)
