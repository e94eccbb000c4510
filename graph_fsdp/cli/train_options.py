"""The ``train`` flags every ``--model`` shares, and the summary lines they add.

``--save``/``--load``/``--save-interval``/``--save-keep-last`` and the resume flags
(:func:`checkpoint_plan`: where --save may write, what --load holds and whether its optimizer
settings match, checked before any rank starts, as the config's ``checkpoint`` section;
:func:`loop_fields`: the loop's steps, checkpoint and NaN/Inf fields), ``--data-path`` (:func:`check_data_path`: the file's
shape, its length and every token id the run will read, or the packs it makes), ``--cuda-graph-verify`` (:func:`verify_option`).
``graph-fsdp train`` uses them for graph_fsdp's GPT (train_cmd.py) and for Megatron-Core
models (mcore.py) alike.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import dataclass

from graph_fsdp.capture.scopes import scope_label
from graph_fsdp.cli.errors import CLIError
from graph_fsdp.cli.options import Resolved, check_optimizer_args, check_positive
from graph_fsdp.cli.paths import check_output_file, check_save_dir
from graph_fsdp.fsdp import checkpoint
from graph_fsdp.models import build_model
from graph_fsdp.training import checkpoints as run_checkpoints
from graph_fsdp.training.checkpoints import CheckpointPolicy
from graph_fsdp.training.data import check_run_data
from graph_fsdp.training.packing import PackedData, PackingPolicy
from graph_fsdp.training.preflight import MemoryPlanError, check_fits

CHECKPOINT_META = checkpoint.META_FILE
"""In a --save checkpoint: the iteration it holds (so --load resumes there), the --model and
the optimizer settings (for the resume check)."""

RESUME_FLAGS = {"lr": "--lr", "weight_decay": "--weight-decay"}
"""The optimizer settings a checkpoint records, by the flag that sets them."""


@dataclass(frozen=True, kw_only=True)
class CheckpointPlan:
    """--save/--load/--save-interval resolved before any rank starts."""

    start: int
    """The iteration the run starts at (the --load checkpoint's, else 0)."""
    checkpoint: CheckpointPolicy
    """The config's ``checkpoint`` section; ``load_path``: the checkpoint directory --load
    reads (the iteration a run directory's tracker names)."""


def _load_start(args: argparse.Namespace, mode: str, shapes: dict | None = None) -> tuple[int, str]:
    """The iteration a --load checkpoint holds and its directory (a run directory's latest
    complete iteration: training/checkpoints.py). Refused with the fix, before any rank
    starts: a directory that is not one of ours, one written for another --model, metadata
    that is missing or corrupt, truncated files, (``shapes``: parameter name -> shape of this
    run's model) another model shape, and optimizer settings that differ from the command
    line's (:func:`check_resume_settings`, ``mode``: :func:`resume_mode`). Strategy and world size need no check: the format
    loads onto any (checkpoint.py)."""
    given = args.load
    try:
        path = run_checkpoints.resolve_checkpoint(given) if os.path.isdir(given) else given
    except checkpoint.CheckpointError as err:
        raise CLIError(f"--load {given}: {err}") from None
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
            f"is missing and there is no {run_checkpoints.TRACKER_FILE}; an interrupted save "
            "leaves only DIR.tmp); pass the DIR a completed --save run wrote"
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
    wanted = {key: getattr(args, key) for key in RESUME_FLAGS}
    check_resume_settings(wanted, mode, path, meta.get("optimizer"))
    try:
        checkpoint.check_checkpoint(path, shapes)
    except checkpoint.CheckpointError as err:
        raise CLIError(f"--load: {err}") from None
    return iteration, path


def resume_mode(args: argparse.Namespace) -> str:
    """``LoopConfig.resume_optimizer_settings`` of --override-opt_param-scheduler /
    --use-checkpoint-opt_param-scheduler (Megatron's spellings)."""
    override, keep = args.override_opt_param_scheduler, args.use_checkpoint_opt_param_scheduler
    if override and keep:
        raise CLIError(
            "--override-opt_param-scheduler takes the command line's optimizer settings, "
            "--use-checkpoint-opt_param-scheduler the checkpoint's: pass one of them"
        )
    return "config" if override else "checkpoint" if keep else "check"


def check_resume_settings(
    wanted: dict[str, float], mode: str, path: str, saved: dict | None
) -> None:
    """Refuse a resume whose --lr / --weight-decay (``wanted``, by :data:`RESUME_FLAGS`' keys)
    differ from the checkpoint's, naming both, unless ``mode`` (:func:`resume_mode`) says
    which to take (training/checkpoints.py [Note: optimizer settings on resume]; the ranks
    check again against what the checkpoint holds)."""
    if mode != "check" or not isinstance(saved, dict):
        return
    differ = [
        f"{flag} {wanted[key]:g} vs {float(saved[key]):g} in the checkpoint"
        for key, flag in RESUME_FLAGS.items()
        if isinstance(saved.get(key), int | float)
        and not math.isclose(float(saved[key]), wanted[key], rel_tol=1e-6)
    ]
    if differ:
        raise CLIError(
            f"--load {path}: the command line's optimizer settings differ from the "
            f"checkpoint's ({'; '.join(differ)}); pass --override-opt_param-scheduler to train "
            "with the command line's or --use-checkpoint-opt_param-scheduler to keep the "
            "checkpoint's"
        )


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
    packing: PackingPolicy | None = None,
) -> str | None:
    """--data-path against the run, before any rank starts; the absolute path (None without
    --data-path). Packed documents (``packing``): the file's documents (ids below
    --vocab-size) make every pack the run reads. Fixed rows (training/data.py
    :func:`check_run_data`): the file's shape, the token ids of every sample the run reads,
    a file shorter than the run refused or, with --allow-data-reuse, a note on stderr.
    ``world_size``: the ranks that read different batches."""
    if not args.data_path:
        return None
    path = os.path.abspath(args.data_path)
    per_step = grad_accum * world_size * args.micro_batch_size
    try:
        if packing is not None:
            # Packs are read from (step * grad_accum + micro) * world * micro_batch_size on.
            data = PackedData(
                packing, vocab_size=vocab_size, data_path=path, eod_token_id=args.eod_token_id
            )
            data.rows((start + steps) * per_step - 1, 1)
            return path
        note = check_run_data(
            args.data_path,
            seq_length=seq_length,
            vocab_size=vocab_size,
            start_step=start,
            steps=steps,
            grad_accum=grad_accum,
            world_size=world_size,
            micro_batch_size=args.micro_batch_size,
            eval_interval=args.eval_interval,
            allow_reuse=getattr(args, "allow_data_reuse", False),
        )
    except ValueError as err:
        prefix = f"--data-path {args.data_path}: " if packing is not None else ""
        raise CLIError(f"{prefix}{err}") from err
    if note is not None:
        print(f"note: {note}", file=sys.stderr)
    return path


def checkpoint_plan(args: argparse.Namespace, shapes: dict | None = None) -> CheckpointPlan:
    """--save, --save-interval, --save-keep-last, --save-on-interrupt, --load and the resume
    flags, checked, as the start iteration and the config's ``checkpoint`` section
    (``shapes``: see :func:`_load_start`)."""
    check_positive(args, "save_interval", "save_keep_last")
    for name, flag in (
        ("save_interval", "--save-interval"),
        ("save_keep_last", "--save-keep-last"),
    ):
        if getattr(args, name) is not None and not args.save:
            raise CLIError(f"{flag} is given without --save; add --save DIR")
    if args.max_consecutive_skipped_steps < 0:
        raise CLIError(
            f"--max-consecutive-skipped-steps {args.max_consecutive_skipped_steps} must be >= 0 "
            "(0: never stop for skipped steps)"
        )
    mode = resume_mode(args)
    if mode != "check" and not args.load:
        flag = "--override" if mode == "config" else "--use-checkpoint"
        raise CLIError(f"{flag}-opt_param-scheduler applies when resuming: add --load DIR")
    if args.save:
        check_save_dir("--save", args.save)
    start, load_path = 0, None
    if args.load:
        start, path = _load_start(args, mode, shapes)
        if start >= args.train_iters:
            raise CLIError(
                f"--load {path} holds iteration {start}, which already reaches --train-iters "
                f"{args.train_iters}; raise --train-iters to train further"
            )
        load_path = os.path.abspath(path)
    policy = CheckpointPolicy(
        save_path=os.path.abspath(args.save) if args.save else None,
        save_at=args.train_iters - start if args.save else 0,  # the end of the run
        save_interval=args.save_interval or 0,
        keep_last=args.save_keep_last,
        save_on_interrupt=args.save_on_interrupt,
        load_path=load_path,
        resume_optimizer_settings=mode,
    )
    return CheckpointPlan(start=start, checkpoint=policy)


def loop_fields(args: argparse.Namespace, plan: CheckpointPlan) -> dict:
    """The LoopConfig fields of the steps, checkpoint, resume and NaN/Inf flags (every
    --model)."""
    return {
        "steps": args.train_iters - plan.start,
        "start_step": plan.start,
        "checkpoint": plan.checkpoint,
        "check_for_nan_in_loss_and_grad": args.check_for_nan_in_loss_and_grad,
        "max_consecutive_skipped_steps": args.max_consecutive_skipped_steps,
    }


def checkpoint_lines(cfg, out: dict) -> list[str]:
    """Summary lines: where the run resumed, the last checkpoint it wrote, skipped steps."""
    lines = []
    policy = cfg.checkpoint
    if policy.load_path:
        lines.append(f"  resumed: {policy.load_path} (iteration {cfg.start_step})")
    saved = out.get("saved_at")
    if saved is not None:
        lines.append(
            f"  checkpoint: {policy.save_path} (iteration {saved}) - "
            f"{run_checkpoints.iteration_dir(policy.save_path, saved)}, named by "
            f"{run_checkpoints.TRACKER_FILE}"
        )
    elif policy.save_path:
        lines.append(
            f"  checkpoint: none written by this run (it stopped before iteration "
            f"{cfg.start_step + policy.save_at}; --save-on-interrupt saves when stopped)"
        )
    if out.get("skipped_steps"):
        lines.append(
            f"  skipped steps: {out['skipped_steps']} (a non-finite gradient norm; the update "
            "was not applied)"
        )
    if out.get("overflow_steps"):
        lines.append(
            f"  overflow steps: {out['overflow_steps']} (a dropless exchange overflowed "
            "--moe-receive-buffer-factor; each was repeated exactly with a buffer of every copy)"
        )
    return lines


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
    graphs = cfg.graphs
    if not graphs.enabled:
        return "eager (whole-step API)" if graphs.optimizer else "eager"
    return f"{graphs.impl} graphs [{scope_label(graphs.scopes, graphs.optimizer)}]"


def input_lines(cfg) -> list[str]:
    """Summary lines for the token file and the optimizer offload a run used (our models and
    Megatron-Core's alike)."""
    lines = []
    if cfg.data_path:
        lines.append(f"  data: {cfg.data_path} (uint16 token file)")
    if cfg.optimizer_offload_fraction:
        lines.append(f"  optimizer CPU offload: fraction {cfg.optimizer_offload_fraction}")
    return lines
