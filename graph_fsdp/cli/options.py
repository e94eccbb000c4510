"""Shared flags (Megatron-LM spellings), their validation and the TrainConfig they build.

Every check here runs before a process group or a CUDA context exists and raises
:class:`CLIError` with a message that names the flag to change. Configuration mistakes are
reported before environment ones (no CUDA, missing TransformerEngine), so a CPU-only CI can
exercise the rules through the CLI - except the static-buffer flags that graphs need: a
machine that cannot run graphs is told so before it is asked for buffer flags (CPU tests call
:func:`check_graph_buffers` directly).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
from dataclasses import dataclass
from typing import get_args

from graph_fsdp.capture.policy import GraphPolicy, capture_impl
from graph_fsdp.capture.scopes import (
    GRAPH_IMPLS,
    MOE_SCOPES,
    SCOPES,
    GraphConfigError,
    check_static_buffers,
    parse_scope_modules,
)
from graph_fsdp.capture.scopes import check_scopes as check_scope_rules
from graph_fsdp.cli.errors import CLIError
from graph_fsdp.cli.launch import resolve_plan
from graph_fsdp.cli.packing_options import add_packing_args, packing_of
from graph_fsdp.distributed import GRAPH_REGISTER_ENV
from graph_fsdp.fsdp.api import STRATEGIES, AllocatorKind, BufferPolicy
from graph_fsdp.models import GPTConfig
from graph_fsdp.models.tp_plans import check_gpt_plan
from graph_fsdp.training.processes import LaunchPlan
from graph_fsdp.training.train import TrainConfig

TRANSFORMER_IMPLS = ("local", "transformer_engine")
"""Megatron's --transformer-impl: the reference torch layers or TransformerEngine layers."""
OUTER_STRATEGIES = ("no_shard", "optim")
"""Megatron-FSDP's --outer-dp-sharding-strategy (HSDP across distributed-optimizer instances)."""
BUFFER_ALLOCATORS = get_args(AllocatorKind)
"""--fsdp-buffer: BufferPolicy's allocators (dynamic, double_buffer, trace_pool)."""


# --------------------------------------------------------------------------------------------
# Flags
# --------------------------------------------------------------------------------------------


def add_model_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=4, help="Transformer layers.")
    g.add_argument("--hidden-size", type=int, default=256, help="Model width (residual size).")
    g.add_argument(
        "--num-attention-heads",
        type=int,
        default=4,
        help="Attention heads; must divide --hidden-size.",
    )
    g.add_argument(
        "--ffn-hidden-size",
        type=int,
        default=None,
        help="MLP/expert inner size (default: 4 x --hidden-size).",
    )
    g.add_argument("--seq-length", type=int, default=128, help="Tokens per sequence.")
    g.add_argument("--vocab-size", type=int, default=1024, help="Vocabulary size.")
    g.add_argument(
        "--num-experts",
        type=int,
        default=None,
        help="Experts per MoE layer (>= 2); unset builds a dense model.",
    )
    g.add_argument(
        "--moe-router-topk", type=int, default=2, help="Experts each token is routed to."
    )
    g.add_argument(
        "--moe-layer-freq",
        type=int,
        default=1,
        help="Layer i is MoE when i %% freq == 0 (1: every layer; 2: alternate).",
    )
    g.add_argument(
        "--moe-expert-capacity-factor",
        type=float,
        default=None,
        metavar="FACTOR",
        help="MoE: each expert takes ceil(tokens x topk / experts x FACTOR) token copies, the "
        "rest are dropped (> 0). Megatron-Core models: unset = dropless (Megatron's default); "
        "graph_fsdp's GPT always has a capacity (default 1.0).",
    )
    g.add_argument(
        "--moe-pad-expert-input-to-capacity",
        action="store_true",
        help="MoE drop-padding: pad every expert's input to its capacity (static expert "
        "shapes, so Megatron-Core's experts capture whole); needs "
        "--moe-expert-capacity-factor. graph_fsdp's GPT always pads.",
    )
    g.add_argument(
        "--moe-dropless",
        action="store_true",
        help="graph_fsdp's GPT: dropless routing (no capacity; grouped GEMMs over device-side "
        "counts; under --expert-model-parallel-size fixed-size exchanges that CUDA graphs "
        "hold). Megatron-Core models are dropless when --moe-expert-capacity-factor is unset.",
    )
    g.add_argument(
        "--moe-receive-buffer-factor",
        type=float,
        default=None,
        metavar="FACTOR",
        help="--moe-dropless with expert parallelism: rows an EP rank receives from one peer, "
        "as a multiple of the balanced load (default: every copy, never drops; a smaller "
        "factor that overflows stops the run naming the layers).",
    )
    g.add_argument(
        "--expert-model-parallel-size",
        type=int,
        default=1,
        metavar="N",
        help="MoE expert parallelism: the experts are partitioned over groups of N consecutive "
        "ranks and sharded over the expert-data-parallel group (world / N ranks); the other "
        "parameters over every rank. N must divide the number of ranks and --num-experts.",
    )
    g.add_argument(
        "--transformer-impl",
        choices=TRANSFORMER_IMPLS,
        default="local",
        help="local: the reference torch layers; transformer_engine: TransformerEngine "
        "TransformerLayer layers (dense models only; CUDA and TransformerEngine needed).",
    )
    g.add_argument(
        "--seed",
        type=int,
        default=1234,
        help="Seed of the weights and the synthetic data (same seed, same run).",
    )


def add_training_args(
    parser: argparse.ArgumentParser,
    *,
    iters_default: int,
    iters_help: str,
    deterministic_default: bool = False,
) -> None:
    g = parser.add_argument_group("training")
    g.add_argument(
        "--micro-batch-size", type=int, default=2, help="Sequences per rank per microbatch."
    )
    g.add_argument(
        "--global-batch-size",
        type=int,
        default=None,
        help="Sequences per optimizer step over all ranks; gradient accumulation = "
        "global / (micro x data-parallel size). Default: micro x data-parallel size.",
    )
    g.add_argument("--train-iters", type=int, default=iters_default, help=iters_help)
    g.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate.")
    g.add_argument("--weight-decay", type=float, default=0.01, help="AdamW weight decay.")
    g.add_argument(
        "--clip-grad",
        type=float,
        default=0.0,
        help="Clip the gradients to this global L2 norm before each optimizer step (over "
        "every rank's shards: graph_fsdp.clip_grad_norm_); 0: off. Megatron's default is 1.0.",
    )
    g.add_argument(
        "--bf16",
        action="store_true",
        help="bf16 compute weights with fp32 main weights and gradients.",
    )
    g.add_argument(
        "--recompute-activations",
        action="store_true",
        help="Activation checkpointing of every transformer layer.",
    )
    if deterministic_default:
        g.add_argument(
            "--deterministic",
            action="store_true",
            default=True,
            help="torch.use_deterministic_algorithms(True), CUBLAS_WORKSPACE_CONFIG=:4096:8 and "
            "NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 in every run. On by default here: without it "
            "flash-attention backward is nondeterministic, so not even eager is reproducible.",
        )
        g.add_argument(
            "--no-deterministic",
            dest="deterministic",
            action="store_false",
            help="Turn the default --deterministic off: nondeterministic algorithms allowed "
            "(faster; even two eager runs may then differ by rounding).",
        )
    else:
        g.add_argument(
            "--deterministic",
            action="store_true",
            help="torch.use_deterministic_algorithms(True), CUBLAS_WORKSPACE_CONFIG=:4096:8 and "
            "NVTE_ALLOW_NONDETERMINISTIC_ALGO=0: bit-reproducible runs (slower).",
        )
    g.add_argument(
        "--eval-interval",
        type=int,
        default=0,
        help="Run a forward-only eval pass every N steps (0: never).",
    )


def add_fsdp_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("FSDP")
    g.add_argument(
        "--data-parallel-sharding-strategy",
        choices=STRATEGIES,
        default="optim_grads_params",
        help="no_shard (DDP), optim (ZeRO-1), optim_grads (ZeRO-2), optim_grads_params (ZeRO-3).",
    )
    g.add_argument(
        "--num-distributed-optimizer-instances",
        type=int,
        default=1,
        metavar="N",
        help="HSDP: N replicas (e.g. the number of nodes) of a 2-D (replicate N, shard "
        "world/N) mesh; parameters, gradients and the optimizer are sharded within an instance "
        "(--data-parallel-sharding-strategy) and gradients all-reduced across instances. "
        "1 (default): plain 1-D FSDP over every rank.",
    )
    g.add_argument(
        "--outer-dp-sharding-strategy",
        choices=OUTER_STRATEGIES,
        default="no_shard",
        help="HSDP, across the instances: no_shard replicates the optimizer; optim shards it "
        "across the instances too (HFSDP: gradients reduce-scattered, not all-reduced, across "
        "instances). Needs --num-distributed-optimizer-instances > 1.",
    )
    g.add_argument(
        "--tensor-model-parallel-size",
        type=int,
        default=1,
        metavar="N",
        help="Tensor parallelism over groups of N consecutive ranks (dense models), each TP "
        "rank's pieces sharded over the data-parallel group (world / N ranks). graph_fsdp's "
        "GPT: torch DTensor TP (parallelize_gpt); Megatron-Core: Megatron's TP. N must divide "
        "the ranks, the heads and the MLP size (and the vocabulary for Megatron-Core).",
    )
    g.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="With --tensor-model-parallel-size > 1: the activations between the TP blocks "
        "split over the sequence (N must divide --seq-length).",
    )
    g.add_argument(
        "--vocab-parallel-embedding",
        action="store_true",
        help="The input embedding's rows split over the ranks and never gathered: token ids "
        "and activations cross the ranks instead of the vocab x hidden table and its fp32 "
        "gradient (the first all-gather and the last reduce-scatter of a ZeRO-3 step). "
        "--vocab-size must be a multiple of the ranks; not with HSDP or tensor parallelism; "
        "graph_fsdp's GPT only.",
    )
    g.add_argument(
        "--fsdp-buffer",
        choices=BUFFER_ALLOCATORS,
        default=None,
        help="Where the unsharded weights and gradients live (BufferPolicy.allocator): "
        "dynamic - the caching allocator (lowest memory; addresses change, so eager only); "
        "double_buffer - persistent slots that units of one size alternate; trace_pool - "
        "slots planned from one traced step. The last two keep static addresses, as CUDA "
        "graphs need. Default: dynamic.",
    )
    g.add_argument(
        "--fsdp-double-buffer",
        action="store_true",
        help="Megatron's spelling of --fsdp-buffer double_buffer.",
    )
    g.add_argument(
        "--fsdp-db-use-persist-buf-on-alloc-fail",
        action="store_true",
        help="A buffer request no planned slot can serve gets a persistent dedicated "
        "buffer instead of an error (never the dynamic allocator).",
    )
    g.add_argument(
        "--grad-comm-dtype",
        choices=("fp32", "bf16"),
        default="fp32",
        help="Dtype gradients are reduce-scattered/all-reduced in.",
    )
    g.add_argument(
        "--ddp-reduce-scatter-with-fp32-accumulation",
        action="store_true",
        help="Megatron's reduce-scatter with fp32 accumulation: the bf16 gradients go over the "
        "wire through an all-to-all (half the bytes of the fp32 reduce-scatter) and each rank "
        "sums its shard's pieces in fp32 (bit-identical to the default on 2 ranks). Needs "
        "--bf16 and a strategy that shards gradients; not with HSDP or --grad-comm-dtype bf16.",
    )


def add_graph_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("CUDA graphs")
    g.add_argument(
        "--cuda-graph-impl",
        choices=(*GRAPH_IMPLS, *MEGATRON_IMPLS),
        default="none",
        help="none: eager; te: TransformerEngine make_graphed_callables; "
        "torch: pure-PyTorch capture. CUDA only. Megatron-Core 0.19's spellings work too: "
        "transformer_engine (te), local (torch), full_iteration (torch with "
        "--cuda-graph-scope full_iteration).",
    )
    g.add_argument(
        "--cuda-graph-modules",
        nargs="*",
        default=None,
        metavar="MODULE",
        help="Megatron-Core 0.19's spelling of the per-layer scopes: any of "
        f"{', '.join(s for s in SCOPES if s != 'full_iteration')}; none, or full: the whole "
        "layer. Instead of --cuda-graph-scope, not with it.",
    )
    g.add_argument(
        "--cuda-graph-scope",
        nargs="*",
        default=None,
        metavar="SCOPE",
        help=f"What to capture: any of {', '.join(SCOPES)}. No scope (or the flag "
        "with no value): the whole layer. moe_preprocess requires moe_router; "
        "full_iteration stands alone (forward+backward of the whole model in one graph per "
        "microbatch, FSDP collectives inside; torch impl, static buffers).",
    )
    g.add_argument(
        "--cuda-graph-optimizer",
        "--optimizer-cuda-graph",
        dest="cuda_graph_optimizer",
        action="store_true",
        help="With --cuda-graph-scope full_iteration: the whole training step in one graph - "
        "every microbatch, the reductions, --clip-grad by the global norm, the fused AdamW "
        "step with an Inf/NaN skip decided on the device, the zeroing: one replay per step "
        "(Megatron's --optimizer-cuda-graph spelling works too). The learning rate lives on "
        "the device; eager rows of bench/compare run the same step without graphs.",
    )
    g.add_argument(
        "--cuda-graph-warmup-steps",
        type=int,
        default=2,
        help="Eager training steps before capture.",
    )
    g.add_argument(
        "--cuda-graph-comm",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Layerwise graphs: replay each FSDP unit's gather (cast + all-gather) and "
        "reduction (cast + reduce-scatter + scaling) as CUDA graphs of their own, captured "
        "on first use; the layers' graphs stay collective-free. --no-cuda-graph-comm: "
        "issue them eagerly.",
    )
    g.add_argument(
        "--cuda-graph-scope-modules",
        nargs="+",
        default=None,
        metavar="SCOPE=PATH[,PATH]",
        help="Which submodules (paths relative to each FSDP unit) a scope captures, replacing "
        "that scope's presets or defining a new scope, e.g. attn=self_attn "
        "mlp=mlp,feed_forward.",
    )


MEGATRON_IMPLS = {"transformer_engine": "te", "local": "torch", "full_iteration": "torch"}
"""Megatron-Core 0.19's ``cuda_graph_impl`` values -> ours (Megatron's ``local`` is its own
per-layer capture in PyTorch; here the torch backend captures those layers)."""


def apply_megatron_graph_spellings(args: argparse.Namespace) -> None:
    """Map Megatron-Core 0.19's ``--cuda-graph-impl {transformer_engine,local,full_iteration}``
    and ``--cuda-graph-modules`` onto ``--cuda-graph-impl``/``--cuda-graph-scope`` in place;
    a contradiction between the two spellings is a CLIError naming both flags."""
    impl = getattr(args, "cuda_graph_impl", None)
    modules = getattr(args, "cuda_graph_modules", None)
    if impl is None:
        return
    if modules is not None:
        if args.cuda_graph_scope is not None:
            raise CLIError(
                f"--cuda-graph-modules {' '.join(modules)} and --cuda-graph-scope "
                f"{' '.join(args.cuda_graph_scope)} both name what to capture: give one of them"
            )
        if "full_iteration" in modules:
            raise CLIError(
                "--cuda-graph-modules full_iteration: Megatron-Core spells the whole-iteration "
                "graph --cuda-graph-impl full_iteration (or use --cuda-graph-scope full_iteration)"
            )
        own = {
            item.split("=", 1)[0] for item in getattr(args, "cuda_graph_scope_modules", None) or []
        }
        known = [s for s in SCOPES if s != "full_iteration"] + sorted(own)
        unknown = [] if modules == ["full"] else [m for m in modules if m not in known]
        if unknown:
            raise CLIError(
                f"--cuda-graph-modules {' '.join(unknown)}: not a module Megatron-Core or "
                f"graph_fsdp captures per layer; use any of {', '.join(known)} (full, or no "
                "value: the whole layer)"
            )
        args.cuda_graph_scope = [] if modules in ([], ["full"]) else list(modules)
    if impl == "full_iteration":
        scope = args.cuda_graph_scope
        if scope not in (None, ["full_iteration"]):
            flag = "--cuda-graph-modules" if modules is not None else "--cuda-graph-scope"
            raise CLIError(
                f"--cuda-graph-impl full_iteration captures the whole iteration, so "
                f"{flag} {' '.join(modules if modules is not None else scope) or '(empty)'} "
                "has no place beside it: drop it, or use --cuda-graph-impl te|torch for "
                "per-layer graphs"
            )
        args.cuda_graph_scope = ["full_iteration"]
    args.cuda_graph_impl = MEGATRON_IMPLS.get(impl, impl)


def add_fused_adamw_arg(group, rows: str) -> None:
    """``--fused-adamw`` (default on): AdamW(fused=True) in ``rows``."""
    group.add_argument(
        "--fused-adamw",
        action=argparse.BooleanOptionalAction,
        default=True,
        help=f"AdamW(fused=True) in {rows}, as in the unsharded baselines, which always use it "
        "(a ratio compares the same optimizer). --no-fused-adamw: torch's default foreach step "
        "(several passes over the shard and one fp32 temporary the size of it).",
    )


def add_launch_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("launch")
    g.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="auto: cuda when available, else cpu (gloo).",
    )
    g.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="Local ranks to spawn when not under torchrun (default: every GPU, or "
        "2 gloo processes on CPU). Ignored under torchrun.",
    )
    g.add_argument(
        "--verbose",
        action="store_true",
        help="Show the spawned ranks' output and tracebacks on screen (default: a failing "
        "rank is reported in one line naming the log file that holds them).",
    )
    g.add_argument(
        "--distributed-timeout-minutes",
        type=float,
        default=None,
        metavar="MIN",
        help="How long a collective waits for a silent rank before the run ends, naming the "
        "rank (Megatron's spelling; fractions allowed). Default: 1 minute (or "
        "GRAPH_FSDP_PG_TIMEOUT_S seconds).",
    )


def add_common_args(
    parser: argparse.ArgumentParser,
    *,
    iters_default: int,
    iters_help: str,
    deterministic_default: bool = False,
) -> None:
    add_model_args(parser)
    add_training_args(
        parser,
        iters_default=iters_default,
        iters_help=iters_help,
        deterministic_default=deterministic_default,
    )
    add_packing_args(parser)
    add_fsdp_args(parser)
    add_graph_args(parser)
    add_launch_args(parser)


# --------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------


def _flag(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def check_divides_ranks(flag: str, value: int, world_size: int, why: str) -> None:
    """``flag value`` must divide the number of ranks (``why``: what the quotient is)."""
    if world_size % value:
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise CLIError(
            f"{flag} {value} does not divide the {world_size} ranks (the {why}); use one of "
            f"{', '.join(map(str, divisors))}"
        )


def check_tensor_parallel_flags(args: argparse.Namespace, world_size: int) -> int:
    """--tensor-model-parallel-size / --sequence-parallel against the ranks and the other
    parallelisms (every model family); returns the data-parallel size (ranks / TP)."""
    tp = args.tensor_model_parallel_size
    if tp < 1:
        raise CLIError(f"--tensor-model-parallel-size {tp} must be >= 1 (1: no tensor parallelism)")
    if args.sequence_parallel and tp == 1:
        raise CLIError(
            "--sequence-parallel splits the sequence over the tensor-parallel group, but "
            "--tensor-model-parallel-size is 1: add --tensor-model-parallel-size N (N > 1) or "
            "drop --sequence-parallel"
        )
    check_divides_ranks(
        "--tensor-model-parallel-size", tp, world_size, "data-parallel size is ranks / TP"
    )
    if tp > 1:
        for flag, value in (
            ("--num-distributed-optimizer-instances", args.num_distributed_optimizer_instances),
            ("--expert-model-parallel-size", args.expert_model_parallel_size),
        ):
            if value != 1:
                raise CLIError(
                    f"--tensor-model-parallel-size {tp} with {flag} {value}: a 3-D mesh (TP with "
                    "HSDP or with expert parallelism) is not wired on the command line; drop one "
                    "of them (HSDP + TP: the library API, docs/tensor_parallel.md)"
                )
    return world_size // tp


def check_vocab_parallel(args: argparse.Namespace, model: GPTConfig, world_size: int) -> None:
    """--vocab-parallel-embedding against the ranks and the other parallelisms (the refusals
    of train.shard_model and VocabParallelEmbedding, said with the flags' names)."""
    if not args.vocab_parallel_embedding:
        return
    for flag, value, plain in (
        ("--num-distributed-optimizer-instances", args.num_distributed_optimizer_instances, 1),
        ("--tensor-model-parallel-size", args.tensor_model_parallel_size, 1),
    ):
        if value != plain:
            raise CLIError(
                f"--vocab-parallel-embedding with {flag} {value}: the embedding's rows are split "
                "over every rank, which that setting splits otherwise; drop one of them"
            )
    if model.vocab_size % world_size:
        raise CLIError(
            f"--vocab-parallel-embedding: --vocab-size {model.vocab_size} is not a multiple of "
            f"the {world_size} ranks; pad the vocabulary to a multiple of {world_size}"
        )


def check_moe_flags(args: argparse.Namespace, num_experts: int | None, world_size: int) -> None:
    """The MoE flags every model family shares (Megatron's spellings): the capacity, drop-
    padding and expert parallelism against the experts and the number of ranks."""
    factor, pad = args.moe_expert_capacity_factor, args.moe_pad_expert_input_to_capacity
    ep = args.expert_model_parallel_size
    given = [
        flag
        for flag, value in (
            ("--moe-expert-capacity-factor", factor is not None),
            ("--moe-pad-expert-input-to-capacity", pad),
            ("--expert-model-parallel-size", ep != 1),
            ("--moe-dropless", getattr(args, "moe_dropless", False)),
        )
        if value
    ]
    if given and num_experts is None:
        raise CLIError(
            f"{', '.join(given)} need(s) an MoE model, but this model is dense: add "
            "--num-experts N (N >= 2) or drop them"
        )
    if factor is not None and not factor > 0:  # NaN fails too
        raise CLIError(
            f"--moe-expert-capacity-factor {factor} must be > 0 (e.g. 1.0: each expert takes "
            "its fair share of the tokens); leave it unset for dropless Megatron-Core MoE"
        )
    if pad and factor is None:
        raise CLIError(
            "--moe-pad-expert-input-to-capacity pads each expert's input to its capacity, which "
            "--moe-expert-capacity-factor sets: add --moe-expert-capacity-factor 1.0 (or drop "
            "the pad flag)"
        )
    check_dropless_flags(args, factor)
    if ep < 1:
        raise CLIError(f"--expert-model-parallel-size {ep} must be >= 1 (1: no expert parallelism)")
    check_divides_ranks(
        "--expert-model-parallel-size", ep, world_size, "expert-data-parallel size is ranks / EP"
    )
    if num_experts is not None and num_experts % ep:
        raise CLIError(
            f"--expert-model-parallel-size {ep} does not divide --num-experts {num_experts}: "
            "each EP rank holds num_experts / EP experts; use an EP that divides it"
        )


def check_dropless_flags(args: argparse.Namespace, capacity_factor: float | None) -> None:
    """--moe-dropless (graph_fsdp's GPT) against the capacity flags and its buffer factor."""
    dropless = getattr(args, "moe_dropless", False)
    buffer = getattr(args, "moe_receive_buffer_factor", None)
    if dropless and capacity_factor is not None:
        raise CLIError(
            f"--moe-dropless and --moe-expert-capacity-factor {capacity_factor}: a dropless "
            "layer has no capacity; drop one of them"
        )
    if buffer is not None and not dropless:
        raise CLIError(
            f"--moe-receive-buffer-factor {buffer} sizes the dropless exchange: add "
            "--moe-dropless (or drop the factor)"
        )


def model_config(args: argparse.Namespace) -> GPTConfig:
    """The GPTConfig of the flags; its errors are re-worded to name the flags."""
    if args.num_attention_heads and args.hidden_size % args.num_attention_heads != 0:
        divisors = [d for d in range(1, args.hidden_size + 1) if args.hidden_size % d == 0]
        nearest = min(divisors, key=lambda d: abs(d - args.num_attention_heads)) if divisors else 1
        raise CLIError(
            f"--num-attention-heads {args.num_attention_heads} does not divide --hidden-size "
            f"{args.hidden_size}; use a head count that divides it (e.g. {nearest})"
        )
    if args.transformer_impl == "transformer_engine" and args.num_experts is not None:
        raise CLIError(
            "--transformer-impl transformer_engine builds dense TransformerEngine layers, but "
            f"--num-experts {args.num_experts} asks for an MoE model: drop --num-experts, or use "
            "--transformer-impl local for MoE models"
        )
    try:
        return GPTConfig(
            num_layers=args.num_layers,
            hidden_size=args.hidden_size,
            num_attention_heads=args.num_attention_heads,
            ffn_hidden_size=args.ffn_hidden_size,
            seq_length=args.seq_length,
            vocab_size=args.vocab_size,
            num_experts=args.num_experts,
            moe_router_topk=args.moe_router_topk,
            moe_layer_freq=args.moe_layer_freq,
            **(
                {"moe_capacity_factor": args.moe_expert_capacity_factor}
                if args.moe_expert_capacity_factor is not None
                else {}
            ),
            moe_dropless=args.moe_dropless,
            moe_receive_buffer_factor=args.moe_receive_buffer_factor,
            seed=args.seed,
            transformer_impl=args.transformer_impl,
        )
    except ValueError as err:
        raise CLIError(re.sub(r"GPTConfig\.(\w+)", lambda m: _flag(m.group(1)), str(err))) from err


def grad_accumulation(args: argparse.Namespace, world_size: int) -> int:
    """Microbatches per step from --global-batch-size (1 when it is not given)."""
    mbs = args.micro_batch_size
    if mbs < 1:
        raise CLIError(f"--micro-batch-size {mbs} must be >= 1")
    if args.global_batch_size is None:
        return 1
    per_step = mbs * world_size
    gbs = args.global_batch_size
    if gbs < 1 or gbs % per_step != 0:
        lower = max(per_step, gbs // per_step * per_step)
        raise CLIError(
            f"--global-batch-size {gbs} is not divisible by --micro-batch-size {mbs} x "
            f"data-parallel size {world_size} = {per_step}; use a multiple of {per_step} "
            f"(e.g. {lower} or {lower + per_step})"
        )
    return gbs // per_step


def hsdp_mesh(args: argparse.Namespace, world_size: int) -> tuple[tuple[int, int] | None, bool]:
    """(mesh_shape, optim_over_replicas) of the HSDP flags; (None, False) for 1-D FSDP."""
    n = args.num_distributed_optimizer_instances
    outer = args.outer_dp_sharding_strategy
    if n < 1:
        raise CLIError(f"--num-distributed-optimizer-instances {n} must be >= 1 (1: plain FSDP)")
    if world_size % n != 0:
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise CLIError(
            f"--num-distributed-optimizer-instances {n} does not divide the data-parallel size "
            f"{world_size} (each instance shards over world / N ranks); use one of "
            f"{', '.join(map(str, divisors))}"
        )
    if outer == "optim" and n == 1:
        raise CLIError(
            "--outer-dp-sharding-strategy optim shards the optimizer across distributed-"
            "optimizer instances, but --num-distributed-optimizer-instances is 1 (replicate size "
            "1: there are no replicas, this is plain FSDP): add "
            "--num-distributed-optimizer-instances N with N > 1 (e.g. the number of nodes), or "
            "drop --outer-dp-sharding-strategy"
        )
    if outer == "optim" and args.data_parallel_sharding_strategy == "no_shard":
        raise CLIError(
            "--outer-dp-sharding-strategy optim shards the optimizer across instances, but "
            "--data-parallel-sharding-strategy no_shard does not shard it within one: use optim, "
            "optim_grads or optim_grads_params"
        )
    if n == 1:
        return None, False
    return (n, world_size // n), outer == "optim"


def parse_scope_set(text: str) -> list[str]:
    """``"attn moe_router"`` or ``"attn,moe_router"`` -> list; ``""`` -> [] (whole layer)."""
    return [s for s in re.split(r"[,\s]+", text.strip()) if s]


def add_scope_sets_arg(group) -> None:
    group.add_argument(
        "--scopes",
        action="append",
        default=None,
        metavar="SCOPES",
        help="One graphed run per occurrence: scopes separated by spaces or "
        'commas, "" for the whole layer; repeat for several runs, e.g. '
        '--scopes "" --scopes "attn moe_router". Default: '
        "--cuda-graph-scope, else the whole layer.",
    )


def scope_sets_from(args: argparse.Namespace) -> tuple[list[list[str]], str]:
    """The graphed runs' scope sets (``--scopes``, repeatable) and the flag they came from."""
    if args.scopes is not None and args.cuda_graph_scope is not None:
        raise CLIError("give the scope sets with --scopes only (drop --cuda-graph-scope)")
    if args.scopes is not None:
        return [parse_scope_set(s) for s in args.scopes], "--scopes"
    if args.cuda_graph_scope is not None:
        return [list(args.cuda_graph_scope)], "--cuda-graph-scope"
    return ([[]] if args.cuda_graph_impl != "none" else []), "--scopes"


def scope_modules_of(args: argparse.Namespace) -> dict[str, list[str]]:
    """``--cuda-graph-scope-modules attn=self_attn ...`` as ``{"attn": ["self_attn"]}``."""
    items = getattr(args, "cuda_graph_scope_modules", None) or []
    try:
        return {k: list(v) for k, v in parse_scope_modules(items).items()}
    except GraphConfigError as err:
        raise CLIError(str(err)) from err


def check_scopes(
    scopes: list[str],
    model: GPTConfig,
    *,
    flag: str,
    scope_modules: dict[str, list[str]] | None = None,
) -> list[str]:
    """Reject unknown, repeated or conflicting scopes and scopes the model does not have.

    The model-independent rules are the engine's (:func:`graph_fsdp.capture.scopes.check_scopes`,
    same messages); the checks against the model's shape are the CLI's, made before any model
    exists (not for scopes --cuda-graph-scope-modules maps: the model tells at capture).
    """
    try:
        check_scope_rules(scopes, flag=flag, scope_modules=scope_modules)
    except GraphConfigError as err:
        raise CLIError(str(err)) from err
    mapped = set(scope_modules or ())
    scopes = [s for s in scopes if s not in mapped]
    moe_wanted = [s for s in scopes if s in MOE_SCOPES]
    if moe_wanted and model.num_experts is None:
        raise CLIError(
            f"{flag} {' '.join(moe_wanted)} needs an MoE model, but this model is dense: add "
            f"--num-experts N (N >= 2) or drop {' '.join(moe_wanted)}"
        )
    if "mlp" in scopes and all(model.is_moe_layer(i) for i in range(model.num_layers)):
        raise CLIError(
            f"{flag} mlp: every layer is MoE (--num-experts {model.num_experts} with "
            f"--moe-layer-freq {model.moe_layer_freq}), so there is no dense MLP to capture; use "
            "moe or moe_router, or raise --moe-layer-freq so that some layers are dense"
        )
    return list(scopes)


def allocator_of(args: argparse.Namespace) -> str:
    """BufferPolicy.allocator of --fsdp-buffer and its Megatron alias --fsdp-double-buffer."""
    allocator = args.fsdp_buffer
    if args.fsdp_double_buffer:
        if allocator not in (None, "double_buffer"):
            raise CLIError(
                f"--fsdp-double-buffer and --fsdp-buffer {allocator} name two allocators for the "
                "same buffers (--fsdp-double-buffer is --fsdp-buffer double_buffer): pass one "
                "of them"
            )
        allocator = "double_buffer"
    allocator = allocator or "dynamic"
    if args.fsdp_db_use_persist_buf_on_alloc_fail and allocator == "dynamic":
        raise CLIError(
            "--fsdp-db-use-persist-buf-on-alloc-fail has no effect with the dynamic allocator: "
            "add --fsdp-double-buffer (or --fsdp-buffer trace_pool)"
        )
    return allocator


def graph_policy(
    args: argparse.Namespace,
    impl: str,
    scopes: list[str],
    scope_modules: dict[str, list[str]] | None = None,
) -> GraphPolicy:
    """The GraphPolicy of one graphed run of the flags (its own rules raise as CLIError),
    with the optimizer the command builds checked against it."""
    try:
        policy = GraphPolicy(
            impl=impl,
            scopes=tuple(scopes),
            warmup_steps=args.cuda_graph_warmup_steps,
            comm_graphs=getattr(args, "cuda_graph_comm", True),
            scope_modules=scope_modules or {},
            # train's --cuda-graph-verify, for the rules only (train_options.verify_option
            # gives the run its value)
            verify=bool(getattr(args, "cuda_graph_verify", None)),
            optimizer=args.cuda_graph_optimizer,
        )
        policy.check_optimizer(
            fused=getattr(args, "fused_adamw", True),  # train/compare: fused with the flag
            offload_fraction=(
                args.optimizer_offload_fraction
                if getattr(args, "optimizer_cpu_offload", False)
                else 0.0
            ),
        )
    except GraphConfigError as err:
        raise CLIError(str(err)) from err
    return policy


def check_whole_step_flag(args: argparse.Namespace, impl: str) -> None:
    """--cuda-graph-optimizer extends a full_iteration graph: refused without graphs."""
    if args.cuda_graph_optimizer and impl == "none":
        raise CLIError(
            "--cuda-graph-optimizer puts the optimizer step inside the full_iteration graph, "
            "but --cuda-graph-impl is none: add --cuda-graph-impl torch --cuda-graph-scope "
            "full_iteration"
        )


def buffer_policy_of(args: argparse.Namespace) -> BufferPolicy:
    """The BufferPolicy of --fsdp-buffer / --fsdp-double-buffer and the persist flag."""
    return BufferPolicy(
        allocator=allocator_of(args),
        persist_on_alloc_fail=args.fsdp_db_use_persist_buf_on_alloc_fail,
    )


def check_graph_buffers(args: argparse.Namespace, scopes: list[str], *, flag: str) -> None:
    """Graphs replay fixed addresses: FSDP's buffers must never move.

    The rule (and its message) is the engine's :func:`graph_fsdp.capture.scopes.
    check_static_buffers` (GraphPolicy.check_buffers), applied to the BufferPolicy the flags
    build.
    """
    try:
        check_static_buffers(buffer_policy_of(args), scopes, flag=flag)
    except GraphConfigError as err:
        raise CLIError(str(err)) from err


def check_graph_environment(
    impl: str, plan: LaunchPlan, cpu_hint: str = "use --cuda-graph-impl none on CPU"
) -> None:
    """Environment checks last: everything else about the flags is already valid."""
    if impl == "none":
        return
    if plan.device != "cuda":
        raise CLIError(
            f"--cuda-graph-impl {impl} needs a CUDA device, but this run is on {plan.device} "
            f"(no CUDA available, or --device cpu); {cpu_hint}"
        )
    if impl == "te" and importlib.util.find_spec("transformer_engine") is None:
        raise CLIError(
            "--cuda-graph-impl te needs TransformerEngine >= 2.19, which is not importable: "
            "install graph-fsdp[te] or use --cuda-graph-impl torch"
        )


def check_transformer_environment(impl: str, plan: LaunchPlan) -> None:
    """--transformer-impl transformer_engine needs CUDA and an importable TransformerEngine."""
    if impl != "transformer_engine":
        return
    if plan.device != "cuda":
        raise CLIError(
            f"--transformer-impl transformer_engine needs a CUDA device, but this run is on "
            f"{plan.device} (no CUDA available, or --device cpu); use --transformer-impl local"
        )
    if importlib.util.find_spec("transformer_engine") is None:
        raise CLIError(
            "--transformer-impl transformer_engine needs TransformerEngine, which is not "
            "importable: install graph-fsdp[te] or use --transformer-impl local"
        )


def check_positive(args: argparse.Namespace, *names: str) -> None:
    for name in names:
        value = getattr(args, name)
        if value is not None and value < 1:
            raise CLIError(f"{_flag(name)} {value} must be >= 1")


def check_optimizer_args(args: argparse.Namespace) -> None:
    """AdamW's hyper-parameters (and --clip-grad): refused here, not by every rank's optimizer
    after the ranks started."""
    for name, example in (("lr", "1e-3"), ("weight_decay", "0.01")):
        value = getattr(args, name)
        if not (value >= 0 and value != float("inf")):  # NaN fails both
            raise CLIError(f"{_flag(name)} {value} must be a finite number >= 0 (e.g. {example})")
    check_clip_grad(args)


def check_clip_grad(args: argparse.Namespace) -> None:
    value = args.clip_grad
    if not (value >= 0 and value != float("inf")):  # NaN fails both
        raise CLIError(
            f"--clip-grad {value} must be a finite norm >= 0 (e.g. 1.0, Megatron's default; "
            "0 turns clipping off)"
        )


# --------------------------------------------------------------------------------------------
# Resolution
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Resolved:
    """Validated flags: the launch plan and the base TrainConfig every run starts from."""

    plan: LaunchPlan
    cfg: TrainConfig

    @property
    def tokens_per_step(self) -> int:
        """Tokens of one optimizer step over all ranks."""
        c = self.cfg
        return c.micro_batch_size * c.grad_accum * c.model.seq_length * self.data_parallel_size

    @property
    def data_parallel_size(self) -> int:
        """Ranks that read different batches (the TP ranks of one read the same)."""
        return self.plan.world_size // (self.cfg.tensor_parallel or 1)


def check_fp32_accumulation(args: argparse.Namespace, mesh_shape) -> bool:
    """--ddp-reduce-scatter-with-fp32-accumulation and the flags it needs."""
    if not args.ddp_reduce_scatter_with_fp32_accumulation:
        return False
    flag = "--ddp-reduce-scatter-with-fp32-accumulation"
    if not args.bf16:
        raise CLIError(
            f"{flag} sends bf16 gradients and sums them in fp32, but without --bf16 the "
            "gradients are fp32 already: add --bf16 or drop the flag"
        )
    if args.grad_comm_dtype == "bf16":
        raise CLIError(
            f"{flag} and --grad-comm-dtype bf16 are two gradient-reduction schemes (fp32 sums "
            "vs a bf16 reduce-scatter): pick one"
        )
    if args.data_parallel_sharding_strategy in ("no_shard", "optim"):
        raise CLIError(
            f"{flag} is a reduce-scatter, but --data-parallel-sharding-strategy "
            f"{args.data_parallel_sharding_strategy} all-reduces full gradients: use "
            "optim_grads or optim_grads_params, or drop the flag"
        )
    if mesh_shape is not None:
        raise CLIError(
            f"{flag} reduce-scatters over one shard group; with "
            f"--num-distributed-optimizer-instances {args.num_distributed_optimizer_instances} "
            "(HSDP) drop it"
        )
    return True


def registration_off_for_all_to_alls(all_to_all: bool, scope_sets) -> None:
    """``NCCL_GRAPH_REGISTER=0`` when a ``full_iteration`` graph of this command captures an
    all-to-all (the gradients' with fp32 accumulation, an expert dispatch's): capture/step.py
    [Note: NCCL graph registration and the all-to-all]. Set before the launcher's ranks (or
    this torchrun rank) create their NCCL groups; a value the user exported is kept (and
    refused at capture unless it is 0)."""
    if all_to_all and any("full_iteration" in scopes for scopes in scope_sets):
        os.environ.setdefault(GRAPH_REGISTER_ENV, "0")


def resolve(
    args: argparse.Namespace,
    *,
    graph_scope_sets: list[list[str]] | None = None,
    scope_flag: str = "--cuda-graph-scope",
    graphs_optional: bool = False,
    graph_steps: int | None = None,
    cpu_hint: str = "use --cuda-graph-impl none on CPU",
) -> Resolved:
    """Validate the common flags and build the base TrainConfig (graph fields included).

    ``graph_scope_sets``: the scope sets the command will run (default: --cuda-graph-scope).
    ``graphs_optional``: True for bench, which skips graphed rows on CPU instead of failing.
    ``graph_steps``: steps a graphed run trains (default --train-iters).
    """
    plan = resolve_plan(args.device, args.nproc)
    check_positive(args, "train_iters", "micro_batch_size")
    check_optimizer_args(args)
    if args.eval_interval < 0:
        raise CLIError(f"--eval-interval {args.eval_interval} must be >= 0 (0: never)")
    if args.cuda_graph_warmup_steps < 0:
        raise CLIError(f"--cuda-graph-warmup-steps {args.cuda_graph_warmup_steps} must be >= 0")
    dp_size = check_tensor_parallel_flags(args, plan.world_size)
    check_moe_flags(args, args.num_experts, plan.world_size)
    model = model_config(args)
    packing = packing_of(args)
    tp = args.tensor_model_parallel_size
    if tp > 1:
        try:
            check_gpt_plan(model, tp, sequence_parallel=args.sequence_parallel)
        except ValueError as err:
            raise CLIError(f"--tensor-model-parallel-size {tp}: {err}") from err
    grad_accum = grad_accumulation(args, dp_size)
    mesh_shape, optim_over_replicas = hsdp_mesh(args, plan.world_size)
    allocator = allocator_of(args)
    impl = args.cuda_graph_impl
    if graph_scope_sets is None:
        given = getattr(args, "cuda_graph_scope", None)
        # Megatron: graphs without a scope capture the whole layer.
        graph_scope_sets = [given] if given is not None else [[]] if impl != "none" else []
    if graph_scope_sets and impl == "none":
        raise CLIError(
            f"{scope_flag} is given but --cuda-graph-impl is none, so nothing would be captured: "
            f"add --cuda-graph-impl te (or torch), or drop {scope_flag}"
        )
    check_whole_step_flag(args, impl)
    scope_modules = scope_modules_of(args)
    if scope_modules and impl == "none":
        raise CLIError(
            "--cuda-graph-scope-modules is given but --cuda-graph-impl is none, so nothing would "
            "be captured: add --cuda-graph-impl te (or torch), or drop --cuda-graph-scope-modules"
        )
    policies = []
    for scopes in graph_scope_sets:
        check_scopes(scopes, model, flag=scope_flag, scope_modules=scope_modules)
        policy = graph_policy(args, capture_impl(impl, scopes), scopes, scope_modules)
        try:
            policy.check_recompute(args.recompute_activations, flag=scope_flag)
            policy.check_steps(
                graph_steps or args.train_iters, given=f"--train-iters {args.train_iters}"
            )
        except GraphConfigError as err:
            raise CLIError(str(err)) from err
        policies.append(policy)
    if not (graphs_optional and plan.device != "cuda"):
        # A machine that cannot run graphs at all is said before advice on buffer flags.
        check_graph_environment(impl, plan, cpu_hint)
    for policy in policies:
        check_graph_buffers(args, list(policy.scopes), flag=scope_flag)
    check_transformer_environment(args.transformer_impl, plan)
    fp32_accumulation = check_fp32_accumulation(args, mesh_shape)
    registration_off_for_all_to_alls(
        fp32_accumulation or args.expert_model_parallel_size > 1, [p.scopes for p in policies]
    )
    check_vocab_parallel(args, model, plan.world_size)
    cfg = TrainConfig(
        model=model,
        packing=packing,
        eod_token_id=args.eod_token_id,
        strategy=args.data_parallel_sharding_strategy,
        mesh_shape=mesh_shape,
        optim_over_replicas=optim_over_replicas,
        expert_parallel=args.expert_model_parallel_size
        if args.expert_model_parallel_size > 1
        else None,
        tensor_parallel=tp if tp > 1 else None,
        sequence_parallel=args.sequence_parallel,
        micro_batch_size=args.micro_batch_size,
        grad_accum=grad_accum,
        steps=args.train_iters,
        lr=args.lr,
        weight_decay=args.weight_decay,
        clip_grad=args.clip_grad,
        bf16=args.bf16,
        grad_comm_dtype="bf16" if args.grad_comm_dtype == "bf16" else None,
        reduce_scatter_fp32_accumulation=fp32_accumulation,
        allocator=allocator,
        persist_on_alloc_fail=args.fsdp_db_use_persist_buf_on_alloc_fail,
        recompute=args.recompute_activations,
        deterministic=args.deterministic,
        eval_interval=args.eval_interval,
        device=plan.device,
        return_params=False,
        cuda_graph_impl=policies[0].impl if len(policies) == 1 else impl,
        cuda_graph_scope=list(graph_scope_sets[0]) if len(graph_scope_sets) == 1 else [],
        cuda_graph_warmup_steps=args.cuda_graph_warmup_steps,
        cuda_graph_scope_modules=scope_modules,
        cuda_graph_comm=args.cuda_graph_comm,
        cuda_graph_optimizer=args.cuda_graph_optimizer,
        fused_optimizer=args.cuda_graph_optimizer,  # the whole step's update is AdamW(fused)
        vocab_parallel_embedding=args.vocab_parallel_embedding,
    )
    return Resolved(plan=plan, cfg=cfg)
