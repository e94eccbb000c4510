"""Shared flags (Megatron-LM spellings), their validation and the TrainConfig they build.

Every check here runs before a process group or a CUDA context exists and raises
:class:`CLIError` with a message that names the flag to change. Configuration mistakes are
reported before environment ones (no CUDA, missing TransformerEngine), so a CPU-only CI can
exercise the rules through the CLI - except the static-buffer flags that graphs need: a
machine that cannot run graphs is told so before it is asked for buffer flags (CPU tests call
:func:`check_graph_buffers` directly). The model flags live in model_options.py, the CUDA
graph flags in graph_options.py, the packed-sequence flags in packing_options.py; this module
adds the training, FSDP and launch flags and :func:`resolve` builds the TrainConfig of them all.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import get_args

import torch

from graph_fsdp.capture.policy import GraphPolicy, capture_impl
from graph_fsdp.capture.scopes import GraphConfigError
from graph_fsdp.cli.errors import CLIError
from graph_fsdp.cli.graph_options import (
    add_graph_args,
    buffer_policy_of,
    check_graph_buffers,
    check_graph_environment,
    check_scopes,
    check_transformer_environment,
    check_whole_step_flag,
    graph_policy,
    registration_off_for_all_to_alls,
    scope_modules_of,
)
from graph_fsdp.cli.launch import resolve_plan
from graph_fsdp.cli.model_options import (
    _flag,
    add_model_args,
    check_divides_ranks,
    check_moe_flags,
    model_config,
)
from graph_fsdp.cli.packing_options import add_packing_args, packing_of
from graph_fsdp.fsdp.api import STRATEGIES, AllocatorKind, MixedPrecisionPolicy
from graph_fsdp.models import GPTConfig
from graph_fsdp.models.tp_plans import check_gpt_plan
from graph_fsdp.training.processes import LaunchPlan
from graph_fsdp.training.train import TrainConfig

OUTER_STRATEGIES = ("no_shard", "optim")
"""Megatron-FSDP's --outer-dp-sharding-strategy (HSDP across distributed-optimizer instances)."""
BUFFER_ALLOCATORS = get_args(AllocatorKind)
"""--fsdp-buffer: BufferPolicy's allocators (dynamic, double_buffer, trace_pool)."""


# --------------------------------------------------------------------------------------------
# Flags
# --------------------------------------------------------------------------------------------


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
        "--create-all-gather-group",
        action="store_true",
        help="The units' all-gathers on a process group of their own over the same ranks, so "
        "they run beside the gradients' reduce-scatters instead of queueing behind them on one "
        "NCCL communicator (ZeRO-3's backward has both per unit). Costs a second "
        "communicator's buffers (NCCL's, outside torch's allocator).",
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


def add_output_dir_arg(group, holds: str, default: str) -> None:
    """``--output-dir DIR``: where the command's ``holds`` go (``default`` when not given)."""
    group.add_argument(
        "--output-dir",
        default=None,
        metavar="DIR",
        help=f"Where {holds} go (default: {default}).",
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


LOOP_FLAGS = {
    "strategy": "data_parallel_sharding_strategy",
    "separate_all_gather_group": "create_all_gather_group",
    "micro_batch_size": "micro_batch_size",
    "steps": "train_iters",
    "lr": "lr",
    "weight_decay": "weight_decay",
    "clip_grad": "clip_grad",
    "eval_interval": "eval_interval",
    "deterministic": "deterministic",
    "fused_optimizer": "cuda_graph_optimizer",  # the whole step's update is AdamW(fused)
}
"""LoopConfig field -> the argparse ``dest`` it copies, for every ``--model``."""


def loop_config_fields(
    args: argparse.Namespace, *, grad_accum: int, graphs: GraphPolicy, mesh_shape=None
) -> dict:
    """The LoopConfig fields of the shared flags (graph_fsdp's GPT: :func:`resolve`;
    Megatron-Core models: mcore.py): :data:`LOOP_FLAGS`, the gradient accumulation, the
    buffers, the mixed precision (``mesh_shape``: the HSDP mesh, for its rules) and the
    validated graphs."""
    return {
        **{name: getattr(args, dest) for name, dest in LOOP_FLAGS.items()},
        "grad_accum": grad_accum,
        "buffers": buffer_policy_of(args),
        "mp": mixed_precision_of(args, mesh_shape),
        "graphs": graphs,
    }


def mixed_precision_of(args: argparse.Namespace, mesh_shape=None) -> MixedPrecisionPolicy:
    """The config's ``mp`` section: --bf16, --grad-comm-dtype and
    --ddp-reduce-scatter-with-fp32-accumulation (:func:`check_fp32_accumulation`)."""
    return MixedPrecisionPolicy(
        param_dtype=torch.bfloat16 if args.bf16 else None,
        grad_comm_dtype=torch.bfloat16 if args.grad_comm_dtype == "bf16" else None,
        reduce_scatter_fp32_accumulation=check_fp32_accumulation(args, mesh_shape),
    )


def run_graphs(
    policies: list[GraphPolicy], args: argparse.Namespace, scope_modules: dict | None = None
) -> GraphPolicy:
    """The base config's graphs: the one graphed run's policy, else eager with the flags'
    shared settings (several runs replace the backend and scopes: bench, compare)."""
    if len(policies) == 1:
        return policies[0]
    return GraphPolicy(
        warmup_steps=args.cuda_graph_warmup_steps,
        comm_graphs=getattr(args, "cuda_graph_comm", True),
        scope_modules=scope_modules or {},
        optimizer=args.cuda_graph_optimizer,
        overlap_next_gather=getattr(args, "cuda_graph_overlap_next_gather", False),
        norm_beside_last_reduction=getattr(args, "cuda_graph_norm_beside_last_reduction", False),
    )


@dataclass(frozen=True, kw_only=True)
class Resolved:
    """Validated flags: the launch plan and the base TrainConfig every run starts from."""

    plan: LaunchPlan
    cfg: TrainConfig
    graph_sets: tuple[GraphPolicy, ...] = ()
    """The validated GraphPolicy of each graphed run the flags ask for (one per scope set;
    ``cfg.graphs`` is the only one's, or eager with the shared settings when there are
    several)."""

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
    buffer_policy_of(args)  # the buffer flags' own rules, before the graphs'
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
    loop = loop_config_fields(
        args,
        grad_accum=grad_accum,
        graphs=run_graphs(policies, args, scope_modules),
        mesh_shape=mesh_shape,
    )
    registration_off_for_all_to_alls(
        loop["mp"].reduce_scatter_fp32_accumulation or args.expert_model_parallel_size > 1,
        [p.scopes for p in policies],
    )
    check_vocab_parallel(args, model, plan.world_size)
    cfg = TrainConfig(
        **loop,
        model=model,
        packing=packing,
        eod_token_id=args.eod_token_id,
        mesh_shape=mesh_shape,
        optim_over_replicas=optim_over_replicas,
        expert_parallel=args.expert_model_parallel_size
        if args.expert_model_parallel_size > 1
        else None,
        tensor_parallel=tp if tp > 1 else None,
        sequence_parallel=args.sequence_parallel,
        recompute=args.recompute_activations,
        device=plan.device,
        return_params=False,
        vocab_parallel_embedding=args.vocab_parallel_embedding,
    )
    return Resolved(plan=plan, cfg=cfg, graph_sets=tuple(policies))
