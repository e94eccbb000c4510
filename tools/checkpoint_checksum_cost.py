"""What the checkpoint checksums cost (fsdp/checkpoint_files.py [Note: checkpoint checksums]):
a save and a load of the benchmarks' 16-layer GPT (hidden 1024, vocabulary 32000, AdamW state)
on 2 gloo ranks, with the checksum part timed on its own in the same processes::

    python tools/checkpoint_checksum_cost.py [DIR] [--layers 16] [--repeats 2]

Prints one line per repeat: save seconds (the checksums' share), load seconds (the checks'
share), the checkpoint's size. Runs on CPU; DIR (default: a temporary directory) needs room
for about 3.2 GB.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

import torch
import torch.distributed as dist

from graph_fsdp.fsdp import checkpoint as ckpt
from graph_fsdp.fsdp.checkpoint_files import verify_checksums, write_checksums
from graph_fsdp.models import GPTConfig
from graph_fsdp.training.processes import spawn
from graph_fsdp.training.train import TrainConfig, build_for, shard_model


def _timed(fn) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def _worker(rank: int, world: int, root: str, layers: int, repeats: int) -> list[dict]:
    model_cfg = GPTConfig(
        num_layers=layers,
        hidden_size=1024,
        num_attention_heads=16,
        seq_length=1024,
        vocab_size=32000,
    )
    cfg = TrainConfig(model=model_cfg)
    model = build_for(cfg, torch.device("cpu"))
    shard_model(model, cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()  # the AdamW state a real checkpoint holds
    rows = []
    for r in range(repeats):
        path = os.path.join(root, f"ck{r}")
        save_s = _timed(lambda: ckpt.save(path, model, opt))
        sums_s = _timed(lambda: write_checksums(path, skip=(ckpt.META_FILE,)))
        load_s = _timed(lambda: ckpt.load(path, model, opt))
        check_s = _timed(lambda: verify_checksums(path))
        size = sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path))
        rows.append(dict(save=save_s, sums=sums_s, load=load_s, check=check_s, bytes=size))
        if rank == 0:
            shutil.rmtree(path)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir", nargs="?", default=None)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    root = args.dir or tempfile.mkdtemp(prefix="graph_fsdp_ckpt_cost_")
    rows = spawn(_worker, 2, root, args.layers, args.repeats, pg_timeout_s=600)[0]
    for r in rows:
        print(
            f"save {r['save']:.2f} s, of it checksums {r['sums']:.2f} s "
            f"({100 * r['sums'] / r['save']:.1f}%) | load {r['load']:.2f} s, of it checks "
            f"{r['check']:.2f} s ({100 * r['check'] / r['load']:.1f}%) | "
            f"{r['bytes'] / 2**30:.2f} GiB"
        )


if __name__ == "__main__":
    main()
