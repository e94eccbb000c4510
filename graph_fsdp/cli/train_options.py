"""The ``train`` flags every ``--model`` shares, and the summary lines they add.

``--save``/``--load``/``--save-interval`` (:func:`checkpoint_plan`: where --save may write,
what --load holds, checked before any rank starts; the iteration a checkpoint holds is
written into it), ``--data-path`` (:func:`check_data_path`: the file's
shape and every token id the run will read), ``--cuda-graph-verify`` (:func:`verify_option`).
``graph-fsdp train`` uses them for graph_fsdp's GPT (train_cmd.py) and for Megatron-Core
models (mcore.py) alike.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from graph_fsdp.capture.scopes import scope_label
from graph_fsdp.cli.errors import CLIError
from graph_fsdp.cli.options import Resolved, check_optimizer_args, check_positive
from graph_fsdp.cli.paths import check_output_file, check_save_dir
from graph_fsdp.fsdp import checkpoint
from graph_fsdp.models import build_model
from graph_fsdp.training.data import check_token_file, check_token_ids, training_samples
from graph_fsdp.training.preflight import MemoryPlanError, check_fits

CHECKPOINT_META = checkpoint.META_FILE
"""In a --save checkpoint: the iteration it holds (so --load resumes there) and the --model."""


def write_checkpoint_meta(path: str, iteration: int, model: str) -> None:
    """Rank 0, after a --save run: the iteration the checkpoint holds and the --model."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, CHECKPOINT_META), "w") as f:
        json.dump({"iteration": iteration, "model": model}, f)


def _load_start(args: argparse.Namespace, shapes: dict | None = None) -> int:
    """The iteration a --load checkpoint holds. Refused with the fix, before any rank starts:
    a directory that is not one of ours, one written for another --model, metadata that is
    missing or corrupt, truncated files and (``shapes``: parameter name -> shape of this run's
    model) another model shape. Strategy and world size need no check: the format loads onto
    any (checkpoint.py)."""
    path = args.load
    if checkpoint.recover_interrupted_save(path):
        print(
            f"note: --load {path}: a save was killed while replacing it; the previous "
            f"checkpoint was put back from {path}.old",
            file=sys.stderr,
        )
    if not os.path.isdir(path):
        raise CLIError(
            f"--load {path}: no such checkpoint directory; pass the DIR a run with "
            "--save DIR wrote, or drop --load to start from scratch"
        )
    if not os.path.isfile(os.path.join(path, ".metadata")):
        raise CLIError(
            f"--load {path}: not a DCP checkpoint ({os.path.join(path, '.metadata')} "
            "is missing; an interrupted save leaves only DIR.tmp); pass the DIR a completed "
            "--save run wrote"
        )
    model = getattr(args, "model", "gpt")
    meta_path = os.path.join(path, CHECKPOINT_META)
    meta = _read_meta(meta_path) if os.path.isfile(meta_path) else {}
    iteration = meta.get("iteration")
    if not isinstance(iteration, int) or iteration < 0:
        why = "has no iteration" if os.path.isfile(meta_path) else "is missing"
        raise CLIError(
            f"--load {path}: {meta_path} {why}, so the iteration to resume at is unknown "
            "(graph-fsdp train --save writes it; graph_fsdp.fsdp.checkpoint.save only with meta=). "
            f'If this is a checkpoint of this model, write {{"iteration": N, "model": '
            f'"{model}"}} there; else pass a DIR a graph-fsdp train --save run wrote'
        )
    saved_model = meta.get("model")
    if saved_model is not None and saved_model != model:
        raise CLIError(
            f"--load {path} holds a --model {saved_model} checkpoint, but this run trains "
            f"--model {model}; use --model {saved_model} (and its shape flags) or another --load"
        )
    try:
        checkpoint.check_checkpoint(path, shapes)
    except checkpoint.CheckpointError as err:
        raise CLIError(f"--load: {err}") from None
    return iteration


def _read_meta(meta_path: str) -> dict:
    try:
        with open(meta_path) as f:
            meta = json.load(f)
    except (OSError, ValueError) as err:
        raise CLIError(f"--load: {meta_path} is unreadable ({err}); restore it") from None
    return meta if isinstance(meta, dict) else {}


def model_shapes(model_cfg) -> dict | None:
    """Parameter name -> shape of the model ``model_cfg`` builds (on the meta device: no
    memory, no weights); None where it cannot be built there (TransformerEngine layers)."""
    if getattr(model_cfg, "transformer_impl", "local") != "local":
        return None
    try:
        model = build_model(model_cfg, device="meta")
    except Exception:  # noqa: BLE001 - no shape check then; the ranks' load still checks
        return None
    return {name: p.shape for name, p in model.named_parameters()}


def check_train_only_flags(args: argparse.Namespace) -> None:
    """Flags of ``train`` itself, for every --model: optimizer, --save-on-interrupt,
    --log-json, a --load that is a file (checked before any rank starts)."""
    check_optimizer_args(args)
    if args.save_on_interrupt and not args.save:
        raise CLIError(
            "--save-on-interrupt (--exit-signal-handler) saves to --save DIR when a signal "
            "stops the run: add --save DIR"
        )
    if args.log_json:
        check_output_file("--log-json", args.log_json)
    if args.load and os.path.lexists(args.load) and not os.path.isdir(args.load):
        raise CLIError(
            f"--load {args.load} is a file, not a checkpoint directory; pass the DIR a run "
            "with --save DIR wrote (a checkpoint is a directory of shards)"
        )


def check_memory(res: Resolved) -> None:
    """Refuse a run whose per-rank memory estimate exceeds what a rank has, before any rank
    allocates (training/preflight.py [Note: memory pre-flight])."""
    plan = res.plan
    local = plan.world_size
    if plan.under_launcher:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", plan.world_size))
    try:
        check_fits(res.cfg, world_size=plan.world_size, local_ranks=local)
    except MemoryPlanError as err:
        raise CLIError(str(err)) from None


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
    """--data-path: the file's shape, that it holds every training sample the run reads
    (else refused, or with --allow-data-reuse a note: :func:`_check_data_length`), and the token
    ids of every sample the run will read (training and eval) against --vocab-size; returns
    the absolute path."""
    path = args.data_path
    try:
        num_tokens = check_token_file(path, seq_length, vocab_size)
        first, count = training_samples(
            start,
            steps,
            grad_accum=grad_accum,
            world_size=world_size,
            micro_batch_size=args.micro_batch_size,
        )
        runs = [(first, count)]
        if args.eval_interval:
            per_eval = world_size * args.micro_batch_size
            offset = (num_tokens - 1) // seq_length // 2  # batch_for's eval region
            for step in range(start, start + steps):
                if (step + 1) % args.eval_interval == 0:
                    runs.append((offset + step * per_eval, per_eval))
        check_token_ids(path, seq_length, vocab_size, runs)
    except ValueError as err:
        raise CLIError(str(err)) from err
    _check_data_length(
        args,
        seq_length=seq_length,
        num_tokens=num_tokens,
        needed=first + count,
        per_step=count // max(steps, 1),
    )
    return os.path.abspath(path)


def _check_data_length(
    args: argparse.Namespace, *, seq_length: int, num_tokens: int, needed: int, per_step: int
) -> None:
    """A token file holds fewer samples than the run reads up to its last iteration: refused
    (the stream would wrap around and train on the same samples again), or with
    --allow-data-reuse said once on stderr."""
    num_samples = (num_tokens - 1) // seq_length
    if needed <= num_samples:
        return
    held = (
        f"--data-path {args.data_path} holds {num_samples} sample{'s' * (num_samples != 1)} "
        f"of --seq-length {seq_length} ({num_tokens} tokens), but the run reads {needed} "
        f"({per_step} per iteration up to --train-iters {args.train_iters})"
    )
    if getattr(args, "allow_data_reuse", False):
        times = needed / num_samples
        print(f"note: {held}: each sample is read {times:.3g} times on average", file=sys.stderr)
        return
    raise CLIError(
        f"{held}, so it would train on the same samples again; pass a file of at least "
        f"{needed * seq_length + 1} tokens, fewer --train-iters, or --allow-data-reuse to "
        "read it again on purpose"
    )


def checkpoint_plan(
    args: argparse.Namespace, shapes: dict | None = None
) -> tuple[int, int, int | None]:
    """(start_step, save_at relative to start, absolute save iteration or None); --save and
    --load checked (``shapes``: see :func:`_load_start`)."""
    check_positive(args, "save_interval")
    if args.save_interval is not None and not args.save:
        raise CLIError("--save-interval is given without --save; add --save DIR")
    if args.save:
        check_save_dir("--save", args.save)
    start = 0
    if args.load:
        start = _load_start(args, shapes)
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
    whole_step = cfg.cuda_graph_optimizer
    if cfg.cuda_graph_impl == "none":
        return "eager (whole-step API)" if whole_step else "eager"
    return f"{cfg.cuda_graph_impl} graphs [{scope_label(cfg.cuda_graph_scope, whole_step)}]"


def input_lines(cfg) -> list[str]:
    """Summary lines for the token file and the optimizer offload a run used (our models and
    Megatron-Core's alike)."""
    lines = []
    if cfg.data_path:
        lines.append(f"  data: {cfg.data_path} (uint16 token file)")
    if cfg.optimizer_offload_fraction:
        lines.append(f"  optimizer CPU offload: fraction {cfg.optimizer_offload_fraction}")
    return lines
