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
import tempfile
import threading
from dataclasses import dataclass, replace
from statistics import median

from tqdm import tqdm

from graph_fsdp.cli import mcore
from graph_fsdp.cli.options import resolve
from graph_fsdp.cli.train_options import (
    check_data_path,
    check_memory,
    check_train_only_flags,
    checkpoint_lines,
    checkpoint_plan,
    graphs_label,
    input_lines,
    loop_fields,
    model_shapes,
    verification_lines,
    verify_option,
)
from graph_fsdp.models import model_flops_per_token
from graph_fsdp.training.processes import launch
from graph_fsdp.training.supervision import Interrupted, console
from graph_fsdp.training.train import TrainConfig, placement_label, run

HELP = "Train the reference model under graph_fsdp."
"""The command's line in ``graph-fsdp --help``."""
COMMON_FLAGS = dict(
    iters_default=10,
    iters_help="Optimizer steps to train (in total, "
    "counting the iterations a --load checkpoint already holds).",
)
"""How the shared flags (options.add_common_args) read in this command."""


def add_args(p: argparse.ArgumentParser) -> None:
    """The flags of this command alone (main.build_parser adds the shared ones first)."""
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
        "--save",
        default=None,
        metavar="DIR",
        help="Write sharded (DCP) checkpoints into DIR, Megatron's layout: DIR/iter_0000020/ per "
        "saved iteration and DIR/latest_checkpointed_iteration.txt naming the latest complete "
        "one. A run saves at its end (and every --save-interval iterations).",
    )
    g.add_argument(
        "--save-interval",
        type=int,
        default=None,
        metavar="N",
        help="Also save after every iteration that is a multiple of N. Default: at the end only.",
    )
    g.add_argument(
        "--save-keep-last",
        type=int,
        default=None,
        metavar="K",
        help="Keep only the newest K checkpoints in --save DIR (older ones are deleted once a "
        "newer one is complete). Default: keep all.",
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
        help="Resume from the latest complete checkpoint in a --save DIR (or from one "
        "checkpoint directory, e.g. DIR/iter_0000020), at its iteration.",
    )
    g.add_argument(
        "--override-opt_param-scheduler",
        dest="override_opt_param_scheduler",
        action="store_true",
        help="On --load, train with the command line's --lr and --weight-decay where they "
        "differ from the checkpoint's (without either flag such a difference is refused).",
    )
    g.add_argument(
        "--use-checkpoint-opt_param-scheduler",
        dest="use_checkpoint_opt_param_scheduler",
        action="store_true",
        help="On --load, keep the checkpoint's --lr and --weight-decay, whatever the command "
        "line says.",
    )
    nan = p.add_argument_group("NaN and Inf")
    nan.add_argument(
        "--check-for-nan-in-loss-and-grad",
        dest="check_for_nan_in_loss_and_grad",
        action="store_true",
        default=True,
        help="Stop the run (exit 1, one line naming the iteration and the value) at a NaN or "
        "Inf loss or gradient norm, before it is saved. On by default.",
    )
    nan.add_argument(
        "--no-check-for-nan-in-loss-and-grad",
        dest="check_for_nan_in_loss_and_grad",
        action="store_false",
        help="Train on through NaN/Inf (a save still refuses a model holding them).",
    )
    nan.add_argument(
        "--max-consecutive-skipped-steps",
        type=int,
        default=10,
        metavar="N",
        help="--cuda-graph-optimizer skips a step whose gradient norm is NaN/Inf on the device; "
        "stop the run after more than N skipped in a row (0: never).",
    )
    g.add_argument(
        "--data-path",
        default=None,
        metavar="FILE",
        help="Flat uint16 token file (np.memmap; np.array(ids, dtype=np.uint16).tofile(FILE)), "
        "ids < --vocab-size. Default: synthetic tokens.",
    )
    g.add_argument(
        "--allow-data-reuse",
        action="store_true",
        help="Let a --data-path file shorter than the run (fewer samples than --train-iters "
        "reads) wrap around and be read again, with a note; without it such a file is refused.",
    )
    g.add_argument(
        "--log-json",
        default=None,
        metavar="PATH",
        help="Rank 0 writes one JSON record per step (JSON lines) to PATH (overwritten).",
    )
    mcore.add_megatron_args(p)  # --model mcore-gpt|mcore-moe and Megatron-Bridge's FSDP settings


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
        # A thread lock, not tqdm's default multiprocessing one: a rank the launcher kills
        # after a stop signal must not leave a semaphore for the resource tracker to report.
        tqdm.set_lock(threading.RLock())
        self.raw_path, self.stats = raw_path, stats
        self.out = open(out_path, "w") if out_path else None  # closed in stop()
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
        postfix = {"loss": f"{float(record.get('loss', 'nan')):.4f}"}  # "nan": nonfinite.py
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
        "skipped_steps": result.get("skipped_steps", 0),
        "overflow_steps": result.get("overflow_steps", 0),
    }


# --------------------------------------------------------------------------------------------
# The command
# --------------------------------------------------------------------------------------------


def main(args: argparse.Namespace) -> int:
    check_train_only_flags(args)
    if args.model != "gpt":
        return mcore.train_main(args)
    mcore.reject_mcore_only_flags(args)
    mcore.validate_bridge_flags(args)
    res = resolve(args)
    check_memory(res)  # before --load's shape check builds the model on the meta device
    shapes = model_shapes(res.cfg.model) if args.load else None
    plan = checkpoint_plan(args, shapes)
    cfg = replace(res.cfg.with_graphs(verify=verify_option(args)), **loop_fields(args, plan))
    data_path = check_data_path(
        args,
        seq_length=cfg.model.seq_length,
        vocab_size=cfg.model.vocab_size,
        world_size=res.data_parallel_size,
        grad_accum=cfg.grad_accum,
        start=plan.start,
        steps=cfg.steps,
        packing=cfg.packing,
    )
    if data_path:
        cfg = replace(cfg, data_path=data_path)
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
    lines += checkpoint_lines(cfg, out)
    return "\n".join(lines)
