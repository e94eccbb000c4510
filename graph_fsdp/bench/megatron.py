"""The benchmark of Megatron-Core GPTs: eager vs graphed per scope (``graph-fsdp bench --model
mcore-gpt|mcore-moe``; the flags are read by cli/mcore.py).

    graph-fsdp bench --model mcore-moe --moe-shared-expert-intermediate-size 512 \\
        --transformer-impl transformer_engine --bf16 --deterministic \\
        --fsdp-double-buffer --fsdp-db-use-persist-buf-on-alloc-fail --graph-impls te torch \\
        --scopes attn --scopes moe_router --scopes "attn moe_router" \\
        --scopes "moe_router moe_preprocess" --scopes "attn moe_router moe_preprocess" \\
        --warmup-iters 5 --train-iters 20

One launch trains the same model, seed and data once per row, back to back in the same
processes (:func:`graph_fsdp.integrations.megatron_train.run`): graph_fsdp eager, one graphed
row per ``--graph-impls`` x ``--scopes`` set, and megatron_fsdp eager (when importable and
asked for with ``--rows``). Each row reports the median and minimum time of its timed steps
(the ``--warmup-iters`` before them include the capture), its peak memory (max over ranks of
``max_memory_allocated`` / ``max_memory_reserved`` during the row), both as ratios to the
eager row, and whether its per-step losses equal eager's bit for bit (meaningful with
``--deterministic``). Writes results.md and results.json to ``--output-dir``.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import traceback
from dataclasses import dataclass, replace
from statistics import median

import torch
import torch.distributed as dist

from graph_fsdp.integrations.megatron_train import run

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
    rows: list[str], impls: list[str], scope_sets: list[list[str]]
) -> tuple[tuple[str, str, tuple[str, ...]], ...]:
    """``(name, kind, scopes)``: kind is ``none`` (eager), a graph impl, or ``megatron_fsdp``."""
    out = []
    if "graph_fsdp" in rows:
        out.append(("graph_fsdp eager", "none", ()))
    if "graph_fsdp_graphed" in rows:
        for impl in impls:
            if impl == "none":
                continue
            for scopes in scope_sets:
                row_impl = "torch" if "full_iteration" in scopes else impl
                name = f"graph_fsdp {row_impl} [{' '.join(scopes) or 'layer'}]"
                if all(name != r[0] for r in out):
                    out.append((name, row_impl, tuple(scopes)))
    if "megatron_fsdp" in rows:
        out.append(("megatron_fsdp eager", "megatron_fsdp", ()))
    return tuple(out)


def _row_config(job: MCoreBenchJob, kind: str, scopes: tuple[str, ...]):
    if kind == "megatron_fsdp":
        return replace(job.base, engine="megatron_fsdp")
    return replace(job.base, cuda_graph_impl=kind, cuda_graph_scope=list(scopes))


def bench_worker(rank: int, world_size: int, job: MCoreBenchJob) -> dict | None:
    """Every row on this rank; rank 0 returns the rows' numbers."""
    cuda = torch.cuda.is_available() and dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    results = []
    for name, kind, scopes in job.rows:
        if kind != "none" and not cuda:
            why = "megatron_fsdp needs" if kind == "megatron_fsdp" else "CUDA graphs need"
            results.append({"name": name, "status": "skipped", "reason": f"{why} a CUDA device"})
            continue
        status, reason, raw = "ok", None, None
        # What earlier rows of this process left allocated (their peak would include it).
        start = torch.cuda.memory_allocated(device) if cuda else 0
        try:
            raw = run(rank, world_size, _row_config(job, kind, scopes))
        except ImportError as err:  # megatron_fsdp not installed
            status, reason = "skipped", str(err).splitlines()[0]
        except Exception as err:  # noqa: BLE001 - one failing row must not hide the others
            status, reason = "failed", f"{type(err).__name__}: {err}".splitlines()[0]
            print(f"[rank {rank}] row {name!r} failed:\n{traceback.format_exc()}", file=sys.stderr)
        peak = torch.cuda.max_memory_allocated(device) if cuda else 0
        reserved = torch.cuda.max_memory_reserved(device) if cuda else 0
        flags = torch.tensor(
            [peak, reserved, status == "failed", start], dtype=torch.float64, device=device
        )
        if world_size > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)  # keeps the ranks in lockstep too
        gc.collect()
        if rank != 0:
            continue
        if status == "ok" and flags[2].item():
            status, reason = "failed", "failed on another rank (see its traceback)"
        if status != "ok":
            results.append({"name": name, "status": status, "reason": reason})
            continue
        timed = raw["times"][job.warmup :]
        results.append(
            {
                "name": name,
                "status": "ok",
                "median_step_ms": median(timed) * 1e3,
                "min_step_ms": min(timed) * 1e3,
                "peak_memory_bytes": int(flags[0].item()) if cuda else None,
                "peak_reserved_bytes": int(flags[1].item()) if cuda else None,
                "start_allocated_bytes": int(flags[3].item()) if cuda else None,
                "losses": raw["losses"],
                "final_loss": raw["losses"][-1],
                "step_times_ms": [t * 1e3 for t in timed],
            }
        )
    if rank != 0:
        return None
    return {
        "rows": results,
        "device_name": torch.cuda.get_device_name(device) if cuda else "CPU",
        "world_size": world_size,
        "backend": dist.get_backend(),
    }


def with_ratios(rows: list[dict]) -> list[dict]:
    """Rows with ``step_time_vs_eager``, ``peak_memory_vs_eager`` and ``losses_equal_eager``
    (None where the eager row or the value is missing)."""
    eager = next((r for r in rows if r["name"] == "graph_fsdp eager" and r["status"] == "ok"), None)
    out = []
    for r in rows:
        r = dict(r)
        if eager is not None and r["status"] == "ok":
            r["step_time_vs_eager"] = r["median_step_ms"] / eager["median_step_ms"]
            if r.get("peak_memory_bytes") and eager.get("peak_memory_bytes"):
                r["peak_memory_vs_eager"] = own_peak(r) / own_peak(eager)
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


def own_peak(row: dict) -> int:
    """The row's peak minus what earlier rows of the process left allocated at its start."""
    return row["peak_memory_bytes"] - (row.get("start_allocated_bytes") or 0)


def _gib(value: int | None) -> str:
    return "-" if not value else f"{value / 2**30:.2f}"


def markdown(report: dict) -> str:
    lines = [
        f"# graph_fsdp bench, {report['model']}: {report['world_size']} x "
        f"{report['device_name']} ({report['backend']}), {report['created']}",
        "",
        report["setup"],
        "",
        "| row | median step ms | min step ms | peak mem GiB (own) | peak reserved GiB | final loss | "
        "step time vs eager | peak mem vs eager | losses == eager |",
        "|---|--:|--:|--:|--:|--:|--:|--:|---|",
    ]
    notes = []
    for r in with_ratios(report["rows"]):
        if r["status"] != "ok":
            lines.append(f"| {r['name']} | {r['status']} |" + " |" * 7)
            notes.append(f"- {r['name']}: {r['status']}: {r['reason']}")
            continue
        same = r.get("losses_equal_eager")
        verdict = (
            "-"
            if same is None or r["name"] == "graph_fsdp eager"
            else "bit-identical"
            if same
            else f"differs from step {r['first_loss_difference_step']} "
            f"(max abs {r['max_loss_difference']:.2e})"
        )
        ratio = r.get("step_time_vs_eager")
        mem = r.get("peak_memory_vs_eager")
        lines.append(
            f"| {r['name']} | {r['median_step_ms']:.2f} | {r['min_step_ms']:.2f} | "
            f"{_gib(own_peak(r) if r['peak_memory_bytes'] else None)} | "
            f"{_gib(r['peak_reserved_bytes'])} | "
            f"{r['final_loss']:.5f} | {'-' if ratio is None else f'{ratio:.2f}x'} | "
            f"{'-' if mem is None else f'{mem:.2f}x'} | {verdict} |"
        )
    lines += [
        "",
        "Step times: median / min over the timed steps (after the warmup steps, which include "
        "the capture). Peak memory: max over ranks of torch.cuda.max_memory_allocated during "
        "the row minus what earlier rows left allocated at its start (own), and "
        "max_memory_reserved (graph pools show in reserved). losses == eager: "
        "every per-step loss equal to the eager row's (bit for bit; run with --deterministic).",
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
