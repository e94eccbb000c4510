"""The ``train`` flags every ``--model`` shares, and the summary lines they add.

``--save``/``--load``/``--save-interval`` (:func:`checkpoint_plan`, with the iteration a
checkpoint holds written beside it), ``--data-path`` (:func:`check_data_path`: the file's
shape and every token id the run will read), ``--cuda-graph-verify`` (:func:`verify_option`).
``graph-fsdp train`` uses them for graph_fsdp's GPT (train_cmd.py) and for Megatron-Core
models (mcore.py) alike.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from graph_fsdp.cli.errors import CLIError
from graph_fsdp.cli.options import check_positive
from graph_fsdp.data import check_token_file, check_token_ids, training_samples

CHECKPOINT_META = "graph_fsdp_cli.json"
"""Written next to a --save checkpoint: the iteration it holds, so --load resumes there."""


def write_checkpoint_meta(path: str, iteration: int, model: str) -> None:
    """Rank 0, after a --save run: the iteration the checkpoint holds and the --model."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, CHECKPOINT_META), "w") as f:
        json.dump({"iteration": iteration, "model": model}, f)


def _load_start(args: argparse.Namespace) -> int:
    """The iteration a --load checkpoint holds; clear errors for a directory that is not one
    of ours or was written for another --model."""
    if not os.path.isdir(args.load):
        raise CLIError(
            f"--load {args.load}: no such checkpoint directory; pass the DIR a run with "
            "--save DIR wrote, or drop --load to start from scratch"
        )
    if not os.path.isfile(os.path.join(args.load, ".metadata")):
        raise CLIError(
            f"--load {args.load}: not a DCP checkpoint ({os.path.join(args.load, '.metadata')} "
            "is missing; an interrupted save leaves only DIR.tmp); pass the DIR a completed "
            "--save run wrote"
        )
    meta_path = os.path.join(args.load, CHECKPOINT_META)
    if not os.path.isfile(meta_path):
        return 0
    with open(meta_path) as f:
        meta = json.load(f)
    saved_model = meta.get("model")
    model = getattr(args, "model", "gpt")
    if saved_model is not None and saved_model != model:
        raise CLIError(
            f"--load {args.load} holds a --model {saved_model} checkpoint, but this run trains "
            f"--model {model}; use --model {saved_model} (and its shape flags) or another --load"
        )
    return int(meta.get("iteration", 0))


def check_data_path(
    args: argparse.Namespace,
    *,
    seq_length: int,
    vocab_size: int,
    world_size: int,
    grad_accum: int,
    start: int,
    steps: int,
) -> str:
    """--data-path: the file's shape, and the token ids of every sample the run will read
    (training and eval) against --vocab-size; returns the absolute path."""
    path = args.data_path
    try:
        num_tokens = check_token_file(path, seq_length, vocab_size)
        runs = [
            training_samples(
                start,
                steps,
                grad_accum=grad_accum,
                world_size=world_size,
                micro_batch_size=args.micro_batch_size,
            )
        ]
        if args.eval_interval:
            per_eval = world_size * args.micro_batch_size
            offset = (num_tokens - 1) // seq_length // 2  # batch_for's eval region
            for step in range(start, start + steps):
                if (step + 1) % args.eval_interval == 0:
                    runs.append((offset + step * per_eval, per_eval))
        check_token_ids(path, seq_length, vocab_size, runs)
    except ValueError as err:
        raise CLIError(str(err)) from err
    return os.path.abspath(path)


def checkpoint_plan(args: argparse.Namespace) -> tuple[int, int, int | None]:
    """(start_step, save_at relative to start, absolute save iteration or None)."""
    check_positive(args, "save_interval")
    if args.save_interval is not None and not args.save:
        raise CLIError("--save-interval is given without --save; add --save DIR")
    start = 0
    if args.load:
        start = _load_start(args)
        if start >= args.train_iters:
            raise CLIError(
                f"--load {args.load} holds iteration {start}, which already reaches --train-iters "
                f"{args.train_iters}; raise --train-iters to train further"
            )
    if not args.save:
        return start, 0, None
    interval = args.save_interval or args.train_iters
    last = args.train_iters // interval * interval
    if last <= start:
        raise CLIError(
            f"--save-interval {interval} never saves between iteration {start} and --train-iters "
            f"{args.train_iters}; lower --save-interval"
        )
    if last - interval > start:
        print(
            f"note: the engine saves once per run; --save {args.save} gets iteration {last}",
            file=sys.stderr,
        )
    return start, last - start, last


def verify_option(args: argparse.Namespace) -> bool | str:
    """--cuda-graph-verify as the runners' ``verify`` (False, True = warn, "raise")."""
    if args.cuda_graph_verify is None:
        return False
    if args.cuda_graph_impl == "none":
        raise CLIError(
            "--cuda-graph-verify checks a graphed step, but --cuda-graph-impl is none: add "
            "--cuda-graph-impl te (or torch) or drop --cuda-graph-verify"
        )
    return "raise" if args.cuda_graph_verify == "raise" else True


def verification_lines(result: dict) -> list[str]:
    """Summary lines of the first graphed step's verification (--cuda-graph-verify)."""
    report = result.get("cuda_graphs") or {}
    return [f"  graph verification: {v['summary']}" for v in report.get("verification", [])]


def graphs_label(cfg) -> str:
    """How a run's steps execute, for summaries: ``eager`` or ``<impl> graphs [<scopes>]``."""
    if cfg.cuda_graph_impl == "none":
        return "eager"
    return f"{cfg.cuda_graph_impl} graphs [{' '.join(cfg.cuda_graph_scope) or 'layer'}]"


def input_lines(cfg) -> list[str]:
    """Summary lines for the token file and the optimizer offload a run used (our models and
    Megatron-Core's alike)."""
    lines = []
    if cfg.data_path:
        lines.append(f"  data: {cfg.data_path} (uint16 token file)")
    if cfg.optimizer_offload_fraction:
        lines.append(f"  optimizer CPU offload: fraction {cfg.optimizer_offload_fraction}")
    return lines
