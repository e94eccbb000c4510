"""Third-party models on their default path, one GPU (NCCL, world size 1).

- A HuggingFace decoder called the plain way (``model(input_ids=..., labels=...)``: no
  attention mask, no position ids) under ``full_iteration`` trains bit-identically to eager:
  its captured attention gets no materialised mask, as in eager (SDPA ``is_causal``; capture
  /transformers_masks.py), and the verification step finds nothing.
- A Megatron-Core GPT seeded with Megatron's default RNG tracker fails its capture with the
  fix named (``use_cudagraphable_rng=True``); with the graph-safe tracker the same capture
  runs.
- ``graph-fsdp profile`` with graphs and default flags runs (its --warmup-iters default
  covers the graph warmup).

Run: python -m pytest -q -s -m gpu tests/capture/test_safe_defaults_gpu.py
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from graph_fsdp_testing import BF16_MP, needs_gpus

from graph_fsdp.models.hf import hf_decoder, hf_decoder_layers, hf_family_available
from graph_fsdp.training.loop import use_deterministic_kernels
from graph_fsdp.training.processes import spawn

pytestmark = [pytest.mark.gpu, needs_gpus(1)]

STEPS, ACCUM, EVAL, MBS, SEQ, VOCAB = 8, 2, 4, 2, 128, 1024


def _batch(step: int, micro: int, device: torch.device) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * step + 10 * micro)
    return torch.randint(0, VOCAB, (MBS, SEQ), generator=gen).to(device)


def _hf_run(family: str, graphed: bool) -> dict:
    from graph_fsdp.capture import FullIterationGraphs
    from graph_fsdp.fsdp.api import BufferPolicy, MixedPrecisionPolicy
    from graph_fsdp.fsdp.checkpoint import full_state_dict
    from graph_fsdp.fsdp.fully_shard import fully_shard

    device = torch.device("cuda", torch.cuda.current_device())
    model = hf_decoder(
        family, vocab=VOCAB, hidden=256, intermediate=512, layers=4, heads=8, seq=SEQ
    ).to(device)
    masks: list[tuple[bool, bool]] = []  # (capturing, mask is None) per first-layer call

    def seen(module, args, kwargs) -> None:
        capturing = torch.cuda.is_current_stream_capturing()
        masks.append((capturing, kwargs.get("attention_mask") is None))

    hf_decoder_layers(model)[0].register_forward_pre_hook(seen, with_kwargs=True)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    bp = BufferPolicy(allocator="double_buffer", persist_on_alloc_fail=True)
    for layer in hf_decoder_layers(model):
        fully_shard(layer, mp_policy=mp, buffer_policy=bp)
    fully_shard(model, mp_policy=mp, buffer_policy=bp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    graphs = (
        FullIterationGraphs(model, warmup_steps=2, verify=True)
        if graphed
        else FullIterationGraphs(model, eager=True, warmup_steps=1)
    )

    def step_fn(input_ids, labels, *, scale):  # the plain call: no mask, no position ids
        out = model(input_ids=input_ids, labels=labels, use_cache=False)
        (out.loss * scale).backward()
        return out.loss

    step = graphs.capture(step_fn)
    losses, evals = [], []
    for i in range(STEPS):
        graphs.before_step()
        total = torch.zeros((), device=device)
        for micro in range(ACCUM):
            model.set_requires_gradient_sync(micro == ACCUM - 1)
            x = _batch(i, micro, device)
            total += step(x, x, scale=1.0 / ACCUM)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total.item())
        if (i + 1) % EVAL == 0:
            model.eval()
            with torch.no_grad():
                x = _batch(i, 99, device)
                evals.append(model(input_ids=x, labels=x, use_cache=False).loss.item())
            model.train()
    report = graphs.report()
    return {
        "losses": losses,
        "evals": evals,
        "params": {k: v.cpu() for k, v in full_state_dict(model).items()},
        "report": report,
        "masks": masks,
    }


def _hf_family(rank: int, world: int, family: str) -> dict:
    use_deterministic_kernels()
    return {"eager": _hf_run(family, False), "graphed": _hf_run(family, True)}


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_huggingface_full_iteration_default_call_is_bit_exact(family: str) -> None:
    pytest.importorskip("transformers")
    if not hf_family_available(family):
        pytest.skip(f"transformers has no {family}")
    res = spawn(_hf_family, 1, family, backend="nccl", timeout=900)[0]
    eager, graphed = res["eager"], res["graphed"]
    report = graphed["report"]
    assert report["captures"] == 1 and report["replays"] > 0, report
    assert report["eager_fallbacks"] == 0, report
    checks = report["verification"]
    assert len(checks) == ACCUM and all(c["identical"] for c in checks), [
        c["summary"] for c in checks
    ]
    assert graphed["losses"] == eager["losses"], (graphed["losses"], eager["losses"])
    assert graphed["evals"] == eager["evals"]
    differ = [n for n, v in eager["params"].items() if not torch.equal(graphed["params"][n], v)]
    assert not differ, differ[:3]
    # The captured forward got no materialised mask, as every eager one: SDPA is_causal.
    captured = [none for capturing, none in graphed["masks"] if capturing]
    assert captured and all(captured), graphed["masks"]
    assert all(none for _, none in eager["masks"])


# --------------------------------------------------------------------------------------------
# Megatron-Core with its default RNG tracker
# --------------------------------------------------------------------------------------------


def _megatron_capture(rank: int, world: int, graph_safe: bool) -> dict:
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from graph_fsdp.capture import CaptureFailedError
    from graph_fsdp.integrations import megatron as gm
    from graph_fsdp.integrations.megatron.train import MCoreTrainConfig, batch, build_sharded

    model = gm.MCoreGPTConfig(
        num_layers=2,
        hidden_size=128,
        num_attention_heads=4,
        seq_length=64,
        vocab_size=256,
        transformer_impl="local",  # its attention forks the RNG tracker in every forward
        attention_backend="local",
    )
    cfg = MCoreTrainConfig(
        model=model, mp=BF16_MP, allocator="double_buffer", persist_on_alloc_fail=True
    )
    gm.init_parallel_state()
    device = torch.device("cuda", torch.cuda.current_device())
    lm, opt = build_sharded(cfg, device)
    # As a user who seeds Megatron the usual way (graph_fsdp's build_gpt set the graph-safe
    # tracker; this replaces it).
    model_parallel_cuda_manual_seed(
        model.seed, use_cudagraphable_rng=graph_safe, force_reset_rng=True
    )
    graphs = gm.make_graphs(lm, model, impl="torch", scopes=["attn"], warmup_steps=1)
    try:
        for step in range(3):
            graphs.before_step()
            x, y = batch(cfg, step, rank, device)
            graphs.forward_backward(0, x, y, 1)
            opt.step()
            opt.zero_grad(set_to_none=True)
    except CaptureFailedError as err:
        return {"refused": str(err)}
    return {"report": graphs.report()}


def _megatron_missing() -> str | None:
    try:
        import megatron.core  # noqa: F401
    except Exception as err:  # noqa: BLE001 - any import failure means no megatron-core
        return f"megatron-core does not import ({err})"
    return None


@pytest.mark.parametrize("graph_safe", [False, True], ids=["default-tracker", "graph-safe"])
def test_megatron_default_rng_tracker_is_named_with_the_fix(graph_safe: bool) -> None:
    missing = _megatron_missing()
    if missing:
        pytest.skip(missing)
    out = spawn(_megatron_capture, 1, graph_safe, backend="nccl", timeout=600)[0]
    if graph_safe:
        assert "refused" not in out, out["refused"]
        assert out["report"]["captures"] == 1 and out["report"]["replays"] > 0, out["report"]
        assert out["report"]["eager_fallbacks"] == 0, out["report"]
        return
    assert "refused" in out, "the default tracker's fork was captured?"
    message = out["refused"]
    assert "use_cudagraphable_rng=True" in message, message
    assert "Megatron-Core's default CUDA RNG tracker" in message, message
    assert "host synchronization" not in message, message


# --------------------------------------------------------------------------------------------
# graph-fsdp profile with graphs, default flags
# --------------------------------------------------------------------------------------------


def test_profile_with_graphs_runs_with_default_flags(tmp_path) -> None:
    argv = [
        sys.executable, "-m", "graph_fsdp", "profile", "--num-layers", "2", "--hidden-size",
        "128", "--num-attention-heads", "4", "--seq-length", "64", "--vocab-size", "512",
        "--nproc", "1", "--cuda-graph-impl", "torch", "--fsdp-double-buffer",
        "--fsdp-db-use-persist-buf-on-alloc-fail", "--profiler", "torch", "--output-dir",
        str(tmp_path),
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "steps after 3 warmup" in proc.stdout, proc.stdout
