"""``graph-fsdp train``: train the reference GPT/MoE model under graph_fsdp.

    graph-fsdp train --num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 \\
        --vocab-size 128 --train-iters 5 --log-json steps.jsonl            # 2 gloo ranks on CPU
    torchrun --nproc-per-node 8 -m graph_fsdp.cli.main train --bf16 --fsdp-double-buffer \\
        --fsdp-db-use-persist-buf-on-alloc-fail --cuda-graph-impl te --cuda-graph-scope attn

Rank 0 shows a progress bar (loss, step time, tokens/s) and writes one JSON record per step
to ``--log-json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
from dataclasses import dataclass, replace
from statistics import median

from graph_fsdp import checkpoint
from graph_fsdp.cli.errors import CLIError
from graph_fsdp.cli.launch import launch
from graph_fsdp.cli.options import add_common_args, check_optimizer_args, check_positive, resolve
from graph_fsdp.cli.paths import check_output_file, check_save_dir
from graph_fsdp.cli.supervision import Interrupted, console
from graph_fsdp.data import check_token_file, check_token_ids, training_samples
from graph_fsdp.models import model_flops_per_token
from graph_fsdp.train import TrainConfig, placement_label, run

CHECKPOINT_META = checkpoint.META_FILE
"""In a --save checkpoint: the iteration it holds (so --load resumes there) and the --model."""


def add_parser(subparsers, formatter) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "train",
        help="Train the reference model under graph_fsdp.",
        formatter_class=formatter,
        description=__doc__,
    )
    add_common_args(
        p,
        iters_default=10,
        iters_help="Optimizer steps to train (in total, "
        "counting the iterations a --load checkpoint already holds).",
    )
    graphs = next(g for g in p._action_groups if g.title == "CUDA graphs")  # add_graph_args'
    graphs.add_argument(
        "--cuda-graph-verify",
        nargs="?",
        const="warn",
        choices=("warn", "raise"),
        default=None,
        help="Check the first graphed step: run it eagerly and replayed from the same state, "
        "compare outputs, gradients and every module's output bit for bit, and name the first "
        "module that differs. warn (the flag alone): report it in the summary and go on; "
        "raise: stop with the report. The verified graphs keep one checksum per module "
        "output: leave it off for timing.",
    )
    g = p.add_argument_group("checkpointing, data and logging")
    g.add_argument(
        "--save", default=None, metavar="DIR", help="Write a sharded (DCP) checkpoint to DIR."
    )
    g.add_argument(
        "--save-interval",
        type=int,
        default=None,
        help="Checkpoint at the last multiple of this interval <= --train-iters "
        "(the engine saves once per run). Default: at the end.",
    )
    g.add_argument(
        "--save-on-interrupt",
        "--exit-signal-handler",
        dest="save_on_interrupt",
        action="store_true",
        help="When SIGINT/SIGTERM stops the run (at the next step boundary), save to --save "
        "first (Megatron's --exit-signal-handler spelling works too). Without it a stopped run "
        "keeps the last scheduled checkpoint.",
    )
    g.add_argument(
        "--load",
        default=None,
        metavar="DIR",
        help="Resume from a checkpoint written by --save (at its iteration).",
    )
    g.add_argument(
        "--data-path",
        default=None,
        metavar="FILE",
        help="Flat uint16 token file (np.memmap; np.array(ids, dtype=np.uint16).tofile(FILE)), "
        "ids < --vocab-size. Default: synthetic tokens.",
    )
    g.add_argument(
        "--log-json",
        default=None,
        metavar="PATH",
        help="Rank 0 writes one JSON record per step (JSON lines) to PATH (overwritten).",
    )
    from graph_fsdp.integrations.megatron_cli import add_megatron_args  # noqa: PLC0415

    add_megatron_args(p)  # --model mcore-gpt|mcore-moe and Megatron-Bridge's FSDP settings
    p.set_defaults(handler=main, subparser=p)
    return p


# --------------------------------------------------------------------------------------------
# Rank 0's per-step log and progress bar
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class StepStats:
    """What turns a step time into throughput numbers."""

    tokens_per_step: int
    flops_per_token: float
    world_size: int

    def enrich(self, record: dict) -> dict:
        t = record.get("step_time_s")
        if isinstance(t, int | float) and t > 0:
            tokens_per_s = self.tokens_per_step / t
            record["tokens_per_s"] = tokens_per_s
            record["tflops_per_gpu"] = tokens_per_s * self.flops_per_token / self.world_size / 1e12
        return record


class StepLogFollower:
    """Follows the JSON lines ``train.run`` writes each step: progress bar plus ``--log-json``.

    ``train.run`` has no per-step callback, but it flushes one record per step to
    ``cfg.log_path``; a thread tails that file, so the bar moves while the run is going.
    """

    def __init__(self, raw_path: str, out_path: str | None, total: int, stats: StepStats) -> None:
        from tqdm import tqdm

        # A thread lock, not tqdm's default multiprocessing one: a rank the launcher kills
        # after a stop signal must not leave a semaphore for the resource tracker to report.
        tqdm.set_lock(threading.RLock())
        self.raw_path, self.stats = raw_path, stats
        self.out = open(out_path, "w") if out_path else None  # noqa: SIM115 - closed in stop()
        self.bar = tqdm(total=total, desc="train", unit="step", file=console(), dynamic_ncols=True)
        self.records: list[dict] = []
        self._pending = ""
        self._offset = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._follow, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self._poll()  # whatever arrived after the thread's last look
        self.bar.close()
        if self.out is not None:
            self.out.close()

    def _follow(self) -> None:
        while not self._stop.wait(0.05):
            self._poll()

    def _poll(self) -> None:
        with open(self.raw_path) as f:
            f.seek(self._offset)
            chunk = f.read()
            self._offset = f.tell()
        self._pending += chunk
        *lines, self._pending = self._pending.split("\n")  # keep a partial last line
        for line in lines:
            if line.strip():
                self._emit(self.stats.enrich(json.loads(line)))

    def _emit(self, record: dict) -> None:
        self.records.append(record)
        if self.out is not None:
            self.out.write(json.dumps(record) + "\n")
            self.out.flush()
        postfix = {"loss": f"{record.get('loss', float('nan')):.4f}"}
        if "step_time_s" in record:
            postfix["step"] = f"{record['step_time_s'] * 1e3:.1f}ms"
        if "tokens_per_s" in record:
            postfix["tok/s"] = f"{record['tokens_per_s']:,.0f}"
        self.bar.set_postfix(postfix, refresh=False)
        self.bar.update(1)


@dataclass(frozen=True, kw_only=True)
class TrainJob:
    cfg: TrainConfig
    stats: StepStats
    log_json: str | None


def train_worker(rank: int, world_size: int, job: TrainJob) -> dict | None:
    """One rank of ``graph-fsdp train``; rank 0 returns the summary."""
    cfg, follower, raw = job.cfg, None, None
    if rank == 0:
        fd, raw = tempfile.mkstemp(prefix="graph_fsdp_steps_", suffix=".jsonl")
        os.close(fd)
        cfg = replace(cfg, log_path=raw)
        follower = StepLogFollower(raw, job.log_json, cfg.steps, job.stats)
        follower.start()
    try:
        result = run(rank, world_size, cfg)
    finally:
        if follower is not None:
            follower.stop()
            os.unlink(raw)
    if rank != 0:
        return None
    return {
        "losses": result["losses"],
        "times": result["times"],
        "eval_losses": result.get("eval_losses", []),
        "peak_memory_bytes": result.get("peak_memory_bytes"),
        "records": follower.records if follower else [],
        "cuda_graphs": result.get("cuda_graphs"),
        "saved_at": result.get("saved_at"),
        "stopped_at": result.get("stopped_at"),
    }


# --------------------------------------------------------------------------------------------
# The command
# --------------------------------------------------------------------------------------------


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
            "(graph-fsdp train --save writes it; graph_fsdp.checkpoint.save only with meta=). "
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
    from graph_fsdp.models import build_model  # noqa: PLC0415

    if getattr(model_cfg, "transformer_impl", "local") != "local":
        return None
    try:
        model = build_model(model_cfg, device="meta")
    except Exception:  # noqa: BLE001 - no shape check then; the ranks' load still checks
        return None
    return {name: p.shape for name, p in model.named_parameters()}


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


def check_train_only_flags(args: argparse.Namespace) -> None:
    """Flags of ``train`` itself, for every --model: optimizer, --save-on-interrupt,
    --log-json."""
    check_optimizer_args(args)
    if args.save_on_interrupt and not args.save:
        raise CLIError(
            "--save-on-interrupt (--exit-signal-handler) saves to --save DIR when a signal "
            "stops the run: add --save DIR"
        )
    if args.save_on_interrupt and args.model != "gpt":
        raise CLIError(
            f"--save-on-interrupt (--exit-signal-handler) is not wired for --model {args.model} "
            "(its ranks stop when signalled, without saving): drop it"
        )
    if args.log_json:
        check_output_file("--log-json", args.log_json)


def main(args: argparse.Namespace) -> int:
    from graph_fsdp.integrations import megatron_cli  # noqa: PLC0415

    check_train_only_flags(args)
    if args.model != "gpt":
        return megatron_cli.main(args)
    megatron_cli.reject_mcore_only_flags(args)
    megatron_cli.validate_bridge_flags(args)
    res = resolve(args)
    shapes = model_shapes(res.cfg.model) if args.load else None
    start, save_at, _ = checkpoint_plan(args, shapes)
    cfg = replace(
        res.cfg,
        steps=args.train_iters - start,
        start_step=start,
        save_path=args.save,
        save_at=save_at,
        save_on_interrupt=args.save_on_interrupt,
        load_path=args.load,
        cuda_graph_verify=verify_option(args),
    )
    if args.data_path:
        path = check_data_path(
            args,
            seq_length=cfg.model.seq_length,
            vocab_size=cfg.model.vocab_size,
            world_size=res.plan.world_size,
            grad_accum=cfg.grad_accum,
            start=start,
            steps=cfg.steps,
        )
        cfg = replace(cfg, data_path=path)
    if args.optimizer_cpu_offload:
        cfg = replace(cfg, optimizer_offload_fraction=args.optimizer_offload_fraction)
    if args.log_json:
        os.makedirs(os.path.dirname(os.path.abspath(args.log_json)), exist_ok=True)
    stats = StepStats(
        tokens_per_step=res.tokens_per_step,
        flops_per_token=model_flops_per_token(cfg.model),
        world_size=res.plan.world_size,
    )
    job = TrainJob(cfg=cfg, stats=stats, log_json=args.log_json)
    try:
        out = launch(res.plan, train_worker, job)
    except Interrupted as stop:  # main() prints how it ended and exits 128 + signal
        if stop.result is not None and stop.result["losses"]:
            print(format_summary(cfg, res.plan.describe(), stats, stop.result, args))
        raise
    if out is None:
        return 0
    print(format_summary(cfg, res.plan.describe(), stats, out, args))
    return 0


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


def format_summary(
    cfg: TrainConfig, where: str, stats: StepStats, out: dict, args: argparse.Namespace
) -> str:
    m = cfg.model
    model = f"{m.num_layers} layers, hidden {m.hidden_size}" + (
        f", {m.num_experts} experts top-{m.moe_router_topk}" if m.num_experts else ""
    )
    graphs = graphs_label(cfg)
    times = out["times"]
    step_s = median(times) if times else float("nan")
    peak = out.get("peak_memory_bytes")
    lines = [
        f"graph-fsdp train: {len(out['losses'])} steps on {where}; {placement_label(cfg)}, "
        f"{graphs}; {model}; grad accumulation {cfg.grad_accum}",
        f"  final loss {out['losses'][-1]:.6f} | median step {step_s * 1e3:.2f} ms | "
        f"{stats.tokens_per_step / step_s:,.0f} tokens/s | "
        f"{stats.enrich({'step_time_s': step_s}).get('tflops_per_gpu', 0.0):.3f} TFLOP/s per GPU | "
        f"peak memory {f'{peak / 2**30:.2f} GiB' if peak else 'n/a (cpu)'}",
        *input_lines(cfg),
        *verification_lines(out),
    ]
    if out.get("eval_losses"):
        lines.append("  eval losses: " + ", ".join(f"{v:.6f}" for v in out["eval_losses"]))
    if args.log_json:
        lines.append(f"  step log: {args.log_json} ({len(out['records'])} records)")
    if out.get("stopped_at") is not None:
        lines.append(
            f"  stopped after iteration {out['stopped_at']} of {cfg.start_step + cfg.steps} "
            "(a stop signal)"
        )
    if out.get("saved_at") is not None:
        lines.append(f"  checkpoint: {args.save} (iteration {out['saved_at']})")
    elif args.save:
        lines.append(
            f"  checkpoint: none written by this run (stopped before iteration "
            f"{cfg.start_step + cfg.save_at}; --save-on-interrupt saves when stopped)"
        )
    return "\n".join(lines)
