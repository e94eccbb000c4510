"""Main job: a short data-parallel training run of the reference GPT under graph_fsdp.

    python -m graph_fsdp.run_demo            # all local GPUs (NCCL), else 2 gloo processes

On CPU the model is scaled down (4 layers, hidden 256) so the run takes seconds. Prints a
header (model, ranks, backend, strategy), one line per step and a closing summary. It takes
no flags (``--help`` says so); ``graph-fsdp train`` is the command line with every setting.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from graph_fsdp.fsdp.api import MixedPrecisionPolicy, dtype_label
from graph_fsdp.models import GPTConfig, build_model
from graph_fsdp.training.processes import spawn
from graph_fsdp.training.train import TrainConfig, run

ZERO = {
    "no_shard": "DDP",
    "optim": "ZeRO-1",
    "optim_grads": "ZeRO-2",
    "optim_grads_params": "ZeRO-3",
}


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m graph_fsdp.run_demo",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    return parser.parse_args(argv)


def main(argv: list[str] | tuple[str, ...] = ()) -> None:
    """The demo; ``argv``: the command line's arguments (only ``--help`` is accepted)."""
    parse_args(list(argv))
    cuda = torch.cuda.device_count() >= 1
    if cuda:
        model, world = GPTConfig(), max(torch.cuda.device_count(), 1)
    else:
        model = GPTConfig(
            vocab_size=4096, num_layers=4, hidden_size=256, num_attention_heads=4, seq_length=256
        )
        world = 2
    cfg = TrainConfig(
        model=model,
        steps=10,
        mp=MixedPrecisionPolicy(param_dtype=torch.bfloat16 if cuda else None),
        device="cuda" if cuda else "cpu",
        return_params=False,
    )
    backend = "nccl" if cuda else "gloo"
    params = sum(p.numel() for p in build_model(model, device="meta").parameters())
    print(
        f"graph_fsdp demo: reference GPT ({model.num_layers} layers, hidden {model.hidden_size}, "
        f"{params / 1e6:.1f}M parameters), {world} ranks, {backend} on {cfg.device}, "
        f"{ZERO.get(cfg.strategy, cfg.strategy)} ({cfg.strategy}), {dtype_label(cfg.compute_dtype)}, {cfg.steps} steps",
        flush=True,
    )
    start = time.perf_counter()
    results = spawn(run, world, cfg, backend=backend)
    wall = time.perf_counter() - start
    losses, times = results[0]["losses"], results[0]["times"]
    for step, (loss, t) in enumerate(zip(losses, times)):
        print(f"step {step:3d}  loss {loss:.4f}  step time {t * 1e3:8.1f} ms")
    print(
        f"done: {len(losses)} steps, loss {losses[0]:.4f} -> {losses[-1]:.4f}, median step "
        f"{statistics.median(times) * 1e3:.1f} ms, {wall:.1f} s in all (process start included)"
    )


if __name__ == "__main__":
    main(sys.argv[1:])
