"""Tensor parallelism + graph_fsdp on 2 and 4 GPUs (NCCL): eager vs graphed, bit for bit.

torch DTensor TP (graph_fsdp's GPT and a HuggingFace Llama, sequence parallel, the plans of
graph_fsdp.models.tp_plans) and Megatron-Core TP with sequence parallelism (TE spec), on
TP 2 (2 GPUs) and DP 2 x TP 2 (4 GPUs); each case skips below its GPU count. Every run trains
20 steps of 2 microbatches (bf16 compute, fp32 main weights, deterministic algorithms, an eval
pass every 5 steps):

- DTensor: eager, layerwise whole-layer graphs (torch backend) and ``full_iteration`` - every
  loss, eval loss and final global weight bit-identical to eager; each graphed run captured
  once, replayed, never fell back to eager, and its verification step reports graphed ==
  eager. The Llama runs pass a ready 4-D causal mask (HuggingFace builds its mask another way
  under capture: tests/core/test_third_party_gpu.py).
- Megatron: eager, TE whole-layer and ``attn`` graphs, torch ``full_iteration``, and a graphed
  run saved at step 10 and resumed: bit-identical losses and eval losses.
- Megatron, Llama-style (GQA, SwiGLU, RMSNorm, RoPE; TE spec, TP 2 + SP): eager vs TE and
  torch whole-layer graphs, ``full_iteration`` and the one-graph step - losses, eval losses and
  final weights bit-identical, every run captured once, replayed, never fell back; one
  ``MCORE_LLAMA_TP`` JSON line per run with its median step time and peak memory.
- Step time (GPT, DP x TP on every GPU, one microbatch): graph_fsdp eager, layerwise and
  full_iteration against torch FSDP2 + TP eager and with its forward+backward captured in one
  graph on the same mesh; one JSON line ``TP_TIMING`` (medians), not asserted beyond sanity.

Run: python -m pytest -q -s -m gpu tests/core/test_tensor_parallel_gpu.py
(the Llama-style case alone: ``-k swiglu``)
"""

from __future__ import annotations

import json
import tempfile
import time
from statistics import median

import pytest
import torch
import torch.distributed as dist
from graph_fsdp_testing import (
    BF16_MP,
    differing_params,
    megatron_stack_missing,
    needs_gpus,
    run_modes,
)

from graph_fsdp.training.checkpoints import CheckpointPolicy
from graph_fsdp.training.loop import use_deterministic_kernels
from graph_fsdp.training.processes import spawn

pytestmark = [pytest.mark.gpu]

STEPS, ACCUM, EVAL, MBS, SEQ, VOCAB, SAVE_AT = 20, 2, 5, 2, 128, 1024, 10
SHAPES = {2: [(1, 2)], 4: [(2, 2)]}
"""GPUs -> the (dp, tp) meshes run on them."""


def _mesh(dp: int, tp: int):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cuda", (dp, tp), mesh_dim_names=("dp", "tp"))


def _gpt_config(big: bool = False):
    from graph_fsdp.models import GPTConfig

    if big:
        return GPTConfig(
            vocab_size=8192, num_layers=8, hidden_size=1024, num_attention_heads=16, seq_length=512
        )
    return GPTConfig(
        vocab_size=VOCAB, num_layers=4, hidden_size=256, num_attention_heads=8, seq_length=SEQ
    )


def _dtensor_model(name: str, mesh, device: torch.device, big: bool = False):
    from graph_fsdp import BufferPolicy, MixedPrecisionPolicy, fully_shard
    from graph_fsdp.models import (
        build_model,
        parallelize_gpt,
        parallelize_hf_decoder,
        sharding_units,
    )
    from graph_fsdp.models.hf import hf_decoder, hf_decoder_layers

    if name == "gpt":
        model = build_model(_gpt_config(big), device=device)
        parallelize_gpt(model, mesh["tp"])
        units = sharding_units(model)
    else:
        cpu = hf_decoder(
            "llama", vocab=VOCAB, hidden=256, intermediate=512, layers=4, heads=8, seq=SEQ
        )
        model = parallelize_hf_decoder(cpu.to(device), mesh["tp"])
        units = [(layer, True) for layer in hf_decoder_layers(model)]
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    bp = BufferPolicy(allocator="double_buffer", persist_on_alloc_fail=True)
    for unit, reshard in units:
        fully_shard(
            unit, mesh=mesh["dp"], mp_policy=mp, buffer_policy=bp, reshard_after_forward=reshard
        )
    return fully_shard(model, mesh=mesh["dp"], mp_policy=mp, buffer_policy=bp)


def _batch(step: int, micro: int, dp_rank: int, device: torch.device, vocab: int = VOCAB):
    gen = torch.Generator().manual_seed(1000 * step + 10 * micro + dp_rank)
    seq = torch.randint(0, vocab, (MBS, SEQ + 1), generator=gen)
    return seq[:, :-1].to(device), seq[:, 1:].contiguous().to(device)


def _runner(model, mode: str):
    from graph_fsdp.capture import FullIterationGraphs, LayerwiseGraphs

    if mode == "eager":
        return FullIterationGraphs(model, eager=True, warmup_steps=1)
    if mode == "full_iteration":
        return FullIterationGraphs(model, warmup_steps=2, verify=True)
    return LayerwiseGraphs(model, impl="torch", scopes=[], warmup_steps=2, verify=True)


def _dtensor_train(name: str, dp: int, tp: int, mode: str) -> dict:
    from graph_fsdp.fsdp.checkpoint import full_state_dict

    device = torch.device("cuda", torch.cuda.current_device())
    mesh = _mesh(dp, tp)
    d = mesh["dp"].get_local_rank()
    model = _dtensor_model(name, mesh, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    graphs = _runner(model, mode)
    causal = torch.ones(SEQ, SEQ, dtype=torch.bool, device=device).tril().expand(MBS, 1, SEQ, SEQ)

    def forward(x, y):
        if name == "gpt":
            return model(x, y)
        return model(input_ids=x, labels=x, attention_mask=causal, use_cache=False).loss

    def step_fn(x, y, *, scale):
        loss = forward(x, y)
        (loss * scale).backward()
        return loss

    step = graphs.capture(step_fn)
    losses, evals = [], []
    for i in range(STEPS):
        graphs.before_step()
        total = torch.zeros((), device=device)
        for micro in range(ACCUM):
            model.set_requires_gradient_sync(micro == ACCUM - 1)
            total += step(*_batch(i, micro, d, device), scale=1.0 / ACCUM).detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # the global norm over dp x tp
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total.item())
        if (i + 1) % EVAL == 0:
            with torch.no_grad():
                evals.append(forward(*_batch(i, 99, d, device)).item())
    out = {"losses": losses, "evals": evals}
    out["params"] = {k: v.cpu() for k, v in full_state_dict(model).items()}
    if mode != "eager":
        out["report"] = graphs.report()
    return out


def _dtensor_all(rank: int, world: int, name: str) -> dict:
    use_deterministic_kernels()
    out = {}
    for dp, tp in SHAPES[world]:
        for mode in ("eager", "layerwise", "full_iteration"):
            out[(dp, tp, mode)] = _dtensor_train(name, dp, tp, mode)
            torch.cuda.empty_cache()
    return out


def _problems(eager: dict, run: dict, what: str) -> list[str]:
    problems = []
    if run["losses"] != eager["losses"]:
        i = next(i for i, (a, b) in enumerate(zip(run["losses"], eager["losses"])) if a != b)
        problems.append(f"{what}: step {i} loss {run['losses'][i]!r} vs {eager['losses'][i]!r}")
    if run["evals"] != eager["evals"]:
        problems.append(f"{what}: eval losses {run['evals']} vs {eager['evals']}")
    differ = [n for n, v in eager["params"].items() if not torch.equal(run["params"][n], v)]
    if differ:
        problems.append(f"{what}: final weights differ: {differ[:3]}")
    report = run["report"]
    if report["captures"] != 1 or report["replays"] == 0 or report["eager_fallbacks"]:
        problems.append(f"{what}: graphs did not replay throughout: {report}")
    bad = [c["summary"] for c in report["verification"] if not c["identical"]]
    if not report["verification"] or bad:
        problems.append(f"{what}: verification {bad or 'did not run'}")
    return problems


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_dtensor_tp_graphed_bit_identical_to_eager(world, name):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA GPUs")
    if name == "llama":
        pytest.importorskip("transformers")
    res = spawn(_dtensor_all, world, name, backend="nccl", timeout=1200)[0]
    problems = []
    for dp, tp in SHAPES[world]:
        eager = res[(dp, tp, "eager")]
        for mode in ("layerwise", "full_iteration"):
            problems += _problems(eager, res[(dp, tp, mode)], f"{name} dp{dp}xtp{tp} {mode}")
    assert not problems, "\n".join(problems)


# ----------------------------------------------------------------------------- Megatron
MCORE_VARIANTS = {
    "te layer": ("te", []),
    "te attn": ("te", ["attn"]),
    "torch full_iteration": ("torch", ["full_iteration"]),
}


def _mcore_all(rank: int, world: int, tp: int) -> dict:
    from graph_fsdp.integrations.megatron import MCoreGPTConfig
    from graph_fsdp.integrations.megatron.train import MCoreTrainConfig, run

    model = MCoreGPTConfig(  # the default 4 layers, hidden 256
        num_attention_heads=8,
        seq_length=SEQ,
        tensor_model_parallel_size=tp,
        sequence_parallel=True,
    )
    static = dict(allocator="double_buffer", persist_on_alloc_fail=True)

    def cfg(**kw) -> MCoreTrainConfig:
        base = dict(model=model, steps=STEPS, eval_interval=EVAL, mp=BF16_MP, deterministic=True)
        return MCoreTrainConfig(**{**base, "grad_accum": ACCUM, "clip_grad": 1.0, **kw})

    out = {"eager": run(rank, world, cfg())}
    for label, (impl, scopes) in MCORE_VARIANTS.items():
        out[label] = run(rank, world, cfg(cuda_graph_impl=impl, cuda_graph_scope=scopes, **static))
    path = [tempfile.mkdtemp(prefix="mcore_tp_") if rank == 0 else None]
    dist.broadcast_object_list(path, src=0)
    graphed = dict(cuda_graph_impl="te", cuda_graph_scope=[], **static)
    first = run(
        rank,
        world,
        cfg(
            steps=SAVE_AT,
            checkpoint=CheckpointPolicy(save_path=path[0], save_at=SAVE_AT),
            **graphed,
        ),
    )
    second = run(
        rank,
        world,
        cfg(
            steps=STEPS - SAVE_AT,
            start_step=SAVE_AT,
            checkpoint=CheckpointPolicy(load_path=path[0]),
            **graphed,
        ),
    )
    out["resume"] = first["losses"] + second["losses"]
    out["resume reports"] = [first.get("cuda_graphs"), second.get("cuda_graphs")]
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_megatron_tp_sp_graphed_bit_identical_to_eager(world):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA GPUs")
    missing = megatron_stack_missing()
    if missing:
        pytest.skip(missing)
    res = spawn(_mcore_all, world, 2, backend="nccl", timeout=1500)[0]
    eager, problems = res["eager"], []
    for label in MCORE_VARIANTS:
        run = res[label]
        for what in ("losses", "eval_losses"):
            if run[what] != eager[what]:
                problems.append(f"{label} {what}: {run[what]} vs eager {eager[what]}")
        report = run.get("cuda_graphs") or {}
        if not report.get("replays") or report.get("eager_fallbacks"):
            problems.append(f"{label}: graphs did not replay throughout: {report}")
    if res["resume"] != eager["losses"]:
        problems.append(f"resume: {res['resume']} vs eager {eager['losses']}")
    for label, report in zip(("resume first", "resume second"), res["resume reports"]):
        report = report or {}
        if not report.get("replays") or report.get("eager_fallbacks"):
            problems.append(f"{label}: graphs did not replay throughout: {report}")
    assert not problems, "\n".join(problems)


# ----------------------------------------------------------------------------- Llama-style
LLAMA_MODES = {
    "te layer": {"cuda_graph_impl": "te"},
    "torch layer": {"cuda_graph_impl": "torch"},
    "full_iteration": {"cuda_graph_impl": "torch", "cuda_graph_scope": ["full_iteration"]},
    "one_graph": {
        "cuda_graph_impl": "torch",
        "cuda_graph_scope": ["full_iteration"],
        "cuda_graph_optimizer": True,
    },
}
"""MCoreTrainConfig fields of the graphed runs of the Llama-style GPT, each against eager."""


def _llama_all(rank: int, world: int) -> dict:
    """The Llama-style Megatron GPT (TE spec: GQA, SwiGLU - fc1 [gate_r; up_r] per TP rank,
    partition_stride=2 -, RMSNorm, RoPE) at TP 2 + SP: eager, then every graphed mode."""

    from graph_fsdp.integrations.megatron import MCoreGPTConfig
    from graph_fsdp.integrations.megatron.train import MCoreTrainConfig, run

    model = MCoreGPTConfig(
        num_layers=4,
        hidden_size=256,
        num_attention_heads=8,
        num_query_groups=2,
        ffn_hidden_size=512,
        swiglu=True,
        normalization="RMSNorm",
        position_embedding_type="rope",
        seq_length=SEQ,
        vocab_size=VOCAB,
        transformer_impl="transformer_engine",
        tensor_model_parallel_size=2,
        sequence_parallel=True,
    )
    base = MCoreTrainConfig(
        model=model,
        steps=STEPS,
        grad_accum=ACCUM,
        eval_interval=EVAL,
        clip_grad=1.0,
        fused_optimizer=True,  # the one-graph step's optimizer; eager runs the same
        mp=BF16_MP,
        deterministic=True,
        allocator="double_buffer",
        persist_on_alloc_fail=True,
        return_params=True,
    )
    return run_modes(run, rank, world, base, LLAMA_MODES)


def _llama_row(label: str, world: int, got: dict) -> str:
    report = got.get("cuda_graphs") or {}
    times = sorted(got["times"][2:])  # past the warmup and capture steps
    row = {
        "model": "mcore llama-style tp2 sp",
        "mode": label,
        "world": world,
        "median_step_ms": round(1e3 * median(times), 3),
        "peak_reserved_mib": round(got["peak_reserved_bytes"] / 2**20, 1),
        "peak_allocated_mib": round(got["peak_memory_bytes"] / 2**20, 1),
        **{k: report[k] for k in ("captures", "replays", "eager_fallbacks") if k in report},
    }
    return "MCORE_LLAMA_TP " + json.dumps(row)


@pytest.mark.parametrize("world", [2, 4])
def test_megatron_swiglu_gqa_tp_sp_every_capture_mode_bit_identical(world):
    """TP 2 (DP 2 x TP 2 on 4 GPUs) of a Llama-style GPT: eager vs TE and torch whole-layer
    graphs, full_iteration and the one-graph step; 20 steps of 2 microbatches with evals,
    bit-identical losses, eval losses and final global weights (fc1 gathered as [gate; up]);
    every graphed run captured once and replayed with no eager fallback. Prints one
    ``MCORE_LLAMA_TP`` JSON line per run (median step time, peak memory)."""
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA GPUs")
    missing = megatron_stack_missing()
    if missing:
        pytest.skip(missing)
    res = spawn(_llama_all, world, backend="nccl", timeout=1500)[0]
    eager, problems = res["eager"], []
    print(_llama_row("eager", world, eager))
    for label in LLAMA_MODES:
        got = res[label]
        if "error" in got:
            problems.append(f"{label}: {got['error']}")
            continue
        print(_llama_row(label, world, got))
        for what in ("losses", "eval_losses"):
            if got[what] != eager[what]:
                problems.append(f"{label} {what}: {got[what]} vs eager {eager[what]}")
        differ = differing_params(got, eager)
        if differ:
            problems.append(f"{label}: final weights differ from eager's: {differ[:4]}")
        report = got.get("cuda_graphs") or {}
        if report.get("captures") != 1 or not report.get("replays") or report["eager_fallbacks"]:
            problems.append(f"{label}: graphs did not replay throughout: {report}")
    fc1 = "module.decoder.layers.0.mlp.linear_fc1.weight"
    assert eager["params"][fc1].shape[0] == 2 * 512, eager["params"][fc1].shape  # [gate; up]
    assert not problems, "\n".join(problems)


# ----------------------------------------------------------------------------- step time
def _fsdp2_tp(mesh, device: torch.device):
    """torch FSDP2 over mesh['dp'] after the same TP plan: torchtitan's order."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from graph_fsdp.models import build_model, parallelize_gpt, sharding_units

    model = build_model(_gpt_config(big=True), device=device)
    parallelize_gpt(model, mesh["tp"])
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for unit, reshard in sharding_units(model):
        fully_shard(unit, mesh=mesh["dp"], mp_policy=mp, reshard_after_forward=reshard)
    return fully_shard(model, mesh=mesh["dp"], mp_policy=mp)


def _timed(step, n: int, warmup: int) -> list[float]:
    times = []
    for i in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step(i)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times[warmup:]


def _timing(rank: int, world: int) -> dict:
    device = torch.device("cuda", torch.cuda.current_device())
    mesh = _mesh(world // 2, 2)
    d = mesh["dp"].get_local_rank()
    cfg = _gpt_config(big=True)
    n, warmup = 15, 5
    out = {}

    def batch(i):
        return _batch(i, 0, d, device, cfg.vocab_size)

    for mode in ("eager", "layerwise", "full_iteration"):
        model = _dtensor_model("gpt", mesh, device, big=True)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        graphs = _runner(model, mode)

        def step_fn(x, y, *, scale, _m=model):
            loss = _m(x, y)
            (loss * scale).backward()
            return loss

        graphed = graphs.capture(step_fn)

        def one(i, _g=graphs, _s=graphed, _o=opt):
            _g.before_step()
            _s(*batch(i), scale=1.0)
            _o.step()
            _o.zero_grad(set_to_none=True)

        out[f"graph_fsdp {mode}"] = median(_timed(one, n, warmup))
        report = graphs.report()
        out[f"graph_fsdp {mode} graphs"] = {
            k: report[k] for k in ("captures", "replays", "eager_fallbacks")
        }
        del model, opt, graphs, graphed
        torch.cuda.empty_cache()
    model = _fsdp2_tp(mesh, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def eager(i):
        model(*batch(i)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    out["fsdp2+tp eager"] = median(_timed(eager, n, warmup))
    try:  # the peer's captured row: its failure is reported, graph_fsdp's rows still are
        out["fsdp2+tp captured"] = _fsdp2_captured(model, opt, batch, device, n, warmup)
    except Exception as err:  # noqa: BLE001 - any capture failure of the peer is its result
        out["fsdp2+tp captured error"] = f"{type(err).__name__}: {err}"[:300]
    return out


def _fsdp2_captured(model, opt, batch, device: torch.device, n: int, warmup: int) -> float:
    """FSDP2's recipe: warm up on a side stream, keep the gradients' addresses
    (``zero_grad(set_to_none=False)``), capture forward+backward, replay; eager optimizer."""
    x, y = batch(0)
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # warmup on the capture stream
        for _ in range(3):
            opt.zero_grad(set_to_none=False)
            model(x, y).backward()
            opt.step()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=False)
    with torch.cuda.graph(graph, stream=side):
        model(x, y).backward()

    def replay(i):
        xi, yi = batch(i)
        x.copy_(xi)
        y.copy_(yi)
        opt.zero_grad(set_to_none=False)
        graph.replay()
        opt.step()

    return median(_timed(replay, n, warmup))


@needs_gpus(2)
def test_tp_step_time_against_fsdp2_tp_captured():
    world = 4 if torch.cuda.device_count() >= 4 else 2
    res = spawn(_timing, world, backend="nccl", timeout=1200)[0]
    print("TP_TIMING " + json.dumps({"world": world, "tp": 2, **res}))
    assert all(res[f"graph_fsdp {m}"] > 0 for m in ("eager", "layerwise", "full_iteration"))
    for mode in ("layerwise", "full_iteration"):  # the timed graphed rows replayed throughout
        report = res[f"graph_fsdp {mode} graphs"]
        assert report["replays"] > 0 and report["eager_fallbacks"] == 0, (mode, report)
