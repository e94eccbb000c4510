"""``graph-fsdp train|bench --model mcore-gpt|mcore-moe|mcore-hybrid``: Megatron-Core GPTs
(and hybrid models, ``--hybrid-layer-pattern``) through the CLI.

    graph-fsdp train --model mcore-gpt --transformer-impl transformer_engine --bf16 \\
        --fsdp-double-buffer --fsdp-db-use-persist-buf-on-alloc-fail \\
        --cuda-graph-impl te --cuda-graph-scope attn mlp
    graph-fsdp train --model mcore-moe --num-experts 4 --moe-router-topk 2 \\
        --moe-shared-expert-intermediate-size 512 --transformer-impl transformer_engine --bf16 \\
        --fsdp-double-buffer --fsdp-db-use-persist-buf-on-alloc-fail \\
        --cuda-graph-impl te --cuda-graph-scope attn moe_router

The flags are the shared ones (Megatron spellings) plus the Megatron-Bridge settings that
:func:`graph_fsdp.integrations.bridge_config.validate_fsdp_config` checks. Every check runs
before a process starts; megatron-core is imported only by the ranks.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import math
import os
import sys
from dataclasses import replace
from statistics import median

from graph_fsdp.bench.megatron import (
    DROPLESS,
    MCORE_ROWS,
    MCoreBenchJob,
    bench_worker,
    markdown,
    plan_rows,
    variant_rows,
    write_report,
)
from graph_fsdp.bench.provenance import code_version
from graph_fsdp.bench.report import gpu_tag
from graph_fsdp.bench.runner import DEFAULT_ROWS
from graph_fsdp.capture.policy import GraphPolicy, capture_impl
from graph_fsdp.capture.scopes import GraphConfigError
from graph_fsdp.cli.errors import CLIError
from graph_fsdp.cli.graph_options import (
    buffer_policy_of,
    check_graph_environment,
    check_whole_step_flag,
    graph_policy,
    registration_off_for_all_to_alls,
    scope_sets_from,
)
from graph_fsdp.cli.launch import resolve_plan
from graph_fsdp.cli.model_options import check_moe_flags, shape_fields
from graph_fsdp.cli.options import (
    check_clip_grad,
    check_positive,
    check_tensor_parallel_flags,
    grad_accumulation,
    loop_config_fields,
    run_graphs,
)
from graph_fsdp.cli.packing_options import packing_of
from graph_fsdp.cli.train_options import (
    check_data_path,
    checkpoint_lines,
    checkpoint_plan,
    graphs_label,
    input_lines,
    loop_fields,
    verification_lines,
    verify_option,
)
from graph_fsdp.fsdp.api import dtype_label
from graph_fsdp.integrations.bridge_config import FSDPConfigError, validate_fsdp_config
from graph_fsdp.integrations.megatron import (
    ATTENTION_BACKENDS,
    MOE_EXPERTS_IMPLS,
    MCoreGPTConfig,
    check_mcore_scopes,
)
from graph_fsdp.integrations.megatron.train import MCoreTrainConfig, run
from graph_fsdp.training.processes import launch

MODELS = ("gpt", "mcore-gpt", "mcore-moe", "mcore-hybrid")
"""--model: graph_fsdp's reference GPT, a Megatron-Core GPTModel (dense / MoE), or a
Megatron-Core hybrid model of --hybrid-layer-pattern (HybridModel)."""


def add_megatron_model_args(parser: argparse.ArgumentParser) -> None:
    """--model and the Megatron-Core model flags (train and bench)."""
    g = parser.add_argument_group("Megatron-Core models")
    g.add_argument(
        "--model",
        choices=MODELS,
        default="gpt",
        help="gpt: graph_fsdp's reference model; mcore-gpt: a Megatron-Core GPTModel "
        "(--num-experts makes it MoE); mcore-moe: the MoE GPTModel (default 4 experts); "
        "mcore-hybrid: Megatron-Core's HybridModel of --hybrid-layer-pattern. "
        'Megatron-Core models need pip install -e ".[megatron]".',
    )
    g.add_argument(
        "--hybrid-layer-pattern",
        default=None,
        metavar="PATTERN",
        help="--model mcore-hybrid: one character per layer - * attention, - MLP, E MoE "
        "(--num-experts, default 4), M Mamba (needs mamba_ssm, causal_conv1d); e.g. '*-E-'. "
        "Sets the layer count (--num-layers is ignored, as in Megatron).",
    )
    g.add_argument(
        "--moe-shared-expert-intermediate-size",
        type=int,
        default=None,
        help="Megatron-Core MoE: inner size of the shared expert (unset: none).",
    )
    g.add_argument(
        "--moe-experts-impl",
        choices=MOE_EXPERTS_IMPLS,
        default="megatron",
        help="Megatron-Core MoE experts: megatron - the layer spec's experts and token "
        "dispatcher (dropless, they copy the token counts to the host, so only attn / "
        "moe_router [moe_preprocess] capture; with --moe-expert-capacity-factor and "
        "--moe-pad-expert-input-to-capacity they capture whole); grouped_mm - graph_fsdp's "
        "dropless experts with device token counts (torch._grouped_mm, bf16 on sm90+; with "
        "--expert-model-parallel-size > 1 fixed-size all-to-alls into a receive buffer sized "
        "by --moe-receive-buffer-factor), captured whole.",
    )
    g.add_argument(
        "--use-megatron-schedule",
        action="store_true",
        help="Megatron-Core models: run each step through get_forward_backward_func().",
    )
    g.add_argument(
        "--attention-backend",
        choices=ATTENTION_BACKENDS,
        default="auto",
        help="Megatron-Core models: TransformerConfig.attention_backend. auto lets "
        "TransformerEngine choose per call - under its CUDA graph capture it may choose another "
        "backend than in eager steps (cuDNN <= 9.15.0, --seq-length not a multiple of 128); "
        "flash, fused or unfused pin one; local needs --transformer-impl local.",
    )


def reject_mcore_only_flags(args: argparse.Namespace) -> None:
    """--model gpt (graph_fsdp's reference model): the Megatron-Core model flags are refused."""
    given = [
        flag
        for flag, value in (
            ("--use-megatron-schedule", args.use_megatron_schedule),
            ("--moe-shared-expert-intermediate-size", args.moe_shared_expert_intermediate_size),
            ("--attention-backend", args.attention_backend != "auto"),
            ("--moe-experts-impl", args.moe_experts_impl != "megatron"),
            ("--hybrid-layer-pattern", args.hybrid_layer_pattern),
            ("--moe-router-skew", getattr(args, "moe_router_skew", None)),
            (
                "--moe-drop-padding-capacity-factor",
                getattr(args, "moe_drop_padding_capacity_factor", None) is not None,
            ),
        )
        if value
    ]
    if given:
        raise CLIError(
            f"{', '.join(given)}: Megatron-Core model flags, but --model is gpt (graph_fsdp's "
            "reference model); add --model mcore-gpt|mcore-moe|mcore-hybrid or drop them"
        )


def add_megatron_args(parser: argparse.ArgumentParser) -> None:
    """``train``: the model flags plus Megatron-Bridge's FSDP settings and optimizer offload."""
    add_megatron_model_args(parser)
    g = parser.add_argument_group("Megatron-Bridge settings")
    g.add_argument(
        "--ckpt-format",
        default="fsdp_dtensor",
        help="Checkpoint format (Megatron-Bridge's name); graph_fsdp writes DCP: fsdp_dtensor.",
    )
    g.add_argument(
        "--optimizer-cpu-offload",
        action="store_true",
        help="Keep the AdamW state of --optimizer-offload-fraction of the local shards in "
        "pinned CPU memory and step it there (graph_fsdp.fsdp.optim_offload.CPUOffloadOptimizer; "
        "needs no --recompute-activations).",
    )
    g.add_argument(
        "--optimizer-offload-fraction",
        type=float,
        default=1.0,
        help="Share of the local shards (by elements) --optimizer-cpu-offload puts on the CPU.",
    )


def validate_bridge_flags(args: argparse.Namespace) -> None:
    """Megatron-Bridge's FSDP rules (integrations/bridge_config.py) that flags reach, for
    every --model: the checkpoint format of --save/--load; then the optimizer offload."""
    try:
        validate_fsdp_config(
            use_graph_fsdp=True, ckpt_format=args.ckpt_format, save=args.save, load=args.load
        )
    except FSDPConfigError as err:
        raise CLIError(str(err)) from err
    validate_optimizer_offload(args)


def validate_optimizer_offload(args: argparse.Namespace) -> None:
    """--optimizer-cpu-offload / --optimizer-offload-fraction (Megatron-LM's spellings)."""
    fraction = args.optimizer_offload_fraction
    if not 0.0 < fraction <= 1.0:
        raise CLIError(
            f"--optimizer-offload-fraction {fraction} must be in (0, 1]: the share of the "
            "optimizer state on the CPU (drop --optimizer-cpu-offload for none)"
        )
    if fraction != 1.0 and not args.optimizer_cpu_offload:
        raise CLIError(
            f"--optimizer-offload-fraction {fraction} is given without --optimizer-cpu-offload; "
            "add --optimizer-cpu-offload"
        )
    if args.optimizer_cpu_offload and args.recompute_activations:
        # graph_fsdp.fsdp.optim_offload.check_offload_config's rule, said with the flags.
        raise CLIError(
            "--optimizer-cpu-offload is supported with activation recompute off: drop "
            "--recompute-activations or --optimizer-cpu-offload"
        )


def mcore_config(args: argparse.Namespace, world_size: int | None = None):
    """The MCoreGPTConfig of the flags (no megatron import: the dataclass is pure);
    ``world_size``: the ranks the run has (the expert-parallel size must divide them)."""
    if getattr(args, "moe_dropless", False):
        raise CLIError(
            f"--moe-dropless is graph_fsdp's GPT's: --model {args.model} is dropless when "
            "--moe-expert-capacity-factor is unset; for dropless experts captured whole (also "
            "with --expert-model-parallel-size) add --moe-experts-impl grouped_mm"
        )
    if packing_of(args) is not None and args.use_megatron_schedule:
        raise CLIError(
            f"--packed-sequences with --model {args.model} runs in graph_fsdp's loop (the "
            "per-token loss scale over the step); drop --use-megatron-schedule"
        )
    pattern = _hybrid_pattern(args)
    experts = args.num_experts
    if experts is None and (args.model == "mcore-moe" or "E" in (pattern or "")):
        experts = 4
    if world_size is not None:
        check_tensor_parallel_flags(args, world_size)
        check_moe_flags(args, experts, world_size)
    if args.moe_experts_impl != "megatron" and not experts:
        raise CLIError(
            f"--moe-experts-impl {args.moe_experts_impl} needs an MoE model: add --num-experts N "
            "or use --model mcore-moe"
        )
    if args.model != "mcore-moe" and args.moe_shared_expert_intermediate_size and not experts:
        raise CLIError(
            "--moe-shared-expert-intermediate-size needs an MoE model: add --num-experts N or "
            "use --model mcore-moe"
        )
    if args.moe_layer_freq != 1:
        raise CLIError(
            f"--moe-layer-freq {args.moe_layer_freq}: Megatron-Core models here make every layer "
            "MoE (--moe-layer-freq 1)"
        )
    try:
        return MCoreGPTConfig(
            **shape_fields(args),
            num_experts=experts,
            moe_shared_expert_intermediate_size=args.moe_shared_expert_intermediate_size,
            moe_expert_capacity_factor=args.moe_expert_capacity_factor,
            moe_pad_expert_input_to_capacity=args.moe_pad_expert_input_to_capacity,
            moe_experts_impl=args.moe_experts_impl if experts else "megatron",
            moe_receive_buffer_factor=getattr(args, "moe_receive_buffer_factor", None),
            expert_model_parallel_size=args.expert_model_parallel_size,
            tensor_model_parallel_size=args.tensor_model_parallel_size,
            sequence_parallel=args.sequence_parallel,
            bf16=args.bf16,
            attention_backend=args.attention_backend,
            hybrid_layer_pattern=pattern,
        )
    except ValueError as err:
        raise CLIError(str(err).replace("MCoreGPTConfig.", "--").replace("_", "-")) from err


def _hybrid_pattern(args: argparse.Namespace) -> str | None:
    """--hybrid-layer-pattern: given exactly for --model mcore-hybrid."""
    pattern = args.hybrid_layer_pattern
    if args.model == "mcore-hybrid" and not pattern:
        raise CLIError(
            "--model mcore-hybrid builds its layers from --hybrid-layer-pattern: give one, e.g. "
            "--hybrid-layer-pattern '*-E-' (* attention, - MLP, E MoE, M Mamba)"
        )
    if args.model != "mcore-hybrid" and pattern:
        raise CLIError(
            f"--hybrid-layer-pattern {pattern} builds a hybrid model, but --model is "
            f"{args.model}: use --model mcore-hybrid"
        )
    return pattern


def moe_label(model) -> str:
    """The MoE settings of a Megatron-Core GPT in words (reports and summaries); a hybrid
    model's pattern first."""
    experts = _experts_label(model)
    return f"hybrid {model.hybrid_layer_pattern}, {experts}" if model.is_hybrid else experts


def _experts_label(model) -> str:
    if not model.num_experts:
        return "dense"
    parts = [f"{model.num_experts} experts top-{model.moe_router_topk}"]
    if model.moe_shared_expert_intermediate_size:
        parts.append(f"shared expert {model.moe_shared_expert_intermediate_size}")
    factor = model.moe_expert_capacity_factor
    if factor is None:
        experts = "grouped_mm" if model.moe_experts_impl == "grouped_mm" else "Megatron's"
        parts.append(f"dropless ({experts} experts)")
    elif model.moe_pad_expert_input_to_capacity:
        parts.append(f"drop-padding (capacity factor {factor:g})")
    else:
        parts.append(f"capacity factor {factor:g} (dropping, unpadded)")
    if model.expert_model_parallel_size > 1:
        parts.append(f"expert parallel {model.expert_model_parallel_size}")
    if model.moe_receive_buffer_factor is not None:
        parts.append(f"receive buffer {model.moe_receive_buffer_factor:g}x")
    return ", ".join(parts)


def tp_label(model) -> str:
    """``, tensor parallel N [with sequence parallel]`` (empty at TP = 1)."""
    if model.tensor_model_parallel_size == 1:
        return ""
    sp = " with sequence parallel" if model.sequence_parallel else ""
    return f", tensor parallel {model.tensor_model_parallel_size}{sp}"


def check_graph_set(
    args: argparse.Namespace, model, impl: str, scopes: list[str], *, flag: str, steps: int
) -> GraphPolicy | None:
    """One graphed run's flags: its GraphPolicy's rules (capture/policy.py: static buffers,
    enough steps to capture), Megatron's scopes for this model, and what full_iteration
    excludes; the validated policy (None for ``impl`` none)."""
    if impl == "none":
        return None
    registration_off_for_all_to_alls(args.expert_model_parallel_size > 1, [scopes])
    policy = graph_policy(args, impl, scopes)
    try:
        check_mcore_scopes(model, scopes)
        policy.check_buffers(buffer_policy_of(args), flag=flag)
        policy.check_steps(steps, given=f"--train-iters {args.train_iters}")
    except GraphConfigError as err:
        raise CLIError(str(err)) from err
    if args.use_megatron_schedule and "full_iteration" in scopes:
        raise CLIError(
            f"--use-megatron-schedule with {flag} full_iteration: the full-iteration "
            "graph replaces the forward/backward schedule; drop one of them"
        )
    return policy


def reject_unwired_flags(args: argparse.Namespace) -> None:
    """Shared flags that Megatron-Core models do not honour: refused, never ignored."""
    if args.recompute_activations:
        raise CLIError("--recompute-activations is not wired for Megatron-Core models; drop it")
    if args.num_distributed_optimizer_instances != 1:
        raise CLIError(
            f"--num-distributed-optimizer-instances {args.num_distributed_optimizer_instances}: "
            "HSDP is not wired for Megatron-Core models (their expert groups are 1-D); drop it"
        )
    if getattr(args, "cuda_graph_verify", None) and args.use_megatron_schedule:
        raise CLIError(
            "--cuda-graph-verify checks a step that graph_fsdp's loop runs (the graphed run "
            "against an eager run of it); Megatron's schedule runs its own: drop "
            "--use-megatron-schedule or --cuda-graph-verify"
        )
    if args.vocab_parallel_embedding:
        raise CLIError(
            "--vocab-parallel-embedding is not wired for Megatron-Core models (their embedding "
            "is Megatron's VocabParallelEmbedding, split by --tensor-model-parallel-size); drop it"
        )
    if args.ddp_reduce_scatter_with_fp32_accumulation:
        raise CLIError(
            "--ddp-reduce-scatter-with-fp32-accumulation is not wired for Megatron-Core models "
            "(gradients are reduced in fp32); drop it"
        )
    if args.grad_comm_dtype != "fp32":
        raise CLIError(
            f"--grad-comm-dtype {args.grad_comm_dtype} is not wired for Megatron-Core models "
            "(gradients are reduced in fp32); drop it"
        )
    if getattr(args, "cuda_graph_scope_modules", None):
        raise CLIError(
            "--cuda-graph-scope-modules: Megatron-Core models use graph_fsdp's Megatron-Core "
            "scope presets (attn=self_attention, moe_router=mlp.router, ...); drop it"
        )


def base_train_config(args: argparse.Namespace, model, plan, graphs=None, **fields):
    """The MCoreTrainConfig of the shared flags (train, compare and bench; options.py's
    table); ``graphs``: the validated policy (None: eager); ``fields`` override."""
    check_clip_grad(args)
    data_world = plan.world_size // model.tensor_model_parallel_size  # TP ranks share batches
    base = loop_config_fields(
        args,
        grad_accum=grad_accumulation(args, data_world),
        graphs=graphs or run_graphs([], args),
    )
    return MCoreTrainConfig(
        **{**base, **fields},
        model=model,
        use_megatron_schedule=args.use_megatron_schedule,
        packing=packing_of(args),  # TE's THD attention (integrations/megatron/packed.py)
        eod_token_id=args.eod_token_id,
    )


def check_mcore_environment(args: argparse.Namespace, model, impl: str, plan) -> None:
    """Environment checks last (CUDA, TransformerEngine, megatron-core importable)."""
    if plan.device != "cuda" and (
        model.transformer_impl == "transformer_engine" or model.num_experts
    ):
        raise CLIError(
            f"--model {args.model} with --transformer-impl {model.transformer_impl}"
            f"{' and MoE (alltoall dispatcher)' if model.num_experts else ''} needs CUDA, but "
            f"this run is on {plan.device}; Megatron-Core's layers allocate on the GPU"
        )
    check_graph_environment(impl, plan)
    if importlib.util.find_spec("megatron") is None:
        raise CLIError(f'--model {args.model} needs megatron-core: pip install -e ".[megatron]"')


def train_main(args: argparse.Namespace) -> int:
    """``graph-fsdp train`` for ``--model mcore-*`` (validation, launch, summary)."""
    validate_bridge_flags(args)
    plan = resolve_plan(args.device, args.nproc)
    model = mcore_config(args, plan.world_size)
    impl = args.cuda_graph_impl
    scopes = list(args.cuda_graph_scope or [])
    check_whole_step_flag(args, impl)
    if args.cuda_graph_scope is not None and impl == "none":
        raise CLIError(
            "--cuda-graph-scope is given but --cuda-graph-impl is none: add --cuda-graph-impl te "
            "(or torch), or drop --cuda-graph-scope"
        )
    graphs = check_graph_set(
        args, model, impl, scopes, flag="--cuda-graph-scope", steps=args.train_iters
    )
    reject_unwired_flags(args)
    verify = verify_option(args)
    data_world = plan.world_size // model.tensor_model_parallel_size  # TP ranks share batches
    grad_accum = grad_accumulation(args, data_world)
    # --save / --load / --save-interval / --data-path: the same rules and files as --model gpt.
    ckpt_plan = checkpoint_plan(args)
    start = ckpt_plan.start
    data_path = check_data_path(
        args,
        seq_length=model.seq_length,
        vocab_size=model.vocab_size,
        world_size=data_world,
        grad_accum=grad_accum,
        start=start,
        steps=args.train_iters - start,
        packing=packing_of(args),
    )
    check_mcore_environment(args, model, impl, plan)
    cfg = base_train_config(
        args,
        model,
        plan,
        graphs=replace(graphs, verify=verify) if graphs is not None else None,
        **loop_fields(args, ckpt_plan),
        model_name=args.model,
        data_path=data_path,
        optimizer_offload_fraction=(
            args.optimizer_offload_fraction if args.optimizer_cpu_offload else 0.0
        ),
    )
    if args.log_json:
        os.makedirs(os.path.dirname(os.path.abspath(args.log_json)) or ".", exist_ok=True)
        open(args.log_json, "w").close()  # overwritten, like the reference model's log
        cfg = replace(cfg, log_path=os.path.abspath(args.log_json))
    out = launch(plan, _worker, cfg)
    if out is not None:
        print(_summary(args, cfg, plan, out))
    return 0


def _summary(args, cfg, plan, out: dict) -> str:
    peak = out.get("peak_memory_bytes")
    lines = [
        f"graph-fsdp train --model {args.model}: {len(out['losses'])} steps on {plan.describe()}; "
        f"{cfg.strategy}, {graphs_label(cfg)}; {moe_label(cfg.model)}{tp_label(cfg.model)}",
        f"  final loss {out['losses'][-1]:.6f} | median step {median(out['times']) * 1e3:.2f} ms"
        f" | peak memory {f'{peak / 2**30:.2f} GiB' if peak else 'n/a (cpu)'}",
        *input_lines(cfg),
        *verification_lines(out),
    ]
    if out.get("stopped_at") is not None:
        lines.append(f"  stopped after iteration {out['stopped_at']} (a stop signal)")
    return "\n".join(lines + checkpoint_lines(cfg, out))


def _worker(rank: int, world_size: int, cfg) -> dict | None:
    result = run(rank, world_size, cfg)  # checkpoints record the iteration and --model
    return result if rank == 0 else None


def compare_config(args: argparse.Namespace, scope_sets: list[list[str]], flag: str):
    """``compare --model mcore-*``: the launch plan and the base MCoreTrainConfig of the
    compared runs (every graphed scope set checked as ``train`` checks its one)."""
    check_positive(args, "train_iters", "micro_batch_size")
    plan = resolve_plan(args.device, args.nproc)
    model = mcore_config(args, plan.world_size)
    reject_unwired_flags(args)
    impl = args.cuda_graph_impl
    check_whole_step_flag(args, impl)
    if impl != "none" and args.use_megatron_schedule:
        raise CLIError(
            "compare verifies each graphed run's first graphed step in graph_fsdp's loop; "
            "Megatron's schedule runs its own: drop --use-megatron-schedule (or compare eager "
            "strategies with --cuda-graph-impl none --reference-strategy STRATEGY)"
        )
    for scopes in scope_sets if impl != "none" else []:
        row_impl = capture_impl(impl, scopes)
        check_graph_set(args, model, row_impl, scopes, flag=flag, steps=args.train_iters)
    check_mcore_environment(args, model, impl, plan)
    return plan, base_train_config(args, model, plan, return_params=True)


# --------------------------------------------------------------------------------------------
# graph-fsdp bench --model mcore-*
# --------------------------------------------------------------------------------------------


def _bench_impls(args: argparse.Namespace) -> list[str]:
    """The graph backends of the graphed rows (--graph-impls, else --cuda-graph-impl)."""
    if args.graph_impls and args.cuda_graph_impl not in ("none", args.graph_impls[0]):
        raise CLIError(
            f"--cuda-graph-impl {args.cuda_graph_impl} and --graph-impls "
            f"{' '.join(args.graph_impls)} disagree: give one of them"
        )
    return list(dict.fromkeys(args.graph_impls or [args.cuda_graph_impl]))


def _bench_rows(args: argparse.Namespace) -> list[str]:
    tp = args.tensor_model_parallel_size
    packed = packing_of(args) is not None
    if list(args.rows) == list(DEFAULT_ROWS):  # not given: every row this model has
        # megatron_fsdp compares data-parallel runs (build_sharded refuses TP for it) of
        # fixed rows (packs run in graph_fsdp's loop only)
        return [r for r in MCORE_ROWS if (tp == 1 and not packed) or r != "megatron_fsdp"]
    if packed and "megatron_fsdp" in args.rows:
        raise CLIError(
            "--rows megatron_fsdp trains fixed rows; --packed-sequences runs in graph_fsdp's "
            "loop only: drop megatron_fsdp from --rows"
        )
    other = [r for r in args.rows if r not in MCORE_ROWS]
    if other:
        raise CLIError(
            f"--rows {' '.join(other)}: not available for --model {args.model} (they run "
            f"graph_fsdp's own GPT); choose from {', '.join(MCORE_ROWS)}"
        )
    if tp > 1 and "megatron_fsdp" in args.rows:
        raise CLIError(
            f"--rows megatron_fsdp compares data-parallel runs, not --tensor-model-parallel-size "
            f"{tp}: drop megatron_fsdp from --rows"
        )
    return list(args.rows)


def build_bench_job(args: argparse.Namespace):
    """``bench``: validate the flags; the job, the launch plan and the report's setup line."""
    check_positive(args, "train_iters", "micro_batch_size")
    if args.warmup_iters < 0:
        raise CLIError(f"--warmup-iters {args.warmup_iters} must be >= 0")
    plan = resolve_plan(args.device, args.nproc)
    model = mcore_config(args, plan.world_size)
    reject_unwired_flags(args)
    scope_sets, flag = scope_sets_from(args)
    impls, rows = _bench_impls(args), _bench_rows(args)
    check_whole_step_flag(args, impls[0] if len(impls) == 1 else "torch")
    graphed = "graph_fsdp_graphed" in rows and any(i != "none" for i in impls)
    if scope_sets and not graphed:
        raise CLIError(
            f"{flag} is given but no graphed row runs: add --graph-impls te (or torch), or drop it"
        )
    steps = args.warmup_iters + args.train_iters

    def check_graph_sets(m) -> None:  # every graphed row's backend and scopes for model m
        for impl in impls if graphed else []:
            for scopes in scope_sets or [[]]:
                row_impl = capture_impl(impl, scopes)
                check_graph_set(args, m, row_impl, scopes, flag=flag, steps=steps)

    check_graph_sets(model)
    if graphed and args.warmup_iters <= args.cuda_graph_warmup_steps:
        raise CLIError(
            f"--warmup-iters {args.warmup_iters} must exceed --cuda-graph-warmup-steps "
            f"{args.cuda_graph_warmup_steps}, so that the capture step is not timed"
        )
    base = base_train_config(
        args, model, plan, steps=steps, eval_interval=0, fused_optimizer=args.fused_adamw
    )
    planned = plan_rows(rows, impls, scope_sets or [[]], optimizer=args.cuda_graph_optimizer)
    variants = bench_variants(args, base)
    models = [model]  # and the drop-padding model of the variants, checked the same way
    for _, cfg in variants:
        if cfg.model not in models:
            check_graph_sets(cfg.model)
            models.append(cfg.model)
    for impl in impls if graphed and plan.device == "cuda" else ["none"]:
        for m in models:
            check_mcore_environment(args, m, impl, plan)
    job = MCoreBenchJob(
        base=base,
        warmup=args.warmup_iters,
        rows=variant_rows(planned, [label for label, _ in variants]) if variants else planned,
        variants=variants,
    )
    moe = moe_label(model)
    setup = (
        f"Megatron-Core GPTModel ({model.transformer_impl} spec): {model.num_layers} layers, "
        f"hidden {model.hidden_size}, heads {model.num_attention_heads}, seq "
        f"{model.seq_length}, vocab {model.vocab_size}, {moe}{tp_label(model)}. Per GPU: micro batch "
        f"{base.micro_batch_size} x grad accumulation {base.grad_accum}; "
        f"{dtype_label(base.compute_dtype)} compute, fp32 main weights; {base.strategy}, "
        f"allocator {base.buffers.allocator}; {'Megatron schedule' if base.use_megatron_schedule else ''}"
        f"{'; ' if base.use_megatron_schedule else ''}"
        f"{'deterministic' if base.deterministic else 'nondeterministic'} algorithms. "
        f"{args.warmup_iters} warmup + {args.train_iters} timed steps per row, seed {model.seed}."
    )
    return job, plan, setup


def bench_variants(args: argparse.Namespace, base) -> tuple[tuple[str, object], ...]:
    """--moe-router-skew / --moe-drop-padding-capacity-factor: ``(label, MCoreTrainConfig)``
    per variant of the launch (bench/megatron.py [Note: bench variants]); () without them."""
    skews = args.moe_router_skew
    factor = args.moe_drop_padding_capacity_factor
    if skews is None and factor is None:
        return ()
    model = base.model
    if not model.is_moe:
        raise CLIError(
            "--moe-router-skew and --moe-drop-padding-capacity-factor vary an MoE model's "
            "experts: add --num-experts N (--model mcore-moe) or drop them"
        )
    bad = [b for b in skews or [] if not math.isfinite(b)]
    if bad:
        raise CLIError(f"--moe-router-skew {' '.join(map(str, bad))}: give finite numbers")
    skews = list(dict.fromkeys(skews or [0.0]))
    routings = [("balanced" if b == 0 else f"skew {b:+g}", b) for b in skews]
    experts = [("", model)]
    if factor is not None:
        if model.moe_experts_impl != "grouped_mm":
            raise CLIError(
                f"--moe-drop-padding-capacity-factor {factor} compares graph_fsdp's dropless "
                "grouped_mm experts with Megatron's drop-padding ones: add --moe-experts-impl "
                "grouped_mm"
            )
        if not (math.isfinite(factor) and factor > 0):
            raise CLIError(
                f"--moe-drop-padding-capacity-factor {factor} must be > 0 (e.g. 1.0: each "
                "expert takes its balanced share of the tokens)"
            )
        padded = replace(
            model,
            moe_experts_impl="megatron",
            moe_expert_capacity_factor=factor,
            moe_pad_expert_input_to_capacity=True,
            moe_receive_buffer_factor=None,
        )
        experts = [(DROPLESS, model), (f"drop-padding {factor:g}", padded)]
    out = []
    for routing, skew in routings:
        for name, m in experts:
            label = f"{name}, {routing}" if name else routing
            out.append((label, replace(base, model=m, router_skew=skew)))
    return tuple(out)


def bench_main(args: argparse.Namespace) -> int:
    """``graph-fsdp bench`` for ``--model mcore-*``: validation, launch, report."""
    job, plan, setup = build_bench_job(args)
    out = launch(plan, bench_worker, job)
    if out is None:
        return 0
    now = datetime.datetime.now()
    report = {
        **out,
        "model": args.model,
        "created": now.isoformat(timespec="seconds"),
        "setup": setup,
        "argv": getattr(args, "argv", None),
        "code": code_version(),
    }
    tag = "cpu" if plan.device == "cpu" else gpu_tag(out["device_name"])
    output_dir = args.output_dir or os.path.join(
        "bench", "results", f"{now:%Y-%m-%d_%H%M%S}_{tag}_{args.model}"
    )
    paths = write_report(report, output_dir)
    print(markdown(report))
    print("wrote " + ", ".join(paths.values()), file=sys.stderr)
    return 1 if any(r["status"] == "failed" for r in out["rows"]) else 0
