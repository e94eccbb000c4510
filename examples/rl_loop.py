"""A verl-style RL loop on graph_fsdp: graphed training, offload, rollout, onload, repeat.

    python examples/rl_loop.py                                  # one GPU, ~170M GPT
    python examples/rl_loop.py --preset 1b --iterations 3       # the >= 1B measurement
    python examples/rl_loop.py --device cpu --preset tiny       # the loop's logic, on CPU
    torchrun --nproc-per-node 2 examples/rl_loop.py --graphs layerwise --strategy optim

Each iteration: ``--train-steps`` training steps under CUDA graphs (full_iteration or
layerwise) -> ``offload_params/grads/optimizer`` -> the weights are exported with
``iter_full_params`` into a separate bf16 inference copy of the model, built on the memory the
offload gave back, which decodes ``--rollout-tokens`` tokens greedily -> the copy is dropped
-> ``onload_*`` -> training resumes. With ``BufferPolicy(keep_addresses_on_offload=True)``
(``--addresses keep``, the default) and torch-memory-saver the graphs replay right after
onload: no recapture, no warmup steps. The script restarts itself under torch-memory-saver's
preload library (``--tms-hook preload``, the default) so that the graphs' pools are released
too. ``--reference`` then trains the same steps without offload or rollout, for a bit-exact
comparison of the losses. ``--packed`` trains on packed responses of lengths that change
every step (lognormal, one pack of ``seq_length`` tokens per sample, attention within each
response, the loss per real token over the ranks; docs/packed_sequences.md): still one capture
for the whole run.

One JSON line per iteration (rank 0): device memory the offload returned to the driver
(``torch.cuda.mem_get_info``) and its share of what training held, offload and onload
seconds, the first training step after onload vs a steady step, the runner's captures so far.
The last line is a summary. The memory figures are the device's: run with the GPU to yourself.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

# Deterministic kernels (bit-exact comparisons): set before CUDA starts.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
for _var, _value in (
    ("NCCL_NVLS_ENABLE", "0"),
    ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
    ("NVSHMEM_DISABLE_NVLS", "1"),
):
    os.environ.setdefault(_var, _value)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from graph_fsdp import (  # noqa: E402
    BufferPolicy,
    MixedPrecisionPolicy,
    fully_shard,
    init_distributed,
    iter_full_params,
)
from graph_fsdp.capture import FullIterationGraphs, LayerwiseGraphs  # noqa: E402
from graph_fsdp.fsdp import offload  # noqa: E402
from graph_fsdp.fsdp.address_keeping import preload_library  # noqa: E402
from graph_fsdp.fsdp.state import collect_states  # noqa: E402
from graph_fsdp.models import GPTConfig, build_model, synthetic_batch  # noqa: E402
from graph_fsdp.models.gpt import sharding_units  # noqa: E402
from graph_fsdp.training.loop import with_token_scale  # noqa: E402
from graph_fsdp.training.packing import PackedData, PackingPolicy  # noqa: E402

PRESETS = {
    "tiny": (
        GPTConfig(
            vocab_size=128, num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=64
        ),
        1,
    ),
    "small": (
        GPTConfig(
            vocab_size=32000, num_layers=8, hidden_size=1024, num_attention_heads=16, seq_length=512
        ),
        2,
    ),
    "1b": (
        GPTConfig(
            vocab_size=32000,
            num_layers=20,
            hidden_size=2048,
            num_attention_heads=16,
            seq_length=1024,
        ),
        1,
    ),
}
"""name -> (model, micro batch size)."""
GIB = 1024**3


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--preset", choices=sorted(PRESETS), default="small")
    p.add_argument(
        "--device",
        choices=["cuda", "cpu"],
        default="cuda",
        help="cpu: gloo, no CUDA graphs (full_iteration runs its step eagerly), no memory figures",
    )
    p.add_argument("--graphs", choices=["full_iteration", "layerwise"], default="full_iteration")
    p.add_argument(
        "--strategy",
        choices=["optim_grads_params", "optim_grads", "optim"],
        default="optim_grads_params",
    )
    p.add_argument("--iterations", type=int, default=5)
    p.add_argument("--train-steps", type=int, default=3, help="training steps per iteration")
    p.add_argument("--rollout-tokens", type=int, default=16)
    p.add_argument("--addresses", choices=["keep", "recapture"], default="keep")
    p.add_argument(
        "--tms-hook",
        choices=["preload", "torch"],
        default="preload",
        help="torch-memory-saver's hook: preload (restarts under LD_PRELOAD; graph pools are "
        "released too) or torch (a pluggable allocator; graph pools stay)",
    )
    p.add_argument("--reference", action="store_true", help="also train without offload")
    p.add_argument(
        "--packed",
        action="store_true",
        help="train on packs of responses whose lengths change every step (one capture)",
    )
    args = p.parse_args(argv)
    if args.iterations < 1 or args.train_steps < 2:
        p.error("--iterations must be >= 1 and --train-steps >= 2 (a first and a steady step)")
    if args.device == "cpu" and args.graphs == "layerwise":
        p.error("--graphs layerwise captures CUDA graphs: use --device cuda (or full_iteration)")
    if args.device == "cuda" and not torch.cuda.is_available():
        # One line, not argparse's usage block: the fix is a command, not a flag's spelling.
        sys.exit(
            f"rl_loop.py: error: --device cuda (the default) needs a GPU, and this torch "
            f"{torch.__version__} sees none; on this machine run: python examples/rl_loop.py "
            "--device cpu --preset tiny"
        )
    return args


def restart_under_preload(args: argparse.Namespace) -> None:
    """Re-run this script with torch-memory-saver's preload library (same process id, so
    torchrun keeps watching it); nothing happens if it is loaded already or not installed."""
    if args.addresses != "keep" or args.tms_hook != "preload" or args.device != "cuda":
        return
    if "torch_memory_saver" in os.environ.get("LD_PRELOAD", ""):
        return
    library = preload_library()
    if library is None:
        return  # the run falls back to recapture and says so
    preload = os.environ.get("LD_PRELOAD", "")
    os.environ["LD_PRELOAD"] = f"{library}:{preload}" if preload else library
    os.execv(sys.executable, [sys.executable, *sys.argv])


def build(cfg: GPTConfig, args: argparse.Namespace, device: torch.device):
    """The training model (ZeRO per ``--strategy``, bf16 compute), its optimizer and runner."""
    policy = BufferPolicy(
        allocator="double_buffer",
        persist_on_alloc_fail=True,
        keep_addresses_on_offload=args.addresses == "keep",
    )
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    model = build_model(cfg, device=device)
    for unit, reshard in sharding_units(model):
        fully_shard(
            unit,
            strategy=args.strategy,
            mp_policy=mp,
            buffer_policy=policy,
            reshard_after_forward=reshard,
        )
    fully_shard(model, strategy=args.strategy, mp_policy=mp, buffer_policy=policy)
    # Fused on CUDA: one kernel and no temporaries, so a step right after onload does not
    # allocate what the emptied caching allocator no longer holds.
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=1e-4, weight_decay=0.01, fused=device.type == "cuda"
    )
    if args.graphs == "full_iteration":
        graphs = FullIterationGraphs(model, warmup_steps=2, eager=device.type != "cuda")
    else:
        graphs = LayerwiseGraphs(model, impl="torch", scopes=[], warmup_steps=2)
    return model, optimizer, graphs


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_bytes(device: torch.device) -> int:
    """Device memory the driver has free (0 off CUDA)."""
    return torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 0


def empty_cache(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def make_step(model, graphs):
    """The runner's step: forward and backward of one batch, fixed rows or packed responses
    (``scale``: world / real tokens of the step, a device tensor copied into the graph)."""

    def step_fn(x, y, *packed):
        if packed:
            position_ids, cu_seqlens, scale = packed
            loss = model(x, y, position_ids=position_ids, cu_seqlens=cu_seqlens) * scale
        else:
            loss = model(x, y)
        loss.backward()
        return loss.detach()

    return graphs.capture(step_fn)


def batch_for(ctx: dict, step: int) -> tuple:
    """The step's batch: synthetic fixed rows, or (``--packed``) this step's responses, packed:
    lengths drawn anew every step, so every step's pack differs."""
    cfg, device, rank = ctx["cfg"], ctx["device"], ctx["rank"]
    if ctx["packs"] is None:
        return synthetic_batch(cfg, ctx["batch"], step, rank=rank, device=device)
    world = dist.get_world_size()
    batch = ctx["packs"].batch(ctx["batch"], step, rank, world, device)
    # The per-token loss over every rank's responses: (*batch, world / their real tokens).
    return with_token_scale([[batch]], world)[0][0]


def train_step(ctx: dict, step_fn, optimizer, graphs, step) -> tuple[float, float]:
    """One graphed training step; returns (loss, seconds)."""
    batch = batch_for(ctx, step)
    device = ctx["device"]
    sync(device)
    t0 = time.perf_counter()
    graphs.before_step()
    loss = step_fn(*batch)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    sync(device)
    return loss.item(), time.perf_counter() - t0


@torch.no_grad()
def rollout(model, cfg: GPTConfig, tokens: int, device: torch.device) -> tuple[list[int], int]:
    """Export the weights into a bf16 inference copy made on the freed memory, decode greedily
    from a fixed prompt; returns the generated ids and the copy's bytes."""
    engine = build_model(cfg, device="meta", dtype=torch.bfloat16).to_empty(device=device).eval()
    params = dict(engine.named_parameters())
    for name, tensor in iter_full_params(model, dtype=torch.bfloat16):  # weight sync
        params[name].copy_(tensor)
    nbytes = sum(p.numel() * p.element_size() for p in params.values())
    ids = synthetic_batch(cfg, 1, 10**6, device=device)[0][:, :32]
    for _ in range(tokens):
        logits = engine(ids[:, -cfg.seq_length :])
        ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    out = ids[0, 32:].tolist()
    del engine, params
    return out, nbytes


def rl_iteration(ctx: dict, it: int) -> dict:
    """Train, offload, roll out, onload; the measurements of one iteration."""
    model, opt, graphs, cfg, args = ctx["model"], ctx["opt"], ctx["graphs"], ctx["cfg"], ctx["args"]
    device = ctx["device"]
    times = []
    for _ in range(args.train_steps):
        loss, seconds = train_step(ctx, ctx["step_fn"], opt, graphs, ctx["step"])
        ctx["losses"].append(loss)
        times.append(seconds)
        ctx["step"] += 1
    sync(device)
    free_train = free_bytes(device)
    t0 = time.perf_counter()
    freed = offload.offload_params(model)["total"] + offload.offload_grads(model)["total"]
    freed += offload.offload_optimizer(model, opt)["total"]
    if device.type == "cuda":
        torch.cuda.empty_cache()  # what eager steps left cached goes back too
    offload_s = time.perf_counter() - t0
    free_off = free_bytes(device)
    t0 = time.perf_counter()
    generated, engine_bytes = rollout(model, cfg, args.rollout_tokens, device)
    sync(device)
    rollout_s = time.perf_counter() - t0
    empty_cache(device)
    t0 = time.perf_counter()
    offload.onload_params(model)
    offload.onload_grads(model)
    offload.onload_optimizer(model, opt)
    sync(device)
    onload_s = time.perf_counter() - t0
    held = ctx["free_base"] - free_train
    report = graphs.report()
    return {
        "iteration": it,
        "held_gib": round(held / GIB, 3),
        "returned_gib": round((free_off - free_train) / GIB, 3),
        "returned_pct": round(100 * (free_off - free_train) / max(held, 1), 1),
        "counted_gib": round(freed / GIB, 3),
        "offload_s": round(offload_s, 3),
        "onload_s": round(onload_s, 3),
        "rollout_s": round(rollout_s, 3),
        "engine_gib": round(engine_bytes / GIB, 3),
        "generated": generated[:8],
        "first_step_ms": round(1e3 * times[0], 2),
        "steady_step_ms": round(1e3 * statistics.median(times[1:]), 2),
        "captures": report["captures"],
        "replays": report["replays"],
    }


def packed_responses(args, cfg: GPTConfig) -> PackedData | None:
    """``--packed``: responses of lognormal lengths (mean a quarter of the sequence), packed
    first-fit, at most 8 per pack."""
    if not args.packed:
        return None
    policy = PackingPolicy(
        budget=cfg.seq_length, max_documents=8, mean_document_length=max(2, cfg.seq_length // 4)
    )
    return PackedData(policy, vocab_size=cfg.vocab_size)


def run_rl(args, cfg, batch, device, rank) -> tuple[list[dict], list[float], dict]:
    sync(device)
    ctx = {"args": args, "cfg": cfg, "batch": batch, "device": device, "rank": rank}
    ctx["packs"] = packed_responses(args, cfg)
    ctx["free_base"] = free_bytes(device)
    ctx["model"], ctx["opt"], ctx["graphs"] = build(cfg, args, device)
    ctx["step_fn"] = make_step(ctx["model"], ctx["graphs"])
    ctx.update(step=0, losses=[])
    iterations = []
    for it in range(args.iterations):
        record = rl_iteration(ctx, it)
        iterations.append(record)
        if rank == 0:
            print(json.dumps(record), flush=True)
    # One more round of steps after the last onload: training goes on from there.
    for _ in range(args.train_steps):
        loss, _ = train_step(ctx, ctx["step_fn"], ctx["opt"], ctx["graphs"], ctx["step"])
        ctx["losses"].append(loss)
        ctx["step"] += 1
    mode = offload.offload_mode(ctx["model"])
    info = {
        "mode": "keep" if mode.keeper is not None else "recapture",
        "notice": mode.notice,
        "report": {k: v for k, v in ctx["graphs"].report().items() if k != "verification"},
        "params": sum(
            r.shape.numel()
            for s in collect_states(ctx["model"])
            for g in s.groups
            for r in g.params
        ),
    }
    ctx["graphs"].close()
    return iterations, ctx["losses"], info


def run_reference(args, cfg, batch, device, rank, steps: int) -> list[float]:
    """The same training steps without offload or rollout."""
    model, opt, graphs = build(cfg, args, device)
    ctx = {"cfg": cfg, "batch": batch, "device": device, "rank": rank}
    ctx["packs"] = packed_responses(args, cfg)
    step_fn = make_step(model, graphs)
    losses = [train_step(ctx, step_fn, opt, graphs, step)[0] for step in range(steps)]
    graphs.close()
    return losses


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    restart_under_preload(args)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    cuda = args.device == "cuda"
    init_distributed("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    torch.use_deterministic_algorithms(True)
    torch.ones(1, 1, device=device).matmul(torch.ones(1, 1, device=device))  # cuBLAS is up
    dist.barrier()
    cfg, batch = PRESETS[args.preset]
    iterations, losses, info = run_rl(args, cfg, batch, device, rank)
    empty_cache(device)
    reference = (
        run_reference(args, cfg, batch, device, rank, len(losses)) if args.reference else None
    )
    later = iterations[1:] or iterations  # the first step of iteration 0 is not after an onload
    summary = {
        "summary": True,
        "preset": args.preset,
        "graphs": args.graphs,
        "strategy": args.strategy,
        "packed": args.packed,
        "world_size": dist.get_world_size(),
        "gpu": torch.cuda.get_device_name(device) if cuda else None,
        "ld_preload": "torch_memory_saver" in os.environ.get("LD_PRELOAD", ""),
        **info,
        "losses": losses,
        "reference_losses": reference,
        "bit_identical": None if reference is None else reference == losses,
        "min_returned_pct": min(r["returned_pct"] for r in iterations),
        "max_first_vs_steady": max(r["first_step_ms"] / r["steady_step_ms"] for r in later),
    }
    if rank == 0:
        print(json.dumps(summary), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return summary


if __name__ == "__main__":
    main()
