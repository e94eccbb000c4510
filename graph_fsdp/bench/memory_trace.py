"""The allocation trace behind ``graph-fsdp profile --memory``: replaying the CUDA caching
allocator's history to the moment of the peak, attributing every live block to a role (by
address, by its allocation frame, by its stack), and the tables that show it (bench/memory.py
runs the training and calls these)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

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


@dataclass(frozen=True)
class Known:
    role: str
    ptr: int
    nbytes: int


def known_bytes(known: Iterable[Known]) -> dict[str, int]:
    """Bytes per role, each storage counted once."""
    seen, out = set(), {}
    for k in known:
        if k.ptr not in seen:
            seen.add(k.ptr)
            out[k.role] = out.get(k.role, 0) + k.nbytes
    return out


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
