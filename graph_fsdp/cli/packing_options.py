"""The command line's packed-sequence flags (train, compare, bench, profile):
``--packed-sequences`` and its budget settings (training/packing.py, models/packed.py [Note:
packed sequences under CUDA graphs]).

Megatron spells packing of a pretraining stream as three flags, ``--reset-position-ids
--reset-attention-mask --eod-mask-loss``; given together they mean ``--packed-sequences``
here (one or two of them alone are refused: graph_fsdp's packs always restart positions, mask
attention at document ends and carry no loss across them).
"""

from __future__ import annotations

import argparse

from graph_fsdp.cli.errors import CLIError
from graph_fsdp.training.packing import PackingPolicy

MEGATRON_TRIO = ("reset_position_ids", "reset_attention_mask", "eod_mask_loss")


def add_packing_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("packed sequences")
    g.add_argument(
        "--packed-sequences",
        action="store_true",
        help="Pack variable-length documents into each --seq-length row (the token budget), "
        "attention within each document only, positions restarting per document, the loss "
        "per real token over the step; every capture mode replays over changing packs.",
    )
    for name in MEGATRON_TRIO:
        g.add_argument(
            "--" + name.replace("_", "-"),
            action="store_true",
            help="Megatron's spelling: the three together mean --packed-sequences.",
        )
    g.add_argument(
        "--packed-max-documents",
        type=int,
        default=16,
        metavar="D",
        help="Documents per row at most (more go to the next pack; default 16).",
    )
    g.add_argument(
        "--packed-mean-document-length",
        type=int,
        default=600,
        metavar="N",
        help="Synthetic documents (no --data-path): mean of their lognormal lengths.",
    )
    g.add_argument(
        "--eod-token-id",
        type=int,
        default=None,
        help="With --data-path: the token that ends each document (Megatron's convention).",
    )
    g.add_argument(
        "--no-split-documents",
        action="store_true",
        help="Refuse a document longer than --seq-length instead of splitting it at the budget.",
    )


def packing_of(args: argparse.Namespace) -> PackingPolicy | None:
    """The run's PackingPolicy (None without --packed-sequences); refuses what packing does not
    support, naming the flag. The layers each --model packs with: graph_fsdp's GPT its local
    layers (they take the document boundaries), Megatron-Core models the TransformerEngine
    spec (TE's THD attention: integrations/megatron/packed.py)."""
    trio = [name for name in MEGATRON_TRIO if getattr(args, name, False)]
    if trio and len(trio) < len(MEGATRON_TRIO):
        missing = [f"--{n.replace('_', '-')}" for n in MEGATRON_TRIO if n not in trio]
        raise CLIError(
            f"--{trio[0].replace('_', '-')} alone is not supported: graph_fsdp packs documents "
            f"with all three of Megatron's settings; add {' '.join(missing)} or use "
            "--packed-sequences"
        )
    if not (getattr(args, "packed_sequences", False) or trio):
        for flag, value in (("--eod-token-id", args.eod_token_id),):
            if value is not None:
                raise CLIError(f"{flag} {value} is given without --packed-sequences: add it")
        return None
    model = getattr(args, "model", "gpt")
    if args.tensor_model_parallel_size > 1 and model == "gpt":
        raise CLIError(
            f"--packed-sequences with --tensor-model-parallel-size "
            f"{args.tensor_model_parallel_size} and --model gpt: the reference GPT packs "
            "documents without tensor parallelism; use --model mcore-gpt (Megatron-Core packs "
            "at any TP size) or drop one of them"
        )
    if model == "gpt" and args.transformer_impl != "local":
        raise CLIError(
            f"--packed-sequences needs --transformer-impl local (got {args.transformer_impl}): "
            "the reference layers take the document boundaries"
        )
    if model != "gpt" and args.transformer_impl != "transformer_engine":
        raise CLIError(
            f"--packed-sequences with --model {model} needs --transformer-impl "
            f"transformer_engine (got {args.transformer_impl}): Megatron-Core's packed attention "
            "is TransformerEngine's THD attention (PackedSeqParams), and the local spec's "
            "DotProductAttention refuses packed sequences"
        )
    if getattr(args, "data_path", None) and args.eod_token_id is None:
        raise CLIError(
            f"--packed-sequences with --data-path {args.data_path} needs --eod-token-id, the "
            "token that ends each document"
        )
    try:
        return PackingPolicy(
            budget=args.seq_length,
            max_documents=args.packed_max_documents,
            split_documents=not args.no_split_documents,
            mean_document_length=args.packed_mean_document_length,
            seed=args.seed,
        )
    except ValueError as err:
        flag = str(err).split("=")[0].replace("PackingPolicy.", "--packed-").replace("_", "-")
        raise CLIError(f"{err} ({flag})") from err
