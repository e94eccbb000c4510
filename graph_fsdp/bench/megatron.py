"""The benchmark of Megatron-Core GPTs: eager vs graphed per scope (``graph-fsdp bench --model
mcore-gpt|mcore-moe``; the flags are read by cli/mcore.py).

    graph-fsdp bench --model mcore-moe --moe-shared-expert-intermediate-size 512 \\
        --transformer-impl transformer_engine --bf16 --deterministic \\
        --fsdp-double-buffer --fsdp-db-use-persist-buf-on-alloc-fail --graph-impls te torch \\
        --scopes attn --scopes moe_router --scopes "attn moe_router" \\
        --scopes "moe_router moe_preprocess" --scopes "attn moe_router moe_preprocess" \\
        --warmup-iters 5 --train-iters 20

One launch trains the same model, seed and data once per row, back to back in the same
processes (:func:`graph_fsdp.integrations.megatron.train.run`): graph_fsdp eager, one graphed
row per ``--graph-impls`` x ``--scopes`` set, and megatron_fsdp eager (when importable and
asked for with ``--rows``). Each row reports the median and minimum time of its timed steps
(the ``--warmup-iters`` before them include the capture), its own peak memory, allocated and
reserved (max over ranks, minus what the row started with: graph_fsdp/bench/verdicts.py
[Note: a row's own peak]), both as ratios to the eager row, whether its per-step losses
equal eager's bit for bit (meaningful with ``--deterministic``) and, for a graphed row, its
captures, replays, eager fallbacks and communication graphs; a graphed row whose graphs did
not replay is FAILED with no time ([Note: graphed rows must replay]). Writes results.md and
results.json (stamped with the git commit) to ``--output-dir``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from statistics import median

import torch
import torch.distributed as dist

from graph_fsdp.bench.report import code_line, memory_notes
from graph_fsdp.bench.runner import Measured, RowRun, run_rows
from graph_fsdp.bench.verdicts import graph_label, graph_verdict
from graph_fsdp.capture.policy import capture_impl
from graph_fsdp.capture.scopes import scope_label
from graph_fsdp.integrations.megatron.train import run

MCORE_ROWS = ("graph_fsdp", "graph_fsdp_graphed", "megatron_fsdp")
"""The bench rows a Megatron-Core model has (the others need graph_fsdp's own GPT)."""


@dataclass(frozen=True, kw_only=True)
class MCoreBenchJob:
    base: object
    """The eager row's MCoreTrainConfig (``steps`` = warmup + timed)."""
    warmup: int
    """Untimed steps per row (graph capture included)."""
    rows: tuple[tuple[str, str, tuple[str, ...]], ...]
    """``(name, engine or graph impl, scopes)`` per row, in report order."""


def plan_rows(
    rows: list[str], impls: list[str], scope_sets: list[list[str]], *, optimizer: bool = False
) -> tuple[tuple[str, str, tuple[str, ...]], ...]:
    """``(name, kind, scopes)``: kind is ``none`` (eager), a graph impl, or ``megatron_fsdp``;
    ``optimizer``: the full_iteration rows hold the optimizer step (--cuda-graph-optimizer)."""
    out = []
    if "graph_fsdp" in rows:
        out.append(("graph_fsdp eager", "none", ()))
    if "graph_fsdp_graphed" in rows:
        for impl in impls:
            if impl == "none":
                continue
            for scopes in scope_sets:
                row_impl = capture_impl(impl, scopes)
                name = f"graph_fsdp {row_impl} [{scope_label(scopes, optimizer)}]"
                if all(name != r[0] for r in out):
                    out.append((name, row_impl, tuple(scopes)))
    if "megatron_fsdp" in rows:
        out.append(("megatron_fsdp eager", "megatron_fsdp", ()))
    return tuple(out)


def _row_config(job: MCoreBenchJob, kind: str, scopes: tuple[str, ...]):
    if kind == "megatron_fsdp":
        return replace(job.base, engine="megatron_fsdp")
    return job.base.with_graphs(impl=kind, scopes=scopes)


def _row_verdict(kind: str, raw: dict | None, timed_steps: int) -> tuple[dict, str | None]:
    """A graphed row's graph fields and why it fails (bench/verdicts.py)."""
    if kind in ("none", "megatron_fsdp") or raw is None:
        return {}, None
    # Megatron-Core rows keep make_graphs' default: communication graphs on.
    return graph_verdict(raw.get("cuda_graphs"), timed_steps=timed_steps, comm_requested=True)


def bench_worker(rank: int, world_size: int, job: MCoreBenchJob) -> dict | None:
    """Every row on this rank; rank 0 returns the rows' numbers."""
    cuda = torch.cuda.is_available() and dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    rows = [
        RowRun(
            name=name,
            call=lambda kind=kind, scopes=scopes: run(
                rank, world_size, _row_config(job, kind, scopes)
            ),
            verdict=lambda raw, kind=kind: _row_verdict(kind, raw, job.base.steps - job.warmup),
            numbers=lambda measured: _measured_row(job, measured),
            skip=_skip_reason(kind, cuda),
            skips=(ImportError,),  # megatron_fsdp not installed
        )
        for name, kind, scopes in job.rows
    ]
    return run_rows(
        rank, world_size, device, rows, torch.cuda.get_device_name(device) if cuda else "CPU"
    )


def _skip_reason(kind: str, cuda: bool) -> str | None:
    if kind == "none" or cuda:
        return None
    why = "megatron_fsdp needs" if kind == "megatron_fsdp" else "CUDA graphs need"
    return f"{why} a CUDA device"


def _measured_row(job: MCoreBenchJob, measured: Measured) -> dict:
    raw = measured.raw
    timed = raw["times"][job.warmup :]
    return {
        **measured.out,
        "status": "ok",
        "median_step_ms": median(timed) * 1e3,
        "min_step_ms": min(timed) * 1e3,
        "losses": raw["losses"],
        "final_loss": raw["losses"][-1],
        "step_times_ms": [t * 1e3 for t in timed],
    }


def with_ratios(rows: list[dict]) -> list[dict]:
    """Rows with ``step_time_vs_eager``, ``peak_memory_vs_eager`` (own allocated),
    ``peak_reserved_vs_eager`` (own reserved) and ``losses_equal_eager`` (None where the
    eager row or the value is missing)."""
    eager = next((r for r in rows if r["name"] == "graph_fsdp eager" and r["status"] == "ok"), None)
    out = []
    for r in rows:
        r = dict(r)
        if eager is not None and r["status"] == "ok":
            r["step_time_vs_eager"] = r["median_step_ms"] / eager["median_step_ms"]
            for key, ratio in (
                ("own_peak_allocated_bytes", "peak_memory_vs_eager"),
                ("own_peak_reserved_bytes", "peak_reserved_vs_eager"),
            ):
                if r.get(key) and eager.get(key):
                    r[ratio] = r[key] / eager[key]
            same = r["losses"] == eager["losses"]
            if not same:
                step = next(
                    (i for i, (a, b) in enumerate(zip(eager["losses"], r["losses"])) if a != b),
                    min(len(r["losses"]), len(eager["losses"])),
                )
                r["first_loss_difference_step"] = step
                r["max_loss_difference"] = max(
                    (abs(a - b) for a, b in zip(eager["losses"], r["losses"])), default=0.0
                )
            r["losses_equal_eager"] = same
        out.append(r)
    return out


def _gib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**30:.2f}"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def markdown(report: dict) -> str:
    lines = [
        f"# graph_fsdp bench, {report['model']}: {report['world_size']} x "
        f"{report['device_name']} ({report['backend']}), {report['created']}",
        "",
        code_line(report),
        "",
        report["setup"],
        "",
        "| row | median step ms | min step ms | own peak allocated GiB | own peak reserved GiB | "
        "graphs: captures/replays/fallbacks, comm | final loss | step time vs eager | "
        "peak allocated vs eager | peak reserved vs eager | losses == eager |",
        "|---|--:|--:|--:|--:|---|--:|--:|--:|--:|---|",
    ]
    notes = []
    for r in with_ratios(report["rows"]):
        own = _gib(r.get("own_peak_allocated_bytes")), _gib(r.get("own_peak_reserved_bytes"))
        if r["status"] != "ok":
            status = r["status"].upper() if r["status"] == "failed" else r["status"]
            lines.append(
                f"| {r['name']} | {status} | | {own[0]} | {own[1]} | {graph_label(r)} |" + " |" * 5
            )
            notes.append(f"- {r['name']}: {status}: {r['reason']}")
            continue
        notes += memory_notes(r)
        same = r.get("losses_equal_eager")
        verdict = (
            "-"
            if same is None or r["name"] == "graph_fsdp eager"
            else "bit-identical"
            if same
            else f"differs from step {r['first_loss_difference_step']} "
            f"(max abs {r['max_loss_difference']:.2e})"
        )
        lines.append(
            f"| {r['name']} | {r['median_step_ms']:.2f} | {r['min_step_ms']:.2f} | {own[0]} | "
            f"{own[1]} | {graph_label(r)} | {r['final_loss']:.5f} | "
            f"{_ratio(r.get('step_time_vs_eager'))} | {_ratio(r.get('peak_memory_vs_eager'))} | "
            f"{_ratio(r.get('peak_reserved_vs_eager'))} | {verdict} |"
        )
    lines += [
        "",
        "Step times: median / min over the timed steps (after the warmup steps, which include "
        "the capture). Own peak allocated / reserved: max over ranks of the row's "
        "torch.cuda.max_memory_allocated / max_memory_reserved minus the bytes allocated / "
        "reserved when it started (after gc and empty_cache); a replay allocates nothing, so a "
        "graphed row's pools show in reserved. graphs: captures / replays / eager fallbacks and "
        "the communication graphs; a graphed row with 0 replays, fewer replays than timed "
        "steps, an eager fallback or failed communication graphs is FAILED (no time). "
        "losses == eager: every per-step loss equal to the eager row's (bit for bit; run with "
        "--deterministic).",
    ]
    if notes:
        lines += ["", "Notes:", *notes]
    return "\n".join(lines) + "\n"


def write_report(report: dict, output_dir: str) -> dict[str, str]:
    os.makedirs(output_dir, exist_ok=True)
    paths = {ext: os.path.join(output_dir, f"results.{ext}") for ext in ("md", "json")}
    with open(paths["md"], "w") as f:
        f.write(markdown(report))
    with open(paths["json"], "w") as f:
        json.dump({**report, "rows": with_ratios(report["rows"])}, f, indent=2)
    return paths
