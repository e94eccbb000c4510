"""Bit-exact regression of layerwise CUDA graphs vs eager graph_fsdp (NCCL, 2 GPUs).

One spawn per model family trains the eager baseline and every (backend, scopes) variant in
the same process group; each variant runs 50 steps with an eval pass every 10 steps, saves a
DCP checkpoint at step 25 and is resumed from it in a second graphed run. Every step's loss,
every eval loss and the final parameters must equal eager bit for bit, and every graphed run
(the resumed one too) must have replayed its graphs with no eager fallback. The lockstep
tests pin their one eager step (a changed sequence length): exactly one fallback per graphed
module, replays on the other steps.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile

import pytest
import torch
from graph_fsdp_testing import GPU_TEST_WORLD as WORLD
from graph_fsdp_testing import MOE_LAYERS, bit_exact_gpu_run, gpu_gpt, needs_gpus

from graph_fsdp.models import GPTConfig
from graph_fsdp.training.checkpoints import CheckpointPolicy
from graph_fsdp.training.loop import use_deterministic_kernels
from graph_fsdp.training.processes import spawn
from graph_fsdp.training.train import TrainConfig, run

pytestmark = [
    pytest.mark.gpu,
    needs_gpus(),
]


def _has_te() -> bool:
    try:
        import transformer_engine.pytorch  # noqa: F401

        return True
    except Exception:  # noqa: BLE001 - any import failure means no TE
        return False


HAS_TE = _has_te()
BACKENDS = ["torch", "te"] if HAS_TE else ["torch"]
STEPS, SAVE_AT, EVAL = 50, 25, 10
BASE = gpu_gpt()
MODELS = {
    "gpt": BASE,
    "moe": gpu_gpt(**MOE_LAYERS),
    "te_layers": dataclasses.replace(BASE, transformer_impl="transformer_engine"),
}
SCOPES = {
    "gpt": [[], ["attn"], ["mlp"], ["full_iteration"]],
    "moe": [
        [],
        ["attn", "moe_router", "moe_preprocess"],
        ["moe_router"],
        ["attn", "moe"],
        ["full_iteration"],
    ],
    "te_layers": [[], ["attn"], ["mlp"]],
}


def _cfg(model: GPTConfig) -> TrainConfig:
    return bit_exact_gpu_run(model, steps=STEPS, eval_interval=EVAL, lr=1e-3)


def _variants(family: str) -> list[tuple[str, list[str]]]:
    backends = ["te"] if family == "te_layers" else BACKENDS
    # full_iteration is captured with torch.cuda graphs only (FSDP's collectives inside).
    return [
        (b, s)
        for b in backends
        for s in SCOPES[family]
        if not (b == "te" and s == ["full_iteration"])
    ]


def _train_family(rank: int, world: int, family: str, ckpt_root: str) -> dict:
    base = _cfg(MODELS[family])
    out = {"eager": run(rank, world, base)}
    for impl, scopes in _variants(family):
        key = f"{impl}:{' '.join(scopes) or 'layer'}"
        path = os.path.join(ckpt_root, key.replace(":", "_").replace(" ", "_"))
        cfg = dataclasses.replace(
            base,
            cuda_graph_impl=impl,
            cuda_graph_scope=scopes,
            checkpoint=CheckpointPolicy(save_path=path, save_at=SAVE_AT),
        )
        full = run(rank, world, cfg)
        resumed = run(
            rank,
            world,
            dataclasses.replace(
                cfg,
                checkpoint=CheckpointPolicy(load_path=path),
                start_step=SAVE_AT,
                steps=STEPS - SAVE_AT,
            ),
        )
        out[key] = {"full": full, "resumed": resumed}
    return out


@pytest.fixture(scope="module", params=list(MODELS))
def family_results(request):
    family = request.param
    if family == "te_layers" and not HAS_TE:
        pytest.skip("TransformerEngine is not installed")
    with tempfile.TemporaryDirectory() as root:
        results = spawn(_train_family, WORLD, family, root, backend="nccl", timeout=1200)
    return family, results[0]


def _assert_equal(a, b, what: str) -> None:
    a, b = torch.tensor(a), torch.tensor(b)
    if not torch.equal(a, b):
        diff = (a != b).nonzero()
        first = int(diff[0, 0]) if len(diff) else -1
        raise AssertionError(
            f"{what}: first differing step {first}: {a[first].item()} vs {b[first].item()}; "
            f"max diff {(a - b).abs().max().item():.3e}"
        )


def _check_variant(eager: dict, full: dict, resumed: dict, what: str) -> None:
    report = full["cuda_graphs"]
    assert report["captures"] == 1 and report["replays"] > 0, (what, report)
    assert report["eager_fallbacks"] == 0, (what, report)
    # the resumed run is graphed too: it captured again and replayed, never eagerly
    report = resumed["cuda_graphs"]
    assert report["captures"] >= 1 and report["replays"] > 0, (f"{what} resumed", report)
    assert report["eager_fallbacks"] == 0, (f"{what} resumed", report)
    _assert_equal(full["losses"], eager["losses"], f"{what} losses")
    _assert_equal(full["eval_losses"], eager["eval_losses"], f"{what} eval losses")
    _assert_equal(resumed["losses"], eager["losses"][SAVE_AT:], f"{what} resumed")
    differ = [n for n, v in eager["params"].items() if not torch.equal(full["params"][n], v)]
    assert not differ, f"{what}: final params differ: {differ}"
    differ = [n for n, v in eager["params"].items() if not torch.equal(resumed["params"][n], v)]
    assert not differ, f"{what}: resumed run's final params differ: {differ}"


def test_graphs_are_bit_exact_with_eager(family_results):
    family, res = family_results
    eager = res["eager"]
    assert len(eager["losses"]) == STEPS and len(eager["eval_losses"]) == STEPS // EVAL
    failures = []  # every variant is checked, so one report shows all that differ
    for impl, scopes in _variants(family):
        key = f"{impl}:{' '.join(scopes) or 'layer'}"
        try:
            _check_variant(eager, res[key]["full"], res[key]["resumed"], f"{family} {key}")
        except AssertionError as err:
            failures.append(str(err).splitlines()[0])
    assert not failures, "\n".join(failures)


def _lockstep(
    rank: int, world: int, impl: str, scopes: list[str] | None = None, frozen_embeddings=False
) -> dict:
    """A graphed model and an eager twin trained in lockstep through the runner's edge cases:
    a changed sequence length (eager fallback), eval passes, and release() (recapture).

    ``scopes=[]`` (whole layers) with the torch backend puts the units' backward handlers in
    the replay Function (capture/torch_backend.py, [Note: backward handlers in the replay]), and the
    fallback, eval and recapture steps register them from the dispatcher instead.
    ``frozen_embeddings``: layer 0's input requires no grad (the replay's anchor leaf)."""
    import warnings

    from graph_fsdp.capture import LayerwiseGraphs
    from graph_fsdp.models import build_model, synthetic_batch
    from graph_fsdp.training.train import shard_model

    use_deterministic_kernels()
    cfg = _cfg(MODELS["gpt"])
    device = torch.device("cuda", rank)
    models, opts = [], []
    for _ in range(2):
        torch.manual_seed(0)
        built = build_model(cfg.model, device=device)
        if frozen_embeddings:
            for p in (*built.embedding.parameters(), *built.position_embedding.parameters()):
                p.requires_grad_(False)
        m = shard_model(built, cfg)
        models.append(m)
        opts.append(torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-3))
    scopes = ["attn"] if scopes is None else scopes
    graphs = LayerwiseGraphs(models[0], impl=impl, scopes=scopes, warmup_steps=1)
    losses: list[list[float]] = [[], []]
    fallback_warnings = 0
    for step in range(8):
        if step == 5:
            models[0]._fsdp_state.root.allocator.release()
        graphs.before_step()
        seq = 64 if step == 3 else cfg.model.seq_length
        x, y = synthetic_batch(cfg.model, 2, step, rank=rank, device=device)
        for i, (m, opt) in enumerate(zip(models, opts)):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                loss = m(x[:, :seq], y[:, :seq])
                loss.backward()
            fallback_warnings += sum("running it eagerly" in str(w.message) for w in caught)
            opt.step()
            opt.zero_grad()
            losses[i].append(loss.item())
            del loss
            m.eval()
            with torch.no_grad():
                losses[i].append(m(x, y).item())
            m.train()
    params = [{n: p.detach().cpu().clone() for n, p in m.named_parameters()} for m in models]
    return {
        "losses": losses,
        "report": graphs.report(),
        "warnings": fallback_warnings,
        "params": params,
    }


@pytest.mark.parametrize("impl", BACKENDS)
@pytest.mark.parametrize("scopes", [["attn"], []], ids=["attn", "layer"])
def test_fallback_eval_and_recapture_stay_bit_exact(impl, scopes):
    res = spawn(_lockstep, WORLD, impl, scopes, backend="nccl")[0]
    graphed, eager = res["losses"]
    assert graphed == eager, (graphed, eager)
    differ = [n for n, v in res["params"][1].items() if not torch.equal(res["params"][0][n], v)]
    assert not differ, f"final params differ: {differ}"
    report = res["report"]
    assert report["captures"] == 2, report  # first capture, then again after release()
    assert report["replays"] > 0, report
    _check_one_fallback_step(res)


def _check_one_fallback_step(res: dict) -> None:
    """Step 3's shorter sequence, and only it, ran eagerly: one eager call per graphed module
    (the layers' attn, or every unit below the root: the layers and the output projection),
    each with its warning; every other graphed step replayed."""
    report = res["report"]
    assert report["eager_fallbacks"] == len(report["callables"]), report
    assert res["warnings"] == len(report["callables"])


@pytest.mark.parametrize("impl", BACKENDS)
def test_layer_whose_input_requires_no_grad_is_bit_exact(impl):
    """Frozen embeddings: layer 0's recorded input requires no grad, yet its parameters do;
    the replay must still run its backward (torch: the anchor leaf) and train layer 0."""
    res = spawn(_lockstep, WORLD, impl, [], True, backend="nccl")[0]
    graphed, eager = res["losses"]
    assert graphed == eager, (graphed, eager)
    first, last = res["params"][1], res["params"][0]
    differ = [n for n, v in first.items() if not torch.equal(last[n], v)]
    assert not differ, f"final params differ: {differ}"
    assert res["report"]["captures"] == 2 and res["report"]["replays"] > 0, res["report"]
    _check_one_fallback_step(res)
