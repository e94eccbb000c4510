"""Where the bytes are at the peak: ``graph-fsdp profile --memory ENGINE``.

    graph-fsdp profile --memory graph_fsdp --bf16 --fsdp-double-buffer \\
        --fsdp-db-use-persist-buf-on-alloc-fail --cuda-graph-impl torch \\
        --cuda-graph-scope full_iteration --warmup-iters 3 --train-iters 2 ...
    graph-fsdp profile --memory fsdp2 --bf16 ...        # torch FSDP2, same model and data

Each rank records the CUDA caching allocator's history from before the model is built
(``torch.cuda.memory._record_memory_history``, Python stacks), trains ``warmup + steps``
steps, takes a snapshot and replays the allocation trace to find the moment of the highest
allocated bytes (the moment ``torch.cuda.max_memory_allocated`` reports). Every block live at that moment is given a role:

1. by address: the engine's known tensors (graph_fsdp: ``main_params``, ``main_grads``,
   ``compute_shard``, the allocator's slots by role, ``accum``; FSDP2: the sharded
   parameters and gradients; both: ``optimizer_state``), read at the end of the run: they
   claim a block only if that very allocation is still live at the end of the trace (a
   storage that comes and goes - a released main grad, a dynamic buffer - may sit at
   another address, or its old address may hold something else, at the peak);
2. by stack: allocations made through graph_fsdp's allocator carry a frame
   ``alloc__<role>`` (the tool wraps the allocator's ``allocate``: the dynamic allocator's
   buffers change address; its re-allocations are ``storage.resize_`` calls inside that
   frame); main grads re-allocated by ``ensure_main_grad`` (param_group.py [Note: releasable
   main grads]); FSDP2's all-gather and reduce-scatter buffers by their functions;
   optimizer temporaries under ``torch/optim``; the model's forward (activations); no
   Python frame at all: autograd's backward thread (gradients and backward temporaries).

Besides the roles at the peak (``by_role``), ``peak_by_role`` gives each role's own highest
live bytes over the whole trace: buffers that are freed before the peak (the dynamic
allocator's gathered weights when the peak is the optimizer step) show there.

A captured step allocates nothing when it replays: its memory is the graph pool, reported
as reserved bytes per pool at the end (``reserved_by_pool``; for graph_fsdp also the model's
own account of its runners' pools, ``graph_pool_bytes``, a row of the table), next to the
peak attribution (which, for a captured run, is the peak of the capture itself). On CPU there is no
allocator history: only the known tensors' bytes are reported.
"""

from __future__ import annotations

import inspect
import json
import os
import pickle
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import nn

from graph_fsdp.bench.peers import accumulating_step, fsdp2_model
from graph_fsdp.bench.provenance import code_version, stamp_line
from graph_fsdp.buffers.allocator import SlotAllocator, key_role
from graph_fsdp.capture.step import eager_forward_backward
from graph_fsdp.capture.whole_step import WholeStepGraph
from graph_fsdp.fsdp.state import collect_states
from graph_fsdp.training.data import batch_for
from graph_fsdp.training.loop import whole_step_microbatch
from graph_fsdp.training.train import (
    build_for,
    device_of,
    make_graphs,
    make_optimizer,
    shard_model,
)

ROLE_ORDER = (
    "main_params",
    "main_grads",
    "optimizer_state",
    "compute_shard",
    "compute_full_persistent",
    "slot:param",
    "slot:grad",
    "slot:grad_comm",
    "slot:rs_out",
    "param",
    "grad",
    "grad_comm",
    "rs_out",
    "accum",
    "fsdp2:sharded_params",
    "fsdp2:sharded_grads",
    "fsdp2:all_gather",
    "fsdp2:reduce_scatter",
    "optimizer_temporaries",
    "activations (forward)",
    "autograd backward (no Python frame)",
    "other",
)
"""Report order; roles not listed (e.g. ``slot:grad+rs_out`` from a trace pool) go last."""

TAG_PREFIX = "alloc__"


# ------------------------------------------------------------------------------------------
# Known tensors
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Known:
    role: str
    ptr: int
    nbytes: int


def _known(role: str, t: torch.Tensor | None) -> Iterable[Known]:
    if t is None:
        return []
    if hasattr(t, "to_local"):  # DTensor (FSDP2's params, grads and optimizer state)
        t = t.to_local()
    storage = t.untyped_storage()
    if storage.nbytes() == 0:
        return []
    return [Known(role, storage.data_ptr(), storage.nbytes())]


def _optimizer_state(opt: torch.optim.Optimizer | None) -> list[Known]:
    out = []
    for state in opt.state.values() if opt is not None else []:
        for value in state.values():
            if torch.is_tensor(value) and value.numel() > 1:
                out += _known("optimizer_state", value)
    return out


def slot_roles(allocator) -> list[tuple[str, torch.Tensor]]:
    """(role, tensor) of every materialised slot of a slot allocator (else empty)."""
    if not isinstance(allocator, SlotAllocator):
        return []
    roles: dict[int, set[str]] = {}
    for key, slot in allocator._assignment.items():
        roles.setdefault(id(slot), set()).add(key_role(key))
    for key, slot in allocator._dedicated.items():
        roles.setdefault(id(slot), set()).add(key_role(key) + " (dedicated)")
    out = []
    for slot in allocator.slots():
        if slot.tensor is not None:
            out.append(("slot:" + "+".join(sorted(roles.get(id(slot), {"?"}))), slot.tensor))
    return out


def known_graph_fsdp(model: nn.Module, opt: torch.optim.Optimizer | None) -> list[Known]:
    states = collect_states(model)
    out: list[Known] = []
    for s in states:
        for g in s.groups:
            out += _known("main_params", g.main_flat)
            out += _known("main_grads", g.main_grad)
            out += _known("compute_shard", g.compute_shard)
            out += _known("compute_full_persistent", g.persistent_full)
            out += _known("accum", g.accum)
    root = states[0].root if states else None
    if root is not None:
        for role, tensor in slot_roles(root.allocator):
            out += _known(role, tensor)
    return out + _optimizer_state(opt)


def known_fsdp2(model: nn.Module, opt: torch.optim.Optimizer | None) -> list[Known]:
    out: list[Known] = []
    for p in model.parameters():
        out += _known("fsdp2:sharded_params", p)
        out += _known("fsdp2:sharded_grads", p.grad)
    return out + _optimizer_state(opt)


def known_bytes(known: Iterable[Known]) -> dict[str, int]:
    """Bytes per role, each storage counted once."""
    seen, out = set(), {}
    for k in known:
        if k.ptr not in seen:
            seen.add(k.ptr)
            out[k.role] = out.get(k.role, 0) + k.nbytes
    return out


# ------------------------------------------------------------------------------------------
# Role tags on graph_fsdp's allocator
# ------------------------------------------------------------------------------------------

_TAGGERS: dict[str, Callable] = {}


def _tagger(role: str) -> Callable:
    """A pass-through function named ``alloc__<role>``: the name shows in the stack."""
    fn = _TAGGERS.get(role)
    if fn is None:
        name = TAG_PREFIX + "".join(c if c.isalnum() else "_" for c in role)
        namespace: dict = {}
        exec(f"def {name}(fn, *args):\n    return fn(*args)\n", namespace)
        fn = _TAGGERS[role] = namespace[name]
    return fn


def tag_allocations(allocator) -> None:
    """Wrap ``allocator.allocate`` so that every allocation it makes carries its key's role
    in the Python stack (see module docstring)."""
    inner = allocator.allocate

    def allocate(key, numel, dtype, device):
        return _tagger(key_role(key))(inner, key, numel, dtype, device)

    allocator.allocate = allocate


# ------------------------------------------------------------------------------------------
# Snapshot attribution (pure: tested on CPU with a fake snapshot)
# ------------------------------------------------------------------------------------------


FREE_ACTIONS = ("free_requested", "free_completed")
"""A block stops counting at its ``free_requested`` (where the allocator's allocated-bytes
statistic drops, so the replayed peak is ``max_memory_allocated``'s); a block freed with
pending stream uses completes later, and its bytes are reusable only then."""


def replay_peak(events: list[dict]) -> tuple[int, dict[int, dict], int]:
    """Replay alloc/free events: (peak bytes, blocks live at the peak by address, index of
    the event that reached it)."""
    live: dict[int, dict] = {}
    total = peak = 0
    peak_at = -1
    for i, e in enumerate(events):
        action = e.get("action")
        if action == "alloc":
            live[e["addr"]] = e
            total += e["size"]
            if total > peak:
                peak, peak_at = total, i
        elif action in FREE_ACTIONS and e["addr"] in live:
            total -= live.pop(e["addr"])["size"]
    live = {}
    for e in events[: peak_at + 1]:
        if e.get("action") == "alloc":
            live[e["addr"]] = e
        elif e.get("action") in FREE_ACTIONS:
            live.pop(e["addr"], None)
    return peak, live, peak_at


SEGMENT_ADD = ("segment_alloc", "segment_map")
SEGMENT_DROP = ("segment_free", "segment_unmap")


def _drop_range(ranges: dict[int, tuple[int, int]], addr: int, size: int) -> None:
    """Remove ``[addr, addr + size)`` from ``ranges`` (``{start: (size, made at)}``): a freed
    segment, or pages an expandable segment unmaps (any part of a mapped range)."""
    for start, (length, made) in list(ranges.items()):
        lo, hi = max(start, addr), min(start + length, addr + size)
        if lo >= hi:
            continue
        del ranges[start]
        if start < lo:
            ranges[start] = (lo - start, made)
        if hi < start + length:
            ranges[hi] = (start + length - hi, made)


def replay_reserved_peak(
    events: list[dict],
) -> tuple[int, dict[int, tuple[int, int]], dict[int, dict], int, set[int]]:
    """Replay segment and block events: (peak reserved bytes, the address ranges reserved at
    that moment as ``{start: (size, index of the event that made it)}``, blocks live then by
    address, index of the event that reached the peak, indices of the events whose ranges are
    still reserved when the trace ends). Reserved is what the process holds from the driver
    (``max_memory_reserved``): a graph's pool and the default pool's cached blocks count,
    used or not; an expandable segment counts its mapped pages."""
    total = peak = 0
    peak_at = -1
    ranges: dict[int, tuple[int, int]] = {}
    at_peak: dict[int, tuple[int, int]] = {}
    for i, e in enumerate(events):
        action = e.get("action")
        if action in SEGMENT_ADD:
            ranges[e["addr"]] = (e["size"], i)
            total += e["size"]
            if total > peak:
                peak, peak_at, at_peak = total, i, dict(ranges)
        elif action in SEGMENT_DROP:
            total -= e["size"]
            _drop_range(ranges, e["addr"], e["size"])
    live: dict[int, dict] = {}
    for e in events[: peak_at + 1]:
        if e.get("action") == "alloc":
            live[e["addr"]] = e
        elif e.get("action") in FREE_ACTIONS:
            live.pop(e["addr"], None)
    return peak, at_peak, live, peak_at, {made for _, made in ranges.values()}


def reserved_at_peak(
    events: list[dict], pools: list[tuple[int, int, str]], role_of: Callable[[dict], str]
) -> dict:
    """Where the process's reserved bytes were at their highest: per pool (a graph's pool by
    its id, ``default`` otherwise) the bytes reserved and the bytes of live blocks in them
    (the rest is cached and unused there: a pool cannot lend it to another), and the live
    blocks' roles. ``pools`` are the graph pools' address ranges at the end of the run: a
    range counts as a graph pool's only if the segment reserved at the peak is the one still
    there at the end (a freed segment's addresses can come back in another pool's); one
    freed before then counts as the default pool's (a dropped graph's pool would too)."""
    peak, ranges, live, peak_at, survivors = replay_reserved_peak(events)

    def pool_of(addr: int) -> str:
        return next((name for lo, hi, name in pools if lo <= addr < hi), "default")

    by_pool: dict[str, dict[str, int]] = {}
    by_stream: dict[str, dict[str, int]] = {}
    owner: list[dict] = []
    for start, (size, made) in sorted(ranges.items()):
        name = pool_of(start) if made in survivors else "default"
        stream = _stream_label(events[made].get("stream")) if name == "default" else None
        owner.append(
            {
                "start": start,
                "reserved": size,
                "allocated": 0,
                "pool": name,
                "stream": stream,
                "made_at": made,
            }
        )
        _count("reserved", size, (by_pool, name), (by_stream, stream))
    by_role: dict[str, int] = {}
    for addr, block in live.items():
        rng = next((r for r in owner if r["start"] <= addr < r["start"] + r["reserved"]), None)
        name, stream = (rng["pool"], rng["stream"]) if rng else ("default", None)
        if rng is not None:
            rng["allocated"] += block["size"]
        _count("allocated", block["size"], (by_pool, name), (by_stream, stream))
        role = role_of(block)
        by_role[role] = by_role.get(role, 0) + block["size"]
    return {
        "peak_reserved_bytes": peak,
        "event_index": peak_at,
        "by_pool": by_pool,
        "default_pool_by_stream": by_stream,
        "by_role": dict(sorted(by_role.items(), key=lambda kv: _role_rank(kv[0]))),
        "unused_ranges": _largest_unused(owner, events),
    }


def _count(field: str, size: int, *tables: tuple[dict, str | None]) -> None:
    """Add ``size`` to ``field`` of each ``(table, key)``'s entry (a None key: not counted)."""
    for table, key in tables:
        if key is not None:
            table.setdefault(key, {"reserved": 0, "allocated": 0})[field] += size


TOP_RANGES = 12
"""Reserved ranges listed at the reserved peak (most unused bytes first)."""


def _largest_unused(owner: list[dict], events: list[dict]) -> list[dict]:
    """The reserved ranges with the most unused bytes at the reserved peak, each with the
    allocation that made the allocator reserve it (the first block allocated after the
    segment event: its site, its stream)."""
    out = []
    for r in sorted(owner, key=lambda r: r["allocated"] - r["reserved"])[:TOP_RANGES]:
        if r["reserved"] == r["allocated"]:
            break
        made = r["made_at"]
        asker = next((e for e in events[made + 1 : made + 8] if e.get("action") == "alloc"), None)
        out.append(
            {
                "reserved": r["reserved"],
                "allocated": r["allocated"],
                "pool": r["pool"],
                "stream": _stream_label(events[made].get("stream")),
                "made_at": made,
                "made_for": alloc_site(asker.get("frames", [])) if asker else "?",
            }
        )
    return out


def format_unused_ranges(result: dict) -> str:
    """The reserved ranges with the most unused bytes at the reserved peak."""
    lines = [
        "| reserved MiB | used MiB | pool | stream | made at event | made for (allocation site) |",
        "|--:|--:|---|---|--:|---|",
    ]
    for r in (result.get("reserved_peak") or {}).get("unused_ranges", []):
        lines.append(
            f"| {r['reserved'] / 2**20:.1f} | {r['allocated'] / 2**20:.1f} | {r['pool']} | "
            f"{r['stream']} | {r['made_at']} | `{r['made_for']}` |"
        )
    return "\n".join(lines) + "\n"


DEFAULT_STREAM = "default stream"


def _stream_label(stream: int | None) -> str:
    """The default pool keeps cached blocks per stream (one stream cannot use another's):
    the default stream, or another by its handle (a capture stream, a side stream)."""
    return DEFAULT_STREAM if not stream else f"stream {stream:#x}"


def role_from_frames(frames: list[dict]) -> str:
    """A role for an allocation no known tensor claims, from its Python stack."""
    if not frames:
        return "autograd backward (no Python frame)"
    for f in frames:
        name = f.get("name", "")
        if name.startswith(TAG_PREFIX):
            return name[len(TAG_PREFIX) :]
    for f in frames:
        path, name = f.get("filename", "").replace("\\", "/"), f.get("name", "")
        if name == "ensure_main_grad" and path.endswith("graph_fsdp/fsdp/param_group.py"):
            return "main_grads"
        if "fsdp/_fully_shard/" in path:
            if "reduce" in name:
                return "fsdp2:reduce_scatter"
            if "all_gather" in name or "unshard" in name or "alloc" in name:
                return "fsdp2:all_gather"
        if "/torch/optim/" in path:
            return "optimizer_temporaries"
    python = [f for f in frames if f.get("filename", "").endswith(".py")]
    if not python:
        return "autograd backward (no Python frame)"
    for f in python:
        path = f["filename"].replace("\\", "/")
        if "graph_fsdp/models/" in path or "/torch/nn/" in path or "transformer_engine" in path:
            return "activations (forward)"
    return "other"


TOP_SITES = 15
"""Allocation sites listed per run (blocks no known tensor claims, largest first)."""


def alloc_site(frames: list[dict]) -> str:
    """Where a block was allocated: the innermost Python frame outside torch's own wrappers
    (``file:line function``), or the innermost frame of any kind."""
    python = [f for f in frames if f.get("filename", "").endswith(".py")]
    skip = ("/torch/utils/", "/torch/_tensor.py", "/torch/autograd/", "/torch/_ops.py")
    chosen = next(
        (f for f in python if not any(s in f["filename"].replace("\\", "/") for s in skip)),
        python[0] if python else (frames[0] if frames else None),
    )
    if chosen is None:
        return "(no frames)"
    path = chosen.get("filename", "?").replace("\\", "/")
    short = "/".join(path.split("/")[-3:])
    return f"{short}:{chosen.get('line', '?')} {chosen.get('name', '?')}"


def format_sites(result: dict) -> str:
    """The largest allocation sites at the peak that no known tensor claims."""
    lines = ["| role | allocation site (innermost Python frame) | GiB |", "|---|---|--:|"]
    for s in result.get("top_sites", []):
        lines.append(f"| {s['role']} | `{s['site']}` | {s['bytes'] / 2**30:.3f} |")
    return "\n".join(lines) + "\n"


def _pool_ranges(snapshot: dict, device: int) -> list[tuple[int, int, str]]:
    out = []
    for seg in snapshot.get("segments", []):
        if seg.get("device", device) != device:
            continue
        pool = tuple(seg.get("segment_pool_id", (0, 0)))
        if pool != (0, 0):
            out.append((seg["address"], seg["address"] + seg["total_size"], f"graph pool {pool}"))
    return out


def _live_at_end(events: list[dict]) -> dict[int, dict]:
    """The alloc event of every block still live when the trace ends, by address."""
    live: dict[int, dict] = {}
    for e in events:
        if e.get("action") == "alloc":
            live[e["addr"]] = e
        elif e.get("action") in FREE_ACTIONS:
            live.pop(e["addr"], None)
    return live


def role_peaks(events: list[dict], role_of: Callable[[dict], str]) -> dict[str, int]:
    """Each role's highest live bytes over the trace (at its own moment, not the peak's)."""
    live: dict[int, tuple[str, int]] = {}
    now: dict[str, int] = {}
    peaks: dict[str, int] = {}
    for e in events:
        action = e.get("action")
        if action == "alloc":
            role = role_of(e)
            live[e["addr"]] = (role, e["size"])
            now[role] = now.get(role, 0) + e["size"]
            peaks[role] = max(peaks.get(role, 0), now[role])
        elif action in FREE_ACTIONS and e["addr"] in live:
            role, size = live.pop(e["addr"])
            now[role] -= size
    return peaks


def attribute(snapshot: dict, known: list[Known], device: int = 0) -> dict:
    """Bytes per role of the blocks live at the allocated-bytes peak of ``snapshot``."""
    traces = snapshot.get("device_traces", [])
    events = traces[device] if device < len(traces) else []
    peak, live, peak_at = replay_peak(events)
    spans = sorted(((k.ptr, k.ptr + k.nbytes, k.role) for k in known), key=lambda s: s[0])
    at_end = _live_at_end(events)

    def known_role(block: dict) -> str | None:
        # Known tensors are read after the run: only the allocation live then is theirs.
        if at_end.get(block["addr"]) is not block:
            return None
        return next((r for lo, hi, r in spans if lo <= block["addr"] < hi), None)

    by_stack: dict[tuple, str] = {}  # a trace repeats few stacks many times

    def role_of(block: dict) -> str:
        role = known_role(block)
        if role is None:
            frames = block.get("frames", [])
            key = tuple((f.get("filename"), f.get("name")) for f in frames)
            role = by_stack.get(key)
            if role is None:
                role = by_stack[key] = role_from_frames(frames)
        return role

    pools = _pool_ranges(snapshot, device)
    by_role: dict[str, int] = {}
    in_pool: dict[str, int] = {}
    sites: dict[tuple[str, str], int] = {}
    for addr, block in live.items():
        role = known_role(block)
        if role is None:
            role = role_from_frames(block.get("frames", []))
            site = (role, alloc_site(block.get("frames", [])))
            sites[site] = sites.get(site, 0) + block["size"]
        by_role[role] = by_role.get(role, 0) + block["size"]
        if any(lo <= addr < hi for lo, hi, _ in pools):
            in_pool[role] = in_pool.get(role, 0) + block["size"]
    reserved: dict[str, int] = {}
    for seg in snapshot.get("segments", []):
        if seg.get("device", device) == device:
            pool = tuple(seg.get("segment_pool_id", (0, 0)))
            name = "default" if pool == (0, 0) else f"graph pool {pool}"
            reserved[name] = reserved.get(name, 0) + seg["total_size"]
    return {
        "peak_allocated_bytes": peak,
        "peak_event_index": peak_at,
        "trace_events": len(events),
        "by_role": dict(sorted(by_role.items(), key=lambda kv: _role_rank(kv[0]))),
        "peak_by_role": dict(
            sorted(role_peaks(events, role_of).items(), key=lambda kv: _role_rank(kv[0]))
        ),
        "in_graph_pool_by_role": in_pool,
        "reserved_by_pool": reserved,
        "reserved_peak": reserved_at_peak(events, pools, role_of),
        "known_bytes": known_bytes(known),
        "top_sites": [
            {"role": role, "site": site, "bytes": nbytes}
            for (role, site), nbytes in sorted(sites.items(), key=lambda kv: -kv[1])[:TOP_SITES]
        ],
    }


def _role_rank(role: str) -> tuple[int, str]:
    return (ROLE_ORDER.index(role) if role in ROLE_ORDER else len(ROLE_ORDER), role)


def _pool_reserved(result: dict) -> int | None:
    return (result.get("graph_pool_bytes") or {}).get("reserved")


def _at_reserved_peak(result: dict, key: str):
    return (result.get("reserved_peak") or {}).get(key)


def _unused(result: dict, *, graph: bool) -> int | None:
    """Bytes reserved but held by no live block at the reserved peak, in the default pool or
    in the graphs' pools."""
    pools = _at_reserved_peak(result, "by_pool")
    if pools is None:
        return None
    return sum(
        v["reserved"] - v["allocated"] for k, v in pools.items() if (k != "default") == graph
    )


def _unused_off_default_stream(result: dict) -> int | None:
    """Bytes of the default pool reserved on streams other than the default stream, unused at
    the reserved peak: cached blocks the default stream's work cannot reuse."""
    streams = _at_reserved_peak(result, "default_pool_by_stream")
    if streams is None:
        return None
    return sum(v["reserved"] - v["allocated"] for k, v in streams.items() if k != DEFAULT_STREAM)


def format_table(results: dict[str, dict]) -> str:
    """Markdown: one column per run (GiB), one row per role, peak and reserved last."""
    names = list(results)
    roles: list[str] = []
    for r in results.values():
        for role in r.get("by_role") or r.get("known_bytes", {}):
            if role not in roles:
                roles.append(role)
    roles.sort(key=_role_rank)

    def gib(v: int | None) -> str:
        return "-" if not v else f"{v / 2**30:.3f}"

    lines = [
        "| role (GiB, rank 0, at the peak) | " + " | ".join(names) + " |",
        "|---|" + "--:|" * len(names),
    ]
    for role in roles:
        cells = [
            gib((r.get("by_role") or r.get("known_bytes", {})).get(role)) for r in results.values()
        ]
        lines.append(f"| {role} | " + " | ".join(cells) + " |")
    for label, fn in (
        # The graphs' private pools as a role of their own (capture/pools.py): a replay
        # allocates nothing, so what it uses is reserved there.
        ("graph pool (reserved, fsdp_memory_report)", _pool_reserved),
        ("**peak allocated (trace)**", lambda r: r.get("peak_allocated_bytes")),
        ("max_memory_allocated", lambda r: r.get("max_memory_allocated")),
        ("**peak reserved (trace)**", lambda r: _at_reserved_peak(r, "peak_reserved_bytes")),
        ("at that peak: unused in the default pool", lambda r: _unused(r, graph=False)),
        ("of which on other streams than the default", _unused_off_default_stream),
        ("at that peak: unused in graph pools", lambda r: _unused(r, graph=True)),
        ("reserved at end, all pools", lambda r: sum(r.get("reserved_by_pool", {}).values())),
        (
            "of which graph pools",
            lambda r: sum(v for k, v in r.get("reserved_by_pool", {}).items() if k != "default"),
        ),
    ):
        lines.append(f"| {label} | " + " | ".join(gib(fn(r)) for r in results.values()) + " |")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------
# The measured run (one engine per launch)
# ------------------------------------------------------------------------------------------

ENGINES = ("graph_fsdp", "fsdp2")


@dataclass(frozen=True, kw_only=True)
class MemoryJob:
    cfg: object
    """A ``TrainConfig``: ``cfg.steps`` measured steps after ``warmup``."""
    engine: str
    warmup: int
    output_dir: str
    max_entries: int = 2_000_000
    save_snapshot: bool = False
    """Also write rank 0's raw snapshot pickle (for pytorch.org/memory_viz)."""


def _graph_fsdp_run(cfg, device: torch.device, rank: int, world_size: int):
    model = build_for(cfg, device)
    shard_model(model, cfg)
    opt = make_optimizer(model.parameters(), cfg)
    graphs = make_graphs(model, cfg, optimizer=opt)
    root = collect_states(model)[0]
    root.lazy_init()  # what the first forward does first: creates the root's allocator
    tag_allocations(root.root.allocator)

    def batch(i: int, micro: int):
        return batch_for(cfg, i * cfg.grad_accum + micro, rank, device, world_size=world_size)

    if isinstance(graphs, WholeStepGraph):  # --cuda-graph-optimizer: one replay per step
        whole = graphs.capture(whole_step_microbatch(model, cfg.grad_accum))

        def whole_step(i: int) -> None:
            whole([batch(i, m) for m in range(cfg.grad_accum)])

        return model, opt, whole_step, known_graph_fsdp

    def step(i: int) -> None:
        if graphs is not None:
            graphs.before_step()
        for micro in range(cfg.grad_accum):
            model.set_requires_gradient_sync(micro == cfg.grad_accum - 1)
            x, y = batch(i, micro)
            if graphs is not None:
                graphs.forward_backward(micro, x, y, cfg.grad_accum)
            else:
                eager_forward_backward(model, x, y, cfg.grad_accum)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return model, opt, step, known_graph_fsdp


def _fsdp2_run(cfg, device: torch.device, rank: int, world_size: int):
    model, opt = fsdp2_model(cfg, world_size, device)
    step = accumulating_step(cfg, model, opt, rank, device, model.set_requires_gradient_sync)
    return model, opt, step, known_fsdp2


def _start_history(max_entries: int) -> None:
    kwargs = {"max_entries": max_entries, "stacks": "python"}
    if "clear_history" in inspect.signature(torch.cuda.memory._record_memory_history).parameters:
        kwargs["clear_history"] = True
    torch.cuda.memory._record_memory_history("all", **kwargs)


def memory_worker(rank: int, world_size: int, job: MemoryJob) -> dict | None:
    if job.engine not in ENGINES:
        raise ValueError(f"memory engine {job.engine!r}: choose one of {', '.join(ENGINES)}")
    cfg = replace(job.cfg, steps=job.warmup + job.cfg.steps)
    device = device_of(cfg)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        _start_history(job.max_entries)
    build = _graph_fsdp_run if job.engine == "graph_fsdp" else _fsdp2_run
    model, opt, step, known_fn = build(cfg, device, rank, world_size)
    for i in range(cfg.steps):
        step(i)
    known = known_fn(model, opt)
    result: dict = {"engine": job.engine, "rank": rank, "world_size": world_size}
    if job.engine == "graph_fsdp":
        result["graph_pool_bytes"] = model.fsdp_memory_report()["graph_pool_bytes"]
    if cuda:
        torch.cuda.synchronize(device)
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(None)
        result.update(attribute(snapshot, known, device.index or 0))
        result["max_memory_allocated"] = torch.cuda.max_memory_allocated(device)
        result["max_memory_reserved"] = torch.cuda.max_memory_reserved(device)
        if job.save_snapshot and rank == 0:
            os.makedirs(job.output_dir, exist_ok=True)
            with open(os.path.join(job.output_dir, f"snapshot_{job.engine}.pickle"), "wb") as f:
                pickle.dump(snapshot, f)
        if result["trace_events"] >= job.max_entries:
            result["note"] = (
                f"the allocation trace hit max_entries={job.max_entries}: its start was dropped, "
                "so the peak is approximate; raise --memory-max-entries or use fewer steps"
            )
    else:
        result["known_bytes"] = known_bytes(known)
        result["note"] = "CPU: no allocator history; known tensors' bytes only"
    peaks = torch.tensor(
        [result.get("peak_allocated_bytes", 0)], dtype=torch.float64, device=device
    )
    if world_size > 1:
        dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
    result["peak_allocated_bytes_max_over_ranks"] = int(peaks.item())
    return result if rank == 0 else None


def write_result(result: dict, label: str, output_dir: str) -> str:
    """``memory_<label>.json``, stamped with the code that produced it (provenance.py)."""
    os.makedirs(output_dir, exist_ok=True)
    path = os.path.join(output_dir, f"memory_{label}.json")
    with open(path, "w") as f:
        json.dump({"label": label, **result, "code": code_version()}, f, indent=2)
    return path


def merge(paths: list[str]) -> str:
    """Side-by-side markdown table of several ``memory_<label>.json`` files."""
    if not paths:
        return "(no memory results: every --memory run failed or was skipped)\n"
    results = {}
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        results[data.get("label", os.path.basename(path))] = data
    stamps = {
        label: stamp_line(data["code"]) if data.get("code") else "not recorded"
        for label, data in results.items()
    }
    if len(set(stamps.values())) == 1:
        text = f"Code: {next(iter(stamps.values()))}.\n\n"
    else:
        text = "Code:\n" + "".join(f"- {k}: {v}\n" for k, v in stamps.items()) + "\n"
    text += format_table(results)
    for label, data in results.items():
        if data.get("top_sites"):
            text += f"\n{label}: largest blocks at the peak that no known tensor claims\n\n"
            text += format_sites(data)
    return text


if __name__ == "__main__":  # python -m graph_fsdp.bench.memory a.json b.json ... -> table
    import sys

    print(merge(sys.argv[1:]), end="")
