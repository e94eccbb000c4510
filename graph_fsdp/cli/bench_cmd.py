"""``graph-fsdp bench``: graph_fsdp eager and graphed vs torch FSDP2 vs Megatron-FSDP.

    graph-fsdp bench --bf16 --num-layers 8 --hidden-size 2048 --num-attention-heads 16 \\
        --seq-length 2048 --micro-batch-size 2 --fsdp-double-buffer \\
        --fsdp-db-use-persist-buf-on-alloc-fail --graph-impls te torch \\
        --scopes "" --scopes "attn" --scopes full_iteration
    graph-fsdp bench --num-layers 2 --hidden-size 32 --num-attention-heads 4   # CPU, gloo

One launch runs every row back to back on the same model, seeds and shapes: graph_fsdp eager,
graph_fsdp graphed (one row per --scopes), torch FSDP2, torch FSDP2 with forward+backward in
one CUDA graph, megatron_fsdp (when importable) and two unsharded single-GPU baselines on rank 0
with the per-GPU batch (fp32 weights, bf16 autocast, fused AdamW; eager, and forward+backward
captured in one CUDA graph). Every ratio is taken against the faster of the two. ``--rows
reference`` adds graph_fsdp's slower parity reference (bf16 weights + fp32 master, unfused
AdamW). Rows that cannot run here are reported as skipped with the reason. Each row reports its own
peak memory (allocated and reserved, minus what it started with); a graphed row reports its
captures, replays, eager fallbacks and communication graphs, and one whose graphs did not
replay is FAILED with no time (graph_fsdp/bench/verdicts.py). Exit status 1 when a row failed.
Writes results.md, results.json (both stamped with the git commit) and results.png to
--output-dir.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import sys

from graph_fsdp.bench.peers import UNSHARDED_SCHEME, BenchSpec
from graph_fsdp.bench.provenance import code_version
from graph_fsdp.bench.report import gpu_tag, markdown, write_report
from graph_fsdp.bench.runner import DEFAULT_ROWS, ROWS, BenchJob, bench_worker
from graph_fsdp.capture.scopes import GRAPH_IMPLS, scope_label
from graph_fsdp.cli import mcore
from graph_fsdp.cli.errors import CLIError
from graph_fsdp.cli.graph_options import (
    add_scope_sets_arg,
    check_graph_environment,
    scope_sets_from,
)
from graph_fsdp.cli.options import add_fused_adamw_arg, add_output_dir_arg, resolve
from graph_fsdp.cli.paths import check_output_dir
from graph_fsdp.distributed import GRAPH_REGISTER_ENV
from graph_fsdp.fsdp.api import dtype_label
from graph_fsdp.training.processes import launch
from graph_fsdp.training.train import placement_label

HELP = "Benchmark graph_fsdp against torch FSDP2, Megatron-FSDP and unsharded."
"""The command's line in ``graph-fsdp --help``."""
COMMON_FLAGS = dict(iters_default=10, iters_help="Timed steps per row (after the warmup).")
"""How the shared flags (options.add_common_args) read in this command."""


def add_args(p: argparse.ArgumentParser) -> None:
    """The flags of this command alone (main.build_parser adds the shared ones first)."""
    g = p.add_argument_group("benchmark")
    add_scope_sets_arg(g)
    g.add_argument(
        "--graph-impls",
        nargs="+",
        choices=[i for i in GRAPH_IMPLS if i != "none"],
        default=None,
        metavar="IMPL",
        help="Capture backends for the layerwise graphed rows: one row per backend and "
        "--scopes set, in the same launch (default: --cuda-graph-impl). full_iteration "
        "rows run once, with torch.",
    )
    g.add_argument(
        "--compare-comm-graphs",
        action="store_true",
        help="Run every layerwise graphed row a second time with --no-cuda-graph-comm "
        "(gathers and reductions issued eagerly), in the same launch.",
    )
    g.add_argument(
        "--warmup-iters",
        type=int,
        default=3,
        help="Untimed steps per row before the timed ones (graph capture included: "
        "must exceed --cuda-graph-warmup-steps when graphs are on).",
    )
    g.add_argument(
        "--rows",
        nargs="+",
        choices=ROWS,
        default=list(DEFAULT_ROWS),
        metavar="ROW",
        help=f"Rows to run, any of: {', '.join(ROWS)} (default: all but reference).",
    )
    g.add_argument(
        "--moe-router-skew",
        nargs="+",
        type=float,
        default=None,
        metavar="B",
        help="--model mcore-moe: run every row once per value, with B added to expert 0's "
        "gating logit in every MoE layer (0: the model's own routing); a skewed load for the "
        "expert-parallel exchange, e.g. --moe-router-skew 0 4.",
    )
    g.add_argument(
        "--moe-drop-padding-capacity-factor",
        type=float,
        default=None,
        metavar="F",
        help="--model mcore-moe --moe-experts-impl grouped_mm: run the rows again, in the same "
        "launch, with Megatron's experts at capacity factor F padded to capacity (drop-padding), "
        "and summarise dropless against drop-padding.",
    )
    add_fused_adamw_arg(g, "the graph_fsdp, FSDP2 and megatron_fsdp rows")
    add_output_dir_arg(g, "results.{md,json,png}", "bench/results/<date>_<gpu-or-cpu>")
    mcore.add_megatron_model_args(p)  # --model mcore-gpt|mcore-moe: cli/mcore.py


def _setup_line(args: argparse.Namespace, job: BenchJob) -> str:
    cfg = job.spec.cfg
    m = cfg.model
    moe = (
        f"{m.num_experts} experts top-{m.moe_router_topk} every {m.moe_layer_freq} layer(s)"
        if m.num_experts
        else "dense"
    )
    graphs = (
        f"{'/'.join(job.graph_impls)} graphs, scopes "
        f"{', '.join(f'[{scope_label(s)}]' for s in job.scope_sets)}"
        if job.graphed
        else "no CUDA graphs requested"
    )
    return (
        f"Model: {m.num_layers} layers, hidden {m.hidden_size}, heads {m.num_attention_heads}, "
        f"ffn {m.ffn_hidden_size}, seq {m.seq_length}, vocab {m.vocab_size}, {moe}. "
        f"Per GPU: micro batch {cfg.micro_batch_size} x grad accumulation {cfg.grad_accum}; "
        f"{dtype_label(cfg.compute_dtype)} compute, fp32 main weights, "
        f"{reduction_label(cfg)}; strategy "
        f"{placement_label(cfg)}{embedding_label(cfg)}, allocator {cfg.buffers.allocator}, "
        f"{'fused' if cfg.fused_optimizer else 'foreach'} AdamW; {graphs}. "
        f"{job.spec.warmup} warmup + {job.spec.steps} timed steps per row, seed {m.seed}. "
        "Unsharded rows: "
        f"{UNSHARDED_SCHEME if cfg.mp.param_dtype else 'fp32 weights and compute, fused AdamW'}."
        f"{environment_label()}{packing_label(cfg)}"
    )


def packing_label(cfg) -> str:
    """--packed-sequences: what a pack is (rows and tokens/s: bench/runner.py packed_rows)."""
    p = cfg.packing
    if p is None:
        return ""
    source = (
        f"documents of {cfg.data_path}"
        if cfg.data_path
        else f"synthetic lognormal documents of mean {p.mean_document_length} tokens"
    )
    return (
        f" Packed: {source}, first-fit into rows of {p.budget} tokens with at most "
        f"{p.max_documents} documents; the padded rows hold the same documents one per row. "
        "tokens/s counts document tokens only."
    )


def environment_label() -> str:
    """NCCL settings of the whole process, so of every row, the peers' included: NCCL's
    graph buffer registration, which the commands turn off for a full_iteration graph that
    captures an all-to-all (cli/options.py: registration_off_for_all_to_alls)."""
    value = os.environ.get(GRAPH_REGISTER_ENV)
    return f" Every row (the peers' too): {GRAPH_REGISTER_ENV}={value}." if value else ""


def reduction_label(cfg) -> str:
    """How graph_fsdp's rows reduce gradients (FSDP2 and megatron_fsdp reduce in fp32)."""
    if cfg.mp.reduce_scatter_fp32_accumulation:
        return "gradients reduced as bf16 all-to-all + fp32 sums (graph_fsdp rows)"
    if cfg.mp.grad_comm_dtype is not None:
        return f"gradients reduced in {dtype_label(cfg.mp.grad_comm_dtype)} (graph_fsdp rows)"
    return "fp32 gradient reduction"


def embedding_label(cfg) -> str:
    """--vocab-parallel-embedding is graph_fsdp's rows' only (the peers gather the table)."""
    return " (graph_fsdp rows only)" if cfg.vocab_parallel_embedding else ""


TP_ROWS = ("graph_fsdp", "graph_fsdp_graphed")
"""The rows that run --tensor-model-parallel-size (the peers' and baselines' runners train the
data-parallel model only)."""


def tensor_parallel_rows(args: argparse.Namespace) -> list[str]:
    """--rows under --tensor-model-parallel-size > 1: graph_fsdp's own rows (the default), the
    others refused."""
    rows = list(args.rows)
    tp = args.tensor_model_parallel_size
    if tp <= 1:
        return rows
    if rows == list(DEFAULT_ROWS):
        return list(TP_ROWS)
    other = [r for r in rows if r not in TP_ROWS]
    if other:
        raise CLIError(
            f"--rows {' '.join(other)} with --tensor-model-parallel-size {tp}: those rows train "
            f"the data-parallel model only; choose from {', '.join(TP_ROWS)}"
        )
    return rows


def main(args: argparse.Namespace) -> int:
    if args.clip_grad:
        raise CLIError(
            f"--clip-grad {args.clip_grad}: bench times the same unclipped step in every row "
            "(the peers' rows do not clip); drop it (train and compare take it)"
        )
    if args.model != "gpt":
        return mcore.bench_main(args)
    mcore.reject_mcore_only_flags(args)
    args.rows = tensor_parallel_rows(args)
    if args.warmup_iters < 0:
        raise CLIError(f"--warmup-iters {args.warmup_iters} must be >= 0")
    scope_sets, flag = scope_sets_from(args)
    if args.graph_impls:
        if args.cuda_graph_impl not in ("none", args.graph_impls[0]):
            raise CLIError(
                f"--cuda-graph-impl {args.cuda_graph_impl} and --graph-impls "
                f"{' '.join(args.graph_impls)} disagree: give one of them"
            )
        args.cuda_graph_impl = args.graph_impls[0]
    impls = list(dict.fromkeys(args.graph_impls or [args.cuda_graph_impl]))
    if args.cuda_graph_impl != "none" and args.warmup_iters <= args.cuda_graph_warmup_steps:
        raise CLIError(
            f"--warmup-iters {args.warmup_iters} must exceed --cuda-graph-warmup-steps "
            f"{args.cuda_graph_warmup_steps}, so that the capture step is not timed"
        )
    res = resolve(
        args,
        graph_scope_sets=scope_sets,
        scope_flag=flag,
        graphs_optional=True,
        graph_steps=args.warmup_iters + args.train_iters,
    )
    if res.plan.device == "cuda":
        for impl in impls[1:]:
            check_graph_environment(impl, res.plan)
    check_output_dir("--output-dir", args.output_dir or os.path.join("bench", "results", "x"))
    cfg = dataclasses.replace(res.cfg, fused_optimizer=res.cfg.fused_optimizer or args.fused_adamw)
    job = BenchJob(
        spec=BenchSpec(cfg=cfg, warmup=args.warmup_iters, steps=args.train_iters),
        rows=tuple(args.rows),
        graph_impls=tuple(impls),
        scope_sets=scope_sets,
        compare_comm_graphs=args.compare_comm_graphs,
    )
    out = launch(res.plan, bench_worker, job)
    if out is None:
        return 0
    now = datetime.datetime.now()
    report = {
        **out,
        "created": now.isoformat(timespec="seconds"),
        "setup": _setup_line(args, job),
        "argv": getattr(args, "argv", None),
        "code": code_version(),
    }
    tag = "cpu" if res.plan.device == "cpu" else gpu_tag(out["device_name"])
    output_dir = args.output_dir or os.path.join("bench", "results", f"{now:%Y-%m-%d_%H%M%S}_{tag}")
    paths = write_report(report, output_dir)
    print(markdown(report))
    print("wrote " + ", ".join(paths.values()), file=sys.stderr)
    failed = [r["name"] for r in out["rows"] if r["status"] == "failed"]
    return 1 if failed else 0
