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

from graph_fsdp.cli.errors import CLIError
from graph_fsdp.cli.options import add_common_args, check_positive, resolve
from graph_fsdp.data import check_token_file, check_token_ids, training_samples
from graph_fsdp.launch import launch
from graph_fsdp.models import model_flops_per_token
from graph_fsdp.train import TrainConfig, placement_label, run

CHECKPOINT_META = "graph_fsdp_cli.json"
"""Written next to a --save checkpoint: the iteration it holds, so --load resumes there."""


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
    from graph_fsdp.cli.mcore import add_megatron_args  # noqa: PLC0415

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

        self.raw_path, self.stats = raw_path, stats
        self.out = open(out_path, "w") if out_path else None  # noqa: SIM115 - closed in stop()
        self.bar = tqdm(total=total, desc="train", unit="step", file=sys.stderr, dynamic_ncols=True)
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
    save_iteration: int | None


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
    if cfg.save_path and job.save_iteration is not None:
        write_checkpoint_meta(cfg.save_path, job.save_iteration, "gpt")
    return {
        "losses": result["losses"],
        "times": result["times"],
        "eval_losses": result.get("eval_losses", []),
        "peak_memory_bytes": result.get("peak_memory_bytes"),
        "records": follower.records if follower else [],
        "cuda_graphs": result.get("cuda_graphs"),
    }


# --------------------------------------------------------------------------------------------
# The command
# --------------------------------------------------------------------------------------------


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


def main(args: argparse.Namespace) -> int:
    from graph_fsdp.cli import mcore  # noqa: PLC0415

    if args.model != "gpt":
        return mcore.main(args)
    mcore.reject_mcore_only_flags(args)
    mcore.validate_bridge_flags(args)
    res = resolve(args)
    start, save_at, save_iteration = checkpoint_plan(args)
    cfg = replace(
        res.cfg,
        steps=args.train_iters - start,
        start_step=start,
        save_path=args.save,
        save_at=save_at,
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
    job = TrainJob(cfg=cfg, stats=stats, log_json=args.log_json, save_iteration=save_iteration)
    out = launch(res.plan, train_worker, job)
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
    if args.save:
        lines.append(f"  checkpoint: {args.save} (iteration {cfg.start_step + cfg.save_at})")
    return "\n".join(lines)
