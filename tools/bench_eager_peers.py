"""Side-by-side eager step time on N GPUs, one launch: graph_fsdp vs torch FSDP2 vs
megatron_fsdp vs an unsharded single-GPU reference (same model, seeds, shapes).

    python tools/bench_eager_peers.py --hidden-size 1024 --seq-length 1024 --out bench/results/x.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import torch

from graph_fsdp.models import GPTConfig, build_model, model_flops_per_token, synthetic_batch
from graph_fsdp.models.gpt import TransformerLayer
from graph_fsdp.testing import spawn
from graph_fsdp.train import MixedPrecisionReference, TrainConfig, shard_model


def _time(step, warmup: int, iters: int) -> list[float]:
    for _ in range(warmup):
        step()
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def _summary(name, times, cfg, mbs, world, loss) -> dict:
    tokens = mbs * cfg.seq_length
    med = statistics.median(times)
    return {
        "name": name,
        "median_ms": med,
        "min_ms": min(times),
        "tokens_per_s_per_gpu": tokens / med * 1e3,
        "tflops_per_gpu": model_flops_per_token(cfg) * tokens / med / 1e9,
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30,
        "world": world,
        "final_loss": loss,
    }


def _graph_fsdp(model_cfg, mbs, rank, allocator):
    dev = torch.device("cuda", rank)
    model = build_model(model_cfg, device=dev)
    shard_model(
        model,
        TrainConfig(model=model_cfg, bf16=True, allocator=allocator, persist_on_alloc_fail=True),
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, opt


def _fsdp2(model_cfg, mbs, rank):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = build_model(model_cfg, device=torch.device("cuda", rank))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def _megatron(model_cfg, mbs, rank, world):
    import megatron_fsdp
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cuda", (world, 1), mesh_dim_names=("dp_shard", "tp"))
    model = build_model(model_cfg, device=torch.device("cuda", rank)).to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=0.0, weight_decay=0.0)
    model, opt = megatron_fsdp.fully_shard(
        model,
        opt,
        device_mesh=mesh,
        dp_shard_dim="dp_shard",
        tp_dim="tp",
        fsdp_unit_modules=[TransformerLayer],
        zero_dp_strategy="optim_grads_params",
        mixed_precision_policy=megatron_fsdp.MixedPrecisionPolicy(
            main_params_dtype=torch.float32, main_grads_dtype=torch.float32
        ),
    )
    for g in opt.param_groups:  # megatron-fsdp 0.6.1 does a fake step at setup (#5974)
        g.update(lr=1e-4, weight_decay=0.01)
    for st in opt.state.values():
        if "step" in st and torch.is_tensor(st["step"]):
            st["step"].zero_()
    return model, opt


def _train_step(model, opt, x, y, last: dict):
    def step():
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        last["loss"] = loss

    return step


def worker(
    rank: int, world: int, model_cfg: GPTConfig, mbs: int, warmup: int, iters: int, modes: list[str]
) -> list[dict]:
    dev = torch.device("cuda", rank)
    x, y = synthetic_batch(model_cfg, mbs, 0, rank=rank, device=dev)
    out = []
    for mode in modes:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        try:
            if mode.startswith("graph_fsdp"):
                model, opt = _graph_fsdp(model_cfg, mbs, rank, mode.split(":")[1])
            elif mode == "torch_fsdp2":
                model, opt = _fsdp2(model_cfg, mbs, rank)
            elif mode == "megatron_fsdp":
                model, opt = _megatron(model_cfg, mbs, rank, world)
            last: dict = {}
            times = _time(_train_step(model, opt, x, y, last), warmup, iters)
            out.append(_summary(mode, times, model_cfg, mbs, world, last["loss"].item()))
            model = opt = None
        except Exception as exc:  # noqa: BLE001 - a peer failing must not hide the others
            out.append({"name": mode, "error": f"{type(exc).__name__}: {exc}"[:300]})
    torch.distributed.barrier()
    if rank == 0:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        model = build_model(model_cfg, device=dev)
        ref = MixedPrecisionReference(model, TrainConfig(model=model_cfg, bf16=True, lr=1e-4))
        last = {}

        def ref_step():
            loss = model(x, y)
            loss.backward()
            ref.step()
            last["loss"] = loss

        out.append(
            _summary(
                "unsharded_1gpu",
                _time(ref_step, warmup, iters),
                model_cfg,
                mbs,
                1,
                last["loss"].item(),
            )
        )
    torch.distributed.barrier()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--num-layers", type=int, default=16)
    ap.add_argument("--hidden-size", type=int, default=1024)
    ap.add_argument("--num-attention-heads", type=int, default=16)
    ap.add_argument("--seq-length", type=int, default=1024)
    ap.add_argument("--micro-batch-size", type=int, default=1)
    ap.add_argument("--num-experts", type=int, default=None)
    ap.add_argument("--moe-layer-freq", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--nproc", type=int, default=torch.cuda.device_count())
    ap.add_argument(
        "--modes",
        nargs="*",
        default=["graph_fsdp:dynamic", "graph_fsdp:double_buffer", "torch_fsdp2", "megatron_fsdp"],
    )
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    cfg = GPTConfig(
        num_layers=a.num_layers,
        hidden_size=a.hidden_size,
        num_attention_heads=a.num_attention_heads,
        seq_length=a.seq_length,
        num_experts=a.num_experts,
        moe_layer_freq=a.moe_layer_freq,
    )
    res = spawn(
        worker, a.nproc, cfg, a.micro_batch_size, a.warmup, a.iters, a.modes, backend="nccl"
    )[0]
    ref = next((r for r in res if r["name"] == "unsharded_1gpu"), None)
    print("| run | median ms | min ms | x unsharded | TFLOP/s/GPU | peak GiB |")
    print("|---|---|---|---|---|---|")
    for r in res:
        if "error" in r:
            print(f"| {r['name']} | error: {r['error'][:80]} |")
            continue
        ratio = r["median_ms"] / ref["median_ms"] if ref else float("nan")
        print(
            f"| {r['name']} | {r['median_ms']:.2f} | {r['min_ms']:.2f} | {ratio:.2f}x | {r['tflops_per_gpu']:.1f} | {r['peak_mem_gib']:.2f} |"
        )
    if a.out:
        meta = {
            "gpu": torch.cuda.get_device_name(0),
            "world": a.nproc,
            "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d"),
            "model": dataclasses.asdict(cfg),
            "micro_batch_size": a.micro_batch_size,
            "iters": a.iters,
            "warmup": a.warmup,
        }
        with open(a.out, "w") as f:
            json.dump({"meta": meta, "results": res}, f, indent=1)


if __name__ == "__main__":
    main()
