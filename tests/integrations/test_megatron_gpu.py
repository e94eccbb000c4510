"""Megatron-Core GPT / MoE GPT (TE layer spec) under graph_fsdp on 2 GPUs (NCCL).

Per model family, one spawn trains (20 steps, eval every 5, bf16, deterministic):
- graph_fsdp eager (graph_fsdp's loop) - the reference;
- graph_fsdp's loop vs megatron.core's get_forward_backward_func() (no_sync_func and
  finalize_model_grads_func are graph_fsdp's), 2 microbatches each: bit-identical;
- one graphed run per applicable --cuda-graph-scope: bit-identical losses and eval losses;
- a graphed run saved at step 10 (graph_fsdp.fsdp.checkpoint) and resumed: steps 10..19 identical;
- megatron_fsdp eager on the same model and seed: losses within bf16 tolerance.
The MoE test prints one JSON line (MCORE_MOE_TIMING) with eager vs graphed median step time
and peak memory per scope. Run: python -m pytest -q -s -m gpu tests/integrations/test_megatron_gpu.py
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import tempfile
import traceback
from statistics import median

import pytest
import torch
from graph_fsdp_testing import BF16_MP, megatron_stack_missing, needs_gpus
from graph_fsdp_testing import GPU_TEST_WORLD as WORLD

from graph_fsdp.training.checkpoints import CheckpointPolicy
from graph_fsdp.training.processes import spawn

pytestmark = [
    pytest.mark.gpu,
    needs_gpus(),
]


MISSING = megatron_stack_missing() if torch.cuda.device_count() >= 2 else None
if MISSING:
    pytestmark.append(pytest.mark.skip(reason=MISSING))

STEPS, EVAL, SAVE_AT = 20, 5, 10
STATIC = dict(allocator="double_buffer", persist_on_alloc_fail=True)


def _cfg(model, **kw):
    from graph_fsdp.integrations.megatron.train import MCoreTrainConfig

    base = dict(model=model, steps=STEPS, eval_interval=EVAL, mp=BF16_MP, deterministic=True)
    base.update(kw)
    return MCoreTrainConfig(**base)


def _diff(name: str, ref: list[float], got: list[float], offset: int = 0) -> str | None:
    for i, (a, b) in enumerate(zip(ref, got)):
        if a != b:
            return f"{name}: step {i + offset} differs: eager {a!r} vs {b!r} (delta {b - a:.3e})"
    if len(ref) != len(got):
        return f"{name}: {len(got)} values, expected {len(ref)}"
    return None


def _family(rank: int, world: int, model, variants: dict, ckpt_scope: tuple | None) -> dict:
    from graph_fsdp.integrations.megatron.train import run

    out = {"eager": run(rank, world, _cfg(model))}
    # Megatron's schedule with 2 microbatches (its no_sync_func and finalize_model_grads_func
    # are graph_fsdp's) against graph_fsdp's own accumulation loop: bit-identical.
    out["eager, 2 microbatches"] = run(rank, world, _cfg(model, grad_accum=2))
    out["schedule"] = run(rank, world, _cfg(model, grad_accum=2, use_megatron_schedule=True))
    for label, (impl, scopes, *extra) in variants.items():
        kw = dict(
            cuda_graph_impl=impl, cuda_graph_scope=scopes, **STATIC, **(extra[0] if extra else {})
        )
        out[label] = run(rank, world, _cfg(model, **kw))
    if ckpt_scope is None:
        return out
    impl, scopes = ckpt_scope
    path = tempfile.mkdtemp(prefix="mcore_ckpt_") if rank == 0 else None
    box = [path]
    torch.distributed.broadcast_object_list(box, src=0)
    graphed = dict(cuda_graph_impl=impl, cuda_graph_scope=list(scopes), **STATIC)
    out["resume"] = _save_and_resume(rank, world, model, box[0], graphed)
    try:  # isolated: a failure here must not hide the bit-exactness results above
        out["megatron_fsdp"] = run(
            rank, world, _cfg(model, engine="megatron_fsdp", eval_interval=0)
        )
    except ImportError as err:
        out["megatron_fsdp"] = {"skipped": str(err)}
    except Exception:  # noqa: BLE001 - reported by _check_megatron_fsdp
        out["megatron_fsdp"] = {"error": traceback.format_exc()}
    return out


def _graph_problem(label: str, report: dict | None) -> str | None:
    """Why a graphed run proves nothing about graphs: no report, no replay or an eager
    fallback of a captured module (None: it replayed throughout)."""
    if report is None:
        return f"{label}: no graph report (the run may have run eagerly)"
    if report["replays"] == 0 or report["eager_fallbacks"]:
        return (
            f"{label}: {report['replays']} replays, {report['eager_fallbacks']} eager "
            f"fallbacks (want > 0 and 0): {report.get('callables', [])[:4]}"
        )
    return None


def _resume_problems(label: str, ref: list[float], res: dict) -> list[str]:
    """A graphed run saved at SAVE_AT and its graphed resumption: losses equal to the eager
    run's, and both runs replayed their graphs with no eager fallback."""
    problems = []
    for name, vals, off, report in (
        ("resume first", res["first"], 0, res["reports"][0]),
        ("resume second", res["second"], SAVE_AT, res["reports"][1]),
    ):
        d = _diff(f"{label}{name}", ref[off : off + len(vals)], vals, off)
        problems += [p for p in (d, _graph_problem(f"{label}{name}", report)) if p]
    return problems


def _check(out: dict, variants: dict) -> list[str]:
    ref = out["eager"]
    problems = []
    for what in ("losses", "eval_losses"):
        d = _diff(f"schedule {what}", out["eager, 2 microbatches"][what], out["schedule"][what])
        if d:
            problems.append(d + " (reference: graph_fsdp's loop with 2 microbatches)")
    for label in variants:
        got = out[label]
        for what in ("losses", "eval_losses"):
            d = _diff(f"{label} {what}", ref[what], got[what])
            if d:
                problems.append(d)
        # A graphed run proves nothing about graphs unless it replayed them throughout.
        d = _graph_problem(label, got.get("cuda_graphs"))
        if d:
            problems.append(d)
    if "resume" in out:
        problems += _resume_problems("", ref["losses"], out["resume"])
    return problems


def _check_megatron_fsdp(out: dict) -> None:
    peer = out["megatron_fsdp"]
    if "error" in peer:
        pytest.fail(f"megatron_fsdp run failed:\n{peer['error']}")
    if "skipped" in peer:
        pytest.skip(f"megatron_fsdp comparison skipped: {peer['skipped']}")
    ref = torch.tensor(out["eager"]["losses"])
    got = torch.tensor(peer["losses"])
    worst = (ref - got).abs().max().item()
    print(f"graph_fsdp vs megatron_fsdp eager: max |delta loss| {worst:.4e}")
    # bf16 compute on both sides; megatron_fsdp's fp32 main weights start from the bf16 cast
    # of the same init, graph_fsdp's from the fp32 init itself.
    torch.testing.assert_close(
        got, ref, rtol=0, atol=5e-2, msg=lambda m: f"graph_fsdp vs megatron_fsdp losses: {m}"
    )


def _models():
    from graph_fsdp.integrations.megatron import MCoreGPTConfig

    dense = MCoreGPTConfig(num_layers=4, hidden_size=256, num_attention_heads=4, seq_length=128)
    moe = dataclasses.replace(
        dense, num_experts=4, moe_router_topk=2, moe_shared_expert_intermediate_size=512
    )
    return dense, moe


DENSE_VARIANTS = {
    "te layer": ("te", []),
    "te attn": ("te", ["attn"]),
    "te mlp": ("te", ["mlp"]),
    "torch attn mlp": ("torch", ["attn", "mlp"]),
    "torch full_iteration": ("torch", ["full_iteration"]),
    "te attn, Megatron schedule": ("te", ["attn"], {"use_megatron_schedule": True}),
}
MOE_VARIANTS = {
    "te attn": ("te", ["attn"]),
    "te moe_router": ("te", ["moe_router"]),
    "te attn moe_router": ("te", ["attn", "moe_router"]),
    "torch attn moe_router": ("torch", ["attn", "moe_router"]),
    "te attn moe_router, Megatron schedule": (
        "te",
        ["attn", "moe_router"],
        {"use_megatron_schedule": True},
    ),
}


def test_mcore_gpt_graphed_bit_identical_to_eager() -> None:
    dense, _ = _models()
    out = spawn(_family, WORLD, dense, DENSE_VARIANTS, ("te", ("attn",)), backend="nccl")[0]
    problems = _check(out, DENSE_VARIANTS)
    assert not problems, "\n".join(problems)
    _check_megatron_fsdp(out)


def _print_timing_and_check(out: dict, variants: dict, tag: str) -> None:
    """Print each run's median step time and peak memory as ``<tag> {json}``, then check every
    graphed variant against the eager run."""
    timing = {
        label: {
            "median_step_ms": median(out[label]["times"][3:]) * 1e3,
            "peak_memory_gib": out[label]["peak_memory_bytes"] / 2**30,
        }
        for label in ("eager", *variants)
    }
    print(f"{tag} " + json.dumps(timing))
    problems = _check(out, variants)
    assert not problems, "\n".join(problems)


def test_mcore_moe_graphed_bit_identical_to_eager() -> None:
    _, moe = _models()
    out = spawn(_family, WORLD, moe, MOE_VARIANTS, ("te", ("attn", "moe_router")), backend="nccl")[
        0
    ]
    _print_timing_and_check(out, MOE_VARIANTS, "MCORE_MOE_TIMING")
    _check_megatron_fsdp(out)


PREPROCESS_VARIANTS = {
    "te moe_router moe_preprocess": ("te", ["moe_router", "moe_preprocess"]),
    "te attn moe_router moe_preprocess": ("te", ["attn", "moe_router", "moe_preprocess"]),
    "torch moe_router moe_preprocess": ("torch", ["moe_router", "moe_preprocess"]),
}


def test_mcore_moe_preprocess_graphed_bit_identical_to_eager() -> None:
    """moe_preprocess: the dispatcher's preprocess state comes back from the graph outputs."""
    _, moe = _models()
    out = spawn(_family, WORLD, moe, PREPROCESS_VARIANTS, None, backend="nccl")[0]
    _print_timing_and_check(out, PREPROCESS_VARIANTS, "MCORE_MOE_PREPROCESS_TIMING")


def test_cli_trains_mcore_moe_with_graphs(tmp_path) -> None:
    """``graph-fsdp train --model mcore-moe`` end to end (2 ranks, TE graphs attn moe_router)."""
    import subprocess
    import sys

    log = tmp_path / "steps.jsonl"
    argv = [
        sys.executable, "-m", "graph_fsdp.cli.main", "train", "--model", "mcore-moe",
        "--moe-shared-expert-intermediate-size", "256", "--transformer-impl",
        "transformer_engine", "--bf16", "--num-layers", "2", "--hidden-size", "128",
        "--seq-length", "64", "--vocab-size", "512", "--train-iters", "6", "--nproc", str(WORLD),
        "--fsdp-double-buffer", "--fsdp-db-use-persist-buf-on-alloc-fail",
        "--cuda-graph-impl", "te", "--cuda-graph-scope", "attn", "moe_router",
        "--use-megatron-schedule", "--log-json", str(log),
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "final loss" in proc.stdout, proc.stdout
    assert len(log.read_text().splitlines()) == 6


# --------------------------------------------------------------------------------------------
# The CLI's --save / --load / --data-path / --optimizer-cpu-offload for Megatron-Core models
# --------------------------------------------------------------------------------------------

# Sequence length 128 (the in-process tests' shape): TE's attention runs the same kernels
# eagerly and under capture. At seq 64 it need not (test_cli_attention_at_seq_64_...).
CLI_SHAPE = ["--hidden-size", "256", "--num-attention-heads", "4", "--seq-length", "128"]
CLI_COMMON = [
    "--transformer-impl", "transformer_engine", "--bf16", "--num-layers", "2", *CLI_SHAPE,
    "--vocab-size", "512", "--nproc", str(WORLD), "--lr", "1e-2", "--deterministic",
    "--fsdp-double-buffer", "--fsdp-db-use-persist-buf-on-alloc-fail", "--cuda-graph-impl", "te",
]  # fmt: skip
CLI_MOE = [
    "--model", "mcore-moe", "--moe-shared-expert-intermediate-size", "256", *CLI_COMMON,
    "--cuda-graph-scope", "attn", "moe_router",
]  # fmt: skip
# Seq 128: at seq 64 TE's graphed attention differs from its eager one (te_backend.py [Note:
# TE attention under capture]), so a resumed run, whose first steps are eager warmup, differs
# from an uninterrupted graphed run at the first resumed step.
CLI_GPT = ["--model", "mcore-gpt", *CLI_COMMON, "--cuda-graph-scope", "attn", "mlp"]


def _train_cli(*args: str, base: list[str] = CLI_MOE) -> str:
    import subprocess
    import sys

    argv = [sys.executable, "-m", "graph_fsdp.cli.main", "train", *base, *args]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc.stdout


def _log(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _learnable_tokens(path) -> str:
    """Every token determines the next (period 13; ids < 13 < --vocab-size 512): a model
    that reads this file learns it fast, while uniform synthetic tokens stay at ln(512)."""
    import numpy as np

    ((np.arange(400 * 64 + 1) * 7) % 13).astype(np.uint16).tofile(path)
    return str(path)


def test_cli_mcore_save_load_data_path(tmp_path) -> None:
    """6 steps in one run == 3 steps with --save, then --load and 3 more: bit-identical
    losses (dense mcore GPT, TE graphs attn mlp, the token file of --data-path)."""
    data = _learnable_tokens(tmp_path / "tokens.bin")
    ckpt = tmp_path / "ckpt"
    full_log, first_log, second_log = (tmp_path / f"{n}.jsonl" for n in ("full", "a", "b"))
    train = functools.partial(_train_cli, base=CLI_GPT)
    out = train("--train-iters", "6", "--data-path", data, "--log-json", str(full_log))
    assert f"data: {data} (uint16 token file)" in out, out
    full = [r["loss"] for r in _log(full_log)]
    assert len(full) == 6
    # The file is read: a learnable stream, unlike synthetic tokens (loss ~ ln 512 = 6.24).
    assert full[-1] < full[0] - 0.5, full
    out = train(
        "--train-iters", "3", "--save", str(ckpt), "--data-path", data,
        "--log-json", str(first_log),
    )  # fmt: skip
    assert f"checkpoint: {ckpt} (iteration 3)" in out, out
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "3"
    meta = json.loads((ckpt / "iter_0000003" / "graph_fsdp_cli.json").read_text())
    assert meta["iteration"] == 3 and meta["model"] == "mcore-gpt", meta
    out = train(
        "--train-iters", "6", "--load", str(ckpt), "--data-path", data,
        "--log-json", str(second_log),
    )  # fmt: skip
    assert "resumed:" in out and "(iteration 3)" in out, out
    first, second = _log(first_log), _log(second_log)
    assert [r["step"] for r in first] == [0, 1, 2]
    assert [r["step"] for r in second] == [3, 4, 5]
    assert [r["loss"] for r in first] == full[:3]
    assert [r["loss"] for r in second] == full[3:]


def test_cli_mcore_optimizer_cpu_offload(tmp_path) -> None:
    """--optimizer-cpu-offload: half the AdamW state on the CPU, with TE graphs; it learns."""
    data = _learnable_tokens(tmp_path / "tokens.bin")
    log = tmp_path / "steps.jsonl"
    out = _train_cli(
        "--train-iters", "6", "--optimizer-cpu-offload", "--optimizer-offload-fraction", "0.5",
        "--data-path", data, "--log-json", str(log),
    )  # fmt: skip
    assert "optimizer CPU offload: fraction 0.5" in out, out
    losses = [r["loss"] for r in _log(log)]
    assert len(losses) == 6 and all(v == v for v in losses), losses  # no NaN
    assert losses[-1] < losses[0] - 0.5, losses


# Head dim 64, as at seq 128 (where graphed == eager): only the sequence length differs. The
# 2026-11-23 runs were at hidden 128 (head dim 32) and seq 64, so those two were confounded.
SEQ64 = ["--hidden-size", "256", "--num-attention-heads", "4", "--seq-length", "64"]


def _te_cudnn() -> str:
    from graph_fsdp.capture.te_backend import te_cudnn_version

    version = te_cudnn_version()
    return ".".join(map(str, version)) if version else "unknown"


@pytest.mark.parametrize(
    ("impl", "backend"), [("te", "auto"), ("te", "unfused"), ("torch", "unfused")]
)
def test_cli_attention_at_seq_64_is_exact_or_flagged(impl: str, backend: str) -> None:
    """Sequence length 64 (not a multiple of 128), attention captured, --cuda-graph-verify.

    2x H200, TE 2.20.2 (2026-11-23): with the backend TE picks (auto) the first graphed step
    differed from eager (loss 6.308999 vs 6.309005; verification: TE's fused_attention ran
    eagerly but not under capture) and torch graphs of the same attention hit an illegal
    memory access - te_backend.py [Note: TE attention under capture]. TE graphs must then be
    flagged by the verification inside the attention; with one pinned backend (unfused) both
    graph backends must be bit-exact.
    """
    out = _train_cli(
        *SEQ64, "--cuda-graph-impl", impl, "--cuda-graph-scope", "attn", "--train-iters", "4",
        "--attention-backend", backend, "--cuda-graph-verify",
        base=["--model", "mcore-gpt", *CLI_COMMON],
    )  # fmt: skip
    lines = [line for line in out.splitlines() if "graph verification:" in line]
    assert len(lines) == 1, out
    line = lines[0]
    print(f"TE cuDNN {_te_cudnn()}, {impl} graphs, attention backend {backend}: {line}")
    if backend == "unfused":
        assert "graphed == eager" in line, line
    else:
        assert "graphed == eager" in line or (
            "graphed != eager" in line and ".self_attention" in line
        ), line


def test_cli_torch_graphs_of_cudnn_attention_at_seq_64_are_refused() -> None:
    """The capture that faulted (torch graphs, TE picks cuDNN attention, seq 64) stops with
    the reason and the fixes before any step runs - or, with TE's cuDNN >= 9.15.1, runs."""
    import subprocess
    import sys

    argv = [sys.executable, "-m", "graph_fsdp.cli.main", "train", "--model", "mcore-gpt"]
    argv += [*CLI_COMMON, *SEQ64, "--cuda-graph-impl", "torch", "--cuda-graph-scope", "attn"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run(argv + ["--train-iters", "4"], capture_output=True, text=True,
                          timeout=300, env=env)  # fmt: skip
    text = proc.stdout + proc.stderr
    print(
        f"TE cuDNN {_te_cudnn()}: torch graphs of auto attention at seq 64 -> rc {proc.returncode}"
    )
    assert "illegal memory access was encountered" not in text, text[-3000:]
    if proc.returncode != 0:
        assert "cannot be captured at sequence length 64" in text, text[-3000:]
        assert "--attention-backend unfused" in text, text[-3000:]


# --------------------------------------------------------------------------------------------
# MoE experts inside the graphs (docs/megatron_moe.md): graph_fsdp's dropless grouped_mm
# experts (device token counts) and Megatron's drop-padding, each with the whole layer, moe
# and full_iteration; bit-identical to eager in losses, eval losses and the final checkpoint.
# Run: GRAPH_FSDP_GPU_TEST_WORLD=1 python -m pytest -q -s -m gpu tests/integrations/test_megatron_gpu.py -k moe
# --------------------------------------------------------------------------------------------

AUX = 1e-2
"""Megatron's load-balancing loss on: its autograd path is captured with the router."""
WHOLE_VARIANTS = {
    "te layer": ("te", []),
    "torch moe": ("torch", ["moe"]),
    "torch full_iteration": ("torch", ["full_iteration"]),
}


def _whole_models() -> dict:
    _, moe = _models()
    moe = dataclasses.replace(moe, moe_aux_loss_coeff=AUX)
    return {
        "dropless grouped_mm": dataclasses.replace(moe, moe_experts_impl="grouped_mm"),
        "drop-padding": dataclasses.replace(
            moe, moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True
        ),
        # Megatron's dropless experts (TEGroupedMLP: another GEMM, another model): the eager
        # step the targets compare against, and its best capture, attn moe_router.
        "dropless megatron": moe,
    }


def _save_and_resume(rank: int, world: int, model, path: str, graphed: dict) -> dict:
    """``SAVE_AT`` graphed steps saved to ``path``, then the rest resumed from it: both runs'
    losses and graph reports."""
    from graph_fsdp.integrations.megatron.train import run

    save = CheckpointPolicy(save_path=path, save_at=SAVE_AT)
    first = run(rank, world, _cfg(model, steps=SAVE_AT, checkpoint=save, **graphed))
    load = CheckpointPolicy(load_path=path)
    rest = dict(steps=STEPS - SAVE_AT, start_step=SAVE_AT, checkpoint=load)
    second = run(rank, world, _cfg(model, **rest, **graphed))
    return {
        "first": first["losses"],
        "second": second["losses"],
        "reports": [first.get("cuda_graphs"), second.get("cuda_graphs")],
    }


def _saved(root: str, family: str, label: str) -> dict:
    """The run writes its final weights and optimizer state (graph_fsdp.fsdp.checkpoint) here."""
    return dict(
        checkpoint=CheckpointPolicy(save_path=_ckpt_dir(root, family, label), save_at=STEPS)
    )


def _ckpt_dir(root: str, family: str, label: str) -> str:
    return os.path.join(root, family.replace(" ", "_"), label.replace(" ", "_"))


def _whole_family(rank: int, world: int, root: str) -> dict:
    from graph_fsdp.integrations.megatron.train import run

    out: dict = {}
    for family, model in _whole_models().items():
        if family == "dropless megatron":
            graphed = dict(cuda_graph_impl="te", cuda_graph_scope=["attn", "moe_router"], **STATIC)
            out[family] = {
                "eager": run(rank, world, _cfg(model)),
                "te attn moe_router": run(rank, world, _cfg(model, **graphed)),
            }
            continue
        fam = {"eager": run(rank, world, _cfg(model, **_saved(root, family, "eager")))}
        for label, (impl, scopes) in WHOLE_VARIANTS.items():
            kw = dict(cuda_graph_impl=impl, cuda_graph_scope=scopes, **STATIC)
            fam[label] = run(rank, world, _cfg(model, **kw, **_saved(root, family, label)))
        out[family] = fam
    # The stacked expert weights through a DCP save and load, with graphs on both sides.
    model = _whole_models()["dropless grouped_mm"]
    graphed = dict(cuda_graph_impl="te", cuda_graph_scope=[], **STATIC)
    path = _ckpt_dir(root, "dropless grouped_mm", "resume")
    out["dropless grouped_mm"]["resume"] = _save_and_resume(rank, world, model, path, graphed)
    return out


def _flat(obj, prefix: str = "") -> dict:
    if isinstance(obj, dict):
        return {k: v for key, val in obj.items() for k, v in _flat(val, f"{prefix}{key}.").items()}
    if isinstance(obj, (list, tuple)):
        return {k: v for i, val in enumerate(obj) for k, v in _flat(val, f"{prefix}{i}.").items()}
    return {prefix[:-1]: obj}


def _checkpoint(path: str) -> dict:
    """Every tensor and value of a graph_fsdp DCP checkpoint (weights and AdamW state): ``path``
    is a run directory (its latest saved iteration) or one checkpoint."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from graph_fsdp.training.checkpoints import resolve_checkpoint

    path = resolve_checkpoint(path)
    dcp_to_torch_save(path, f"{path}.pt")
    return _flat(torch.load(f"{path}.pt", weights_only=False))


def _checkpoint_diff(label: str, ref: dict, got: dict) -> str | None:
    if ref.keys() != got.keys():
        return f"{label}: checkpoint keys differ from eager: {sorted(ref.keys() ^ got.keys())[:6]}"
    for key, a in ref.items():
        b = got[key]
        if torch.is_tensor(a):
            if not torch.equal(a, b):
                delta = (a.double() - b.double()).abs().max().item()
                return f"{label}: final {key} differs from eager (max |delta| {delta:.3e})"
        elif a != b:
            return f"{label}: final {key} differs from eager: {a!r} vs {b!r}"
    return None


def _check_whole(out: dict, root: str) -> list[str]:
    problems = []
    for family in ("dropless grouped_mm", "drop-padding"):
        fam = out[family]
        ref_ckpt = _checkpoint(_ckpt_dir(root, family, "eager"))
        expert_keys = [k for k in ref_ckpt if ".mlp.experts." in k]
        if not expert_keys:
            problems.append(f"{family}: no expert weights in the checkpoint ({list(ref_ckpt)[:4]})")
        for label in WHOLE_VARIANTS:
            got = fam[label]
            name = f"{family}, {label}"
            for what in ("losses", "eval_losses"):
                d = _diff(f"{name} {what}", fam["eager"][what], got[what])
                if d:
                    problems.append(d)
            d = _graph_problem(name, got.get("cuda_graphs"))
            if d:
                problems.append(d)
            d = _checkpoint_diff(name, ref_ckpt, _checkpoint(_ckpt_dir(root, family, label)))
            if d:
                problems.append(d)
    # Megatron's dropless experts: timed beside the others, graphed only around the experts
    label = "dropless megatron, te attn moe_router"
    d = _graph_problem(label, out["dropless megatron"]["te attn moe_router"].get("cuda_graphs"))
    if d:
        problems.append(d)
    grouped = out["dropless grouped_mm"]
    problems += _resume_problems(
        "dropless grouped_mm ", grouped["eager"]["losses"], grouped["resume"]
    )
    return problems


def _timing(res: dict, skip: int = 3) -> dict:
    return {
        "median_step_ms": round(median(res["times"][skip:]) * 1e3, 3),
        "peak_allocated_gib": round(res["peak_memory_bytes"] / 2**30, 4),
        "peak_reserved_gib": round(res["peak_reserved_bytes"] / 2**30, 4),
        # Allocated when the run started: what earlier runs of this process left (libraries'
        # workspaces, MiB; GiB would mean an earlier run's model leaked into this peak).
        "start_allocated_gib": round(res.get("start_memory_bytes", 0) / 2**30, 4),
    }


def _targets(rows: dict) -> dict:
    """The issue's targets, measured (printed, not asserted: these machines are noisy)."""
    full = "torch full_iteration"
    step = {f: {k: v["median_step_ms"] for k, v in r.items()} for f, r in rows.items()}
    peak = {f: {k: v["peak_allocated_gib"] for k, v in r.items()} for f, r in rows.items()}
    grouped, pad = "dropless grouped_mm", "drop-padding"
    return {
        "dropless full_iteration / Megatron dropless eager (<= 0.25)": round(
            step[grouped][full] / step["dropless megatron"]["eager"], 3
        ),
        "dropless full_iteration / drop-padding full_iteration (<= 1.2)": round(
            step[grouped][full] / step[pad][full], 3
        ),
        "dropless grouped_mm eager / Megatron dropless eager": round(
            step[grouped]["eager"] / step["dropless megatron"]["eager"], 3
        ),
        "peak allocated / family eager (<= 1.15)": {
            f"{family}, {label}": round(peak[family][label] / peak[family]["eager"], 3)
            for family in (grouped, pad)
            for label in rows[family]
            if label != "eager"
        },
    }


def test_mcore_moe_experts_captured_whole_bit_identical_to_eager(tmp_path) -> None:
    root = str(tmp_path)
    out = spawn(_whole_family, WORLD, root, backend="nccl")[0]
    rows = {
        family: {label: _timing(res) for label, res in fam.items() if label != "resume"}
        for family, fam in out.items()
    }
    for family, fam in rows.items():
        for label, row in fam.items():
            print("MCORE_MOE_WHOLE " + json.dumps({"family": family, "row": label, **row}))
    print("MCORE_MOE_WHOLE_TARGETS " + json.dumps(_targets(rows)))
    problems = _check_whole(out, root)
    assert not problems, "\n".join(problems)


def test_grouped_moe_has_no_host_sync_and_replays_new_routing_bit_identical() -> None:
    """graph_fsdp's dropless pieces alone (grouped_moe.py), bf16 on this GPU: forward+backward
    with no synchronising CUDA call (sync debug mode "error"), captured in one CUDA graph and
    replayed with new routings written into its inputs (an expert without tokens, all tokens on
    two experts): every output bit-identical to an eager run of the same routing."""
    import torch.nn.functional as F

    from graph_fsdp.parallel import grouped_moe as gmoe

    dev, bf16 = torch.device("cuda", torch.cuda.current_device()), torch.bfloat16
    tokens, hidden, ffn, experts, topk = 1024, 256, 512, 8, 2
    gen = torch.Generator().manual_seed(0)

    def routing(case: str) -> tuple[torch.Tensor, torch.Tensor]:
        logits = torch.randn(tokens, experts, generator=gen)
        if case == "expert 3 gets nothing":
            logits[:, 3] = -1e9
        elif case == "all tokens on two experts":
            logits[:, 1], logits[:, 6] = 1e9, 1e9
        top = logits.topk(topk, dim=1).indices
        probs = torch.zeros(tokens, experts).scatter(
            1, top, torch.rand(tokens, topk, generator=gen)
        )
        return top.to(dev), probs.to(dev, bf16)

    def leaf(*shape) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) / 16).to(dev, bf16).requires_grad_()

    x, fc1, fc2 = leaf(tokens, hidden), leaf(experts, 2 * ffn, hidden), leaf(experts, hidden, ffn)
    top, p = routing("random")
    probs = p.clone().requires_grad_()
    grad_out = torch.randn(tokens, hidden, generator=gen).to(dev, bf16)

    def step():
        y = gmoe.dropless_moe(x, probs, top, fc1, fc2, activation=F.silu, gated=True)
        return (y, *torch.autograd.grad(y, (x, probs, fc1, fc2), grad_out))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError):  # the mode does catch a sync
            torch.ones(1, device=dev).item()
        step()  # raises on any synchronising call
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step()
    names = ("y", "grad x", "grad probs", "grad fc1", "grad fc2")
    for case in ("random", "expert 3 gets nothing", "all tokens on two experts"):
        new_top, new_probs = routing(case)
        with torch.no_grad():
            top.copy_(new_top)
            probs.copy_(new_probs)
        graph.replay()
        eager = step()
        for name, a, b in zip(names, static, eager):
            assert torch.equal(a, b), (case, name, (a.float() - b.float()).abs().max().item())
        if case == "expert 3 gets nothing":
            assert not static[3][3].any() and not static[4][3].any(), "empty expert's wgrad"


# Bigger MoE: step time and peak memory only (bit-exactness is the small model's test above).
BIG = dict(
    num_layers=8,
    hidden_size=1024,
    num_attention_heads=16,
    ffn_hidden_size=2048,
    seq_length=2048,
    num_experts=8,
    moe_router_topk=2,
    moe_shared_expert_intermediate_size=2048,
    moe_aux_loss_coeff=AUX,
)
BIG_ROWS = {
    "dropless megatron": ["eager", "te attn moe_router"],
    "dropless grouped_mm": ["eager", "te layer", "torch full_iteration"],
    "drop-padding": ["eager", "te attn moe_router", "te layer", "torch full_iteration"],
}
BIG_SCOPES = {
    "te attn moe_router": ("te", ["attn", "moe_router"]),
    "te layer": ("te", []),
    "torch full_iteration": ("torch", ["full_iteration"]),
}


def _big_rows(rank: int, world: int) -> dict:
    from graph_fsdp.integrations.megatron import MCoreGPTConfig
    from graph_fsdp.integrations.megatron.train import run

    base = MCoreGPTConfig(**BIG)
    models = {
        "dropless megatron": base,
        "dropless grouped_mm": dataclasses.replace(base, moe_experts_impl="grouped_mm"),
        "drop-padding": dataclasses.replace(
            base, moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True
        ),
    }
    out: dict = {}
    for family, labels in BIG_ROWS.items():
        for label in labels:
            kw = dict(steps=8, eval_interval=0, micro_batch_size=2)
            if label != "eager":
                impl, scopes = BIG_SCOPES[label]
                kw.update(cuda_graph_impl=impl, cuda_graph_scope=scopes, **STATIC)
            res = run(rank, world, _cfg(models[family], **kw))
            report = res.get("cuda_graphs")
            out.setdefault(family, {})[label] = {
                **_timing(res),
                "replays": report["replays"] if report else None,
                "eager_fallbacks": report["eager_fallbacks"] if report else None,
            }
    saved: dict = {}
    for family, model in models.items():
        try:  # isolated: a failure here must not hide the timings above
            saved[family] = _saved_per_moe_layer(model)
        except Exception:  # noqa: BLE001 - printed with the results
            saved[family] = {"error": traceback.format_exc()[-800:]}
    return {"rows": out, "saved": saved}


def _saved_per_moe_layer(model) -> dict:
    """What autograd keeps for backward in one MoE layer's forward at the model's shapes (2
    sequences, bf16, router included, parameters aside): MiB and bytes per routed row."""
    from graph_fsdp_testing import saved_tensor_bytes

    from graph_fsdp.integrations import megatron as gm

    lm = gm.build_gpt(dataclasses.replace(model, num_layers=1, bf16=True))
    moe = gm.transformer_layers(lm)[0].mlp.to(torch.bfloat16)
    x = torch.randn(model.seq_length, 2, model.hidden_size, device="cuda", dtype=torch.bfloat16)
    x.requires_grad_()
    (y, _), kept = saved_tensor_bytes(lambda: moe(x), exclude=tuple(moe.parameters()))
    y.float().sum().backward()
    rows = model.seq_length * 2 * model.moe_router_topk
    return {"saved_mib": round(kept / 2**20, 2), "saved_bytes_per_routed_row": kept // rows}


def test_mcore_moe_bigger_model_timing() -> None:
    """8 layers, hidden 1024, 8 experts top-2 + a shared expert, seq 2048, 2 sequences a step:
    one JSON line per row (median step over steps 3..7, peak allocated and reserved memory,
    memory allocated at the run's start), then the ratios the issue sets targets for, then
    what one MoE layer keeps for backward per family. Checks only that the graphs replayed."""
    res = spawn(_big_rows, WORLD, backend="nccl")[0]
    rows = res["rows"]
    for family, fam in rows.items():
        for label, row in fam.items():
            print("MCORE_MOE_BIG " + json.dumps({"family": family, "row": label, **row}))
    print("MCORE_MOE_BIG_TARGETS " + json.dumps(_targets(rows)))
    print("MCORE_MOE_BIG_SAVED_PER_LAYER " + json.dumps(res["saved"]))
    for family, fam in rows.items():
        for label, row in fam.items():
            if label != "eager":
                assert row["replays"] and row["eager_fallbacks"] == 0, (family, label, row)
