"""Benchmark report: a markdown table, the raw JSON and a PNG bar chart.

Every row is also given as a ratio to the *fastest* unsharded single-GPU row of the same launch
(``unsharded eager`` or ``unsharded captured``, rows marked ``baseline``): step time (row /
baseline: above 1 is slower) and tokens/s per GPU (row / baseline: below 1 is slower per
GPU). A slower single-GPU row must not flatter the sharded ones.

Host columns: ``host ms`` is the median host time to issue a step's work (up to the
closing synchronize; a row whose host ms is close to its step time is host-bound), and
``host us/layer`` divides the model's forward and backward calls' host time by the
layers (and microbatches): for layerwise graphs that is one graph launch plus the eager
FSDP work at the layer's boundary.

Memory columns: each row's own peak, allocated and reserved (bench/verdicts.py [Note: a
row's own peak]). Graph column: captures / replays / eager fallbacks and the communication
graphs of a graphed row; a graphed row whose graphs did not replay is FAILED, with no time
([Note: graphed rows must replay]). The header names the commit (provenance.py).
"""

from __future__ import annotations

import json
import os
import re

from graph_fsdp.bench.provenance import stamp_line
from graph_fsdp.bench.verdicts import graph_label

LEFTOVER_NOTE_BYTES = 64 * 2**20
"""A row that starts with this much still allocated, or with this much free space in the
segments it starts with, gets a note (bench/verdicts.py [Note: a row's own peak])."""

LEGACY_REFERENCE_PREFIX = "unsharded reference"
"""Reports written before rows carried ``baseline``: their one unsharded row."""


def _is_baseline(row: dict) -> bool:
    if "baseline" in row:
        return bool(row["baseline"])
    return row["name"].startswith(LEGACY_REFERENCE_PREFIX)


def reference_row(rows: list[dict]) -> dict | None:
    """The fastest (lowest median step time) baseline row that ran, or None."""
    ok = [r for r in rows if _is_baseline(r) and r["status"] == "ok"]
    return min(ok, key=lambda r: r["median_step_ms"], default=None)


def with_ratios(rows: list[dict]) -> list[dict]:
    """Rows with ``step_time_vs_ref`` and ``tokens_per_gpu_vs_ref`` added where computable
    (denominator: :func:`reference_row`), and ``ratio_baseline`` naming it."""
    ref = reference_row(rows)
    out = []
    for r in rows:
        r = dict(r)
        if ref is not None and r["status"] == "ok":
            r["ratio_baseline"] = ref["name"]
            r["step_time_vs_ref"] = r["median_step_ms"] / ref["median_step_ms"]
            per_gpu = r["tokens_per_s"] / r["world_size"]
            r["tokens_per_gpu_vs_ref"] = per_gpu / (ref["tokens_per_s"] / ref["world_size"])
        out.append(r)
    return out


def gpu_tag(device_name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'h100'; CPUs -> 'cpu'."""
    words = [w for w in re.split(r"[\s_-]+", device_name) if w.upper() != "NVIDIA"]
    chip = next((w for w in words if re.search(r"\d", w)), words[0] if words else "gpu")
    return re.sub(r"[^a-z0-9]+", "", chip.lower()) or "gpu"


def _fmt(value: object, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def code_line(report: dict) -> str:
    """The report's commit stamp (provenance.py), or a line saying it has none."""
    code = report.get("code")
    return f"Code: {stamp_line(code)}." if code else "Code: not recorded (an older report)."


def _gib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**30:.2f}"


def memory_notes(r: dict) -> list[str]:
    """What a row's own peaks leave out (bench/verdicts.py [Note: a row's own peak])."""
    notes = []
    start = r.get("start_allocated_bytes") or 0
    if start >= LEFTOVER_NOTE_BYTES:
        notes.append(
            f"- {r['name']}: {start / 2**30:.2f} GiB were still allocated when the row started "
            "(left by earlier rows): not counted in its own peaks"
        )
    slack = r.get("start_reserved_slack_bytes") or 0
    if slack >= LEFTOVER_NOTE_BYTES:
        notes.append(
            f"- {r['name']}: its own reserved peak may be low by about {slack / 2**30:.2f} GiB "
            "(free space in segments earlier rows' blocks still held, which it could use "
            "without reserving)"
        )
    return notes


def markdown(report: dict) -> str:
    rows = with_ratios(report["rows"])
    lines = [
        f"# graph_fsdp benchmark: {report['world_size']} x {report['device_name']} "
        f"({report.get('backend') or '?'}), {report['created']}",
        "",
        code_line(report),
        "",
        report["setup"],
        "",
        "| row | ranks | median step ms | min step ms | host ms | host us/layer fwd, bwd | "
        "tokens/s | TFLOP/s per GPU | own peak allocated GiB | own peak reserved GiB | "
        "graphs: captures/replays/fallbacks, comm | final loss | step time vs ref | "
        "tokens/s per GPU vs ref |",
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|---|--:|--:|--:|",
    ]
    notes = []
    for r in rows:
        own = _gib(r.get("own_peak_allocated_bytes")), _gib(r.get("own_peak_reserved_bytes"))
        if r["status"] != "ok":
            status = r["status"].upper() if r["status"] == "failed" else r["status"]
            lines.append(
                f"| {r['name']} | {status} |" + " |" * 6 + f" {own[0]} | {own[1]} | "
                f"{graph_label(r)} |" + " |" * 3
            )
            notes.append(f"- {r['name']}: {status}: {r['reason']}")
            continue
        notes += memory_notes(r)
        if "padding_fraction" in r:
            notes.append(
                f"- {r['name']}: tokens/s counts document tokens only; padding "
                f"{r['padding_fraction']:.1%} of the row tokens"
            )
        per_layer = "-"
        if "host_fwd_us_per_layer" in r or "host_bwd_us_per_layer" in r:
            per_layer = ", ".join(
                _fmt(r.get(f"host_{d}_us_per_layer"), ".0f") for d in ("fwd", "bwd")
            )
        lines.append(
            f"| {r['name']} | {r['world_size']} | {r['median_step_ms']:.2f} | "
            f"{r['min_step_ms']:.2f} | {_fmt(r.get('median_host_ms'), '.2f')} | {per_layer} | "
            f"{r['tokens_per_s']:,.0f} | {r['tflops_per_gpu']:.3f} | {own[0]} | {own[1]} | "
            f"{graph_label(r)} | {r['final_loss']:.5f} | "
            f"{_fmt(r.get('step_time_vs_ref'), '.2f', 'x')} | "
            f"{_fmt(r.get('tokens_per_gpu_vs_ref'), '.2f', 'x')} |"
        )
    ref = reference_row(rows)
    lines += [
        "",
        "ref: "
        + (
            f"{ref['name']}, the fastest unsharded single-GPU row of this launch"
            if ref is not None
            else "none (no unsharded row ran): no ratios"
        )
        + ". own peak allocated / reserved: max over ranks of the row's "
        "torch.cuda.max_memory_allocated / max_memory_reserved minus the bytes allocated / "
        "reserved when it started (after gc and empty_cache). A replay allocates nothing: a "
        "graphed row's pools show in reserved, not in allocated.",
        "",
        "graphs: a graphed row's captures / replays / eager fallbacks and its communication "
        "graphs; it is FAILED (no time) with 0 replays, fewer replays than timed steps, any "
        "eager fallback, or communication graphs that failed or never replayed.",
        "",
        "host ms: host time to issue a step (close to the step time = host-bound); host "
        "us/layer: host time of the forward and backward calls per layer and microbatch "
        "(layerwise graphs: a graph launch plus FSDP's eager work at the layer boundary).",
    ]
    if notes:
        lines += ["", "Notes:", *notes]
    return "\n".join(lines) + "\n"


def bar_chart(report: dict, path: str) -> None:
    """Median step time and tokens/s per GPU per row (ok rows), ratios annotated."""
    import matplotlib  # noqa: PLC0415 (optional: pip install graph-fsdp[bench])

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415 (optional dependency)

    rows = [r for r in with_ratios(report["rows"]) if r["status"] == "ok"]
    fig, axes = plt.subplots(1, 2, figsize=(13, 0.6 * max(len(rows), 1) + 1.8))
    names = [r["name"] for r in rows]
    panels = (
        ("median step time (ms)", [r["median_step_ms"] for r in rows], "step_time_vs_ref"),
        (
            "tokens/s per GPU",
            [r["tokens_per_s"] / r["world_size"] for r in rows],
            "tokens_per_gpu_vs_ref",
        ),
    )
    for ax, (title, values, ratio_key) in zip(axes, panels):
        bars = ax.barh(names, values, color="#4c72b0")
        for bar, r in zip(bars, rows):
            ratio = r.get(ratio_key)
            ax.annotate(
                f"{ratio:.2f}x" if ratio is not None else "",
                (bar.get_width(), bar.get_y() + bar.get_height() / 2),
                xytext=(3, 0),
                textcoords="offset points",
                va="center",
                fontsize=8,
            )
        ax.set_title(title)
        ax.invert_yaxis()
        ax.margins(x=0.15)
    if not rows:
        axes[0].text(0.5, 0.5, "no row ran", ha="center", va="center", transform=axes[0].transAxes)
    fig.suptitle(
        f"graph_fsdp bench: {report['world_size']} x {report['device_name']} "
        "(ratios vs the fastest unsharded 1-GPU row)",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_report(report: dict, output_dir: str) -> dict[str, str]:
    """Write results.md, results.json and results.png; return their paths."""
    os.makedirs(output_dir, exist_ok=True)
    paths = {ext: os.path.join(output_dir, f"results.{ext}") for ext in ("md", "json", "png")}
    with open(paths["md"], "w") as f:
        f.write(markdown(report))
    with open(paths["json"], "w") as f:
        json.dump({**report, "rows": with_ratios(report["rows"])}, f, indent=2)
    try:
        bar_chart(report, paths["png"])
    except ImportError as err:
        paths.pop("png")
        print(f"note: no bar chart ({err}); pip install matplotlib", flush=True)
    return paths
