"""The general step API, verification and capture-failure diagnosis on real graphs (NCCL, 2 GPUs).

On the reference GPT (bf16, double buffer, deterministic):
- ``FullIterationGraphs.capture(step_fn)`` with several inputs, a keyword constant and a dict
  output trains bit-identically to eager; the returned loss is the caller's (a later replay
  does not overwrite it); ``verify=True`` reports graphed == eager for both microbatch
  positions; layerwise ``verify=True`` too;
- a module that computes something else under stream capture (``is_current_stream_capturing``,
  like HuggingFace's mask code) is flagged by the verification, naming that module;
- a module that syncs with the host (``.item()``) or copies a CPU tensor to the GPU fails the
  capture with ``CaptureFailedError`` naming that module; eager random ops (dropout) work
  after it, reproducing the same masks from the same seed.
"""

from __future__ import annotations

import pytest
import torch
from graph_fsdp_testing import GPU_TEST_WORLD as WORLD
from graph_fsdp_testing import bit_exact_gpu_run, needs_gpus

from graph_fsdp.models import GPTConfig
from graph_fsdp.training.loop import use_deterministic_kernels
from graph_fsdp.training.processes import spawn

pytestmark = [
    pytest.mark.gpu,
    needs_gpus(),
]

MODEL = GPTConfig(
    vocab_size=1024, num_layers=4, hidden_size=256, num_attention_heads=4, seq_length=128
)
STEPS, ACCUM = 10, 2


def _setup(rank: int):
    from graph_fsdp.training.train import build_for, shard_model

    use_deterministic_kernels()  # build_for and shard_model do not read cfg.deterministic
    cfg = bit_exact_gpu_run(MODEL, grad_accum=ACCUM)
    device = torch.device("cuda", rank)
    model = shard_model(build_for(cfg, device), cfg)
    return cfg, device, model, torch.optim.AdamW(model.parameters(), lr=1e-3)


CAPTURED_SCALE = 2.0
"""What the perturbed module multiplies its output by under capture. A power of two changes
every nonzero bf16 value exactly; a relative change below half a bf16 ulp (>= 2**-9, e.g.
``* 1.001``) rounds back to the same bf16 value: no difference any verification could see."""


def _capturing_changes(module: torch.nn.Module) -> None:
    """The module computes another value while a graph is being captured."""
    forward = module.forward

    def changed(x):
        out = forward(x)
        return out * CAPTURED_SCALE if torch.cuda.is_current_stream_capturing() else out

    module.forward = changed


def _train(rank: int, kind: str, scopes: list[str], verify, perturb: bool) -> dict:
    from graph_fsdp.capture import FullIterationGraphs, LayerwiseGraphs
    from graph_fsdp.training.data import batch_for

    cfg, device, model, opt = _setup(rank)
    if perturb:
        _capturing_changes(model.layers[1].mlp.fc2)
    if kind == "eager":
        graphs = FullIterationGraphs(model, eager=True, warmup_steps=1)
    elif kind == "full":
        graphs = FullIterationGraphs(model, warmup_steps=2, verify=verify)
    else:
        graphs = LayerwiseGraphs(model, impl="torch", scopes=scopes, warmup_steps=2, verify=verify)

    def step_fn(x, y, *, scale):
        loss = model(x, y) * scale
        loss.backward()
        return {"loss": loss, "tokens": x.numel()}

    step = graphs.capture(step_fn)
    losses, kept = [], None
    for i in range(STEPS):
        graphs.before_step()
        total = torch.zeros((), device=device)
        for micro in range(ACCUM):
            model.set_requires_gradient_sync(micro == ACCUM - 1)
            x, y = batch_for(cfg, i * ACCUM + micro, rank, device)
            out = step(x, y, scale=1.0 / ACCUM)
            if i == 3 and micro == 0:
                kept = (out["loss"], out["loss"].clone())
            total += out["loss"]
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total.item())
    return {"losses": losses, "owned": torch.equal(*kept), "report": graphs.report()}


def _all(rank: int, world: int) -> dict:
    return {
        "eager": _train(rank, "eager", [], False, False),
        "full": _train(rank, "full", [], True, False),
        "layer_attn": _train(rank, "layer", ["attn", "mlp"], True, False),
        "full_perturbed": _train(rank, "full", [], True, True),
        "layer_perturbed": _train(rank, "layer", ["mlp"], True, True),
    }


@pytest.fixture(scope="module")
def results():
    return spawn(_all, WORLD, backend="nccl", timeout=900)[0]


def _replayed(report: dict, checks: int) -> list[dict]:
    """The run captured once and replayed every step after its warmup, with no eager
    fallback; it made ``checks`` verifications, each of whose graphed runs replayed (not
    eager against eager). Returns them."""
    assert report["captures"] == 1, report
    assert report["replays"] >= (STEPS - 2) * ACCUM, report  # warmup_steps=2
    assert report["eager_fallbacks"] == 0, report
    verification = report["verification"]
    assert len(verification) == checks, verification
    for c in verification:
        assert c["verified"] and c["replays"] > 0 and c["fallbacks"] == 0, c["summary"]
    return verification


def test_step_api_full_iteration_is_bit_exact_and_owned(results):
    eager, full = results["eager"], results["full"]
    assert full["losses"] == eager["losses"], (full["losses"], eager["losses"])
    assert full["owned"], "a replay overwrote a loss the caller holds"
    report = full["report"]
    assert report["callables"] == ["microbatch 0", "microbatch 1"], report
    checks = _replayed(report, ACCUM)  # one per microbatch position
    assert [c["identical"] for c in checks] == [True, True], report
    assert "graphed == eager bit for bit" in checks[0]["summary"]


def test_layerwise_verification_passes(results):
    run = results["layer_attn"]
    assert run["losses"] == results["eager"]["losses"]
    checks = _replayed(run["report"], 1)
    assert checks[0]["identical"], checks


@pytest.mark.parametrize("key", ["full_perturbed", "layer_perturbed"])
def test_verification_names_the_module_that_differs_under_capture(results, key):
    checks = _replayed(results[key]["report"], ACCUM if key.startswith("full") else 1)
    flagged = [c for c in checks if not c["identical"]]
    assert flagged, checks
    assert flagged[0]["first_module"] == "layers.1.mlp.fc2", flagged[0]["summary"]
    assert results[key]["losses"] != results["eager"]["losses"]


def _fail(rank: int, world: int, kind: str, fault: str) -> dict:
    from graph_fsdp.capture import CaptureFailedError, FullIterationGraphs, LayerwiseGraphs
    from graph_fsdp.training.data import batch_for

    cfg, device, model, opt = _setup(rank)
    mlp = model.layers[2].mlp
    forward = mlp.forward

    def faulty(x):
        if fault == "item":
            if x.float().abs().sum().item() < 0:  # a host sync
                return x
        else:
            x = x + torch.zeros(1).to(x.device, x.dtype)  # a CPU->GPU copy
        return forward(x)

    mlp.forward = faulty
    if kind == "full":
        graphs = FullIterationGraphs(model, warmup_steps=1)
    else:
        graphs = LayerwiseGraphs(model, impl="torch", scopes=["mlp"], warmup_steps=1)
    x, y = batch_for(cfg, 0, rank, device)
    ones = torch.ones(64, device=device)
    torch.cuda.manual_seed(7)
    masks = [torch.nn.functional.dropout(ones, 0.5) for _ in range(2)]
    try:
        for _ in range(3):
            graphs.before_step()
            graphs.forward_backward(0, x, y, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
    except CaptureFailedError as err:
        # Random ops work again and continue from the seed as before the capture.
        torch.cuda.manual_seed(7)
        again = [torch.nn.functional.dropout(ones, 0.5) for _ in range(2)]
        reproduced = all(torch.equal(a, b) for a, b in zip(masks, again))
        return {"module": err.module, "phase": err.phase, "text": str(err), "rng": reproduced}
    return {"module": None, "text": "no error"}


@pytest.mark.parametrize("kind", ["full", "layer"])
@pytest.mark.parametrize("fault", ["item", "copy"])
def test_capture_failure_names_the_module(kind, fault):
    # A short join timeout: the ranks report before tearing down NCCL after a failed capture.
    r = spawn(_fail, WORLD, kind, fault, backend="nccl", timeout=180)[0]
    expected = "layers.2.mlp"
    assert r["module"] == expected and r["phase"] == "forward", r["text"]
    assert f"while the forward of {expected} was running" in r["text"]
    assert r["rng"], "eager dropout after the failed capture differs from before it"
    if kind == "full":
        assert "use layerwise graphs instead of full_iteration" in r["text"]
    else:
        assert "pick scopes that leave that module eager" in r["text"]
