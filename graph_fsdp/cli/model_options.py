"""The command line's model flags: the reference GPT's shape and MoE settings (Megatron's
spellings), checked against the ranks, and the GPTConfig they describe."""

from __future__ import annotations

import argparse
import re

from graph_fsdp.cli.errors import CLIError
from graph_fsdp.models import GPTConfig

TRANSFORMER_IMPLS = ("local", "transformer_engine")
"""Megatron's --transformer-impl: the reference torch layers or TransformerEngine layers."""


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
        help="--moe-dropless (Megatron-Core: --moe-experts-impl grouped_mm) with expert "
        "parallelism: rows an EP rank receives from one peer, as a multiple of the balanced "
        "load (default: every copy, never drops; a step that overflows a smaller factor is "
        "repeated exactly with every copy's buffer, counted as an overflow step and named in a "
        "warning with the factor that would have held it).",
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


SHAPE_FLAGS = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "ffn_hidden_size",
    "seq_length",
    "vocab_size",
    "moe_router_topk",
    "transformer_impl",
    "seed",
)
"""The model flags whose ``dest`` is the config field's name in graph_fsdp's GPTConfig and
Megatron-Core's MCoreGPTConfig alike."""


def shape_fields(args: argparse.Namespace) -> dict:
    """The model config fields of :data:`SHAPE_FLAGS` (every ``--model``)."""
    return {name: getattr(args, name) for name in SHAPE_FLAGS}


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
    """--moe-dropless (graph_fsdp's GPT) against the capacity flags, and the receive-buffer
    factor against what it sizes (--moe-dropless; Megatron-Core's grouped_mm at EP > 1)."""
    dropless = getattr(args, "moe_dropless", False)
    buffer = getattr(args, "moe_receive_buffer_factor", None)
    if dropless and capacity_factor is not None:
        raise CLIError(
            f"--moe-dropless and --moe-expert-capacity-factor {capacity_factor}: a dropless "
            "layer has no capacity; drop one of them"
        )
    if buffer is None or dropless:
        return
    if getattr(args, "model", "gpt") == "gpt":
        raise CLIError(
            f"--moe-receive-buffer-factor {buffer} sizes the dropless exchange: add "
            "--moe-dropless (or drop the factor)"
        )
    if args.moe_experts_impl != "grouped_mm" or args.expert_model_parallel_size == 1:
        raise CLIError(
            f"--moe-receive-buffer-factor {buffer} sizes the grouped_mm experts' exchange over "
            f"the expert-parallel group (--model {args.model}): add --moe-experts-impl "
            "grouped_mm and --expert-model-parallel-size N > 1 (or drop the factor)"
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
            **shape_fields(args),
            num_experts=args.num_experts,
            moe_layer_freq=args.moe_layer_freq,
            **(
                {"moe_capacity_factor": args.moe_expert_capacity_factor}
                if args.moe_expert_capacity_factor is not None
                else {}
            ),
            moe_dropless=args.moe_dropless,
            moe_receive_buffer_factor=args.moe_receive_buffer_factor,
        )
    except ValueError as err:
        raise CLIError(re.sub(r"GPTConfig\.(\w+)", lambda m: _flag(m.group(1)), str(err))) from err
