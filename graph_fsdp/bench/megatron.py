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


@dataclass(frozen=True)
class PlannedRow:
    """One row of a launch: its name, ``kind`` (``none`` for eager, a graph impl, or
    ``megatron_fsdp``), the scopes, whether the full_iteration graph holds the optimizer step
    (the one graph) and the variant (model and routing) it trains."""

    name: str
    kind: str
    scopes: tuple[str, ...] = ()
    one_graph: bool = False
    variant: str = ""


@dataclass(frozen=True, kw_only=True)
class MCoreBenchJob:
    base: object
    """The eager row's MCoreTrainConfig (``steps`` = warmup + timed)."""
    warmup: int
    """Untimed steps per row (graph capture included)."""
    rows: tuple[PlannedRow, ...]
    """The rows in report order."""
    variants: tuple[tuple[str, object], ...] = ()
    """``(label, MCoreTrainConfig)`` of each variant the rows name; none: every row trains
    ``base`` ([Note: bench variants])."""

    def config_of(self, row: PlannedRow):
        """The MCoreTrainConfig ``row`` trains."""
        base = dict(self.variants).get(row.variant, self.base)
        if row.kind == "megatron_fsdp":
            return replace(base, engine="megatron_fsdp")
        return base.with_graphs(impl=row.kind, scopes=row.scopes, optimizer=row.one_graph)


def plan_rows(
    rows: list[str], impls: list[str], scope_sets: list[list[str]], *, optimizer: bool = False
) -> tuple[PlannedRow, ...]:
    """The rows of one model: graph_fsdp eager, a graphed row per impl x scope set, and
    megatron_fsdp. ``optimizer`` (--cuda-graph-optimizer): each full_iteration row runs twice,
    with the eager optimizer and as the one graph, side by side (as graph_fsdp's own GPT's
    bench pairs them: bench/runner.py)."""
    out = []
    if "graph_fsdp" in rows:
        out.append(PlannedRow("graph_fsdp eager", "none"))
    if "graph_fsdp_graphed" in rows:
        for impl in impls:
            if impl == "none":
                continue
            for scopes in scope_sets:
                row_impl = capture_impl(impl, scopes)
                twins = (False, True) if optimizer and "full_iteration" in scopes else (False,)
                for one in twins:
                    name = f"graph_fsdp {row_impl} [{scope_label(scopes, one)}]"
                    if all(name != r.name for r in out):
                        out.append(PlannedRow(name, row_impl, tuple(scopes), one))
    if "megatron_fsdp" in rows:
        out.append(PlannedRow("megatron_fsdp eager", "megatron_fsdp"))
    return tuple(out)


# [Note: bench variants] ``--moe-router-skew B [B ...]`` and
# ``--moe-drop-padding-capacity-factor F`` run the rows of one model once per variant in the
# same launch: per skew value (0: the model's own routing, "balanced"; B: B added to expert
# 0's gating logit in every MoE layer, integrations/megatron skew_router), the model as given
# ("dropless": graph_fsdp's grouped_mm experts) and, with F, the same model with Megatron's
# experts at capacity factor F padded to capacity ("drop-padding F"), same seed and data.
# Each row is named "<variant>: <row>" and compared (time, memory, losses) with its own
# variant's eager row; :func:`ep_summary` puts the dropless rows against the drop-padding
# ones.


def variant_rows(rows: tuple[PlannedRow, ...], labels: list[str]) -> tuple[PlannedRow, ...]:
    """``rows`` once per variant label, named "<label>: <row>" ([Note: bench variants])."""
    return tuple(
        replace(row, name=f"{label}: {row.name}", variant=label) for label in labels for row in rows
    )


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
            name=row.name,
            call=lambda row=row: run(rank, world_size, job.config_of(row)),
            verdict=lambda raw, row=row: _row_verdict(row.kind, raw, job.base.steps - job.warmup),
            numbers=lambda measured, row=row: {
                **_measured_row(job, measured),
                "variant": row.variant,
            },
            skip=_skip_reason(row.kind, cuda),
            skips=(ImportError,),  # megatron_fsdp not installed
        )
        for row in job.rows
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
        "overflow_steps": raw.get("overflow_steps", 0),
    }


def with_ratios(rows: list[dict]) -> list[dict]:
    """Rows with ``step_time_vs_eager``, ``peak_memory_vs_eager`` (own allocated),
    ``peak_reserved_vs_eager`` (own reserved) and ``losses_equal_eager`` (None where the
    eager row or the value is missing)."""
    eagers = {
        r.get("variant", ""): r
        for r in rows
        if r["name"].endswith("graph_fsdp eager") and r["status"] == "ok"
    }
    out = []
    for r in rows:
        r = dict(r)
        eager = eagers.get(r.get("variant", ""))
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


DROPLESS = "dropless"
"""The variant label of the model as given when drop-padding rows sit beside it."""


def _variant_row(ok: dict, variant: str, suffix: str) -> dict | None:
    """The ok row of ``variant`` whose name ends with ``suffix``."""
    return next(
        (r for n, r in ok.items() if n.startswith(f"{variant}: ") and n.endswith(suffix)), None
    )


def _over(a: dict | None, b: dict | None, key: str) -> float | None:
    return None if a is None or b is None or not b.get(key) else a[key] / b[key]


def ep_summary(rows: list[dict]) -> list[dict]:
    """Per routing of a launch with drop-padding rows ([Note: bench variants]): the dropless
    rows against the drop-padding ``full_iteration`` row - step time and own peak reserved
    ratios - and the overflow repeats of each dropless row; None where a row did not run."""
    ok = {r["name"]: r for r in rows if r["status"] == "ok"}
    variants = list(dict.fromkeys(r.get("variant", "") for r in rows if r.get("variant")))
    out = []
    for dropless in (v for v in variants if v.split(", ")[0] == DROPLESS):
        routing = dropless.partition(", ")[2]
        padded = next((v for v in variants if v != dropless and v.endswith(f", {routing}")), None)
        if padded is None:
            continue
        eager = _variant_row(ok, dropless, "graph_fsdp eager")
        fi = _variant_row(ok, dropless, "[full_iteration]")
        one = _variant_row(ok, dropless, "[full_iteration + optimizer]")
        pad_fi = _variant_row(ok, padded, "[full_iteration]")
        step, reserved = "median_step_ms", "own_peak_reserved_bytes"
        out.append(
            {
                "routing": routing,
                "against": padded,
                "dropless full_iteration / dropless eager, step": _over(fi, eager, step),
                "dropless full_iteration / drop-padding full_iteration, step": _over(
                    fi, pad_fi, step
                ),
                "dropless one graph / drop-padding full_iteration, step": _over(one, pad_fi, step),
                "dropless full_iteration / drop-padding full_iteration, own peak reserved": _over(
                    fi, pad_fi, reserved
                ),
                "dropless one graph / drop-padding full_iteration, own peak reserved": _over(
                    one, pad_fi, reserved
                ),
                "overflow steps of the dropless rows": {
                    n.partition(": ")[2]: r.get("overflow_steps")
                    for n, r in ok.items()
                    if r.get("variant") == dropless
                },
            }
        )
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
            if same is None or r["name"].endswith("graph_fsdp eager")
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
    summary = ep_summary(report["rows"])
    if summary:
        lines += ["", "Dropless against drop-padding ([Note: bench variants]):", ""]
        for entry in summary:
            parts = [
                f"{key} {_ratio(value)}"
                for key, value in entry.items()
                if key not in ("routing", "against", "overflow steps of the dropless rows")
            ]
            repeats = ", ".join(
                f"{name} {n}" for name, n in entry["overflow steps of the dropless rows"].items()
            )
            lines.append(
                f"- {entry['routing']} (against {entry['against']}): {'; '.join(parts)}; "
                f"overflow repeats: {repeats or '-'}"
            )
    if notes:
        lines += ["", "Notes:", *notes]
    return "\n".join(lines) + "\n"


def write_report(report: dict, output_dir: str) -> dict[str, str]:
    os.makedirs(output_dir, exist_ok=True)
    paths = {ext: os.path.join(output_dir, f"results.{ext}") for ext in ("md", "json")}
    with open(paths["md"], "w") as f:
        f.write(markdown(report))
    with open(paths["json"], "w") as f:
        rows = with_ratios(report["rows"])
        json.dump({**report, "rows": rows, "ep_summary": ep_summary(report["rows"])}, f, indent=2)
    return paths
