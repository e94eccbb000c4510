"""The command line's CUDA graph flags: Megatron's ``--cuda-graph-*`` spellings, scope sets,
the GraphPolicy they resolve to, and the checks of the machine and buffers a capture needs."""

from __future__ import annotations

import argparse
import importlib.util
import os
import re

from graph_fsdp.capture.policy import GraphPolicy
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
from graph_fsdp.distributed import GRAPH_REGISTER_ENV
from graph_fsdp.fsdp.api import BufferPolicy
from graph_fsdp.models import GPTConfig
from graph_fsdp.training.processes import LaunchPlan


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
        "--cuda-graph-overlap-next-gather",
        dest="cuda_graph_overlap_next_gather",
        action="store_true",
        help="With --cuda-graph-optimizer: update the first two units of the forward (the "
        "root and the unit it prefetches) first and start their next-step all-gathers "
        "(ZeRO-3) or weight refreshes (ZeRO-1/2) under the rest of the optimizer step, so the "
        "next step starts with them gathered (Megatron's --overlap-param-gather-with-"
        "optimizer-step, inside the graph). Same bits. bench: each one-graph row is run "
        "with and without it, beside full_iteration with the eager optimizer.",
    )
    g.add_argument(
        "--cuda-graph-norm-beside-last-reduction",
        dest="cuda_graph_norm_beside_last_reduction",
        action="store_true",
        help="With --cuda-graph-optimizer: the global gradient norm over the gradients "
        "reduced before the step's last reduction (a ZeRO-3 GPT's input embedding) runs on a "
        "side stream beside that reduction instead of after it. Same bits.",
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
            overlap_next_gather=getattr(args, "cuda_graph_overlap_next_gather", False),
            norm_beside_last_reduction=getattr(
                args, "cuda_graph_norm_beside_last_reduction", False
            ),
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


def registration_off_for_all_to_alls(all_to_all: bool, scope_sets) -> None:
    """``NCCL_GRAPH_REGISTER=0`` when a ``full_iteration`` graph of this command captures an
    all-to-all (the gradients' with fp32 accumulation, an expert dispatch's): capture/step.py
    [Note: NCCL graph registration and the all-to-all]. Set before the launcher's ranks (or
    this torchrun rank) create their NCCL groups; a value the user exported is kept (and
    refused at capture unless it is 0)."""
    if all_to_all and any("full_iteration" in scopes for scopes in scope_sets):
        os.environ.setdefault(GRAPH_REGISTER_ENV, "0")


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


def buffer_policy_of(args: argparse.Namespace) -> BufferPolicy:
    """The BufferPolicy of --fsdp-buffer / --fsdp-double-buffer and the persist flag."""
    return BufferPolicy(
        allocator=allocator_of(args),
        persist_on_alloc_fail=args.fsdp_db_use_persist_buf_on_alloc_fail,
    )
