"""Main job: a short data-parallel training run of the reference GPT under graph_fsdp.

    python -m graph_fsdp.run_demo            # all local GPUs (NCCL), else 2 gloo processes

On CPU the model is scaled down (4 layers, hidden 256) so the run takes seconds.
"""

from __future__ import annotations

import torch

from graph_fsdp.launch import spawn
from graph_fsdp.models import GPTConfig
from graph_fsdp.train import TrainConfig, run


def main() -> None:
    cuda = torch.cuda.device_count() >= 1
    if cuda:
        model, world = GPTConfig(), max(torch.cuda.device_count(), 1)
    else:
        model = GPTConfig(
            vocab_size=4096, num_layers=4, hidden_size=256, num_attention_heads=4, seq_length=256
        )
        world = 2
    cfg = TrainConfig(
        model=model, steps=10, bf16=cuda, device="cuda" if cuda else "cpu", return_params=False
    )
    results = spawn(run, world, cfg, backend="nccl" if cuda else "gloo")
    for step, (loss, t) in enumerate(zip(results[0]["losses"], results[0]["times"])):
        print(f"step {step:3d}  loss {loss:.4f}  step time {t * 1e3:8.1f} ms")


if __name__ == "__main__":
    main()
