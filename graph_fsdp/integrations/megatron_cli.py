"""``graph-fsdp train --model mcore-gpt|mcore-moe``: Megatron-Core GPTs through the CLI.

    graph-fsdp train --model mcore-gpt --transformer-impl transformer_engine --bf16 \\
        --fsdp-double-buffer --fsdp-db-use-persist-buf-on-alloc-fail \\
        --cuda-graph-impl te --cuda-graph-scope attn mlp
    graph-fsdp train --model mcore-moe --num-experts 4 --moe-router-topk 2 \\
        --moe-shared-expert-intermediate-size 512 --transformer-impl transformer_engine --bf16 \\
        --fsdp-double-buffer --fsdp-db-use-persist-buf-on-alloc-fail \\
        --cuda-graph-impl te --cuda-graph-scope attn moe_router

The flags are the shared ones (Megatron spellings) plus the Megatron-Bridge settings
:func:`graph_fsdp.config.validate_fsdp_config` checks. Every check runs before a process
starts; megatron-core is imported only by the ranks.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
from dataclasses import replace
from statistics import median

from graph_fsdp.api import BufferPolicy
from graph_fsdp.capture.scopes import GraphConfigError
from graph_fsdp.cli.errors import CLIError
from graph_fsdp.cli.launch import launch, resolve_plan
from graph_fsdp.cli.options import allocator_of, check_graph_environment, grad_accumulation
from graph_fsdp.config import FSDPConfigError, validate_fsdp_config

MODELS = ("gpt", "mcore-gpt", "mcore-moe")
"""--model: graph_fsdp's reference GPT, or a Megatron-Core GPTModel (dense / MoE)."""


def add_megatron_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("Megatron-Core models and Megatron-Bridge settings")
    g.add_argument(
        "--model",
        choices=MODELS,
        default="gpt",
        help="gpt: graph_fsdp's reference model; mcore-gpt: a Megatron-Core GPTModel "
        "(--num-experts makes it MoE); mcore-moe: the MoE GPTModel (default 4 experts). "
        'Megatron-Core models need pip install -e ".[megatron]".',
    )
    g.add_argument(
        "--moe-shared-expert-intermediate-size",
        type=int,
        default=None,
        help="Megatron-Core MoE: inner size of the shared expert (unset: none).",
    )
    g.add_argument(
        "--use-megatron-schedule",
        action="store_true",
        help="Megatron-Core models: run each step through get_forward_backward_func().",
    )
    g.add_argument(
        "--ckpt-format",
        default="fsdp_dtensor",
        help="Checkpoint format (Megatron-Bridge's name); graph_fsdp writes DCP: fsdp_dtensor.",
    )
    g.add_argument(
        "--use-torch-fsdp2",
        action="store_true",
        help="Megatron-Bridge's torch FSDP2 switch; rejected: graph_fsdp is the FSDP engine.",
    )
    g.add_argument(
        "--use-tp-pp-dp-mapping",
        action="store_true",
        help="Megatron-Bridge's rank-order switch; rejected (unsupported with graph_fsdp).",
    )
    g.add_argument(
        "--cpu-offload",
        action="store_true",
        help="Checked against Megatron-Bridge's rules (pipeline size 1, no recompute).",
    )


def validate_bridge_flags(args: argparse.Namespace) -> None:
    """Megatron-Bridge's FSDP rules (graph_fsdp.config), for every --model."""
    try:
        validate_fsdp_config(
            use_graph_fsdp=True,
            use_torch_fsdp2=args.use_torch_fsdp2,
            use_tp_pp_dp_mapping=args.use_tp_pp_dp_mapping,
            ckpt_format=args.ckpt_format,
            save=args.save,
            load=args.load,
            cpu_offload=args.cpu_offload,
            recompute_granularity="full" if args.recompute_activations else None,
        )
    except FSDPConfigError as err:
        raise CLIError(str(err)) from err
    if args.cpu_offload:
        raise CLIError("--cpu-offload: graph_fsdp has no CPU offload yet; drop --cpu-offload")


def mcore_config(args: argparse.Namespace):
    """The MCoreGPTConfig of the flags (no megatron import: the dataclass is pure)."""
    from graph_fsdp.integrations.megatron import MCoreGPTConfig  # noqa: PLC0415

    experts = args.num_experts
    if args.model == "mcore-moe" and experts is None:
        experts = 4
    if args.model == "mcore-gpt" and args.moe_shared_expert_intermediate_size and not experts:
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
            num_layers=args.num_layers,
            hidden_size=args.hidden_size,
            num_attention_heads=args.num_attention_heads,
            ffn_hidden_size=args.ffn_hidden_size,
            seq_length=args.seq_length,
            vocab_size=args.vocab_size,
            num_experts=experts,
            moe_router_topk=args.moe_router_topk,
            moe_shared_expert_intermediate_size=args.moe_shared_expert_intermediate_size,
            transformer_impl=args.transformer_impl,
            bf16=args.bf16,
            seed=args.seed,
        )
    except ValueError as err:
        raise CLIError(str(err).replace("MCoreGPTConfig.", "--").replace("_", "-")) from err


def main(args: argparse.Namespace) -> int:
    """``graph-fsdp train`` for ``--model mcore-*`` (validation, launch, summary)."""
    from graph_fsdp.integrations.megatron import check_mcore_scopes  # noqa: PLC0415
    from graph_fsdp.integrations.megatron_train import MCoreTrainConfig  # noqa: PLC0415

    validate_bridge_flags(args)
    plan = resolve_plan(args.device, args.nproc)
    model = mcore_config(args)
    impl = args.cuda_graph_impl
    scopes = list(args.cuda_graph_scope or [])
    if args.cuda_graph_scope is not None and impl == "none":
        raise CLIError(
            "--cuda-graph-scope is given but --cuda-graph-impl is none: add --cuda-graph-impl te "
            "(or torch), or drop --cuda-graph-scope"
        )
    if impl != "none":
        try:
            check_mcore_scopes(model, scopes)
            from graph_fsdp.capture.scopes import check_static_buffers  # noqa: PLC0415

            check_static_buffers(
                BufferPolicy(
                    allocator=allocator_of(args),
                    persist_on_alloc_fail=args.fsdp_db_use_persist_buf_on_alloc_fail,
                ),
                scopes,
            )
        except GraphConfigError as err:
            raise CLIError(str(err)) from err
        if args.train_iters <= args.cuda_graph_warmup_steps:
            raise CLIError(
                f"--train-iters {args.train_iters} must exceed --cuda-graph-warmup-steps "
                f"{args.cuda_graph_warmup_steps}, or no step ever runs graphed"
            )
    if "full_iteration" in scopes and allocator_of(args) == "dynamic":
        raise CLIError(
            "--cuda-graph-scope full_iteration replays FSDP's buffer hand-offs at fixed "
            "addresses: add --fsdp-double-buffer (or --fsdp-trace-pool)"
        )
    if args.use_megatron_schedule and "full_iteration" in scopes:
        raise CLIError(
            "--use-megatron-schedule with --cuda-graph-scope full_iteration: the full-iteration "
            "graph replaces the forward/backward schedule; drop one of them"
        )
    if args.recompute_activations:
        raise CLIError("--recompute-activations is not wired for Megatron-Core models; drop it")
    if args.data_path or args.load or args.save:
        raise CLIError(
            "--data-path, --save and --load are not wired for Megatron-Core models in the CLI "
            "yet (synthetic tokens; graph_fsdp.checkpoint works from Python)"
        )
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
    cfg = MCoreTrainConfig(
        model=model,
        strategy=args.data_parallel_sharding_strategy,
        micro_batch_size=args.micro_batch_size,
        grad_accum=grad_accumulation(args, plan.world_size),
        steps=args.train_iters,
        lr=args.lr,
        weight_decay=args.weight_decay,
        bf16=args.bf16,
        allocator=allocator_of(args),
        persist_on_alloc_fail=args.fsdp_db_use_persist_buf_on_alloc_fail,
        eval_interval=args.eval_interval,
        use_megatron_schedule=args.use_megatron_schedule,
        cuda_graph_impl=impl,
        cuda_graph_scope=scopes,
        cuda_graph_warmup_steps=args.cuda_graph_warmup_steps,
        deterministic=args.deterministic,
    )
    if args.log_json:
        os.makedirs(os.path.dirname(os.path.abspath(args.log_json)) or ".", exist_ok=True)
        open(args.log_json, "w").close()  # overwritten, like the reference model's log
        cfg = replace(cfg, log_path=os.path.abspath(args.log_json))
    out = launch(plan, _worker, cfg)
    if out is None:
        return 0
    peak = out.get("peak_memory_bytes")
    graphs = "eager" if impl == "none" else f"{impl} graphs [{' '.join(scopes) or 'layer'}]"
    print(
        f"graph-fsdp train --model {args.model}: {len(out['losses'])} steps on {plan.describe()}; "
        f"{cfg.strategy}, {graphs}\n"
        f"  final loss {out['losses'][-1]:.6f} | median step {median(out['times']) * 1e3:.2f} ms"
        f" | peak memory {f'{peak / 2**30:.2f} GiB' if peak else 'n/a (cpu)'}"
    )
    return 0


def _worker(rank: int, world_size: int, cfg) -> dict | None:
    from graph_fsdp.integrations.megatron_train import run  # noqa: PLC0415

    result = run(rank, world_size, cfg)
    return result if rank == 0 else None
