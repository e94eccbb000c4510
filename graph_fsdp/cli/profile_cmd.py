"""``graph-fsdp profile``: profile a few training steps and summarise where time goes.

    graph-fsdp profile --num-layers 2 --hidden-size 32 --num-attention-heads 4 --train-iters 3
    graph-fsdp profile --bf16 --profiler nsys ...       # nsys report with NVTX ranges (CUDA)

With ``--profiler auto`` on CUDA, if ``nsys`` is on PATH (and this is not already running
under it) the command re-executes itself under
``nsys profile -t cuda,nvtx,osrt --capture-range=none`` and prints ``nsys stats``.
Otherwise the torch profiler writes one Chrome trace per rank (open in Perfetto or
chrome://tracing) and the command prints, per step, wall time, GPU busy % (CPU op busy % on
CPU), time in collectives and exposed communication (collective time not overlapped by
compute), then host time per ``graph_fsdp/<phase>/<fqn>`` range and per collective.

``--memory ENGINE`` (graph_fsdp or fsdp2) instead attributes the bytes live at the peak of
allocated CUDA memory to roles (main params, main grads, optimizer state, compute shard,
unsharded param/grad/grad-comm slots, activations, ...) and writes ``memory_<label>.json``;
see :mod:`graph_fsdp.bench.memory`. ``python -m graph_fsdp.bench.memory A.json B.json``
prints several side by side. Every file written names the git commit
(graph_fsdp/bench/provenance.py): ``memory_<label>.json``, and beside the traces
``profile_summary.json`` (the per-rank summaries).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import shutil
import subprocess
import sys
from statistics import mean

from graph_fsdp.bench.memory import ENGINES, MemoryJob, memory_worker, write_result
from graph_fsdp.bench.memory_trace import format_sites, format_table, format_unused_ranges
from graph_fsdp.bench.profiling import ProfileJob, profile_worker
from graph_fsdp.bench.provenance import code_version, stamp_line
from graph_fsdp.bench.trace import format_summary
from graph_fsdp.cli.errors import CLIError
from graph_fsdp.cli.options import add_fused_adamw_arg, add_output_dir_arg, resolve
from graph_fsdp.cli.paths import check_output_dir
from graph_fsdp.cuda_streams import NVTX_ENV
from graph_fsdp.training.processes import LaunchPlan, launch

UNDER_NSYS = "GRAPH_FSDP_UNDER_NSYS"
"""Set in the environment of the re-executed command, so it does not re-exec again."""


HELP = "Profile a few steps (nsys or torch profiler) and summarise them."
"""The command's line in ``graph-fsdp --help``."""
COMMON_FLAGS = dict(iters_default=3, iters_help="Profiled steps (after --warmup-iters).")
"""How the shared flags (options.add_common_args) read in this command."""


def add_args(p: argparse.ArgumentParser) -> None:
    """The flags of this command alone (main.build_parser adds the shared ones first)."""
    g = p.add_argument_group("profiling")
    g.add_argument(
        "--warmup-iters",
        type=int,
        default=None,
        help="Unprofiled steps first (graphed runs: include capture, so must exceed "
        "--cuda-graph-warmup-steps). Default: 1, or --cuda-graph-warmup-steps + 1 with graphs "
        "(the capture step is then the last unprofiled one).",
    )
    g.add_argument(
        "--profiler",
        choices=("auto", "torch", "nsys"),
        default="auto",
        help="auto: nsys when on PATH and on CUDA, else the torch profiler.",
    )
    add_output_dir_arg(g, "traces", "bench/profiles/<date>_<cpu-or-cuda>")
    g.add_argument(
        "--memory",
        choices=ENGINES,
        default=None,
        metavar="ENGINE",
        help="Memory breakdown instead of a time profile: run graph_fsdp (as the other flags "
        "say: allocator, graphs) or fsdp2 (torch FSDP2, same model, bf16 params, fp32 "
        "reduction) and attribute the bytes live at the allocated-memory peak to roles.",
    )
    add_fused_adamw_arg(g, "--memory's graph_fsdp and FSDP2 runs")
    g.add_argument(
        "--memory-label",
        default=None,
        metavar="NAME",
        help="--memory: the run's name in memory_<NAME>.json (default: the engine and mode).",
    )
    g.add_argument(
        "--memory-max-entries",
        type=int,
        default=2_000_000,
        metavar="N",
        help="--memory: allocator trace entries kept (older ones are dropped).",
    )
    g.add_argument(
        "--memory-snapshot",
        action="store_true",
        help="--memory: also write rank 0's raw snapshot pickle (pytorch.org/memory_viz).",
    )


def _under_nsys() -> bool:
    return os.environ.get(UNDER_NSYS) == "1"


def _choose_profiler(args: argparse.Namespace, plan: LaunchPlan) -> str:
    if _under_nsys():
        return "nvtx-only"
    nsys = shutil.which("nsys")
    if args.profiler == "nsys":
        if plan.device != "cuda":
            raise CLIError(
                "--profiler nsys traces CUDA work; on CPU use --profiler torch (or auto)"
            )
        if nsys is None:
            raise CLIError(
                "--profiler nsys: nsys is not on PATH; install Nsight Systems or use "
                "--profiler torch"
            )
        return "nsys"
    if args.profiler == "auto" and nsys is not None and plan.device == "cuda":
        return "nsys"
    return "torch"


def _reexec_under_nsys(args: argparse.Namespace, plan: LaunchPlan, output_dir: str) -> int:
    rank = os.environ.get("RANK")
    base = os.path.join(output_dir, f"nsys_rank{rank}" if rank is not None else "nsys")
    cmd = [
        shutil.which("nsys") or "nsys",
        "profile",
        "-t",
        "cuda,nvtx,osrt",
        "--capture-range=none",
        "--force-overwrite",
        "true",
        "-o",
        base,
        sys.executable,
        "-m",
        "graph_fsdp.cli.main",
        *args.argv,
        "--output-dir",
        output_dir,
    ]
    print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
    # graph_fsdp's own NVTX ranges are off unless a profiler listens: ask for them.
    rc = subprocess.call(cmd, env={**os.environ, UNDER_NSYS: "1", NVTX_ENV: "1"})
    report = base + ".nsys-rep"
    if rc == 0 and os.path.exists(report) and (rank is None or rank == "0"):
        subprocess.call(
            [
                shutil.which("nsys") or "nsys",
                "stats",
                "--report",
                "nvtx_sum",
                "--report",
                "cuda_gpu_kern_sum",
                report,
            ]
        )
        print(f"nsys report: {report}")
    return rc


def main(args: argparse.Namespace) -> int:
    if args.warmup_iters is None:
        graphed = args.cuda_graph_impl != "none"
        args.warmup_iters = args.cuda_graph_warmup_steps + 1 if graphed else 1
    if args.warmup_iters < 0:
        raise CLIError(f"--warmup-iters {args.warmup_iters} must be >= 0")
    if args.cuda_graph_impl != "none" and args.warmup_iters <= args.cuda_graph_warmup_steps:
        raise CLIError(
            f"--warmup-iters {args.warmup_iters} must exceed --cuda-graph-warmup-steps "
            f"{args.cuda_graph_warmup_steps}, so that capture is not among the profiled steps"
        )
    res = resolve(args, graph_steps=args.warmup_iters + args.train_iters)
    output_dir = args.output_dir or os.path.join(
        "bench", "profiles", f"{datetime.datetime.now():%Y-%m-%d_%H%M%S}_{res.plan.device}"
    )
    check_output_dir("--output-dir", output_dir)
    if args.memory is not None:
        return _memory(args, res, output_dir)
    profiler = _choose_profiler(args, res.plan)
    os.makedirs(output_dir, exist_ok=True)
    if profiler == "nsys":
        return _reexec_under_nsys(args, res.plan, output_dir)
    job = ProfileJob(
        cfg=res.cfg,
        warmup=args.warmup_iters,
        output_dir=output_dir,
        torch_profiler=profiler == "torch",
    )
    out = launch(res.plan, profile_worker, job)
    if out is None:
        return 0
    ranks = out["ranks"]
    print(
        f"graph-fsdp profile: {args.train_iters} steps after {args.warmup_iters} warmup on "
        f"{res.plan.describe()}; {res.cfg.strategy}, "
        f"{res.cfg.graphs.impl + ' graphs' if res.cfg.graphs.enabled else 'eager'}"
    )
    print(f"code: {stamp_line()}")
    summary_path = os.path.join(output_dir, "profile_summary.json")
    with open(summary_path, "w") as f:  # the per-rank summaries, stamped (provenance.py)
        json.dump({"argv": getattr(args, "argv", None), "code": code_version(), **out}, f)
    for r in ranks:
        if r["summary"] is None:
            print(
                f"  rank {r['rank']}: mean step {mean(r['times']) * 1e3:.2f} ms (NVTX ranges "
                "only: see the nsys report)"
            )
    first = ranks[0]
    if first["summary"] is not None:
        print(format_summary(first["summary"], title=f"rank 0 (trace: {first['trace']})"))
        for r in ranks[1:]:
            s = r["summary"]
            print(
                f"  rank {r['rank']}: mean step {s['mean_step_ms']:.2f} ms, communication "
                f"{s['comm_ms_per_step']:.2f} ms/step, exposed {s['exposed_comm_ms_per_step']:.2f} "
                f"ms/step (trace: {r['trace']})"
            )
    return 0


def _memory(args: argparse.Namespace, res, output_dir: str) -> int:
    if args.memory_max_entries < 1000:
        raise CLIError(f"--memory-max-entries {args.memory_max_entries} must be >= 1000")
    cfg = dataclasses.replace(res.cfg, fused_optimizer=res.cfg.fused_optimizer or args.fused_adamw)
    if args.memory == "fsdp2" and cfg.graphs.enabled:
        raise CLIError(
            "--memory fsdp2 runs torch FSDP2 eagerly: drop --cuda-graph-impl/--cuda-graph-scope"
        )
    graphs = cfg.graphs
    mode = f"{graphs.impl}_{'_'.join(graphs.scopes) or 'layer'}" if graphs.enabled else "eager"
    label = args.memory_label or f"{args.memory}_{mode}"
    if not label.replace("_", "").replace("-", "").isalnum():
        raise CLIError(f"--memory-label {label!r}: use letters, digits, '-' and '_' only")
    job = MemoryJob(
        cfg=cfg,
        engine=args.memory,
        warmup=args.warmup_iters,
        output_dir=output_dir,
        max_entries=args.memory_max_entries,
        save_snapshot=args.memory_snapshot,
    )
    out = launch(res.plan, memory_worker, job)
    if out is None:
        return 0
    path = write_result(out, label, output_dir)
    print(
        f"graph-fsdp profile --memory {args.memory}: {label}, {args.train_iters} steps after "
        f"{args.warmup_iters} warmup on {res.plan.describe()}"
    )
    print(f"code: {stamp_line()}")
    print(format_table({label: out}), end="")
    if out.get("top_sites"):
        print("\nLargest blocks at the peak that no known tensor claims:\n")
        print(format_sites(out), end="")
    if (out.get("reserved_peak") or {}).get("unused_ranges"):
        print("\nReserved ranges with the most unused bytes at the reserved peak:\n")
        print(format_unused_ranges(out), end="")
    if out.get("note"):
        print(f"note: {out['note']}")
    print(f"wrote {path}", file=sys.stderr)
    return 0
