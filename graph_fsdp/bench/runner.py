"""One benchmark launch: every requested row, side by side, in the same processes.

These machines are noisy, so the rows run back to back in one process group and the report
gives each as a ratio to the faster of the two unsharded single-GPU rows (eager and captured)
measured in the same launch. Each row reports its own peak memory, allocated and reserved
(bench/verdicts.py [Note: a row's own peak]); a graphed row reports its captures, replays,
eager fallbacks and communication graphs, and is failed - no time - when its graphs did not
replay as its name claims ([Note: graphed rows must replay]).
"""

from __future__ import annotations

import platform
import sys
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from statistics import median

import torch
import torch.distributed as dist

from graph_fsdp.bench.peers import (
    BenchSpec,
    Skip,
    device_of,
    run_fsdp2,
    run_fsdp2_cuda_graph,
    run_graph_fsdp,
    run_megatron_fsdp,
    run_reference,
    run_unsharded,
    run_unsharded_captured,
)
from graph_fsdp.bench.verdicts import (
    MEMORY_KEYS,
    CudaCounters,
    RowMemory,
    graph_verdict,
    memory_fields,
)
from graph_fsdp.capture.policy import capture_impl
from graph_fsdp.capture.scopes import scope_label
from graph_fsdp.models import model_flops_per_token

ROWS = (
    "graph_fsdp",
    "graph_fsdp_graphed",
    "fsdp2",
    "fsdp2_cuda_graph",
    "megatron_fsdp",
    "unsharded",
    "unsharded_captured",
    "reference",
)
"""Row kinds, in report order: graph_fsdp eager, graph_fsdp graphed (one row per scope set),
torch FSDP2, FSDP2 with fwd+bwd in one CUDA graph, Megatron-FSDP, the unsharded single-GPU
baselines (eager; fwd+bwd captured) and graph_fsdp's slower parity reference."""

DEFAULT_ROWS = tuple(r for r in ROWS if r != "reference")
"""The parity reference (grad casts, non-fused AdamW) runs only when asked for."""


@dataclass(frozen=True, kw_only=True)
class BenchJob:
    spec: BenchSpec
    rows: tuple[str, ...] = DEFAULT_ROWS
    graph_impls: tuple[str, ...] = ("none",)
    """Layerwise capture backends: one graphed row per backend and scope set."""
    scope_sets: list[list[str]] = field(default_factory=list)
    compare_comm_graphs: bool = False
    """Each layerwise row once more with its gathers and reductions eager
    (``GraphPolicy.comm_graphs`` off)."""

    @property
    def graphed(self) -> bool:
        return any(impl != "none" for impl in self.graph_impls)


@dataclass(frozen=True, kw_only=True)
class Row:
    name: str
    runner: Callable[[int, int, BenchSpec], dict | None]
    spec: BenchSpec
    world_size: int | None = None
    """GPUs the row uses (None: all ranks)."""
    skip: str | None = None
    """Known up front not to run here, and why."""
    baseline: bool = False
    """An unsharded single-GPU step: the fastest such row is the ratios' denominator."""
    graphed: bool = False
    """Its time is a graphed time: its graphs must replay ([Note: graphed rows must replay])."""


def plan_rows(job: BenchJob) -> list[Row]:
    spec, cfg = job.spec, job.spec.cfg
    eager = replace(spec, cfg=cfg.with_graphs(impl="none", scopes=()))
    rows: list[Row] = []
    if "graph_fsdp" in job.rows:
        rows.append(Row(name="graph_fsdp eager", runner=run_graph_fsdp, spec=eager))
    if "graph_fsdp_graphed" in job.rows and job.graphed:
        planned = set()
        for impl in job.graph_impls:
            for scopes in job.scope_sets or [[]]:
                row_impl = capture_impl(impl, scopes)
                name = f"graph_fsdp {row_impl} [{scope_label(scopes, cfg.graphs.optimizer)}]"
                if name in planned:
                    continue
                planned.add(name)
                graphed = replace(spec, cfg=cfg.with_graphs(impl=row_impl, scopes=scopes))
                skip = None if cfg.device == "cuda" else "CUDA graphs need a CUDA device"
                row = Row(name=name, runner=run_graph_fsdp, spec=graphed, skip=skip, graphed=True)
                rows += _overlap_twins(row) or [row]
                if job.compare_comm_graphs and "full_iteration" not in scopes:
                    eager_comm = replace(graphed, cfg=graphed.cfg.with_graphs(comm_graphs=False))
                    rows.append(
                        Row(
                            name=f"{name}, eager comm",
                            runner=run_graph_fsdp,
                            spec=eager_comm,
                            skip=skip,
                            graphed=True,
                        )
                    )
    if cfg.packing is not None:
        return packed_rows(rows, spec)
    if "fsdp2" in job.rows:
        rows.append(Row(name="torch FSDP2", runner=run_fsdp2, spec=eager))
    if "fsdp2_cuda_graph" in job.rows:
        rows.append(
            Row(
                name="torch FSDP2 + CUDA graph (fwd+bwd)",
                runner=run_fsdp2_cuda_graph,
                spec=eager,
                graphed=True,
            )
        )
    if "megatron_fsdp" in job.rows:
        rows.append(Row(name="megatron_fsdp", runner=run_megatron_fsdp, spec=eager))
    no_graphs = None if cfg.device == "cuda" else "CUDA graphs need a CUDA device"
    one_rank = (  # (row, name, runner, the Row's other fields): unsharded runs on rank 0
        ("unsharded", "unsharded eager (1 rank)", run_unsharded, {"baseline": True}),
        (
            "unsharded_captured",
            "unsharded captured (1 rank)",
            run_unsharded_captured,
            {"baseline": True, "skip": no_graphs, "graphed": True},
        ),
        (
            "reference",
            "parity reference, bf16 weights + fp32 master, unfused AdamW (1 rank)",
            run_reference,
            {},
        ),
    )
    for key, name, runner, fields in one_rank:
        if key in job.rows:
            rows.append(Row(name=name, runner=runner, spec=eager, world_size=1, **fields))
    return rows


def packed_rows(rows: list[Row], spec: BenchSpec) -> list[Row]:
    """--packed-sequences: graph_fsdp's rows on the packs (with the fused AdamW, the one-graph
    step beside every full_iteration row), then each again on the same documents padded to
    the budget, one document per row (``PackingPolicy.padded``), the fixed-shape way to graph
    variable lengths; the peers and baselines are not run."""
    packing = spec.cfg.packing
    if spec.cfg.fused_optimizer and not spec.cfg.graphs.optimizer:
        # The one-graph step beside each full_iteration row (it needs the fused AdamW).
        rows = [twin for row in rows for twin in (row, *_one_graph_twin(row))]
    padded = [
        replace(
            row,
            name=f"{row.name}, padded ({packing.max_documents} rows of {packing.budget})",
            spec=replace(
                row.spec, cfg=replace(row.spec.cfg, packing=replace(packing, padded=True))
            ),
        )
        for row in rows
    ]
    packed = [replace(row, name=f"{row.name}, packed") for row in rows]
    return packed + padded


def _overlap_twins(row: Row) -> list[Row]:
    """--cuda-graph-overlap-next-gather: a one-graph row as three, side by side -
    full_iteration with the eager (fused) optimizer, the one graph without the overlap, the
    one graph with it ([Note: the next step's gathers in the step graph]); [] for other rows."""
    graphs = row.spec.cfg.graphs
    if not (graphs.optimizer and graphs.overlap_next_gather and graphs.full_iteration):
        return []
    cfg = row.spec.cfg
    plain = cfg.with_graphs(optimizer=False, overlap_next_gather=False)
    off = cfg.with_graphs(overlap_next_gather=False)
    return [
        replace(
            row,
            name=f"graph_fsdp {graphs.impl} [{scope_label(graphs.scopes)}]",
            spec=replace(row.spec, cfg=plain),
        ),
        replace(row, spec=replace(row.spec, cfg=off)),
        replace(row, name=f"{row.name}, next gathers overlapped"),
    ]


def _one_graph_twin(row: Row) -> tuple[Row, ...]:
    cfg = row.spec.cfg
    if not cfg.graphs.full_iteration:
        return ()
    one = cfg.with_graphs(optimizer=True)
    name = f"graph_fsdp {cfg.graphs.impl} [{scope_label(cfg.graphs.scopes, True)}]"
    return (replace(row, name=name, spec=replace(row.spec, cfg=one)),)


def device_name(cfg_device: str) -> str:
    if cfg_device == "cuda":
        return torch.cuda.get_device_name(torch.cuda.current_device())
    return f"CPU ({platform.machine() or platform.processor() or 'unknown'})"


def row_result(row: Row, world_size: int, raw: dict) -> dict:
    """Times -> the numbers in the report (throughput is over the row's GPUs)."""
    cfg = row.spec.cfg
    gpus = row.world_size or world_size
    times = raw["times"]
    step_s = median(times)
    data_ranks = gpus // (cfg.tensor_parallel or 1)  # the TP ranks of one share its batches
    tokens_per_step = cfg.micro_batch_size * cfg.grad_accum * cfg.model.seq_length * data_ranks
    packed = {}
    if raw.get("document_tokens"):
        # Packed or padded documents: only document tokens count (rank 0's x the ranks).
        rows = 1 if not cfg.packing.padded else cfg.packing.max_documents
        documents = sum(raw["document_tokens"]) / len(raw["document_tokens"])
        packed["padding_fraction"] = 1 - documents * data_ranks / (tokens_per_step * rows)
        tokens_per_step = documents * data_ranks
    tokens_per_s = tokens_per_step / step_s
    return {
        **packed,
        "name": row.name,
        "status": "ok",
        "baseline": row.baseline,
        "world_size": gpus,
        "median_step_ms": step_s * 1e3,
        "min_step_ms": min(times) * 1e3,
        "tokens_per_s": tokens_per_s,
        "tflops_per_gpu": tokens_per_s * model_flops_per_token(cfg.model) / gpus / 1e12,
        "final_loss": raw["final_loss"],
        "step_times_ms": [t * 1e3 for t in times],
        **host_numbers(raw, cfg),
    }


def host_numbers(raw: dict, cfg) -> dict:
    """Median host time to issue a step, and per layer and direction where the row's
    forward and backward calls were timed apart (graph_fsdp eager and layerwise rows)."""
    out = {}
    if raw.get("host_step_times"):
        out["median_host_ms"] = median(raw["host_step_times"]) * 1e3
    per_step = cfg.grad_accum * cfg.model.num_layers
    for key, direction in (("host_forward_times", "fwd"), ("host_backward_times", "bwd")):
        if raw.get(key) and median(raw[key]) > 0:
            out[f"host_{direction}_us_per_layer"] = median(raw[key]) / per_step * 1e6
    return out


def _agree(values: list[float], device: torch.device, world_size: int) -> list[float]:
    """Element-wise max over ranks (peak memory, failure flags); keeps ranks in lockstep."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if world_size > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


@dataclass
class Measured:
    """One row as rank 0 reports it: status, reason, this rank's raw numbers, and the fields
    every row has (name, graph fields, its own peak memory)."""

    status: str
    reason: str | None
    raw: dict | None
    out: dict


def measure_row(
    rank: int,
    world_size: int,
    device: torch.device,
    counters: CudaCounters | None,
    name: str,
    call: Callable[[], dict | None],
    verdict: Callable[[dict | None], tuple[dict, str | None]],
    skips: tuple[type[BaseException], ...] = (Skip,),
) -> Measured | None:
    """Run one row on this rank (``call``) with its memory measured around it; ``skips``
    mark it skipped, any other exception failed (one failing row must not hide the others);
    ``verdict(raw)`` gives a row that ran its graph fields and why its graphs fail. The ranks agree
    on memory (max) and failures; rank 0 gets the outcome, the others None."""
    memory = RowMemory.start(counters) if counters is not None else None
    raw, status, reason = None, "ok", None
    try:
        raw = call()
    except skips as err:
        status, reason = "skipped", str(err).splitlines()[0] if str(err) else type(err).__name__
    except Exception as err:  # noqa: BLE001 - one failing row must not hide the others
        print(
            f"[rank {rank}] bench row {name!r} failed:\n{traceback.format_exc()}", file=sys.stderr
        )
        status, reason = "failed", f"{type(err).__name__}: {err}".splitlines()[0]
    memory = memory.stop(counters).values() if memory is not None else [0] * len(MEMORY_KEYS)
    graphs, graph_failure = verdict(raw) if status == "ok" else ({}, None)
    *memory, failed, graph_failed = _agree(
        [*memory, status == "failed", graph_failure is not None], device, world_size
    )
    if rank != 0:
        return None
    out = {"name": name, **graphs}
    if counters is not None:
        out.update(memory_fields(memory))
    if failed and status == "ok":
        status, reason = "failed", "failed on another rank (see its traceback)"
    elif graph_failed and status == "ok":
        status = "failed"
        reason = graph_failure or "its graphs did not replay on another rank"
    if status != "ok":
        print(f"bench: {name}: {status} ({reason})", file=sys.stderr)
    return Measured(status=status, reason=reason, raw=raw, out=out)


def _graph_check(row: Row, raw: dict | None) -> tuple[dict, str | None]:
    """A graphed row's graph fields and why it fails ([Note: graphed rows must replay]); a
    rank that did not run the row (1-GPU rows: only rank 0) has nothing to check."""
    if not row.graphed or raw is None:
        return {}, None
    return graph_verdict(
        raw.get("graphs"),
        timed_steps=row.spec.steps,
        comm_requested=row.spec.cfg.graphs.comm_graphs,
    )


@dataclass(frozen=True, kw_only=True)
class RowRun:
    """One row of a launch as :func:`run_rows` runs it."""

    name: str
    call: Callable[[], dict | None]
    """Runs the row on this rank; its raw numbers."""
    verdict: Callable[[dict | None], tuple[dict, str | None]]
    """:func:`measure_row`'s ``verdict``: the row's graph fields and why its graphs fail."""
    numbers: Callable[[Measured], dict]
    """A row that ran ok: its entry in the report, from what rank 0 measured."""
    skip: str | None = None
    """Known up front not to run here, and why."""
    skips: tuple[type[BaseException], ...] = (Skip,)
    """Exceptions that mark the row skipped rather than failed."""
    extra: dict = field(default_factory=dict)
    """Fields a skipped or failed row's entry records after the measured ones."""


def run_rows(
    rank: int, world_size: int, device: torch.device, rows: Iterable[RowRun], device_name: str
) -> dict | None:
    """Every row on this rank, one after another (:func:`measure_row`); rank 0 returns the
    report's rows - skipped, failed or measured - with the launch's device and size."""
    counters = CudaCounters(device) if device.type == "cuda" else None
    results = []
    for row in rows:
        if row.skip is not None:
            results.append({"name": row.name, "status": "skipped", "reason": row.skip, **row.extra})
            continue
        measured = measure_row(
            rank, world_size, device, counters, row.name, row.call, row.verdict, skips=row.skips
        )
        if measured is None:
            continue
        if measured.status != "ok":
            results.append(
                {**measured.out, **row.extra, "status": measured.status, "reason": measured.reason}
            )
            continue
        results.append(row.numbers(measured))
    if rank != 0:
        return None
    return {
        "rows": results,
        "device_name": device_name,
        "world_size": world_size,
        "backend": dist.get_backend() if dist.is_initialized() else None,
    }


def bench_worker(rank: int, world_size: int, job: BenchJob) -> dict | None:
    """Run every planned row on this rank; rank 0 returns the rows' results."""
    device = device_of(job.spec.cfg)
    rows = [
        RowRun(
            name=row.name,
            call=lambda row=row: row.runner(rank, world_size, row.spec),
            verdict=lambda raw, row=row: _graph_check(row, raw),
            numbers=lambda measured, row=row: _measured_row(row, world_size, measured),
            skip=row.skip,
            extra={"baseline": row.baseline},
        )
        for row in plan_rows(job)
    ]
    return run_rows(rank, world_size, device, rows, device_name(device.type))


def _measured_row(row: Row, world_size: int, measured: Measured) -> dict:
    result = {**row_result(row, world_size, measured.raw), **measured.out, "baseline": row.baseline}
    print(
        f"bench: {row.name}: median {result['median_step_ms']:.2f} ms/step, "
        f"{result['tokens_per_s']:,.0f} tokens/s",
        file=sys.stderr,
    )
    return result
