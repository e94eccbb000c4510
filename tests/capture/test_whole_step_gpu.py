"""The whole training step as one CUDA graph (``WholeStepGraph``) on NCCL.

Bit-exactness: 30 steps of the graphed step equal the eager step (``eager=True``, the same
code without graphs) bit for bit - per-step loss, gradient norm and skip flag, an eval loss
between replays, one step run eagerly between replays (``step.eagerly``, an overflowed
step's repeat), the final weights and the whole optimizer state - with 1 and 4
microbatches, fused AdamW with clipping and fused SGD without, an LR schedule (the learning
rate a device tensor the scheduler fills), and an Inf injected into one microbatch of rank
0 at one step (the update is skipped on every rank, the optimizer state left as it was), and
a checkpoint-style ``load_state_dict`` mid-run (new state tensors: the step captures again).
Every graphed step after the warmup but the eager one is exactly one replay. The main
gradients live in the graph's pool, pinned while it lives (whole_step.py [Note: main
gradients in the step graph's pool]): an eval forward and an eager step between replays keep
their address, as does a capture while another holder pinned them once that holder lets go;
``close()`` takes the pin back. The 2-rank variants (the skip
decided from an all-reduced norm inside the graph; the reduce-scatter with fp32
accumulation, its all-to-all inside the graph) and the refusal of that all-to-all while NCCL
registers graph buffers skip below 2 GPUs.

Timing: one launch, the rows side by side on the 16-layer GPT (hidden 1024, seq 1024, micro
batch 1, bf16 compute, fp32 main weights, fused AdamW everywhere), each row's own peak
allocated and reserved memory (bench/verdicts.py [Note: a row's own peak]), printed as JSON
lines (run pytest with ``-s``). Asserted: every graphed row (all but the two eager ones)
captured, replayed at least once per timed step and never fell back to eager; on 2 GPUs the
reserved-memory ratios of ``RESERVED_BOUNDS``. The step-time targets are printed, not
asserted. Run with
``NCCL_GRAPH_REGISTER=0`` on 2 GPUs to add the rows whose graphs capture the gradients'
all-to-all (capture/step.py [Note: NCCL graph registration and the all-to-all]).
``GRAPH_FSDP_TIMING_REPEATS=N`` runs every timing row N times in turn (a row's time: the
median of its runs' medians); ``GRAPH_FSDP_TIMING_SHAPE=hidden2048`` times hidden 2048 at
seq 2048.

    GRAPH_FSDP_GPU_TEST_WORLD=1 python -m pytest -q -s -m gpu tests/capture/test_whole_step_gpu.py
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import time
from statistics import median

import pytest
import torch
import torch.distributed as dist
from graph_fsdp_testing import BF16_MP, needs_gpus
from graph_fsdp_testing import GPU_TEST_WORLD as WORLD

from graph_fsdp.models import GPTConfig
from graph_fsdp.training.loop import use_deterministic_kernels
from graph_fsdp.training.processes import spawn

pytestmark = [pytest.mark.gpu, needs_gpus(1)]

SMALL = GPTConfig(
    vocab_size=1024, num_layers=4, hidden_size=256, num_attention_heads=4, seq_length=128
)
STEPS, WARMUP, INF_STEP, LOAD_STEP, EVAL_STEP, EAGER_STEP = 30, 2, 12, 16, 20, 22


def _exact_cfg(grad_accum: int, vocab_parallel: bool = False, fp32_accumulation: bool = False):
    from graph_fsdp.training.train import TrainConfig

    return TrainConfig(
        model=SMALL,
        vocab_parallel_embedding=vocab_parallel,
        mp=dataclasses.replace(BF16_MP, reduce_scatter_fp32_accumulation=fp32_accumulation),
        micro_batch_size=2,
        grad_accum=grad_accum,
        device="cuda",
        allocator="double_buffer",
        persist_on_alloc_fail=True,
    )


def _lr_factor(step: int) -> float:
    """Linear warmup over 5 steps, then a decay: the learning rate changes every step."""
    return min(1.0, (step + 1) / 5) * 0.9 ** max(0, step - 5)


def _optimizer(kind: str, model) -> torch.optim.Optimizer:
    if kind == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, fused=True)
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, fused=True)


def _poison(step: int, micro: int, rank: int, device) -> torch.Tensor:
    bad = step == INF_STEP and micro == 0 and rank == 0
    return torch.tensor(math.inf if bad else 1.0, device=device)


def _snapshot(model, opt) -> dict:
    from graph_fsdp.fsdp.checkpoint import full_state_dict

    params = [p for g in opt.param_groups for p in g["params"]]
    state = {
        f"{i}.{k}": v.detach().cpu().clone()
        for i, p in enumerate(params)
        for k, v in opt.state.get(p, {}).items()
        if torch.is_tensor(v)
    }
    weights = {k: v.detach().cpu().clone() for k, v in full_state_dict(model).items()}
    return {"weights": weights, "opt": state}


def _poisoned_step(step, sched, cfg, i: int, rank: int, device) -> torch.Tensor:
    """Step ``i`` over ``cfg.grad_accum`` microbatches (``_poison`` ed), then the scheduler:
    ``[loss, grad norm, skipped]``."""
    from graph_fsdp.training.data import batch_for

    n = cfg.grad_accum
    mbs = [
        (*batch_for(cfg, i * n + m, rank, device), _poison(i, m, rank, device)) for m in range(n)
    ]
    res = step(mbs, n=n)
    sched.step()
    return torch.stack([res.loss, res.grad_norm, res.skipped])


def _train(
    rank: int,
    world: int,
    grad_accum: int,
    kind: str,
    clip,
    vocab_parallel: bool,
    fp32_accumulation: bool,
    beside: bool = False,
    *,
    eager: bool,
) -> dict:
    from graph_fsdp.capture.whole_step import StepPolicy, WholeStepGraph
    from graph_fsdp.training.data import batch_for
    from graph_fsdp.training.train import build_for, device_of, shard_model

    cfg = _exact_cfg(grad_accum, vocab_parallel, fp32_accumulation)
    device = device_of(cfg)
    model = shard_model(build_for(cfg, device), cfg)
    opt = _optimizer(kind, model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_factor)
    policy = StepPolicy(clip_grad=clip, norm_beside_last_reduction=beside)
    runner = WholeStepGraph(model, opt, policy=policy, warmup_steps=WARMUP, eager=eager)

    def step_fn(x, y, poison, *, n):
        loss = (model(x, y) / n) * poison
        loss.backward()
        return loss.detach()

    step = runner.capture(step_fn)
    rows, snaps, eval_loss = [], {}, None
    for i in range(STEPS):
        # EAGER_STEP: run eagerly between replays (an overflowed step's repeat), writing the
        # main gradients the graph pinned
        run = step.eagerly if i == EAGER_STEP else step
        rows.append(_poisoned_step(run, sched, cfg, i, rank, device))
        if i in (INF_STEP - 1, INF_STEP):
            snaps[i] = _snapshot(model, opt)
        if i == LOAD_STEP:  # new state tensors, same values (a checkpoint load): recapture
            opt.load_state_dict(copy.deepcopy(opt.state_dict()))
        if i == EVAL_STEP:  # an eager forward between replays (the main grads stay: pinned)
            with torch.no_grad():
                eval_loss = model(*batch_for(cfg, i, rank, device, eval=True)).float().cpu()
    out = {
        "summary": torch.stack(rows).cpu(),
        "snapshots": snaps,
        "final": _snapshot(model, opt),
        "eval_loss": eval_loss,
        "lr": [float(x) for x in sched.get_last_lr()],
        "report": runner.report(),
        "memory": model.fsdp_memory_report(),
    }
    runner.close()
    return out


def _exact_worker(rank: int, world: int, variants: list[tuple]) -> dict:
    use_deterministic_kernels()  # eager must repeat itself before graphs can
    out = {}
    for variant in variants:
        for eager in (True, False):
            key = (*variant, "eager" if eager else "graphed")
            out[key] = _train(rank, world, *variant, eager=eager)
            dist.barrier()
    return out


# (microbatches, optimizer, clip, vocab-parallel embedding: vocab_parallel.py, reduce-scatter
# with fp32 accumulation: an all-to-all inside the graph on 2 ranks, reduce.py[, the norm
# beside the last reduction: grad_norm.py, the same bits as without])
VARIANTS = [
    (1, "adamw", 0.5, False, False),
    (4, "adamw", 0.5, False, False),
    (1, "sgd", None, False, False),
    (4, "adamw", 0.5, True, False),
    (4, "adamw", 0.5, True, True),
    (4, "adamw", 0.5, False, False, True),
]


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical, NaNs included."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.contiguous().view(ints), b.contiguous().view(ints))


def _differing(a: dict, b: dict) -> list[str]:
    assert a.keys() == b.keys()
    return [k for k in a if not _same_bits(a[k], b[k])]


def _check_exact(results: list[dict], variants: list[tuple]) -> None:
    expected_skips = torch.tensor([1.0 if i == INF_STEP else 0.0 for i in range(STEPS)])
    for rank, res in enumerate(results):
        for variant in variants:
            grad_accum, kind, clip, vocab_parallel, fp32_accumulation, *beside = variant
            eager, graphed = res[(*variant, "eager")], res[(*variant, "graphed")]
            what = f"rank {rank}, {grad_accum} microbatch(es), {kind}, clip {clip}"
            what += ", vocab-parallel embedding" if vocab_parallel else ""
            what += ", reduce-scatter with fp32 accumulation" if fp32_accumulation else ""
            if beside and beside[0]:  # the same bits as the same variant without it
                what += ", norm beside the last reduction"
                plain = res[(*variant[:5], "graphed")]
                assert _same_bits(plain["summary"], graphed["summary"]), what
            rows = [
                i
                for i in range(STEPS)
                if not _same_bits(eager["summary"][i], graphed["summary"][i])
            ]
            first = rows[0] if rows else 0
            assert rows == [], (
                f"{what}: steps {rows} differ (loss, norm, skipped): "
                f"{eager['summary'][first].tolist()} vs {graphed['summary'][first].tolist()}"
            )
            assert torch.equal(graphed["summary"][:, 2], expected_skips), what
            assert _same_bits(eager["eval_loss"], graphed["eval_loss"]), what
            assert _differing(eager["final"]["weights"], graphed["final"]["weights"]) == [], what
            assert _differing(eager["final"]["opt"], graphed["final"]["opt"]) == [], what
            before, after = graphed["snapshots"][INF_STEP - 1], graphed["snapshots"][INF_STEP]
            assert _differing(before["weights"], after["weights"]) == [], f"{what}: not skipped"
            assert _differing(before["opt"], after["opt"]) == [], f"{what}: state changed"
            assert eager["lr"] == graphed["lr"], what
            report = graphed["report"]
            # One replay per graphed step, none eager after the warmup but EAGER_STEP's;
            # captured after the warmup and again after the optimizer's state tensors were
            # replaced.
            assert report["captures"] == 2, report
            assert report["captured_at_step"] == LOAD_STEP + 1, report
            assert report["replays"] == STEPS - WARMUP - 1, report
            assert report["eager_fallbacks"] == 0 and report["impl"] == "torch", report
            assert eager["report"]["replays"] == 0 and eager["report"]["impl"] == "eager"
            print(
                json.dumps(
                    {
                        "whole_step_exact": what,
                        "steps": STEPS,
                        "replays": report["replays"],
                        "skipped_step": INF_STEP,
                        "graph_pool_reserved_bytes": graphed["memory"]["graph_pool_bytes"],
                    }
                )
            )


def _pins_worker(rank: int, world: int) -> dict:
    """Main-gradient addresses and pins of two graphed runs of the small GPT: ``alone``, and
    ``after_other`` - every group pinned by another holder (another runner's graphs) before
    the runner exists, that holder letting go after the capture."""
    from graph_fsdp.capture.pools import MainGradPins
    from graph_fsdp.capture.whole_step import WholeStepGraph
    from graph_fsdp.fsdp.state import collect_states
    from graph_fsdp.training.data import batch_for
    from graph_fsdp.training.train import build_for, device_of, shard_model

    use_deterministic_kernels()
    cfg = _exact_cfg(1)
    device = device_of(cfg)

    def run(other_holder: bool) -> dict:
        model = shard_model(build_for(cfg, device), cfg)
        runner = WholeStepGraph(model, _optimizer("adamw", model), warmup_steps=WARMUP)
        groups = [g for s in collect_states(model) for g in s.groups]

        class Holder:  # stands for another runner
            pass

        holder = Holder()
        other = MainGradPins(holder)
        if other_holder:
            other.pin(groups)

        def step_fn(x, y):
            loss = model(x, y)
            loss.backward()
            return loss.detach()

        step = runner.capture(step_fn)
        for i in range(WARMUP + 2):  # the warmup steps, the capture's step, one replay
            step([batch_for(cfg, i, rank, device)])
        other.unpin()  # no-op without the other holder
        torch.cuda.synchronize()
        segments = [
            s
            for s in torch.cuda.memory_snapshot()
            if tuple(s["segment_pool_id"]) == tuple(runner._pool)
        ]

        def addresses() -> list[int]:
            return [g.main_grad.data_ptr() for g in groups]

        captured = addresses()
        out = {
            "in_pool": [
                any(s["address"] <= p < s["address"] + s["total_size"] for s in segments)
                for p in captured
            ],
            "pinned": [g.main_grad_pinned for g in groups],
        }
        with torch.no_grad():  # an eval forward: releases main gradients nobody pins
            model(*batch_for(cfg, 0, rank, device, eval=True))
        out["kept_through_eval"] = addresses() == captured and all(
            g.main_grad.untyped_storage().nbytes() for g in groups
        )
        step.eagerly([batch_for(cfg, WARMUP + 2, rank, device)])
        out["kept_through_eager_step"] = addresses() == captured
        replays = runner.replays
        step([batch_for(cfg, WARMUP + 3, rank, device)])
        out["replayed_after"] = runner.replays == replays + 1
        runner.close()
        out["pinned_after_close"] = [g.main_grad_pinned for g in groups]
        with torch.no_grad():
            model(*batch_for(cfg, 0, rank, device, eval=True))
        out["bytes_after_close"] = [g.main_grad.untyped_storage().nbytes() for g in groups]
        return out

    return {"alone": run(False), "after_other": run(True)}


def test_whole_step_main_grads_are_pinned_in_its_pool():
    """whole_step.py [Note: main gradients in the step graph's pool]: made in the graph's pool
    (after another holder's pin: where that holder kept them), pinned by the runner while its
    graph lives - an eval forward and an eager step between replays keep their bytes and
    address -, released by the first forward after ``close()``."""
    (res,) = spawn(_pins_worker, 1, backend="nccl")
    alone, after_other = res["alone"], res["after_other"]
    assert all(alone["in_pool"]), alone
    for out in (alone, after_other):
        assert all(out["pinned"]), out
        assert out["kept_through_eval"] and out["kept_through_eager_step"], out
        assert out["replayed_after"], out
        assert not any(out["pinned_after_close"]), out
        assert not any(out["bytes_after_close"]), out


def test_whole_step_graph_is_bit_identical_to_eager():
    variants = [*VARIANTS[:4], VARIANTS[5]]  # one rank: fp32 accumulation is a copy
    results = spawn(_exact_worker, 1, variants, backend="nccl")
    _check_exact(results, variants)


@needs_gpus(2)
def test_whole_step_graph_is_bit_identical_to_eager_on_two_ranks(monkeypatch):
    # the skip decided from the norm all-reduced inside the graph; the embedding's
    # collectives and the gradients' all-to-all inside it (the all-to-all needs NCCL's graph
    # registration off: capture/step.py [Note: NCCL graph registration and the all-to-all])
    monkeypatch.setenv("NCCL_GRAPH_REGISTER", "0")
    variants = [VARIANTS[0], VARIANTS[1], VARIANTS[3], VARIANTS[4], VARIANTS[5]]
    results = spawn(_exact_worker, 2, variants, backend="nccl")
    _check_exact(results, variants)


def _refusal_worker(rank: int, world: int) -> str:
    """``"<step> <message>"`` of the refusal, the step at which it came ("" if none)."""
    from graph_fsdp.capture.scopes import GraphConfigError
    from graph_fsdp.capture.whole_step import WholeStepGraph
    from graph_fsdp.training.data import batch_for
    from graph_fsdp.training.train import build_for, device_of, shard_model

    cfg = _exact_cfg(1, fp32_accumulation=True)
    device = device_of(cfg)
    model = shard_model(build_for(cfg, device), cfg)
    runner = WholeStepGraph(model, _optimizer("adamw", model), warmup_steps=WARMUP)

    def step_fn(x, y):
        loss = model(x, y)
        loss.backward()
        return loss.detach()

    step = runner.capture(step_fn)
    for i in range(WARMUP + 1):
        try:
            step([batch_for(cfg, i, rank, device)])
        except GraphConfigError as err:
            return f"{i} {err}"
    return ""


@needs_gpus(2)
def test_a_graphed_all_to_all_is_refused_while_nccl_registers_graph_buffers(monkeypatch):
    """On real NCCL groups, NCCL_GRAPH_REGISTER unset: the warmup steps run eagerly, the
    capture is refused at the all-to-all (a replay that would hang), naming the caller, the
    variable and the fixes."""
    monkeypatch.delenv("NCCL_GRAPH_REGISTER", raising=False)
    for err in spawn(_refusal_worker, 2, backend="nccl"):
        assert err.startswith(f"{WARMUP} FSDP's gradient reduction with reduce_scatter"), err
        assert "(NCCL_GRAPH_REGISTER=unset): its replay hangs" in err, err
        assert "is captured into the whole-step graph" in err, err
        assert "Set NCCL_GRAPH_REGISTER=0" in err, err


def _loop_worker(rank: int, world: int) -> dict:
    """The training loop (train.run) with --cuda-graph-optimizer: graphed whole steps against
    the same loop's eager whole steps (cuda_graph_impl "none"), 4 microbatches, clipping."""
    from graph_fsdp.training.train import run

    base = dataclasses.replace(
        _exact_cfg(4),
        steps=12,
        clip_grad=0.5,
        eval_interval=5,
        cuda_graph_optimizer=True,
        cuda_graph_scope=["full_iteration"],
        cuda_graph_warmup_steps=WARMUP,
        deterministic=True,
        fused_optimizer=True,
    )
    eager = run(rank, world, base)
    graphed = run(rank, world, dataclasses.replace(base, cuda_graph_impl="torch"))
    return {"eager": eager, "graphed": graphed}


def test_training_loop_whole_step_is_bit_identical_to_its_eager_twin():
    """``graph-fsdp train --cuda-graph-scope full_iteration --cuda-graph-optimizer`` runs the
    loop through WholeStepGraph: every graphed step one replay, losses, eval losses and final
    weights equal to the eager whole steps bit for bit."""
    for out in spawn(_loop_worker, WORLD, backend="nccl"):
        eager, graphed = out["eager"], out["graphed"]
        report = graphed["cuda_graphs"]
        assert report["whole_step"] and report["impl"] == "torch", report
        assert report["captures"] == 1 and report["replays"] == 12 - WARMUP, report
        assert report["eager_fallbacks"] == 0, report
        assert eager["cuda_graphs"]["replays"] == 0
        assert graphed["losses"] == eager["losses"]
        assert graphed["eval_losses"] == eager["eval_losses"]
        for name, value in eager["params"].items():
            assert torch.equal(graphed["params"][name], value), name


# --------------------------------------------------------------------------------------------
# Timing: one launch, rows side by side
# --------------------------------------------------------------------------------------------

TIMED_STEPS, TIMED_WARMUP = 20, 3


def _whole_step_row(
    rank: int,
    world: int,
    spec,
    *,
    clip=None,
    overlap: bool = False,
    units: int = 2,
    beside: bool = False,
) -> dict:
    """graph_fsdp's whole step (one replay per step): warmup steps and the capture's step
    untimed, then ``spec.steps`` timed steps, each generating its batches as the other rows."""
    from graph_fsdp.capture.whole_step import StepPolicy, WholeStepGraph
    from graph_fsdp.models import synthetic_batch
    from graph_fsdp.training.train import build_for, device_of, shard_model

    cfg = spec.cfg
    device = device_of(cfg)
    model = shard_model(build_for(cfg, device), cfg)
    opt = torch.optim.AdamW(
        model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, fused=True
    )
    policy = StepPolicy(
        clip_grad=clip,
        overlap_next_gather=overlap,
        next_gather_units=units,
        norm_beside_last_reduction=beside,
    )
    runner = WholeStepGraph(model, opt, policy=policy, warmup_steps=spec.warmup)

    def step_fn(x, y, *, n):
        loss = model(x, y) / n
        loss.backward()
        return loss.detach()

    step = runner.capture(step_fn)
    first = spec.warmup + 1
    times, host, losses = [], [], []
    for i in range(first + spec.steps):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        mbs = [
            synthetic_batch(
                cfg.model, cfg.micro_batch_size, i * cfg.grad_accum + m, rank=rank, device=device
            )
            for m in range(cfg.grad_accum)
        ]
        losses.append(step(mbs, n=cfg.grad_accum).loss)
        host.append(time.perf_counter() - t0)
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    out = {
        "times": times[first:],
        "host_step_times": host[first:],
        "final_loss": float(losses[-1]),
        "graphs": runner.report(),
        "graph_pool_bytes": runner.graph_pool_bytes(),
        "persistent_bytes": model.fsdp_memory_report()["persistent_bytes"],
    }
    runner.close()
    return out


A2A_ROW = "graph_fsdp whole step, vocab-parallel embedding, bf16 all-to-all + fp32 sums"


FULL_ITERATION = {"cuda_graph_impl": "torch", "cuda_graph_scope": ["full_iteration"]}


TIMED_SHAPES = {
    "hidden1024": GPTConfig(),
    "hidden2048": GPTConfig(hidden_size=2048, seq_length=2048),
}
"""The timing rows' GPT by ``$GRAPH_FSDP_TIMING_SHAPE`` (default hidden1024): 16 layers,
vocab 32000, 16 heads; hidden 1024 at seq 1024, or hidden 2048 at seq 2048."""


def _timed_spec(grad_accum: int = 1, **changes):
    """A timing row's spec: the 16-layer GPT of ``TIMED_SHAPES``, micro batch 1, bf16
    compute, fused AdamW, the double buffer; ``changes`` to the TrainConfig."""
    from graph_fsdp.bench.peers import BenchSpec
    from graph_fsdp.training.train import TrainConfig

    shape = os.environ.get("GRAPH_FSDP_TIMING_SHAPE", "hidden1024")
    if shape not in TIMED_SHAPES:
        raise ValueError(f"GRAPH_FSDP_TIMING_SHAPE={shape!r}: one of {sorted(TIMED_SHAPES)}")
    cfg = TrainConfig(
        model=TIMED_SHAPES[shape],
        mp=BF16_MP,
        micro_batch_size=1,
        grad_accum=grad_accum,
        device="cuda",
        fused_optimizer=True,
        allocator="double_buffer",
        persist_on_alloc_fail=True,
    )
    return BenchSpec(
        cfg=dataclasses.replace(cfg, **changes), warmup=TIMED_WARMUP, steps=TIMED_STEPS
    )


def _rows(world: int) -> list[tuple]:
    """(name, runner, spec, kwargs): the peers' rows (eager, captured reference, full_iteration,
    FSDP2 + graph) and the whole-step rows."""
    from graph_fsdp.bench.peers import (
        run_fsdp2_cuda_graph,
        run_graph_fsdp,
        run_unsharded,
        run_unsharded_captured,
    )

    spec = _timed_spec
    full = FULL_ITERATION
    layers = {"cuda_graph_impl": "torch", "cuda_graph_scope": []}  # no scope: whole layers
    rows = [
        ("one GPU, eager", run_unsharded, spec(), {}),
        (
            "one GPU, fwd+bwd captured, optimizer eager (reference)",
            run_unsharded_captured,
            spec(),
            {},
        ),
        ("graph_fsdp eager", run_graph_fsdp, spec(), {}),
        ("graph_fsdp full_iteration", run_graph_fsdp, spec(**full), {}),
        ("graph_fsdp layerwise (whole layers)", run_graph_fsdp, spec(**layers), {}),
        ("torch FSDP2, fwd+bwd captured", run_fsdp2_cuda_graph, spec(), {}),
        ("graph_fsdp whole step (one graph)", _whole_step_row, spec(), {}),
        ("graph_fsdp whole step, clip 1.0", _whole_step_row, spec(), {"clip": 1.0}),
        # ZeRO-2: the bf16 weights stay gathered from forward to backward (no second cast),
        # as autocast's saved casts in the reference row
        (
            "graph_fsdp whole step, optim_grads",
            _whole_step_row,
            spec(strategy="optim_grads"),
            {},
        ),
        # the embedding's rows never gathered: ids and activations cross the ranks instead
        # (vocab_parallel.py [Note: vocab-parallel embedding])
        (
            "graph_fsdp full_iteration, vocab-parallel embedding",
            run_graph_fsdp,
            spec(vocab_parallel_embedding=True, **full),
            {},
        ),
        (
            "graph_fsdp whole step, vocab-parallel embedding",
            _whole_step_row,
            spec(vocab_parallel_embedding=True),
            {},
        ),
        (
            "graph_fsdp layerwise, vocab-parallel embedding",
            run_graph_fsdp,
            spec(vocab_parallel_embedding=True, **layers),
            {},
        ),
        (
            "graph_fsdp whole step, optim_grads, vocab-parallel embedding",
            _whole_step_row,
            spec(strategy="optim_grads", vocab_parallel_embedding=True),
            {},
        ),
        ("reference x4 microbatches", run_unsharded_captured, spec(4), {}),
        ("graph_fsdp full_iteration x4 microbatches", run_graph_fsdp, spec(4, **full), {}),
        ("graph_fsdp whole step x4 microbatches", _whole_step_row, spec(4), {}),
    ]
    if world > 1 and os.environ.get("NCCL_GRAPH_REGISTER") == "0":
        # The bf16 gradients over the wire by an all-to-all, each rank's shard summed in fp32
        # (reduce.py [Note: reduce-scatter with fp32 accumulation]): half the bytes of the fp32
        # reduce-scatter, the same bits on 2 ranks. Inside a graph it needs NCCL's graph
        # registration off (capture/step.py [Note: NCCL graph registration and the
        # all-to-all]), a process-wide setting: run with NCCL_GRAPH_REGISTER=0 to add them.
        a2a = {"vocab_parallel_embedding": True, "reduce_scatter_fp32_accumulation": True}
        rows += [
            (A2A_ROW, _whole_step_row, spec(**a2a), {}),
            (f"{A2A_ROW}, optim_grads", _whole_step_row, spec(strategy="optim_grads", **a2a), {}),
        ]
    return rows


def _timing_worker(rank: int, world: int, which: str = "all") -> list[dict] | None:
    """Every row of ``which`` run ``$GRAPH_FSDP_TIMING_REPEATS`` times (default 1), the rows
    in turn each time (A B C, A B C): :func:`_merged` reads the repeats."""
    from graph_fsdp.bench.verdicts import CudaCounters, RowMemory
    from graph_fsdp.training.train import device_of

    device = torch.device("cuda", torch.cuda.current_device())
    counters = CudaCounters(device)
    out = []
    rows = (_rows if which == "all" else _overlap_rows)(world)
    for name, runner, spec, kwargs in rows * TIMING_REPEATS:
        assert device_of(spec.cfg) == device
        memory = RowMemory.start(counters)
        raw = runner(rank, world, spec, **kwargs)
        memory.stop(counters)
        values = torch.tensor(memory.values(), dtype=torch.float64, device=device)
        if world > 1:
            dist.all_reduce(values, op=dist.ReduceOp.MAX)
        if raw is None:  # a one-GPU row on another rank
            continue
        graphs = raw.get("graphs") or {}
        out.append(
            {
                "row": name,
                "world_size": 1 if runner.__name__.startswith("run_unsharded") else world,
                "microbatches": spec.cfg.grad_accum,
                "median_step_ms": round(median(raw["times"]) * 1e3, 3),
                "median_host_ms": round(median(raw["host_step_times"]) * 1e3, 3),
                "own_peak_allocated_gib": round(values[0].item() / 2**30, 3),
                "own_peak_reserved_gib": round(values[1].item() / 2**30, 3),
                "captures": graphs.get("captures"),
                "replays": graphs.get("replays"),
                "eager_fallbacks": graphs.get("eager_fallbacks"),
                "graph_pool_bytes": raw.get("graph_pool_bytes"),
                "persistent_bytes": raw.get("persistent_bytes"),
                "final_loss": raw["final_loss"],
            }
        )
    return out if rank == 0 else None


TIMING_REPEATS = int(os.environ.get("GRAPH_FSDP_TIMING_REPEATS", "1"))
"""How many times each timing row runs in one launch (rows in turn): step-time differences
between levers of a few percent are within one run's spread (rows of identical code differed
by up to 4% within a launch on one H200)."""


def _merged(records: list[dict]) -> dict[str, dict]:
    """The rows by name; with repeats, each row's step and host times are the median of its
    repeats' medians (``median_step_ms_each`` keeps them), its peaks the largest, its replays
    and fallbacks the sums."""
    rows: dict[str, dict] = {}
    for rec in records:
        name = rec["row"]
        if name not in rows:
            rows[name] = {**rec, "median_step_ms_each": [rec["median_step_ms"]]}
            continue
        row = rows[name]
        row["median_step_ms_each"].append(rec["median_step_ms"])
        for key in ("own_peak_allocated_gib", "own_peak_reserved_gib"):
            row[key] = max(row[key], rec[key])
        for key in ("captures", "replays", "eager_fallbacks"):
            if rec[key] is not None:
                row[key] = (row[key] or 0) + rec[key]
        row.setdefault("_host", [row["median_host_ms"]]).append(rec["median_host_ms"])
    for row in rows.values():
        each = row["median_step_ms_each"]
        row["median_step_ms"] = round(median(each), 3)
        row["median_host_ms"] = round(median(row.pop("_host", [row["median_host_ms"]])), 3)
        row["repeats"] = len(each)
    return rows


def _ratio(rows: dict, name: str, ref: str, key: str = "median_step_ms") -> float:
    return round(rows[name][key] / rows[ref][key], 3)


EAGER_ROWS = ("one GPU, eager", "graph_fsdp eager")
"""The timing rows that run no graph; every other row is graphed and must replay."""
FSDP2_GRAPH = "torch FSDP2, fwd+bwd captured"
RESERVED_BOUNDS = (
    ("graph_fsdp full_iteration", FSDP2_GRAPH, 1.0),
    ("graph_fsdp layerwise (whole layers)", FSDP2_GRAPH, 1.0),
    ("graph_fsdp whole step (one graph)", FSDP2_GRAPH, 1.0),
    ("graph_fsdp full_iteration", "graph_fsdp eager", 1.16),
    ("graph_fsdp whole step (one graph)", "graph_fsdp eager", 1.16),
    ("graph_fsdp layerwise (whole layers)", "graph_fsdp eager", 1.26),
)
"""(row, against, bound): the row's own peak reserved over the other row's, asserted on 2 GPUs
with room for drift between launches: on 2 H200s (2026-11-27) every graphed row reserved
0.79-0.86x of FSDP2 + graph's peak, and full_iteration and the one-graph step 1.11x and 1.12x
of graph_fsdp eager's, layerwise 1.21x; the one-graph step's eager steps on its capture
stream gave 1.19-1.21x, and before the capture's release order every graphed row was
1.36-1.47x."""


def _reserved_label(row: str, against: str, bound: float) -> str:
    return f"{row} reserved / {against} reserved (asserted <= {bound} on 2 GPUs)"


def _check_graphed_rows(rows: dict) -> None:
    """Every graphed row captured, replayed at least once per timed step (the reference rows
    and the whole step: once per microbatch, resp. step) and never ran a captured module
    eagerly; the eager rows report no replay."""
    graphed = [name for name in rows if name not in EAGER_ROWS]
    assert len(graphed) >= 14, sorted(rows)  # every graphed row of _rows() ran
    for name in graphed:
        row = rows[name]
        assert row["captures"] and row["captures"] >= 1, row
        assert row["replays"] and row["replays"] >= TIMED_STEPS, row
        assert row["eager_fallbacks"] == 0, row
    for name in EAGER_ROWS:
        assert not rows[name]["replays"], rows[name]


@needs_gpus()
def test_whole_step_timing_and_memory():
    rows = _merged(spawn(_timing_worker, WORLD, backend="nccl")[0])
    ref, ref4 = (
        "one GPU, fwd+bwd captured, optimizer eager (reference)",
        "reference x4 microbatches",
    )
    for row in rows.values():
        base = ref4 if row["microbatches"] == 4 else ref
        row["x_reference"] = _ratio(rows, row["row"], base)
        print(json.dumps(row))
    one = "graph_fsdp whole step (one graph)"
    # Printed for the record; the step-time targets are not asserted (launches vary).
    ratios = {
        "world_size": WORLD,
        "one graph / reference (target <= 0.97 at world size 1, <= 1.03 on 2 GPUs)": rows[one][
            "x_reference"
        ],
        "one graph x4 / reference x4": rows["graph_fsdp whole step x4 microbatches"]["x_reference"],
        "one graph optim_grads / reference": rows["graph_fsdp whole step, optim_grads"][
            "x_reference"
        ],
        "one graph vocab-parallel embedding / reference": rows[
            "graph_fsdp whole step, vocab-parallel embedding"
        ]["x_reference"],
        "one graph optim_grads vocab-parallel embedding / reference": rows[
            "graph_fsdp whole step, optim_grads, vocab-parallel embedding"
        ]["x_reference"],
        **{
            _reserved_label(row, against, bound): _ratio(
                rows, row, against, "own_peak_reserved_gib"
            )
            for row, against, bound in RESERVED_BOUNDS
        },
        **{
            f"{name} reserved / graph_fsdp eager reserved": _ratio(
                rows, name, "graph_fsdp eager", "own_peak_reserved_gib"
            )
            for name in rows
            if name.startswith("graph_fsdp") and "vocab-parallel" in name
        },
        **{f"{name} / reference": rows[name]["x_reference"] for name in rows if A2A_ROW in name},
    }
    print(json.dumps({"ratios": ratios}))
    # What must hold: every graphed row replayed once per timed step (or microbatch).
    _check_graphed_rows(rows)
    if WORLD == 2:
        for row, against, bound in RESERVED_BOUNDS:  # memory regressions
            key = _reserved_label(row, against, bound)
            assert ratios[key] <= bound, (key, ratios[key])
    whole = [name for name in rows if name.startswith("graph_fsdp whole step")]
    for name in whole:
        n = rows[name]["repeats"]  # one capture per run of the row
        assert rows[name]["captures"] == n and rows[name]["eager_fallbacks"] == 0, rows[name]
        assert rows[name]["replays"] == n * (TIMED_STEPS + 1), rows[name]  # + the capture's
        assert math.isfinite(rows[name]["final_loss"]), rows[name]


# ----------------------------------------------------------------- next step's gathers overlapped
# StepPolicy(overlap_next_gather=True) (capture/next_gather.py [Note: the next step's gathers in
# the step graph]): the graphed step with it equals the eager step without it, bit for bit,
# through the traps that must make the next step gather again; and its timing row.
# The Inf is _poison's step (INF_STEP, 12); the load comes after it.
OV_STEPS, OV_SAVE, OV_EVAL, OV_DROP, OV_INF, OV_LOAD = 16, 5, 8, 10, INF_STEP, 14
OVERLAP_VARIANTS = [  # (strategy, microbatches, the all-gathers on a group of their own)
    ("optim_grads_params", 1, False),
    ("optim_grads_params", 2, False),
    ("optim_grads", 1, False),
    ("optim", 2, False),
    # comm.py [Note: a communicator for the all-gathers]: the next step's gathers on the
    # second communicator; the same bits as the shared group's run above
    ("optim_grads_params", 2, True),
]


def _overlap_train(
    rank, world, strategy, grad_accum, own_group: bool, graphed: bool, path: str
) -> dict:
    from graph_fsdp.capture.whole_step import StepPolicy, WholeStepGraph
    from graph_fsdp.fsdp import checkpoint
    from graph_fsdp.training.data import batch_for
    from graph_fsdp.training.train import build_for, device_of, shard_model

    cfg = dataclasses.replace(
        _exact_cfg(grad_accum), strategy=strategy, separate_all_gather_group=own_group
    )
    device = device_of(cfg)
    model = shard_model(build_for(cfg, device), cfg)
    opt = _optimizer("adamw", model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_factor)
    policy = StepPolicy(clip_grad=0.5, overlap_next_gather=graphed)  # eager: the switch off
    runner = WholeStepGraph(model, opt, policy=policy, warmup_steps=WARMUP, eager=not graphed)

    def step_fn(x, y, poison, *, n):
        loss = (model(x, y) / n) * poison
        loss.backward()
        return loss.detach()

    step = runner.capture(step_fn)
    rows, evals = [], []
    for i in range(OV_STEPS):
        if i == OV_SAVE:
            checkpoint.save(path, model, opt)
        if i == OV_EVAL:  # ZeRO-3: reshards the units the last replay gathered
            with torch.no_grad():
                evals.append(model(*batch_for(cfg, i, rank, device, eval=True)).float().cpu())
        if i == OV_DROP:
            runner.drop()
        if i == OV_LOAD:  # older weights than the gathered ones; new optimizer state tensors
            checkpoint.load(path, model, opt)
        rows.append(_poisoned_step(step, sched, cfg, i, rank, device))
    out = {
        "summary": torch.stack(rows).cpu(),
        "evals": evals,
        "final": _snapshot(model, opt),
        "report": runner.report(),
    }
    runner.close()
    return out


def _overlap_worker(rank: int, world: int, path: str) -> dict:
    use_deterministic_kernels()
    out = {}
    for variant in OVERLAP_VARIANTS:
        for graphed in (False, True):
            where = f"{path}/{'_'.join(map(str, variant))}_{graphed}"
            out[(*variant, graphed)] = _overlap_train(rank, world, *variant, graphed, where)
            dist.barrier()
    return out


@needs_gpus()
def test_overlapped_next_gathers_are_bit_identical_to_eager(tmp_path):
    results = spawn(_overlap_worker, WORLD, str(tmp_path), backend="nccl")
    skips = torch.tensor([1.0 if i == OV_INF else 0.0 for i in range(OV_STEPS)])
    for rank, res in enumerate(results):
        for variant in OVERLAP_VARIANTS:
            strategy, grad_accum, own_group = variant
            what = f"rank {rank} of {WORLD}, {strategy}, {grad_accum} microbatch(es)"
            what += ", all-gathers' own group" if own_group else ""
            eager, graphed = res[(*variant, False)], res[(*variant, True)]
            if own_group:  # the same collectives on a second communicator: the same bits
                shared = res[(strategy, grad_accum, False, True)]
                assert _same_bits(shared["summary"], graphed["summary"]), what
                assert _differing(shared["final"]["weights"], graphed["final"]["weights"]) == []
            differ = [
                i
                for i in range(OV_STEPS)
                if not _same_bits(eager["summary"][i], graphed["summary"][i])
            ]
            assert differ == [], (what, differ, eager["summary"], graphed["summary"])
            assert torch.equal(graphed["summary"][:, 2], skips), what
            assert all(_same_bits(a, b) for a, b in zip(eager["evals"], graphed["evals"])), what
            assert _differing(eager["final"]["weights"], graphed["final"]["weights"]) == [], what
            assert _differing(eager["final"]["opt"], graphed["final"]["opt"]) == [], what
            report = graphed["report"]
            # Captured after the warmup, after drop() and after the load replaced the optimizer's
            # state; the eval's resharded units gathered again at their addresses (no capture).
            assert report["captures"] == 3, (what, report)
            assert report["replays"] == OV_STEPS - WARMUP, (what, report)
            assert report["eager_fallbacks"] == 0 and report["policy"]["overlap_next_gather"]
            print(json.dumps({"overlap_exact": what, "replays": report["replays"]}))


def _overlap_rows(world: int) -> list[tuple]:
    """full_iteration (eager fused AdamW) and the one graph with the overlap off and on, and
    with the all-gathers on a group of their own, for ZeRO-3 and ZeRO-2, on the timing test's
    16-layer GPT, beside the captured reference and torch FSDP2 with its step captured."""
    from graph_fsdp.bench.peers import (
        run_fsdp2_cuda_graph,
        run_graph_fsdp,
        run_unsharded_captured,
    )

    spec, full = _timed_spec, FULL_ITERATION
    rows = [
        (
            "one GPU, fwd+bwd captured, optimizer eager (reference)",
            run_unsharded_captured,
            spec(),
            {},
        ),
        (FSDP2_GRAPH, run_fsdp2_cuda_graph, spec(), {}),
    ]
    for strategy in ("optim_grads_params", "optim_grads"):
        rows += [
            (f"{strategy} full_iteration", run_graph_fsdp, spec(strategy=strategy, **full), {}),
            (f"{strategy} one graph", _whole_step_row, spec(strategy=strategy), {}),
            (
                f"{strategy} one graph, next gathers overlapped",
                _whole_step_row,
                spec(strategy=strategy),
                {"overlap": True},
            ),
            (
                f"{strategy} one graph, next gathers overlapped, 1 unit",
                _whole_step_row,
                spec(strategy=strategy),
                {"overlap": True, "units": 1},
            ),
        ]
        # The all-gathers on a communicator of their own (comm.py [Note: a communicator for
        # the all-gathers]): the same rows, the gathers beside the reduce-scatters.
        own = spec(strategy=strategy, separate_all_gather_group=True)
        rows += [
            (
                f"{strategy} full_iteration{OWN_GROUP}",
                run_graph_fsdp,
                spec(strategy=strategy, separate_all_gather_group=True, **full),
                {},
            ),
            (f"{strategy} one graph{OWN_GROUP}", _whole_step_row, own, {}),
            (
                f"{strategy} one graph{OWN_GROUP}, next gathers overlapped",
                _whole_step_row,
                own,
                {"overlap": True},
            ),
        ]
    # the norm over the gradients reduced before the last reduction beside it (grad_norm.py
    # [Note: the norm beside the last reduction]), ZeRO-3, with and without the levers above
    for name, row_spec, kwargs in (
        ("one graph", spec(), {}),
        (
            f"one graph{OWN_GROUP}, next gathers overlapped",
            spec(separate_all_gather_group=True),
            {"overlap": True},
        ),
    ):
        rows.append(
            (
                f"optim_grads_params {name}{BESIDE}",
                _whole_step_row,
                row_spec,
                {**kwargs, "beside": True},
            )
        )
    return rows


BESIDE = ", norm beside the last reduction"


OWN_GROUP = ", all-gathers' own group"


@needs_gpus()
def test_overlapped_next_gathers_timing_and_memory():
    """Median step time and own peak reserved, overlap off vs on, and the all-gathers on a
    group of their own vs shared with the reduce-scatters (printed; written as JSON to
    $GRAPH_FSDP_OVERLAP_TIMING_JSON when set). Asserted: one capture, a replay every step, no
    fallback, and the overlap's cost in peak reserved under 8% (ZeRO-3 holds the next step's
    first units through the step: measured 3.9% with one unit, 6.3% with two; ZeRO-2 none)."""
    rows = _merged(spawn(_timing_worker, WORLD, "overlap", backend="nccl")[0])
    ref = "one GPU, fwd+bwd captured, optimizer eager (reference)"
    for row in rows.values():
        row["x_reference"] = _ratio(rows, row["row"], ref)
        print(json.dumps(row))
    shape = os.environ.get("GRAPH_FSDP_TIMING_SHAPE", "hidden1024")
    summary = {"world_size": WORLD, "shape": shape, "rows": list(rows.values())}
    fsdp2 = rows[FSDP2_GRAPH]  # captured once, a replay every timed step
    n = fsdp2["repeats"]
    assert fsdp2["captures"] == n and fsdp2["replays"] >= n * TIMED_STEPS, fsdp2
    checked = []
    for strategy in ("optim_grads_params", "optim_grads"):
        off = f"{strategy} one graph"
        for on in (f"{off}, next gathers overlapped", f"{off}, next gathers overlapped, 1 unit"):
            what = on.removeprefix(f"{off}, next gathers overlapped") or ", 2 units"
            summary[f"{strategy}{what}: on / off step time"] = _ratio(rows, on, off)
            summary[f"{strategy}{what}: on / off peak reserved"] = _ratio(
                rows, on, off, "own_peak_reserved_gib"
            )
            checked.append(on)
        checked.append(off)
        for shared in (f"{strategy} full_iteration", off, f"{off}, next gathers overlapped"):
            own = shared.replace(" full_iteration", f" full_iteration{OWN_GROUP}").replace(
                " one graph", f" one graph{OWN_GROUP}"
            )
            what = shared.removeprefix(f"{strategy} ")
            summary[f"{strategy} {what}: own / shared all-gather group step time"] = _ratio(
                rows, own, shared
            )
            summary[f"{strategy} {what}: own / shared all-gather group peak reserved"] = _ratio(
                rows, own, shared, "own_peak_reserved_gib"
            )
            checked.append(own)
    for without in ("one graph", f"one graph{OWN_GROUP}, next gathers overlapped"):
        row = f"optim_grads_params {without}"
        summary[f"optim_grads_params {without}: norm beside / after step time"] = _ratio(
            rows, f"{row}{BESIDE}", row
        )
        checked.append(f"{row}{BESIDE}")
    print(json.dumps({k: v for k, v in summary.items() if k != "rows"}))
    path = os.environ.get("GRAPH_FSDP_OVERLAP_TIMING_JSON")
    if path:  # written before the checks: a failed bound's numbers come back too
        with open(path, "w") as f:
            json.dump(summary, f, indent=2)
    for name in checked:
        row = rows[name]
        n = row["repeats"]  # one capture per run of the row
        assert row["captures"] == n and row["eager_fallbacks"] == 0, row
        assert row["replays"] == n * (TIMED_STEPS + 1), row
        assert math.isfinite(row["final_loss"]), row
    for key, ratio in summary.items():  # measured on 2 H200s: 1.039 (1 unit), 1.063 (2 units)
        if key.endswith("on / off peak reserved"):
            assert ratio <= 1.08, (key, summary)
