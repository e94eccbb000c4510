"""Memory breakdown: snapshot attribution (fake snapshots) and the bytes-per-role model
checked against a real 2-rank gloo run."""

from __future__ import annotations

import json

import torch
from graph_fsdp_testing import BF16_MP

from graph_fsdp.bench.memory import MemoryJob, _known, memory_worker, merge, write_result
from graph_fsdp.bench.memory_model import Shape, fsdp2_roles, graph_fsdp_roles, unit_numels
from graph_fsdp.bench.memory_trace import (
    Known,
    _unused_off_default_stream,
    attribute,
    format_table,
    format_unused_ranges,
    known_bytes,
    replay_peak,
    reserved_at_peak,
    role_from_frames,
)
from graph_fsdp.fsdp.api import BufferPolicy
from graph_fsdp.models import GPTConfig
from graph_fsdp.training.processes import spawn
from graph_fsdp.training.train import TrainConfig

GPT = "/src/graph_fsdp/models/gpt.py"
OPTIM = "/site-packages/torch/optim/adamw.py"
FSDP2 = "/site-packages/torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py"


def frame(filename: str, name: str, line: int = 1) -> dict:
    return {"filename": filename, "name": name, "line": line}


def alloc(addr: int, size: int, *frames: dict) -> dict:
    return {"action": "alloc", "addr": addr, "size": size, "frames": list(frames)}


def free(addr: int) -> list[dict]:
    return [
        {"action": "free_requested", "addr": addr, "size": 0, "frames": []},
        {"action": "free_completed", "addr": addr, "size": 0, "frames": []},
    ]


EVENTS = [
    alloc(1000, 400, frame("/x/graph_fsdp/fsdp/param_group.py", "__init__")),  # main_params
    alloc(
        2000,
        800,
        frame("/x/graph_fsdp/buffers/allocator.py", "allocate"),
        frame("<string>", "alloc__grad_comm"),
    ),
    alloc(3000, 300, frame("/x/torch/nn/functional.py", "linear"), frame(GPT, "forward")),
    alloc(4000, 200),  # autograd's backward thread: no Python frame
    alloc(4400, 100, frame("/usr/lib/libc10.so", "c10::alloc")),  # C++ frames only
    *free(2000),  # peak (1800) was just before this
    alloc(5000, 500, frame(OPTIM, "_multi_tensor_adamw")),
    alloc(6000, 50, frame(FSDP2, "foreach_reduce")),
]

SNAPSHOT = {
    "device_traces": [[], EVENTS],
    "segments": [
        {"device": 1, "address": 0, "total_size": 8192, "segment_pool_id": (0, 0)},
        {"device": 1, "address": 2900, "total_size": 1024, "segment_pool_id": (1, 2)},
        {"device": 0, "address": 0, "total_size": 99, "segment_pool_id": (0, 0)},
    ],
}


def test_replay_peak_finds_the_live_set_at_the_highest_total() -> None:
    peak, live, at = replay_peak(EVENTS)
    assert peak == 400 + 800 + 300 + 200 + 100
    assert sorted(live) == [1000, 2000, 3000, 4000, 4400]
    assert at == 4
    # A block stops counting at free_requested (as max_memory_allocated does), also when
    # its free completes later (pending stream uses).
    late = [alloc(1, 10), free(1)[0], alloc(2, 5), free(1)[1], alloc(3, 7)]
    peak2, live2, at2 = replay_peak(late)
    assert peak2 == 12 and sorted(live2) == [2, 3] and at2 == 4


def segment(action: str, addr: int, size: int) -> dict:
    return {"action": action, "addr": addr, "size": size, "frames": []}


def test_reserved_peak_counts_segments_per_pool_used_or_not() -> None:
    """The process's reserved peak: the default pool's cached segments plus a graph pool's,
    each with the bytes live blocks hold there; empty_cache before the capture lowers it."""
    events = [
        segment("segment_alloc", 0, 1000),  # default pool
        alloc(0, 600, frame(GPT, "forward")),
        *free(0),  # cached, unused
        segment("segment_alloc", 5000, 400),  # graph pool
        alloc(5000, 300, frame(GPT, "forward")),
        segment("segment_free", 0, 1000),  # empty_cache: the cached segment goes back
        segment("segment_alloc", 5400, 200),  # the pool grows: below the first peak
        alloc(5400, 100),
    ]
    pools = [(5000, 5600, "graph pool (1, 0)")]
    out = reserved_at_peak(events, pools, lambda b: role_from_frames(b["frames"]))
    assert out["peak_reserved_bytes"] == 1400 and out["event_index"] == 4
    assert out["by_pool"] == {
        "default": {"reserved": 1000, "allocated": 0},
        "graph pool (1, 0)": {"reserved": 400, "allocated": 0},
    }
    assert out["by_role"] == {}
    assert out["default_pool_by_stream"] == {"default stream": {"reserved": 1000, "allocated": 0}}
    # Without the empty_cache the pool's growth is the peak (reached at its segment_alloc,
    # before the block that asked for it).
    kept = [e for e in events if e["action"] != "segment_free"]
    out = reserved_at_peak(kept, pools, lambda b: role_from_frames(b["frames"]))
    assert out["peak_reserved_bytes"] == 1600
    assert out["by_pool"]["graph pool (1, 0)"] == {"reserved": 600, "allocated": 300}
    assert out["by_role"] == {"activations (forward)": 300}
    # A default segment freed before a graph pool got its addresses is the default pool's.
    reused = [
        segment("segment_alloc", 5000, 600),
        segment("segment_free", 5000, 600),
        segment("segment_alloc", 5000, 400),
    ]
    out = reserved_at_peak(reused, pools, lambda b: "x")
    assert out["peak_reserved_bytes"] == 600 and out["event_index"] == 0
    assert out["by_pool"] == {"default": {"reserved": 600, "allocated": 0}}
    # Expandable segments map and unmap pages of one segment, an unmap any part of a mapping.
    mapped = [segment("segment_map", 0, 512), segment("segment_map", 512, 512)]
    mapped += [segment("segment_unmap", 256, 512), segment("segment_map", 2048, 64)]
    out = reserved_at_peak(mapped, [(512, 1024, "graph pool (0, 1)")], lambda b: "x")
    assert out["peak_reserved_bytes"] == 1024 and out["event_index"] == 1
    assert out["by_pool"] == {
        "default": {"reserved": 512, "allocated": 0},
        "graph pool (0, 1)": {"reserved": 512, "allocated": 0},
    }
    late = reserved_at_peak(mapped + [segment("segment_map", 4096, 1024)], [], lambda b: "x")
    assert late["peak_reserved_bytes"] == 256 + 256 + 64 + 1024
    assert late["by_pool"]["default"]["reserved"] == 256 + 256 + 64 + 1024


def test_reserved_peak_splits_the_default_pool_by_stream() -> None:
    """A capture stream's cached blocks are the default pool's but out of the default
    stream's reach: the peak says how much of the unused bytes sit on other streams."""
    side = 0x7F00
    events = [
        segment("segment_alloc", 0, 1000),  # default stream: 600 live, 300 cached
        alloc(0, 600, frame(GPT, "forward")),
        {**alloc(1000, 300, frame(GPT, "forward"))},
        *free(1000),  # cached on the default stream
        {**segment("segment_alloc", 2000, 800), "stream": side},  # the peak: nothing live yet
        {**alloc(2000, 500, frame(GPT, "forward")), "stream": side},
    ]
    out = reserved_at_peak(events, [], lambda b: "x")
    assert out["peak_reserved_bytes"] == 1800 and out["event_index"] == 5
    assert out["by_pool"] == {"default": {"reserved": 1800, "allocated": 600}}
    assert out["default_pool_by_stream"] == {
        "default stream": {"reserved": 1000, "allocated": 600},
        "stream 0x7f00": {"reserved": 800, "allocated": 0},
    }
    assert _unused_off_default_stream({"reserved_peak": out}) == 800
    # The ranges with the most unused bytes, each with the allocation it was reserved for.
    ranges = out["unused_ranges"]
    assert [(r["reserved"], r["allocated"], r["stream"]) for r in ranges] == [
        (800, 0, "stream 0x7f00"),
        (1000, 600, "default stream"),
    ]
    assert ranges[0]["made_at"] == 5 and "gpt.py" in ranges[0]["made_for"]
    assert "| 0.0 | 0.0 | default | stream 0x7f00 | 5 | `" in format_unused_ranges(
        {"reserved_peak": out}
    )
    assert "| of which on other streams than the default |" in format_table(
        {"run": {"reserved_peak": out}}
    )


def test_attribute_by_address_then_by_stack() -> None:
    known = [Known("main_params", 1000, 400), Known("optimizer_state", 5000, 500)]
    out = attribute(SNAPSHOT, known, device=1)
    assert out["peak_allocated_bytes"] == 1800
    assert out["by_role"] == {
        "main_params": 400,
        "grad_comm": 800,
        "activations (forward)": 300,
        "autograd backward (no Python frame)": 300,
    }
    assert list(out["by_role"])[0] == "main_params"  # report order
    assert out["in_graph_pool_by_role"] == {"activations (forward)": 300}
    assert out["reserved_by_pool"] == {"default": 8192, "graph pool (1, 2)": 1024}
    assert out["known_bytes"] == {"main_params": 400, "optimizer_state": 500}
    assert out["trace_events"] == len(EVENTS)
    # Blocks no known tensor claims, largest first, with their innermost Python frame.
    assert out["top_sites"][0] == {
        "role": "grad_comm",
        "site": "graph_fsdp/buffers/allocator.py:1 allocate",
        "bytes": 800,
    }
    assert {s["site"] for s in out["top_sites"]} == {
        "graph_fsdp/buffers/allocator.py:1 allocate",
        "torch/nn/functional.py:1 linear",
        "(no frames)",
        "usr/lib/libc10.so:1 c10::alloc",
    }
    # A known span claims a block inside it (a slot's view at an offset).
    out = attribute(SNAPSHOT, [Known("slot:grad", 3900, 1000)], device=1)
    assert out["by_role"]["slot:grad"] == 200 + 100
    assert out["by_role"]["activations (forward)"] == 300


PARAM_GROUP = "/x/graph_fsdp/fsdp/param_group.py"
REDUCE = "/x/graph_fsdp/fsdp/reduce.py"
ALLOCATOR = "/x/graph_fsdp/buffers/allocator.py"
MEMORY = "/x/graph_fsdp/bench/memory.py"


def resized_param(addr: int, size: int) -> dict:
    """A dynamic allocator's re-allocation: ``storage.resize_`` inside the tagged allocate."""
    return alloc(
        addr,
        size,
        frame(ALLOCATOR, "allocate", 190),  # storage.resize_(nbytes): no Python frame of its own
        frame("<string>", "alloc__param"),
        frame(MEMORY, "allocate"),
        frame(PARAM_GROUP, "unshard"),
    )


def main_grad(addr: int, size: int) -> dict:
    return alloc(addr, size, frame(PARAM_GROUP, "ensure_main_grad"), frame(REDUCE, "reduce_grads"))


OPT_PEAK = [
    alloc(100, 40, frame(PARAM_GROUP, "__init__")),  # main_params (persistent)
    resized_param(200, 30),  # forward gather, step 0
    *free(200),
    resized_param(200, 30),  # backward re-gather
    main_grad(300, 40),  # reduced into the re-allocated main grad
    *free(200),  # resharded after backward
    alloc(500, 40, frame(OPTIM, "_multi_tensor_adamw")),  # optimizer step: the peak (120)
    *free(500),
    *free(300),  # next forward releases the main grad
    resized_param(300, 30),  # ...whose address the next gather reuses
    alloc(200, 20, frame(GPT, "forward")),
    *free(300),
    *free(200),
    main_grad(500, 40),  # the last step's main grad, where the temporaries were at the peak
]


def test_released_storages_are_attributed_by_stack_not_by_their_final_address() -> None:
    # The known tensors are read after the run: main_grad at 500, the released gathered
    # weights have no storage (memory.py's _known skips them).
    known = [Known("main_params", 100, 40), Known("main_grads", 500, 40)]
    out = attribute({"device_traces": [OPT_PEAK]}, known)
    assert out["peak_allocated_bytes"] == 120
    # The main grad live at the peak (at 300, released since) is still the main grad, by
    # its ensure_main_grad frame; the temporaries at 500 are not claimed by the final
    # main grad's span; the gathered weights are not live at an optimizer-step peak.
    assert out["by_role"] == {"main_params": 40, "main_grads": 40, "optimizer_temporaries": 40}
    # Each role's own highest live bytes: the resized (tagged) gathers show there.
    assert out["peak_by_role"] == {
        "main_params": 40,
        "main_grads": 40,
        "param": 30,
        "optimizer_temporaries": 40,
        "activations (forward)": 20,
    }
    assert out["known_bytes"] == {"main_params": 40, "main_grads": 40}


def test_dynamic_reallocation_stack_carries_the_tag(monkeypatch) -> None:
    """The stack the CUDA allocator records (CapturedTraceback, Python frames) for the
    dynamic allocator's ``storage.resize_`` re-allocation carries the role's tag frame."""
    from torch._C._profiler import gather_traceback, symbolize_tracebacks

    from graph_fsdp.bench.memory import tag_allocations
    from graph_fsdp.buffers.allocator import DynamicAllocator

    stacks = []
    resize = torch.UntypedStorage.resize_

    def recording_resize(storage, nbytes):
        tb = gather_traceback(python=True, script=False, cpp=False)
        stacks.append(symbolize_tracebacks([tb])[0])
        return resize(storage, nbytes)

    allocator = DynamicAllocator()
    tag_allocations(allocator)
    monkeypatch.setattr(torch.UntypedStorage, "resize_", recording_resize)
    key, cpu = ("layers.0", "param", torch.bfloat16), torch.device("cpu")
    first = allocator.allocate(key, 10, torch.bfloat16, cpu)  # torch.empty
    allocator.free(key)  # resize_(0)
    again = allocator.allocate(key, 10, torch.bfloat16, cpu)  # resize_(20): re-allocation
    assert again is first and again.untyped_storage().nbytes() == 20
    assert [role_from_frames(s) for s in stacks] == ["other", "param"]


def test_roles_from_frames() -> None:
    assert role_from_frames([frame(OPTIM, "_multi_tensor_adamw")]) == "optimizer_temporaries"
    assert role_from_frames([frame(FSDP2, "foreach_reduce")]) == "fsdp2:reduce_scatter"
    assert role_from_frames([frame(FSDP2, "foreach_all_gather")]) == "fsdp2:all_gather"
    assert role_from_frames([frame("<s>", "alloc__rs_out"), frame(GPT, "x")]) == "rs_out"
    assert role_from_frames([frame(PARAM_GROUP, "ensure_main_grad")]) == "main_grads"
    assert role_from_frames([frame("/x/other/param_group.py", "ensure_main_grad")]) == "other"
    assert role_from_frames([frame("/x/train.py", "run")]) == "other"
    assert role_from_frames([]) == "autograd backward (no Python frame)"


def test_table_and_merge(tmp_path) -> None:
    a = attribute(SNAPSHOT, [Known("main_params", 1000, 400)], device=1)
    b = {
        "known_bytes": {"main_params": 2**30, "compute_shard": 2**29},
        "graph_pool_bytes": {"reserved": 2**31, "allocated": 0},
    }
    text = format_table({"graph_fsdp_eager": a, "cpu": b})
    assert "| graph pool (reserved, fsdp_memory_report) | - | 2.000 |" in text
    assert "| role (GiB, rank 0, at the peak) | graph_fsdp_eager | cpu |" in text
    assert "| compute_shard | - | 0.500 |" in text
    assert "| main_params | 0.000 | 1.000 |" in text
    paths = [write_result(a, "a", str(tmp_path)), write_result(b, "b", str(tmp_path))]
    assert json.loads((tmp_path / "memory_a.json").read_text())["label"] == "a"
    assert "| role (GiB, rank 0, at the peak) | a | b |" in merge(paths)
    assert "no memory results" in merge([])
    # Each result names the code that produced it (provenance.py); one stamp heads the table.
    from graph_fsdp.bench.provenance import code_version, stamp_line

    assert json.loads((tmp_path / "memory_a.json").read_text())["code"] == code_version()
    assert merge(paths).startswith(f"Code: {stamp_line()}.\n")
    assert "a: largest blocks at the peak" in merge(paths)
    assert "| grad_comm | `graph_fsdp/buffers/allocator.py:1 allocate` | 0.000 |" in merge(paths)


def test_known_skips_absent_and_released_storages() -> None:
    # compute_shard is None unless the optimizer runs over replicas; a released main grad
    # keeps its tensor object with a 0-byte storage: neither claims any address.
    grad = torch.zeros(16)
    assert _known("main_grads", grad) == [
        Known("main_grads", grad.untyped_storage().data_ptr(), 64)
    ]
    grad.untyped_storage().resize_(0)
    assert _known("main_grads", grad) == []
    assert _known("compute_shard", None) == []


def test_known_bytes_counts_each_storage_once() -> None:
    k = [Known("main_params", 1, 8), Known("main_params", 1, 8), Known("x", 2, 4)]
    assert known_bytes(k) == {"main_params": 8, "x": 4}


TINY = GPTConfig(num_layers=3, hidden_size=64, num_attention_heads=4, seq_length=16, vocab_size=200)


def test_unit_numels_follow_the_model() -> None:
    units = unit_numels(TINY)
    assert [n for n, _ in units] == ["layers.0", "layers.1", "layers.2", "output", "root"]
    h, v, s = 64, 200, 16
    assert sum(units[0][1]) == 12 * h * h + 2 * h
    assert units[-2][1] == [v * h]  # the output projection is its own unit
    assert units[-1][1] == [v * h, s * h, h]


def test_model_matches_a_real_run() -> None:
    """The bytes-per-role model equals what a 2-rank gloo run holds on rank 0."""
    cfg = TrainConfig(
        model=TINY,
        mp=BF16_MP,
        buffers=BufferPolicy(allocator="double_buffer"),
        steps=1,
        micro_batch_size=2,
    )
    job = MemoryJob(cfg=cfg, engine="graph_fsdp", warmup=1, output_dir="unused")
    result = spawn(memory_worker, 2, job)[0]
    roles = graph_fsdp_roles(Shape(model=TINY, world_size=2))
    # Between steps no slot holds bytes: the backward-only slots and the idle weight slots give
    # theirs back ([Note: backward slots between steps], [Note: weight slots during backward]).
    slots = ("slot:param", "slot:grad", "slot:grad_comm")
    assert all(roles[k] for k in slots)
    between_steps = {k: v for k, v in roles.items() if k not in slots}
    assert result["known_bytes"] == between_steps
    assert result["graph_pool_bytes"] == {"reserved": 0, "allocated": 0}  # no graph on CPU
    assert "CPU" in result["note"]


def test_serial_grad_comm_slot_saves_the_per_class_slots() -> None:
    shape = Shape(model=TINY, world_size=2)
    per_class = graph_fsdp_roles(Shape(model=TINY, world_size=2, serial_comm=False))
    serial = graph_fsdp_roles(shape)
    totals = {name: sum(n) for name, n in unit_numels(TINY)}
    # fp32 copies of whole (padded) units: two layer slots + the root slot before, one
    # slot of the largest unit after. Every other role is unchanged.
    assert per_class["slot:grad_comm"] > serial["slot:grad_comm"] >= max(totals.values()) * 4
    assert {k: v for k, v in per_class.items() if k != "slot:grad_comm"} == {
        k: v for k, v in serial.items() if k != "slot:grad_comm"
    }


def test_fsdp2_model_roles() -> None:
    roles = fsdp2_roles(Shape(model=TINY, world_size=2))
    n = sum(sum(u) for _, u in unit_numels(TINY))
    # Every TINY parameter has an even first dim: exact halves.
    assert roles["main_params"] == n // 2 * 4
    assert roles["optimizer_state"] == 2 * roles["main_params"]
