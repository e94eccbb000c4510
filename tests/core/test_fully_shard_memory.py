"""Memory behaviour of the engine on real gloo groups: no persistent compute-dtype shard,
main gradients released between steps (and kept while the optimizer can still read them)."""

from __future__ import annotations

import gc
import types
import weakref

import pytest
import torch
from graph_fsdp_testing import BF16_MP, TINY_GPT, shard_layers, spawn_cases

from graph_fsdp import BufferPolicy, MixedPrecisionPolicy, fully_shard
from graph_fsdp.fsdp.state import collect_states
from graph_fsdp.models import build_model, synthetic_batch
from graph_fsdp.training.processes import spawn
from graph_fsdp.training.train import TrainConfig, run

TINY = TINY_GPT


def _grad_lifecycle(rank: int, world: int, strategy: str) -> dict:
    torch.manual_seed(0)
    model = build_model(TINY, device="cpu")
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    shard_layers(model, strategy=strategy, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = synthetic_batch(TINY, micro_batch_size=2, step=rank, device="cpu")
    report = model.fsdp_memory_report
    out = {"persistent_roles": sorted(report()["persistent_bytes"])}
    model(x, y).backward()
    out["after_backward"] = report()["persistent_bytes"]["main_grads"]
    grads_first = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    # zero_grad(set_to_none=False): the next backward must add to the kept gradients.
    opt.zero_grad(set_to_none=False)
    model(x, y).backward()
    model(x, y).backward()
    grads_twice = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    out["accumulated"] = all(
        torch.equal(2 * a, b) or torch.allclose(2 * a, b, rtol=0, atol=1e-6)
        for a, b in zip(grads_first, grads_twice)
    )
    opt.step()
    opt.zero_grad(set_to_none=True)
    out["after_zero_grad"] = report()["persistent_bytes"]["main_grads"]
    with torch.no_grad():
        model(x, y)  # the next forward releases the gradients nobody can read any more
    out["after_next_forward"] = report()["persistent_bytes"]["main_grads"]
    model(x, y).backward()
    out["grads_back"] = [
        torch.isfinite(p.grad).all().item() for p in model.parameters() if p.grad is not None
    ]
    out["after_next_backward"] = report()["persistent_bytes"]["main_grads"]
    return out


BF16 = TrainConfig(model=TINY, strategy="optim_grads_params", steps=3, mp=BF16_MP)


@pytest.fixture(scope="module")
def two_ranks():
    """Every 2-rank check of this file in one spawned group."""
    return spawn_cases(
        {
            **{f"lifecycle:{s}": (_grad_lifecycle, s) for s in ("optim_grads_params", "no_shard")},
            "bf16:first": (run, BF16),
            "bf16:second": (run, BF16),
            "slots:dynamic": (_slots_at_the_backward_peak, "dynamic"),
            "slots:double_buffer": (_slots_at_the_backward_peak, "double_buffer"),
            "slots:double_buffer+pinned": (_slots_at_the_backward_peak, "double_buffer", True),
            "garbage_in_slots": (_grads_with_garbage_in_slots,),
            "dropped_model": (_dropped_model_is_collected,),
            "one_rank_reduction": (_one_rank_reduction,),
        },
        2,
    )


def test_main_grads_released_between_steps_and_kept_while_readable(two_ranks):
    for strategy in ("optim_grads_params", "no_shard"):
        for res in two_ranks[f"lifecycle:{strategy}"]:
            assert "compute_shard" not in res["persistent_roles"]
            assert res["after_backward"] > 0
            assert res["accumulated"], strategy
            assert res["after_zero_grad"] == res["after_backward"]  # freed lazily, at forward
            assert res["after_next_forward"] == 0, strategy
            assert res["after_next_backward"] == res["after_backward"]
            assert res["grads_back"] and all(res["grads_back"])


def test_bf16_copy_in_gather_matches_reference_bitwise_across_runs(two_ranks):
    # bf16 compute weights cast straight into the gather buffer: two identical runs agree
    # bit for bit and the unsharded mixed-precision reference agrees to bf16 tolerance.
    a, b = two_ranks["bf16:first"], two_ranks["bf16:second"]
    assert a[0]["losses"] == b[0]["losses"]
    ref = run(0, 2, TrainConfig(**{**BF16.__dict__, "mode": "reference"}))
    assert max(abs(x - y) for x, y in zip(a[0]["losses"], ref["losses"])) < 2e-2


def _slot_bytes(allocator) -> dict:
    """Bytes each role's slots hold now (a slot serving several roles counts for each)."""
    out: dict = {}
    seen: set = set()
    for key, slot in getattr(allocator, "_assignment", {}).items():
        if (id(slot), key[1]) in seen or slot.tensor is None:
            continue
        seen.add((id(slot), key[1]))
        out[key[1]] = out.get(key[1], 0) + slot.tensor.untyped_storage().nbytes()
    return out


def _slots_at_the_backward_peak(
    rank: int, world: int, allocator: str, pin_grads: bool = False
) -> dict:
    # [Note: weight slots during backward], [Note: gradients autograd creates]: the start of
    # backward, when the loss gradients and every activation are live, finds no idle weight
    # slot, no reduction buffer and no zeroed gradient slot (unless graphs pinned the
    # gradients: then the preset views); the steps stay bit-identical to the dynamic
    # allocator's either way.
    torch.manual_seed(0)
    model = build_model(TINY, device="cpu")
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    buffers = BufferPolicy(allocator=allocator)
    shard_layers(model, mp_policy=mp, buffer_policy=buffers)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def alloc():
        return model._fsdp_state.root.allocator

    seen: list = []

    def at_norm_output_grad(module, args, output):
        # Backward reaches the final norm after the loss and logits gradients, before the
        # last layer's backward (and its gather) starts.
        output.register_hook(lambda g: seen.append(_slot_bytes(alloc())))

    model.final_norm.register_forward_hook(at_norm_output_grad)
    out: dict = {"losses": []}
    groups = [g for s in collect_states(model) for g in s.groups]
    for step in range(3):
        if pin_grads and step == 1:
            alloc().pin_roles(("grad",))  # what a layerwise capture does
        for g in groups:  # what a capture does first: fresh leaves over released slots too
            g.renew_unsharded()
        x, y = synthetic_batch(TINY, micro_batch_size=2, step=step + rank, device="cpu")
        loss = model(x, y)
        out.setdefault("after_forward", _slot_bytes(alloc()))
        loss.backward()
        out["after_backward"] = _slot_bytes(alloc())  # the optimizer step runs on this
        opt.step()
        opt.zero_grad(set_to_none=True)
        out["losses"].append(loss.item())
    out["backward_start"] = seen[-1] if seen else None
    out["params"] = [p.detach().clone() for p in model.parameters()]
    return out


def test_backward_peak_holds_no_idle_weight_slots_or_reduction_buffers(two_ranks):
    dyn = two_ranks["slots:dynamic"]
    for res, ref in zip(two_ranks["slots:double_buffer"], dyn):
        assert res["losses"] == ref["losses"] and not ref["after_forward"]
        assert all(torch.equal(a, b) for a, b in zip(res["params"], ref["params"]))
        after, start = res["after_forward"], res["backward_start"]
        # The two layers' weight slots were given back after forward: only the root's
        # (kept for backward) is left, and nothing gathers again before the norm's backward.
        assert start["param"] == after["param"], (after, start)
        assert start.get("grad_comm", 0) == 0, start
        assert start.get("grad", 0) == 0, start  # autograd holds the root's gradients
        # The layers' slots came back for backward: each layer re-gathered its weights.
        assert after["param"] > 0
        # After backward no slot holds bytes, the root's weights included (FSDP2 frees them
        # after backward too): the optimizer step, a small model's peak, finds none.
        assert not any(res["after_backward"].values()), res["after_backward"]
    for res, ref in zip(two_ranks["slots:double_buffer+pinned"], dyn):
        assert res["losses"] == ref["losses"]
        assert all(torch.equal(a, b) for a, b in zip(res["params"], ref["params"]))
        assert res["backward_start"]["grad"] > 0  # the preset views graphs write into


class _ThirdLayerUnused(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = (torch.nn.Linear(*s) for s in ((5, 7), (7, 3), (3, 3)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x))).sum()  # self.c gets no gradient


def _grads_with_garbage_in_slots(rank: int, world: int) -> dict:
    # param_group.py [Note: gradients autograd creates]: collecting autograd's gradients
    # zeroes only what they do not cover. Every slot comes back full of NaN here, so a
    # parameter without a gradient (the unused layer) or padding left unzeroed would show.
    from graph_fsdp.buffers.allocator import Slot

    materialise = Slot.materialise

    def poisoned(self):
        fresh = self.tensor is None or self.released
        tensor = materialise(self)
        if fresh:
            tensor.fill_(float("nan"))
        return tensor

    Slot.materialise = poisoned
    try:
        torch.manual_seed(0)
        plain = _ThirdLayerUnused()
        model = _ThirdLayerUnused()
        model.load_state_dict(plain.state_dict())
        fully_shard(model, buffer_policy=BufferPolicy(allocator="double_buffer"))
        x = torch.randn(4, 5, generator=torch.Generator().manual_seed(rank))
        grads = []
        for _ in range(2):
            model(x).backward()
            grads.append([None if p.grad is None else p.grad.clone() for p in model.parameters()])
            for p in model.parameters():
                p.grad = None
        # The same step on the unsharded copy, its gradients averaged over ranks by hand.
        plain(x).backward()
        full = [
            torch.zeros_like(p) if p.grad is None else p.grad / world for p in plain.parameters()
        ]
        for g in full:
            torch.distributed.all_reduce(g)
        return {"grads": grads, "full": full}
    finally:
        Slot.materialise = materialise


def test_collected_gradients_zero_what_autograd_did_not_cover(two_ranks):
    results = two_ranks["garbage_in_slots"]
    full = results[0]["full"]
    assert full[-1].abs().sum() == 0 and full[-2].abs().sum() == 0  # model.c: no gradient
    for step in range(2):
        for i, want in enumerate(full):
            # Each rank holds a contiguous piece (or none) of every parameter's gradient.
            pieces = [r["grads"][step][i] for r in results if r["grads"][step][i] is not None]
            got = torch.cat(pieces)
            assert torch.isfinite(got).all(), (step, i)
            torch.testing.assert_close(got, want.flatten(), rtol=1e-6, atol=1e-6)


class _KeepsLastRouting(torch.nn.Module):
    """Keeps a tensor of its last forward, autograd graph and all, in a plain attribute holder:
    what Megatron-Core's MoE token dispatchers do with the routing probabilities."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(16, 16)
        self.dispatcher = types.SimpleNamespace(probs=None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        self.dispatcher.probs = y.softmax(-1)
        return y


def _dropped_model_is_collected(rank: int, world: int) -> dict:
    # [Note: autograd holds FSDP states weakly]: the kept tensor's graph holds FSDP's backward
    # handlers; with strong references the model stayed alive (a cycle through C++ autograd
    # nodes, which the garbage collector cannot see) after the training loop dropped it.
    torch.manual_seed(0)
    model = torch.nn.Sequential(_KeepsLastRouting(), _KeepsLastRouting(), torch.nn.Linear(16, 4))
    fully_shard(model[0])
    fully_shard(model[1])
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(2):
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(step + rank))
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    kept = model[1].dispatcher.probs
    graph_kept = kept.grad_fn is not None
    del kept
    refs = [weakref.ref(model), *(weakref.ref(p) for p in model.parameters())]
    del model, opt
    gc.collect()
    return {"graph_kept": graph_kept, "alive": sum(r() is not None for r in refs)}


def test_dropped_model_is_collected_while_a_module_kept_a_forward_tensor(two_ranks):
    for res in two_ranks["dropped_model"]:
        assert res["graph_kept"]
        assert res["alive"] == 0, res


def _one_rank_reduction(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = build_model(TINY, device="cpu")
    reference = build_model(TINY, device="cpu")
    reference.load_state_dict(model.state_dict())
    reference.to(torch.bfloat16)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    bp = BufferPolicy(allocator="double_buffer", persist_on_alloc_fail=True)
    shard_layers(model, mp_policy=mp, buffer_policy=bp)
    x, y = synthetic_batch(TINY, micro_batch_size=2, step=rank, device="cpu")
    model(x, y).backward()
    reference(x, y).backward()
    names = [n for n, _ in reference.named_parameters()]
    grads = dict(zip(names, (p.grad for p in reference.parameters())))
    same = world == 1 and all(
        torch.equal(p.grad, grads[n].float().reshape(-1)) for n, p in model.named_parameters()
    )
    peak = model.fsdp_memory_report()["peak_live_bytes"]
    return {"grad_comm": peak.get("grad_comm", 0), "same_as_unsharded": same}


def test_one_rank_casts_gradients_straight_into_main_grads(two_ranks):
    """One data-parallel rank: the reduction is the identity (param_group.py
    ``_reduces_nothing``): no fp32 reduction buffer, and the main gradients are exactly the
    bf16 gradients cast to fp32. Two ranks use the buffer (what the check tells apart)."""
    (one,) = spawn(_one_rank_reduction, 1)
    assert one["grad_comm"] == 0 and one["same_as_unsharded"], one
    two = two_ranks["one_rank_reduction"]
    assert all(r["grad_comm"] > 0 for r in two), two
