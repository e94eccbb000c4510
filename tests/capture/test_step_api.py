"""The general step API (``graphs.capture(step_fn)`` / ``forward_backward``) on gloo, eager.

``FullIterationGraphs(model, eager=True)`` runs the graphed runner's step logic - microbatch
positions, call signatures, owned outputs, the older ``(micro, x, y, denom)`` call - without
graphs, so it runs here on real process groups; the GPU tests replay the same logic.
"""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch
from graph_fsdp_testing import SMALLEST_GPT, spawn_cases

from graph_fsdp.capture import FullIterationGraphs, GraphConfigError
from graph_fsdp.capture.step import eager_forward_backward
from graph_fsdp.training.data import batch_for
from graph_fsdp.training.train import TrainConfig, build_for, shard_model

TINY = SMALLEST_GPT
CFG = TrainConfig(model=TINY, micro_batch_size=2, grad_accum=2, device="cpu")


def _pair(cfg: TrainConfig):
    models, opts = [], []
    for _ in range(2):
        m = shard_model(build_for(cfg, torch.device("cpu")), cfg)
        models.append(m)
        opts.append(torch.optim.AdamW(m.parameters(), lr=1e-2))
    return models, opts


def _errors(graphs: FullIterationGraphs, step, model, x, y) -> dict[str, str]:
    """Every call the runner must refuse, each at a fresh step (position 0, sync off)."""

    def other_fn(x, y, *, scale, offset):
        return x

    attempts = {
        "shape": lambda: step(x[:, :4], y[:, :4], scale=0.5, offset=3),
        "dtype": lambda: step(x.int(), y, scale=0.5, offset=3),
        "constant": lambda: step(x, y, scale=0.25, offset=3),
        "structure": lambda: step(x, y, scale=0.5),
        "kwarg_tensor": lambda: step(x, y, scale=0.5, offset=x),
        "function": lambda: graphs.forward_backward(other_fn, x, y, scale=0.5, offset=3),
    }
    out = {}
    for name, call in attempts.items():
        graphs.before_step()
        model.set_requires_gradient_sync(False)
        try:
            call()
            out[name] = "no error"
        except GraphConfigError as err:
            out[name] = str(err)
    graphs.before_step()
    model.set_requires_gradient_sync(True)  # position 0 was recorded with sync off
    try:
        step(x, y, scale=0.5, offset=3)
        out["sync"] = "no error"
    except GraphConfigError as err:
        out["sync"] = str(err)
    return out


def _step_api_worker(rank: int, world: int) -> dict:
    cfg = CFG
    (model, twin), (opt, twin_opt) = _pair(cfg)
    fresh = FullIterationGraphs(model, eager=True, warmup_steps=1)
    try:
        fresh.forward_backward(lambda: None)
        before_step_error = "no error"
    except GraphConfigError as err:
        before_step_error = str(err)
    graphs = FullIterationGraphs(model, eager=True, warmup_steps=1)

    def step_fn(input_ids, labels, *, scale, offset=None):
        loss = model(input_ids, labels) * scale
        loss.backward()
        # A pytree of outputs with non-tensor leaves: all come back, tensors detached.
        return {"loss": loss, "tokens": input_ids.numel(), "pair": (loss * 2, offset)}

    step = graphs.capture(step_fn)
    losses, twin_losses, kept = [], [], None
    for i in range(3):
        graphs.before_step()
        for micro in range(cfg.grad_accum):
            last = micro == cfg.grad_accum - 1
            model.set_requires_gradient_sync(last)
            twin.set_requires_gradient_sync(last)
            x, y = batch_for(cfg, i * cfg.grad_accum + micro, rank, torch.device("cpu"))
            out = step(x, y, scale=1.0 / cfg.grad_accum, offset=3)
            assert out["tokens"] == x.numel() and out["pair"][1] == 3
            assert not out["loss"].requires_grad and out["loss"].grad_fn is None
            if kept is None:
                kept = (out["loss"], out["loss"].clone())
            losses.append(out["loss"])
            twin_losses.append(eager_forward_backward(twin, x, y, cfg.grad_accum))
        for o in (opt, twin_opt):
            o.step()
            o.zero_grad(set_to_none=True)
    same_params = all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))
    errors = _errors(graphs, step, model, *batch_for(cfg, 0, rank, torch.device("cpu")))
    # The older call: forward_backward(micro, x, y, denom) at explicit positions.
    (m2, t2), _ = _pair(cfg)
    old = FullIterationGraphs(m2, eager=True, warmup_steps=1)
    old_losses, ref_losses = [], []
    for i in range(2):
        old.before_step()
        for micro in range(2):
            for m in (m2, t2):
                m.set_requires_gradient_sync(micro == 1)
            x, y = batch_for(cfg, i * 2 + micro, rank, torch.device("cpu"))
            old_losses.append(old.forward_backward(micro, x, y, 2))
            ref_losses.append(eager_forward_backward(t2, x, y, 2))
    try:
        static = dataclasses.replace(cfg, allocator="double_buffer", persist_on_alloc_fail=True)
        FullIterationGraphs(shard_model(build_for(static, torch.device("cpu")), static))
        cpu_error = "no error"
    except GraphConfigError as err:
        cpu_error = str(err)
    return {
        "losses": torch.stack(losses),
        "twin_losses": torch.stack(twin_losses),
        "same_params": same_params,
        "kept_intact": torch.equal(kept[0], kept[1]),
        "errors": errors,
        "before_step_error": before_step_error,
        "old": (torch.stack(old_losses), torch.stack(ref_losses)),
        "cpu_error": cpu_error,
        "positions": sorted(graphs.positions),
        "report": graphs.report(),
    }


@pytest.fixture(scope="module")
def two_ranks():
    """Both workers of this file in one spawned group (the HuggingFace one if installed)."""
    cases = {"step_api": (_step_api_worker,)}
    if importlib.util.find_spec("transformers") is not None:
        cases["huggingface"] = (_hf_worker,)
    return spawn_cases(cases, 2)


@pytest.fixture(scope="module")
def step_results(two_ranks):
    return two_ranks["step_api"]


def test_step_api_matches_the_plain_eager_loop(step_results):
    for r in step_results:
        assert torch.equal(r["losses"], r["twin_losses"])
        assert r["same_params"] and r["kept_intact"]
        assert r["positions"] == [0, 1]  # no_sync and sync microbatches: two positions
        assert r["report"]["impl"] == "eager" and r["report"]["captures"] == 0
        old, ref = r["old"]
        assert torch.equal(old, ref)


def test_step_api_rejects_calls_that_cannot_replay(step_results):
    errors = step_results[0]["errors"]
    assert "tensor args[0] is (2, 4):int64" in errors["shape"], errors["shape"]
    assert "captured as (2, 8):int64" in errors["shape"]
    assert "args[0] is (2, 8):int32" in errors["dtype"], errors["dtype"]
    assert "kwargs['scale'] is 0.25, captured as 0.5" in errors["constant"], errors["constant"]
    assert "structure differs" in errors["structure"], errors["structure"]
    assert "kwargs['offset'] is" in errors["kwarg_tensor"], errors["kwarg_tensor"]
    assert "first made with step function" in errors["function"], errors["function"]
    assert "other_fn" in errors["function"]
    assert "gradient sync off when it was recorded, now on" in errors["sync"], errors["sync"]
    assert "before_step()" in step_results[0]["before_step_error"]
    assert "eager=True" in step_results[0]["cpu_error"]


def _hf_model(layers: int = 2):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def _shard_hf(model, cfg: TrainConfig):
    from graph_fsdp.fsdp.api import BufferPolicy
    from graph_fsdp.fsdp.fully_shard import fully_shard

    bp = BufferPolicy(allocator=cfg.allocator, persist_on_alloc_fail=cfg.persist_on_alloc_fail)
    for layer in model.model.layers:
        fully_shard(layer, strategy=cfg.strategy, buffer_policy=bp)
    return fully_shard(model, strategy=cfg.strategy, buffer_policy=bp)


def _hf_worker(rank: int, world: int) -> dict:
    from graph_fsdp.capture import select_targets
    from graph_fsdp.capture.torch_backend import CallSignature

    cfg = dataclasses.replace(CFG, allocator="double_buffer", persist_on_alloc_fail=True)
    model, twin = _shard_hf(_hf_model(), cfg), _shard_hf(_hf_model(), cfg)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, twin)]
    units = [(f"model.layers.{i}", layer) for i, layer in enumerate(model.model.layers)]
    targets = [t.name for t in select_targets(units, ["attn", "mlp"])]
    # What a decoder layer is called with: recorded as LayerwiseGraphs' dispatcher would.
    calls = []
    handle = model.model.layers[0].register_forward_pre_hook(
        lambda m, a, k: calls.append((a, k)), with_kwargs=True
    )
    graphs = FullIterationGraphs(model, eager=True, warmup_steps=1)

    def step_fn(input_ids, labels):
        out = model(input_ids=input_ids, labels=labels, use_cache=False)
        out.loss.backward()
        return out  # an output object: loss and logits come back detached

    step = graphs.capture(step_fn)
    losses, ref = [], []
    gen = torch.Generator().manual_seed(rank)
    for _ in range(3):
        graphs.before_step()
        x = torch.randint(0, 64, (2, 16), generator=gen)
        out = step(x, x)
        losses.append(out.loss)
        assert out.logits.shape == (2, 16, 64) and out.logits.grad_fn is None
        r = twin(input_ids=x, labels=x, use_cache=False)
        r.loss.backward()
        ref.append(r.loss.detach())
        for o in opts:
            o.step()
            o.zero_grad(set_to_none=True)
    handle.remove()
    args, kwargs = calls[0]
    sig = CallSignature(args, kwargs, what="model.layers.0")
    with torch.no_grad():
        try:
            model(input_ids=x, use_cache=True)
            cache_error = "no error"
        except Exception:  # noqa: BLE001 - not expected: no hook records here
            cache_error = "forward failed"
    seen = []
    h = model.model.layers[0].register_forward_pre_hook(
        lambda m, a, k: seen.append((a, k)), with_kwargs=True
    )
    with torch.no_grad():
        model(input_ids=x, use_cache=True)
    h.remove()
    try:
        CallSignature(*seen[0], what="model.layers.0")
    except GraphConfigError as err:
        cache_error = str(err)
    return {
        "targets": targets,
        "losses": torch.stack(losses),
        "ref": torch.stack(ref),
        "kwargs": sorted(kwargs),
        "signature": sig.describe(),
        "cache_error": cache_error,
    }


def test_huggingface_llama_under_fully_shard_eager_step_api(two_ranks):
    pytest.importorskip("transformers")
    r = two_ranks["huggingface"][0]
    assert r["targets"] == [
        "model.layers.0.self_attn",
        "model.layers.0.mlp",
        "model.layers.1.self_attn",
        "model.layers.1.mlp",
    ]
    assert torch.equal(r["losses"], r["ref"]), (r["losses"], r["ref"])
    assert "position_embeddings" in r["kwargs"], r["kwargs"]
    assert r["signature"], r["signature"]
    assert "past_key_values" in r["cache_error"] and "use_cache=False" in r["cache_error"], r[
        "cache_error"
    ]
