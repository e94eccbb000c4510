"""Summaries of a torch profiler (Kineto) Chrome trace: step time, busy time, communication.

Pure functions over the trace JSON, so they are tested with hand-written traces.

* Steps are the ``graph_fsdp/step/<i>`` ranges when present, else the spans between
  consecutive ``Optimizer.step#...`` ranges (a loop without step ranges), else the whole
  trace.
* On CUDA, busy time is the union of kernels and memcpy/memset; collectives are kernels whose
  name contains ``nccl``; compute is every other kernel.
* On CPU (gloo), busy time is the union of ``cpu_op`` events; collectives are ops and ranges
  named ``c10d::*``, ``gloo:*``, ``*all_gather*``, ``*reduce_scatter*``, ...; compute is every
  other op that neither runs inside a collective nor contains one on the same thread.
* Exposed communication is collective time not overlapped by compute:
  ``|union(collectives) - union(compute)|``; per collective launch, numbered in its step (the
  n-th collective of every measured step is one position), the mean exposed time says which
  collective leaves compute waiting, and when in the step; per kind (all-gather,
  reduce-scatter, all-reduce, all-to-all, other), the time the step spent in collectives of
  that kind and the part of it not under compute, so a change that moves one kind (the next
  step's gathers under the optimizer step) shows in its own row.
* On CUDA each step also says how long after its start the GPU's first operation began (the
  host's work before the step's first launch).
"""

from __future__ import annotations

import bisect
import re
from collections import defaultdict

from graph_fsdp.cuda_streams import STEP_RANGE_PREFIX

Interval = tuple[float, float]

COLLECTIVE = re.compile(
    r"nccl|c10d::|gloo:|all_?gather|reduce_?scatter|all_?reduce|all_?to_?all|broadcast|"
    r"record_param_comms",
    re.IGNORECASE,
)
KINDS = (
    ("all-gather", re.compile(r"all_?gather", re.IGNORECASE)),
    ("reduce-scatter", re.compile(r"reduce_?scatter", re.IGNORECASE)),
    ("all-reduce", re.compile(r"all_?reduce", re.IGNORECASE)),
    ("all-to-all", re.compile(r"all_?to_?all|send_?recv", re.IGNORECASE)),
)
"""A collective's kind by its kernel or op name (NCCL's ``ncclDevKernel_AllGather_...``, gloo's
``c10d::allgather_``); anything else is ``other``."""
GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
RANGE_PREFIX = "graph_fsdp/"
OPTIMIZER_STEP = "Optimizer.step#"


# --------------------------------------------------------------------------------------------
# Interval math (all inputs/outputs in the trace's microseconds)
# --------------------------------------------------------------------------------------------


def merge(intervals: list[Interval]) -> list[Interval]:
    """Union of intervals as sorted, disjoint intervals."""
    out: list[list[float]] = []
    for lo, hi in sorted(intervals):
        if hi <= lo:
            continue
        if out and lo <= out[-1][1]:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return [(lo, hi) for lo, hi in out]


def total(merged: list[Interval]) -> float:
    return sum(hi - lo for lo, hi in merged)


def clip(merged: list[Interval], lo: float, hi: float) -> list[Interval]:
    """The parts of ``merged`` inside [lo, hi]."""
    return [(max(a, lo), min(b, hi)) for a, b in merged if b > lo and a < hi]


def subtract(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """``a - b`` for merged (sorted, disjoint) interval lists."""
    out, j = [], 0
    for lo, hi in a:
        while j < len(b) and b[j][1] <= lo:
            j += 1
        cur, k = lo, j
        while k < len(b) and b[k][0] < hi:
            if b[k][0] > cur:
                out.append((cur, b[k][0]))
            cur = max(cur, b[k][1])
            k += 1
        if cur < hi:
            out.append((cur, hi))
    return out


def _overlaps(merged: list[Interval], lo: float, hi: float) -> bool:
    i = bisect.bisect_left(merged, (hi,))  # first interval starting at or after hi
    return i > 0 and merged[i - 1][1] > lo


# --------------------------------------------------------------------------------------------
# Trace summary
# --------------------------------------------------------------------------------------------


def _complete_events(trace: dict) -> list[dict]:
    return [
        e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e and "ts" in e
    ]


def _span(e: dict) -> Interval:
    ts = float(e["ts"])
    return ts, ts + float(e["dur"])


def _step_windows(events: list[dict]) -> list[tuple[str, float, float]]:
    ann = [e for e in events if e.get("cat") == "user_annotation"]
    steps = sorted(
        (_span(e)[0], _span(e)[1], e["name"])
        for e in ann
        if e["name"].startswith(STEP_RANGE_PREFIX)
    )
    if steps:
        return [(name, lo, hi) for lo, hi, name in steps]
    starts = [_span(e)[0] for e in events]
    if not starts:
        return []
    opt_ends = sorted(_span(e)[1] for e in ann if e["name"].startswith(OPTIMIZER_STEP))
    if opt_ends:
        bounds = [min(starts), *opt_ends]
        return [(f"step {i}", bounds[i], bounds[i + 1]) for i in range(len(opt_ends))]
    return [("trace", min(starts), max(_span(e)[1] for e in events))]


def _cpu_compute(events: list[dict], comm: list[dict]) -> list[Interval]:
    comm_by_thread: dict[object, list[Interval]] = defaultdict(list)
    for e in comm:
        comm_by_thread[(e.get("pid"), e.get("tid"))].append(_span(e))
    merged = {k: merge(v) for k, v in comm_by_thread.items()}
    out = []
    for e in events:
        if e.get("cat") != "cpu_op" or COLLECTIVE.search(e["name"]):
            continue
        lo, hi = _span(e)
        # On one thread ops nest: overlapping a collective means inside it or around it.
        if not _overlaps(merged.get((e.get("pid"), e.get("tid")), []), lo, hi):
            out.append((lo, hi))
    return out


def _exposed_by_position(
    comm: list[dict], exposed_u: list[Interval], windows: list[tuple[str, float, float]]
) -> list[dict]:
    """The n-th collective of each step (n = its position): its name, mean start after the
    step's start, mean duration and mean time not under compute (its part of ``exposed_u``,
    the collectives' time not under compute); most exposed first."""
    seen: dict[int, list[tuple[str, float, float, float]]] = defaultdict(list)
    for _, lo, hi in windows:
        launches = sorted((_span(e), e["name"]) for e in comm if lo <= _span(e)[0] < hi)
        for n, ((a, b), name) in enumerate(launches):
            seen[n].append((name, a - lo, b - a, total(clip(exposed_u, a, b))))
    rows = [
        {
            "position": n,
            "name": obs[0][0],
            "steps": len(obs),
            "at_ms": sum(o[1] for o in obs) / len(obs) / 1e3,
            "duration_us": sum(o[2] for o in obs) / len(obs),
            "exposed_us": sum(o[3] for o in obs) / len(obs),
        }
        for n, obs in seen.items()
    ]
    return sorted(rows, key=lambda r: (-r["exposed_us"], r["position"]))


def collective_kind(name: str) -> str:
    """all-gather, reduce-scatter, all-reduce, all-to-all or other (:data:`KINDS`)."""
    return next((kind for kind, pattern in KINDS if pattern.search(name)), "other")


def _exposed_by_kind(
    comm: list[dict], compute_u: list[Interval], windows: list[tuple[str, float, float]]
) -> list[dict]:
    """Per collective kind, the mean per measured step of: launches, time in collectives of
    the kind (their union) and its part not under compute. Kinds running at once (an
    all-gather beside a reduce-scatter) each count the time they share."""
    n = max(len(windows), 1)
    by_kind: dict[str, list[dict]] = defaultdict(list)
    for e in comm:
        by_kind[collective_kind(e["name"])].append(e)
    rows = []
    for kind, events in by_kind.items():
        union = merge([_span(e) for e in events])
        exposed = subtract(union, compute_u)
        calls = comm_us = exposed_us = 0.0
        for _, lo, hi in windows:
            calls += sum(1 for e in events if lo <= _span(e)[0] < hi)
            comm_us += total(clip(union, lo, hi))
            exposed_us += total(clip(exposed, lo, hi))
        rows.append(
            {
                "kind": kind,
                "calls_per_step": calls / n,
                "comm_ms_per_step": comm_us / n / 1e3,
                "exposed_ms_per_step": exposed_us / n / 1e3,
            }
        )
    return sorted(rows, key=lambda r: (-r["exposed_ms_per_step"], r["kind"]))


def summarize_trace(trace: dict, *, skip_steps: int = 0) -> dict:
    """Per-step wall/busy/communication numbers, host ranges and collectives of a trace."""
    events = _complete_events(trace)
    gpu_events = [e for e in events if e.get("cat") in GPU_CATEGORIES]
    on_gpu = any(e.get("cat") == "kernel" for e in gpu_events)
    if on_gpu:
        kernels = [e for e in gpu_events if e.get("cat") == "kernel"]
        comm = [e for e in kernels if "nccl" in e["name"].lower()]
        compute = [_span(e) for e in kernels if "nccl" not in e["name"].lower()]
        busy = merge([_span(e) for e in gpu_events])
    else:
        comm = [
            e
            for e in events
            if e.get("cat") in ("cpu_op", "user_annotation") and COLLECTIVE.search(e["name"])
        ]
        compute = _cpu_compute(events, comm)
        busy = merge([_span(e) for e in events if e.get("cat") == "cpu_op"])
    comm_u, compute_u = merge([_span(e) for e in comm]), merge(compute)
    exposed_u = subtract(comm_u, compute_u)
    windows = _step_windows(events)
    steps = []
    for name, lo, hi in windows:
        wall = hi - lo
        inside = clip(busy, lo, hi)
        step = {
            "name": name,
            "wall_ms": wall / 1e3,
            "busy_pct": 100.0 * total(inside) / wall if wall > 0 else 0.0,
            "comm_ms": total(clip(comm_u, lo, hi)) / 1e3,
            "exposed_comm_ms": total(clip(exposed_u, lo, hi)) / 1e3,
        }
        if on_gpu:
            step["first_gpu_op_ms"] = (inside[0][0] - lo) / 1e3 if inside else None
        steps.append(step)
    measured = steps[skip_steps:] or steps
    n = max(len(measured), 1)
    # Ranges and collectives are counted from the first measured step on.
    start = (windows[skip_steps:] or windows)[0][1] if windows else float("-inf")
    ranges: dict[str, list[float]] = defaultdict(list)
    for e in events:
        name = e["name"]
        if (
            e.get("cat") == "user_annotation"
            and name.startswith(RANGE_PREFIX)
            and not name.startswith(STEP_RANGE_PREFIX)
            and _span(e)[0] >= start
        ):
            ranges[name].append(float(e["dur"]))
    collectives: dict[str, list[float]] = defaultdict(list)
    for e in comm:
        if _span(e)[0] >= start:
            collectives[e["name"]].append(float(e["dur"]))
    comm_ms = sum(s["comm_ms"] for s in measured)
    exposed_ms = sum(s["exposed_comm_ms"] for s in measured)
    starts = [s["first_gpu_op_ms"] for s in measured if s.get("first_gpu_op_ms") is not None]
    return {
        "device": "cuda" if on_gpu else "cpu",
        "steps": steps,
        "skipped_steps": len(steps) - len(measured),
        "mean_step_ms": sum(s["wall_ms"] for s in measured) / n,
        "mean_busy_pct": sum(s["busy_pct"] for s in measured) / n,
        "comm_ms_per_step": comm_ms / n,
        "exposed_comm_ms_per_step": exposed_ms / n,
        "exposed_comm_pct": 100.0 * exposed_ms / comm_ms if comm_ms > 0 else 0.0,
        "mean_first_gpu_op_ms": sum(starts) / len(starts) if starts else None,
        "exposed_by_position": _exposed_by_position(
            comm, exposed_u, windows[skip_steps:] or windows
        ),
        "exposed_by_kind": _exposed_by_kind(comm, compute_u, windows[skip_steps:] or windows),
        "ranges": sorted(
            (
                {
                    "name": k,
                    "calls": len(v),
                    "total_ms": sum(v) / 1e3,
                    "ms_per_step": sum(v) / 1e3 / n,
                }
                for k, v in ranges.items()
            ),
            key=lambda r: -r["total_ms"],
        ),
        "collectives": sorted(
            (
                {"name": k, "calls": len(v), "total_ms": sum(v) / 1e3}
                for k, v in collectives.items()
            ),
            key=lambda r: -r["total_ms"],
        ),
    }


def format_summary(summary: dict, *, title: str, max_rows: int = 15) -> str:
    busy = "GPU busy %" if summary["device"] == "cuda" else "CPU op busy %"
    lines = [title, f"  {'step':<24}{'wall ms':>10}{busy:>15}{'comm ms':>10}{'exposed ms':>12}"]
    for i, s in enumerate(summary["steps"]):
        mark = " (warmup, excluded)" if i < summary["skipped_steps"] else ""
        lines.append(
            f"  {s['name']:<24}{s['wall_ms']:>10.2f}{s['busy_pct']:>15.1f}"
            f"{s['comm_ms']:>10.2f}{s['exposed_comm_ms']:>12.2f}{mark}"
        )
    lines.append(
        f"  mean step {summary['mean_step_ms']:.2f} ms, {busy} {summary['mean_busy_pct']:.1f}; "
        f"communication {summary['comm_ms_per_step']:.2f} ms/step of which "
        f"{summary['exposed_comm_ms_per_step']:.2f} ms ({summary['exposed_comm_pct']:.0f}%) "
        "exposed (not overlapped by compute)"
    )
    if summary.get("mean_first_gpu_op_ms") is not None:
        lines.append(
            f"  the GPU's first operation of a step began {summary['mean_first_gpu_op_ms']:.3f} ms "
            "after the step's start (mean)"
        )
    kinds = summary.get("exposed_by_kind", [])
    if kinds:
        lines.append(
            f"  {'collectives by kind, per step':<48}{'calls':>7}{'comm ms':>10}{'exposed ms':>12}"
        )
        for r in kinds:
            lines.append(
                f"  {r['kind']:<48}{r['calls_per_step']:>7.1f}{r['comm_ms_per_step']:>10.3f}"
                f"{r['exposed_ms_per_step']:>12.3f}"
            )
    exposed = [r for r in summary.get("exposed_by_position", []) if r["exposed_us"] > 0]
    if exposed:
        lines.append(
            f"  {'most exposed collectives (n-th of its step)':<48}{'at ms':>8}{'us':>9}"
            f"{'exposed us':>12}"
        )
        for r in exposed[:5]:
            label = f"#{r['position']} {r['name']}"[:47]
            lines.append(
                f"  {label:<48}{r['at_ms']:>8.3f}{r['duration_us']:>9.1f}{r['exposed_us']:>12.1f}"
            )
    if summary["ranges"]:
        lines.append(
            f"  {'host ranges graph_fsdp/<phase>/<fqn>':<48}{'calls':>7}{'total ms':>10}"
            f"{'ms/step':>9}"
        )
        for r in summary["ranges"][:max_rows]:
            lines.append(
                f"  {r['name']:<48}{r['calls']:>7}{r['total_ms']:>10.2f}{r['ms_per_step']:>9.2f}"
            )
    if summary["collectives"]:
        lines.append(f"  {'collectives':<48}{'calls':>7}{'total ms':>10}")
        for r in summary["collectives"][:max_rows]:
            lines.append(f"  {r['name']:<48}{r['calls']:>7}{r['total_ms']:>10.2f}")
    return "\n".join(lines)
