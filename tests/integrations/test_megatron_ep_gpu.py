"""A Megatron-Core MoE GPT with expert parallelism on GPUs (NCCL): graphs bit for bit with eager.

The MoE GPT of the GPU tests (TE layer spec, 4 layers, hidden 256, 4 experts top-2 + a shared
expert, aux loss 1e-2, seq 128, bf16, deterministic kernels), built with
``gm.init_parallel_state(expert_model_parallel_size=EP)`` and ``MCoreGPTConfig(
expert_model_parallel_size=EP)``; ``shard_gpt`` shards the experts over the expert-data-parallel
group and the rest over every rank. Layouts (world, EP), each skipping with fewer GPUs:

- ``ep1_groups_world1`` (1, 1): EP = 1 through the expert mesh (``shard_gpt(expert_groups=True)``)
- ``ep2_world2`` (2, 2), ``ep2x2_world4`` (4, 2: EP 2 x EDP 2), ``ep4_world4`` (4, 4)

Per layout, one spawn trains 20 steps with an eval every 5:
- drop-padding (``moe_expert_capacity_factor=1.0``, ``moe_pad_expert_input_to_capacity``,
  alltoall: equal all-to-all splits): eager, te whole layer, torch ``moe``, torch
  ``full_iteration``;
- dropless (Megatron's alltoall + TEGroupedMLP): eager, te ``attn moe_router``, torch
  ``attn moe_router``, te ``moe_router moe_preprocess`` (the whole layer, ``moe`` and
  ``full_iteration`` are refused, which is checked too).

``test_mcore_grouped_mm_dropless_ep_graphs_bit_identical_to_eager`` (EP 2 on 2 GPUs, EP 2 x
EDP 2 on 4) runs graph_fsdp's dropless grouped_mm experts (``moe_experts_impl="grouped_mm"``,
receive buffer 1.5 x the balanced load): eager, te whole layer, torch ``moe``, torch
``full_iteration``, each bit-identical to eager, captured once, replayed, no fallback, no
exchange overflow; prints ``MCORE_EP_DROPLESS`` JSON lines (median step ms, peak GiB).
Every graphed run must equal its eager run bit for bit - losses, eval losses and the final
weights (every expert, under its global name) - and must have replayed with no eager
fallback. ``test_checkpoints_between_ep_sizes_on_gpus`` (2 GPUs) saves at EP = 2 and loads at
EP = 1 (and back): the weights bit for bit; training goes on within bf16 rounding.
``test_mcore_grouped_mm_overflowed_steps_repeat_exactly`` (EP 2 on 2 GPUs; EP 4 and EP 2 x
EDP 2 on 4) trains the grouped_mm GPT through graph_fsdp's loop with a receive buffer that
overflows on some steps (the smallest factor a probe run's warnings named): eager, te whole
layer, torch ``moe``, ``full_iteration`` and the one graph (eager and the one graph on 4 GPUs)
- overflow steps counted, bit-identical to the run without a factor, one capture, a replay
every graphed step, no eager fallback.

    python -m pytest -q -s -m gpu tests/integrations/test_megatron_ep_gpu.py -k world1     # 1 GPU
    python -m pytest -q -s -m gpu tests/integrations/test_megatron_ep_gpu.py -k "world2 or between"
    python -m pytest -q -s -m gpu tests/integrations/test_megatron_ep_gpu.py -k world4     # 4 GPUs
    python -m pytest -q -s -m gpu tests/integrations/test_megatron_ep_gpu.py -k "grouped_mm and world2"
    python -m pytest -q -s -m gpu tests/integrations/test_megatron_ep_gpu.py -k overflowed
"""

from __future__ import annotations

import json
import os
from statistics import median

import pytest
import torch
import torch.distributed as dist
from graph_fsdp_testing import (
    OVERFLOW_MODES,
    megatron_stack_missing,
    overflow_probe,
    overflow_problems,
)

from graph_fsdp.training.loop import use_deterministic_kernels
from graph_fsdp.training.processes import spawn

pytestmark = pytest.mark.gpu


MISSING = megatron_stack_missing() if torch.cuda.is_available() else None
if MISSING:
    pytestmark = [pytestmark, pytest.mark.skip(reason=MISSING)]

STEPS, EVAL, AUX = 20, 5, 1e-2
LAYOUTS = {
    "ep1_groups_world1": (1, 1),
    "ep2_world2": (2, 2),
    "ep2x2_world4": (4, 2),
    "ep4_world4": (4, 4),
}
"""label -> (world size, EP size); EDP = world / EP."""
FAMILIES = {
    "drop-padding": (
        dict(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True),
        {
            "te layer": ("te", []),
            "torch moe": ("torch", ["moe"]),
            "torch full_iteration": ("torch", ["full_iteration"]),
        },
    ),
    "dropless": (
        {},
        {
            "te attn moe_router": ("te", ["attn", "moe_router"]),
            "torch attn moe_router": ("torch", ["attn", "moe_router"]),
            "te moe_router moe_preprocess": ("te", ["moe_router", "moe_preprocess"]),
        },
    ),
}
REFUSED = {"dropless": [[], ["moe"], ["full_iteration"]]}
"""Scopes the dropless family must refuse at EP > 1 (the dispatch syncs with the host)."""
BUFFER = 2.0  # EP 2: at most every routed row lands on one rank, twice the balanced load
"""The grouped_mm family's receive buffer per peer: 1.5 x the balanced load (a smaller one
than the default of every copy, so its overflow flag and all-reduce run in the graphs)."""
GROUPED_MM_FAMILIES = {
    "grouped_mm dropless": (
        dict(moe_experts_impl="grouped_mm", moe_receive_buffer_factor=BUFFER),
        {
            "te layer": ("te", []),
            "torch moe": ("torch", ["moe"]),
            "torch full_iteration": ("torch", ["full_iteration"]),
        },
    ),
}
"""graph_fsdp's dropless grouped_mm experts: at EP > 1 the dropless exchange of
parallel/dropless_ep.py (fixed-size all-to-alls, device offsets), captured whole."""


def _model(ep: int, **kw):
    from graph_fsdp.integrations.megatron import MCoreGPTConfig

    return MCoreGPTConfig(  # the default shape: 4 layers, hidden 256, 4 heads, sequence 128
        num_experts=4,
        moe_router_topk=2,
        moe_shared_expert_intermediate_size=512,
        moe_aux_loss_coeff=AUX,
        expert_model_parallel_size=ep,
        bf16=True,
        **kw,
    )


def _deterministic() -> None:
    # As the Megatron-Core GPU tests: eager runs must be reproducible before graphs can equal
    # them (Megatron's unfused MoE permutation warns instead of failing: same kernels in both).
    use_deterministic_kernels(warn_only=True)


def _batch(step: int, rank: int, cfg, device, *, eval: bool = False):
    g = torch.Generator().manual_seed(step * 7919 + rank * 104729 + (1 << 20 if eval else 0))
    seq = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length + 1), generator=g)
    return seq[:, :-1].to(device), seq[:, 1:].contiguous().to(device)


def _run(
    rank: int,
    cfg,
    *,
    expert_groups: bool | None = None,
    impl: str = "none",
    scopes=(),
    steps=range(STEPS),
    save: str | None = None,
    load: str | None = None,
) -> dict:
    """Build, shard and train ``cfg`` (graph_fsdp's loop): losses, eval losses, step times,
    peak memory, the graph report and the final global weights (CPU copies)."""
    import gc
    import time

    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    from graph_fsdp.capture.step import eager_forward_backward
    from graph_fsdp.fsdp import checkpoint as ckpt
    from graph_fsdp.fsdp.api import BufferPolicy, MixedPrecisionPolicy
    from graph_fsdp.integrations import megatron as gm
    from graph_fsdp.parallel.dropless_ep import take_overflow

    cuda = torch.cuda.is_available()  # (the loop also runs eagerly on CPU ranks)
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    gm.init_parallel_state(expert_model_parallel_size=cfg.expert_model_parallel_size)
    gc.collect()  # the previous run's model and graphs (reference cycles): a peak of its own
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    lm = gm.build_gpt(cfg, device)
    gm.shard_gpt(
        lm,
        mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16),
        buffer_policy=BufferPolicy(allocator="double_buffer", persist_on_alloc_fail=True),
        expert_groups=expert_groups,
    )
    opt = torch.optim.AdamW(lm.parameters(), lr=1e-3, weight_decay=0.01)
    if load:
        ckpt.load(load, lm, opt)
    out: dict = {"loaded": _cpu(ckpt.full_state_dict(lm)) if load else None}
    # One microbatch a step: the aux loss's gradient scale is 1 (a tensor graphs read).
    MoEAuxLossAutoScaler.main_loss_backward_scale = torch.ones(1, device=device)
    graphs = gm.make_graphs(lm, cfg, impl=impl, scopes=list(scopes), warmup_steps=2)
    losses, evals, times = [], [], []
    for step in steps:
        if graphs is not None:
            graphs.before_step()
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        x, y = _batch(step, rank, cfg, device)
        if graphs is not None:
            loss = graphs.forward_backward(0, x, y, 1)
        else:
            loss = eager_forward_backward(lm, x, y, 1)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss = loss.detach().float()
        dist.all_reduce(loss)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item() / dist.get_world_size())
        if (step + 1) % EVAL == 0:
            with torch.no_grad():
                evals.append(lm(*_batch(step, rank, cfg, device, eval=True)).float().item())
    if save:
        ckpt.save(save, lm, opt)
    out.update(
        losses=losses,
        evals=evals,
        step_ms=round(median(times[3:]) * 1e3, 3) if len(times) > 3 else None,
        peak_gib=round(torch.cuda.max_memory_allocated(device) / 2**30, 4) if cuda else None,
        report=graphs.report() if graphs is not None else None,
        weights=_cpu(ckpt.full_state_dict(lm)),
        overflow=take_overflow(lm),  # dropless exchanges that dropped rows (grouped_mm, EP > 1)
    )
    if graphs is not None:
        graphs.close()
    return out


def _cpu(state: dict) -> dict:
    return {k: v.detach().cpu() for k, v in state.items()}


def _problems(label: str, eager: dict, got: dict, *, once: bool = False) -> list[str]:
    problems = []
    for what in ("losses", "evals"):
        diff = [i for i, (a, b) in enumerate(zip(eager[what], got[what])) if a != b]
        if diff or len(eager[what]) != len(got[what]):
            i = diff[0] if diff else min(len(eager[what]), len(got[what]))
            problems.append(f"{label}: {what} differ from eager from index {i}")
    report = got["report"]
    if not report or report["replays"] == 0 or report["eager_fallbacks"]:
        problems.append(f"{label}: graphs did not replay throughout ({report})")
    if once and report and report["captures"] != 1:
        problems.append(f"{label}: captured {report['captures']} times, not once")
    for run, what in ((eager, "eager"), (got, "graphed")):
        if run["overflow"]:
            problems.append(f"{label}: the {what} run's exchange overflowed: {run['overflow']}")
    if eager["weights"].keys() != got["weights"].keys():
        problems.append(f"{label}: other weight names than eager's")
    else:
        differ = [k for k, v in eager["weights"].items() if not torch.equal(v, got["weights"][k])]
        if differ:
            problems.append(f"{label}: final weights differ from eager: {differ[:4]}")
    return problems


def _layout(
    rank: int, world: int, ep: int, expert_groups: bool | None, families: dict = FAMILIES
) -> dict:
    from graph_fsdp.capture.scopes import GraphConfigError
    from graph_fsdp.integrations import megatron as gm

    _deterministic()
    problems, rows = [], []
    for family, (kw, variants) in families.items():
        cfg = _model(ep, **kw)
        for scopes in REFUSED.get(family, []) if ep > 1 else []:
            try:
                gm.check_mcore_scopes(cfg, scopes)
                problems.append(f"{family}: --cuda-graph-scope {scopes} was not refused at EP {ep}")
            except GraphConfigError as err:
                if "moe_pad_expert_input_to_capacity=True" not in str(err):
                    problems.append(f"{family}: refusal names no drop-padding: {err}")
        eager = _run(rank, cfg, expert_groups=expert_groups)
        names = [k for k in eager["weights"] if ".mlp.experts." in k]
        # Global names: the last of the 4 experts is there at any EP (TE: weight3; grouped_mm:
        # the stacked weight's 4 rows).
        stacked = [k for k in names if k.endswith("experts.linear_fc1.weight")]
        if not any(k.endswith("weight3") or ".local_experts.3." in k for k in names) and not (
            stacked and all(eager["weights"][k].shape[0] == 4 for k in stacked)
        ):
            problems.append(f"{family}: global expert weights missing: {names[:4]}")
        rows.append({"family": family, "row": "eager", "ms": eager["step_ms"],
                     "gib": eager["peak_gib"]})  # fmt: skip
        for label, (impl, scopes) in variants.items():
            got = _run(rank, cfg, expert_groups=expert_groups, impl=impl, scopes=scopes)
            once = family in GROUPED_MM_FAMILIES
            problems += _problems(f"EP {ep}, {family}, {label}", eager, got, once=once)
            rows.append({"family": family, "row": label, "ms": got["step_ms"],
                         "gib": got["peak_gib"]})  # fmt: skip
    return {"problems": problems, "rows": rows}


@pytest.mark.parametrize("label", list(LAYOUTS))
def test_mcore_expert_parallel_graphs_bit_identical_to_eager(label: str, monkeypatch) -> None:
    world, ep = LAYOUTS[label]
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA GPUs")
    # full_iteration captures Megatron's token all-to-alls: capture/step.py [Note: NCCL graph
    # registration and the all-to-all] (process-wide: every variant runs under it)
    monkeypatch.setenv("NCCL_GRAPH_REGISTER", "0")
    groups = True if ep == 1 else None
    results = spawn(_layout, world, ep, groups, backend="nccl", timeout=1500, pg_timeout_s=600)
    for row in results[0]["rows"]:
        print("MCORE_EP " + json.dumps({"layout": label, **row}))
    problems = [f"rank {r}: {p}" for r, res in enumerate(results) for p in res["problems"]]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("label", ["ep2_world2", "ep2x2_world4"])
def test_mcore_grouped_mm_dropless_ep_graphs_bit_identical_to_eager(label: str, monkeypatch):
    """graph_fsdp's dropless grouped_mm experts over EP 2: eager, the whole layer (te), moe and
    full_iteration (torch), bit for bit, one capture, replays and no eager fallback."""
    world, ep = LAYOUTS[label]
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA GPUs")
    monkeypatch.setenv("NCCL_GRAPH_REGISTER", "0")  # full_iteration holds the all-to-alls
    results = spawn(
        _layout, world, ep, None, GROUPED_MM_FAMILIES, backend="nccl", timeout=1500,
        pg_timeout_s=600,
    )  # fmt: skip
    for row in results[0]["rows"]:
        print("MCORE_EP_DROPLESS " + json.dumps({"layout": label, "buffer": BUFFER, **row}))
    problems = [f"rank {r}: {p}" for r, res in enumerate(results) for p in res["problems"]]
    assert not problems, "\n".join(problems)


def _between(rank: int, world: int, root: str) -> dict:
    _deterministic()
    at2, at1 = os.path.join(root, "ep2"), os.path.join(root, "ep1")
    half = STEPS // 2
    first = _run(rank, _model(2), steps=range(half), save=at2)
    rest2 = _run(rank, _model(2), steps=range(half, STEPS), load=at2)
    rest1 = _run(rank, _model(1), steps=range(half, STEPS), load=at2, save=at1)
    back = _run(rank, _model(2), steps=range(0), load=at1)
    out = {
        "saved at 2 -> loaded at 1": (first["weights"], rest1["loaded"]),
        "saved at 1 -> loaded at 2": (rest1["weights"], back["loaded"]),
        "losses at 2": rest2["losses"],
        "losses at 1": rest1["losses"],
    }
    return out if rank == 0 else {}


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_checkpoints_between_ep_sizes_on_gpus(tmp_path) -> None:
    out = spawn(_between, 2, str(tmp_path), backend="nccl", timeout=900, pg_timeout_s=600)[0]
    for what in ("saved at 2 -> loaded at 1", "saved at 1 -> loaded at 2"):
        saved, loaded = out[what]
        assert saved.keys() == loaded.keys(), what
        for k, v in saved.items():
            assert torch.equal(v, loaded[k]), (what, k)
    # Training goes on from the loaded state: bf16 expert GEMMs over other token groupings
    # (both EP ranks' tokens in one GEMM at EP 2) round differently, so not bit for bit.
    a, b = torch.tensor(out["losses at 2"]), torch.tensor(out["losses at 1"])
    print(f"EP 2 vs EP 1 after the load: max |delta loss| {(a - b).abs().max().item():.3e}")
    torch.testing.assert_close(b, a, rtol=0, atol=2e-2)


OVERFLOW_STEPS, OVERFLOW_WARMUP = 8, 2


def _overflow_cfg(ep: int, factor: float | None, **graphs):
    from graph_fsdp.fsdp.api import BufferPolicy
    from graph_fsdp.integrations.megatron.train import MCoreTrainConfig

    model = _model(ep, moe_experts_impl="grouped_mm", moe_receive_buffer_factor=factor)
    buffers = BufferPolicy(allocator="double_buffer", persist_on_alloc_fail=True)  # layerwise
    return MCoreTrainConfig(
        model=model, steps=OVERFLOW_STEPS, eval_interval=4, bf16=True, deterministic=True,
        fused_optimizer=True, return_params=True, cuda_graph_warmup_steps=OVERFLOW_WARMUP,
        buffers=buffers, **graphs,
    )  # fmt: skip


def _overflow_probe(rank: int, world: int, ep: int) -> list[float]:
    from graph_fsdp.integrations.megatron.train import run

    return overflow_probe(rank, world, run, _overflow_cfg(ep, 0.5))  # overflows every step


def _overflow_runs(rank: int, world: int, ep: int, factor: float, modes: dict) -> dict:
    from graph_fsdp.integrations.megatron.train import run

    out = {"none": run(rank, world, _overflow_cfg(ep, None))}
    for name, graphs in modes.items():
        out[name] = run(rank, world, _overflow_cfg(ep, factor, **graphs))
    return out


OVERFLOW_LAYOUTS = {"ep2_world2": (2, 2), "ep4_world4": (4, 4), "ep2x2_world4": (4, 2)}


@pytest.mark.parametrize("label", list(OVERFLOW_LAYOUTS))
def test_mcore_grouped_mm_overflowed_steps_repeat_exactly(label: str, monkeypatch) -> None:
    world, ep = OVERFLOW_LAYOUTS[label]
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA GPUs")
    monkeypatch.setenv("NCCL_GRAPH_REGISTER", "0")  # full_iteration holds the all-to-alls
    modes = dict(OVERFLOW_MODES, layer={"cuda_graph_impl": "te"})
    if world == 4:
        modes = {k: modes[k] for k in ("eager", "one_graph")}
    named = spawn(_overflow_probe, world, ep, backend="nccl", timeout=900, pg_timeout_s=600)[0]
    assert len(named) == OVERFLOW_STEPS and min(named) < max(named), named
    results = spawn(
        _overflow_runs, world, ep, min(named), modes, backend="nccl", timeout=1500,
        pg_timeout_s=600,
    )  # fmt: skip
    problems = [
        f"rank {rank}: {p}"
        for rank, res in enumerate(results)
        for name in modes
        for p in overflow_problems(
            f"{label} {name}", res["none"], res[name], steps=OVERFLOW_STEPS, warmup=OVERFLOW_WARMUP
        )
    ]
    assert not problems, "\n".join(problems)
