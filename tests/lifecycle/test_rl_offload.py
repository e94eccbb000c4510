"""Offload for RL loops (gloo): kept addresses, model chunks, the recapture fallback, refusals.

On CPU there is no CUDA graph and no torch-memory-saver, so the address-keeping mode runs on
a test backend that does what releasing physical memory does to contents: it overwrites every
tensor of a released region (NaN) and again on restore (garbage). A run that offloads and
onloads through it must train bit-identically to one that never offloads - which fails if
anything reads released memory, or relies on contents offload does not keep. The real backend
(torch-memory-saver) runs in tests/lifecycle/test_rl_offload_gpu.py.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import subprocess
import sys
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
from graph_fsdp_testing import TINY_GPT

from graph_fsdp import BufferPolicy, fully_shard, iter_full_params
from graph_fsdp.capture import FullIterationGraphs
from graph_fsdp.capture.torch_backend import CallSignature
from graph_fsdp.fsdp import address_keeping as ak
from graph_fsdp.fsdp import offload
from graph_fsdp.fsdp.checkpoint import full_state_dict
from graph_fsdp.fsdp.fully_shard import synchronize_param_gather
from graph_fsdp.fsdp.state import collect_states
from graph_fsdp.models import GPTConfig, build_model, synthetic_batch
from graph_fsdp.models.gpt import sharding_units
from graph_fsdp.training.processes import spawn

TINY = TINY_GPT
CPU = torch.device("cpu")


class PoisoningBackend:
    """Releasing physical memory loses its contents: this backend overwrites them instead
    (NaN on release, garbage on restore) and refuses what torch-memory-saver refuses (a
    region released twice, restored without release)."""

    description = "poisoning test backend"
    releases_graph_pools = False

    def __init__(self) -> None:
        self.paused: set[str] = set()
        self.calls: list[tuple[str, str, int]] = []

    def region(self, tag: str):
        return nullcontext()

    def capture(self, graph, tag: str, **kwargs):
        raise AssertionError("no CUDA graph is captured on CPU")

    def pause(self, tag: str, tensors: list[torch.Tensor]) -> None:
        if tag in self.paused:
            raise RuntimeError(f"{tag} released twice")
        for t in tensors:
            t.fill_(math.nan if t.is_floating_point() else -1)
        self.paused.add(tag)
        self.calls.append(("pause", tag.rsplit(".", 1)[1], len(tensors)))

    def resume(self, tag: str, tensors: list[torch.Tensor]) -> None:
        if tag not in self.paused:
            raise RuntimeError(f"{tag} restored without a release")
        for t in tensors:
            t.fill_(1234.5 if t.is_floating_point() else 7)
        self.paused.discard(tag)
        self.calls.append(("resume", tag.rsplit(".", 1)[1], len(tensors)))


def _build(strategy: str, keep: bool, seed_shift: int = 0):
    policy = BufferPolicy(allocator="double_buffer", keep_addresses_on_offload=keep)
    cfg = TINY if not seed_shift else GPTConfig(**{**vars(TINY), "seed": TINY.seed + seed_shift})
    model = build_model(cfg, device=CPU)
    for unit, reshard in sharding_units(model):
        fully_shard(unit, strategy=strategy, buffer_policy=policy, reshard_after_forward=reshard)
    fully_shard(model, strategy=strategy, buffer_policy=policy)
    return model


def _optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)


def _expect(fn, match: str, error=RuntimeError) -> str:
    with pytest.raises(error, match=match) as info:
        fn()
    return str(info.value)


def _opt_state(opt) -> list[torch.Tensor]:
    return [v.clone() for p in opt.state for v in opt.state[p].values() if torch.is_tensor(v)]


def _flat(model) -> torch.Tensor:
    return torch.cat(
        [g.main_flat.detach().reshape(-1) for s in collect_states(model) for g in s.groups]
    )


def _kept_addresses(rank: int, world_size: int, strategy: str) -> dict:
    """Keep mode through the poisoning backend vs a plain run: bit-identical training, the
    runner never suspended, parameters readable (unpoisoned) while offloaded."""
    backend = PoisoningBackend()
    ak.set_backend(backend)
    notices = io.StringIO()
    ref, model = _build(strategy, keep=False), _build(strategy, keep=True)
    ref_opt, opt = _optimizer(ref.parameters()), _optimizer(model.parameters())
    graphs = FullIterationGraphs(model, warmup_steps=1, eager=True)

    def step_fn(x, y):
        loss = model(x, y)
        loss.backward()
        return loss.detach()

    step = graphs.capture(step_fn)
    losses, ref_losses, out = [], [], {"checks": []}
    with contextlib.redirect_stderr(notices):
        for i in range(7):
            x, y = synthetic_batch(TINY, 1, i, rank=rank, device=CPU)
            loss = ref(x, y)
            loss.backward()
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)
            ref_losses.append(loss.item())
            graphs.before_step()
            losses.append(step(x, y).item())
            if i in (1, 4):  # inside the step: gradients attached (live) and kept
                out["checks"].append(_cycle(model, opt, graphs, live_grads=True))
            opt.step()
            opt.zero_grad(set_to_none=True)
            if i in (2, 5):  # between steps: no gradient attached (dead) and not kept
                out["checks"].append(_cycle(model, opt, graphs, live_grads=False))
    keeper = collect_states(model)[0].root.offload_mode.keeper
    opt_keeper = getattr(opt, "_graph_fsdp_address_keeper", None)
    out.update(
        losses=losses,
        ref_losses=ref_losses,
        same_params=all(torch.equal(a, b) for a, b in zip(_flat(model), _flat(ref))),
        same_opt=all(torch.equal(a, b) for a, b in zip(_opt_state(opt), _opt_state(ref_opt))),
        steps_seen=graphs.steps_seen,
        mode=keeper is not None,
        optimizer_state_in_region=opt_keeper is not None
        and all(opt_keeper.owns(v) for v in _opt_state_refs(opt)),
        kinds=sorted({kind for _, kind, _ in backend.calls}),
        notices=_notices(notices),
        rank=rank,
    )
    ak.set_backend(None)
    return out


def _notices(captured: io.StringIO) -> list[str]:
    return [
        line for line in captured.getvalue().splitlines() if line.startswith("graph_fsdp offload")
    ]


def _opt_state_refs(opt) -> list[torch.Tensor]:
    return [
        v for p in opt.state for v in opt.state[p].values() if torch.is_tensor(v) and v.numel() > 1
    ]


def _cycle(model, opt, graphs, *, live_grads: bool) -> dict:
    before = _flat(model).clone()
    grads = [p.grad.clone() if p.grad is not None else None for p in model.parameters()]
    states = collect_states(model)
    root = states[0].root
    steps_seen = graphs.steps_seen
    reference = full_state_dict(model)
    freed = {
        "params": offload.offload_params(model),
        "grads": offload.offload_grads(model),
        "optimizer": offload.offload_optimizer(model, opt),
    }
    export = dict(iter_full_params(model))
    check = {
        "released": sorted(root.offload_mode.keeper.paused),
        "readable": torch.equal(_flat(model), before),
        "export": export.keys() == reference.keys()
        and all(torch.equal(export[k], v) for k, v in reference.items()),
        "grads_detached": all(p.grad is None for p in model.parameters()),
        "freed_main": freed["params"]["main_params"] == before.numel() * 4,
        "refused_step": "onload_params" in _expect(graphs.before_step, "onload"),
        "refused_unshard": "onload_params()" in _expect(model.unshard, "unshard with offloaded"),
    }
    offload.onload_optimizer(model, opt)
    offload.onload_grads(model)
    offload.onload_params(model)
    check["restored"] = torch.equal(_flat(model), before) and root.offloaded == set()
    after = [p.grad for p in model.parameters()]
    if live_grads:
        check["grads_kept"] = all(
            (a is None) == (b is None) and (a is None or torch.equal(a, b))
            for a, b in zip(grads, after)
        )
    else:
        check["grads_kept"] = all(a is None for a in after)
    check["runner_kept"] = graphs.steps_seen == steps_seen
    return check


@pytest.mark.parametrize("strategy", ["optim_grads_params", "optim"])
def test_kept_addresses_train_bit_identically(strategy):
    for result in spawn(_kept_addresses, 2, strategy):
        assert result["mode"], "keep mode was not chosen with a backend installed"
        assert result["losses"] == result["ref_losses"]
        assert result["same_params"] and result["same_opt"]
        assert result["steps_seen"] == 7, "keep mode must not suspend the graph runner"
        assert result["optimizer_state_in_region"]
        assert result["kinds"] == sorted(ak.KINDS)
        assert len(result["checks"]) == 4
        for check in result["checks"]:
            assert check["released"] == ["buffers", "grads", "graphs", "params"], check
            failed = [k for k, v in check.items() if v is False]
            assert not failed, f"{failed} in {check}"
        if result["rank"] == 0:  # the notice is printed on rank 0, once
            assert len(result["notices"]) == 1 and "addresses kept" in result["notices"][0]
            assert "poisoning test backend" in result["notices"][0]
        else:
            assert result["notices"] == []


# ---------------------------------------------------------------------- chunks, refusals
def _chunks_and_refusals(rank: int, world_size: int) -> dict:
    out: dict = {}
    notices = io.StringIO()
    chunks = [_build("optim_grads_params", keep=True), _build("optim", keep=True, seed_shift=1)]
    opt = _optimizer([p for c in chunks for p in c.parameters()])
    graphs = FullIterationGraphs(chunks[0], warmup_steps=1, eager=True)
    x, y = synthetic_batch(TINY, 1, 0, rank=rank, device=CPU)
    with contextlib.redirect_stderr(notices):
        # A forward with grad and no backward yet: the step is open.
        loss = chunks[0](x, y)
        out["mid_step"] = [
            _expect(lambda: offload.offload_params(chunks), "between a training forward"),
            _expect(lambda: offload.offload_grads(chunks[0]), "between a training forward"),
            _expect(lambda: list(iter_full_params(chunks)), "between a training forward"),
        ]
        loss.backward()
        with torch.no_grad():
            chunks[1](x, y)  # a forward without grad leaves nothing open
        opt.step()
        opt.zero_grad()
        main_bytes = [
            sum(g.main_flat.numel() * 4 for s in collect_states(c) for g in s.groups)
            for c in chunks
        ]
        before = [full_state_dict(c) for c in chunks]
        freed = offload.offload_params(chunks)
        out["summed"] = freed["main_params"] == sum(main_bytes)
        out["offloaded"] = [collect_states(c)[0].root.offloaded == {"params"} for c in chunks]
        out["again"] = _expect(lambda: offload.offload_params(chunks[1]), "already offloaded")
        out["forward"] = _expect(lambda: chunks[1](x, y), r"onload_params\(\)")
        out["runner"] = _expect(graphs.before_step, "onload_params")
        export = {f"{i}.{k}": v for i, c in enumerate(chunks) for k, v in iter_full_params(c)}
        reference = {f"{i}.{k}": v for i, b in enumerate(before) for k, v in b.items()}
        out["export"] = export.keys() == reference.keys() and all(
            torch.equal(export[k], reference[k]) for k in reference
        )
        offload.offload_optimizer(chunks, opt)
        out["optimizer_twice"] = _expect(
            lambda: offload.offload_optimizer(chunks, opt), "already offloaded"
        )
        out["step_refused"] = _expect(opt.step, "onload_optimizer")
        offload.onload_optimizer(chunks, opt)
        offload.onload_params(chunks)
        out["restored"] = all(
            all(torch.equal(full_state_dict(c)[k], v) for k, v in b.items())
            for c, b in zip(chunks, before)
        )
        out["onload_twice"] = _expect(lambda: offload.onload_params(chunks), "without offload")
        synchronize_param_gather(chunks[1])  # one module, not a list
        out["bad_calls"] = [
            _expect(lambda: offload.offload_params([chunks[0], chunks[0]]), "twice", ValueError),
            _expect(lambda: offload.offload_params([]), "non-empty", TypeError),
            _expect(lambda: offload.offload_params(opt), "got AdamW", TypeError),
            _expect(lambda: offload.offload_optimizer(opt, chunks[0]), "torch.optim", TypeError),
        ]
        # Recapture: a model without kept addresses (the policy off) suspends its runner.
        plain = _build("optim_grads_params", keep=False)
        runner = FullIterationGraphs(plain, warmup_steps=1, eager=True)

        def step_fn(x, y):
            loss = plain(x, y)
            loss.backward()
            return loss.detach()

        runner.before_step()
        runner.capture(step_fn)(x, y)
        offload.offload_params(plain)
        out["recapture_suspended"] = runner.steps_seen == 0
        offload.onload_params(plain)
    out["notices"] = _notices(notices) if rank == 0 else None
    out["modes"] = [collect_states(c)[0].root.offload_mode.keeper is not None for c in chunks]
    return out


def test_chunks_refusals_and_the_recapture_fallback():
    for result in spawn(_chunks_and_refusals, 2):
        for message in result["mid_step"]:
            assert "between a training forward and its backward" in message
            assert "torch.no_grad()" in message
        assert result["summed"] and result["offloaded"] == [True, True]
        assert "onload_params()" in result["forward"] and "onload_params()" in result["runner"]
        assert result["export"] and result["restored"]
        assert "without offload_params" in result["onload_twice"]
        assert "already offloaded" in result["again"] and "already" in result["optimizer_twice"]
        assert "onload_optimizer" in result["step_refused"]
        assert len(result["bad_calls"]) == 4
        assert result["recapture_suspended"]
        # CPU without a test backend: keep_addresses_on_offload falls back, and says why.
        assert result["modes"] == [False, False]
        if result["notices"] is None:  # printed on rank 0 only
            continue
        assert any(
            "recaptured after onload: keep_addresses_on_offload is set, but the model is on cpu"
            in line
            for line in result["notices"]
        )
        assert any("BufferPolicy(keep_addresses_on_offload=True)" in n for n in result["notices"])
        assert len(result["notices"]) == len(set(result["notices"])) == 2


class RegionLog(PoisoningBackend):
    """The poisoning backend, recording which regions allocations were made in."""

    def __init__(self) -> None:
        super().__init__()
        self.entered: list[str] = []

    def region(self, tag: str):
        self.entered.append(tag.rsplit(".", 1)[1])
        return nullcontext()


def _static_buffers(rank: int, world_size: int) -> dict:
    backend = RegionLog()
    ak.set_backend(backend)
    try:
        kept, plain = _build("optim_grads_params", keep=True), _build("optim", keep=False)
        x, y = synthetic_batch(TINY, 2, 0, rank=rank, device=CPU)
        for model in (kept, plain):
            model(x, y).backward()  # the root's lazy init decides the offload mode
        backend.entered.clear()
        with ak.static_memory(collect_states(kept))():
            pass
        entered = list(backend.entered)
        with ak.static_memory(collect_states(plain))():
            pass
        return {"kept": entered, "plain": backend.entered[len(entered) :]}
    finally:
        ak.set_backend(None)


def test_static_capture_buffers_are_made_in_the_graphs_region():
    """A capture's static inputs and incoming gradients (dead between steps) are made in the
    graphs region of a model whose addresses are kept, so offload releases them with the
    pools; a model without kept addresses makes them anywhere. The recorded samples they are
    copied from can wait on the host and still give fresh copies with the recorded metadata."""
    (result,) = spawn(_static_buffers, 1)
    assert result == {"kept": ["graphs"], "plain": []}
    x = torch.randn(3, 4, requires_grad=True)
    sig = CallSignature((x,), {"mask": torch.ones(3, dtype=torch.bool), "scale": 2})
    sig.samples_to_host()
    first, second = sig.static_copies(), sig.static_copies()
    assert [t.requires_grad for t in first] == [True, False]
    assert first[0].data_ptr() not in (second[0].data_ptr(), sig.samples[0].data_ptr())
    assert torch.equal(first[0], x.detach()) and torch.equal(first[1], sig.samples[1])


def test_keep_addresses_needs_a_static_allocator():
    with pytest.raises(ValueError, match="allocator='dynamic'"):
        BufferPolicy(keep_addresses_on_offload=True)
    assert BufferPolicy(allocator="trace_pool", keep_addresses_on_offload=True)


# ---------------------------------------------------------------------- the example
@pytest.mark.slow
@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
def test_rl_loop_example_runs_on_cpu(packed):
    """examples/rl_loop.py end to end on CPU (gloo, the full_iteration runner's eager mode, the
    recapture fallback): its JSON lines, and losses equal to the run without offload - with
    fixed rows and with packed responses whose lengths change every step."""
    root = Path(__file__).resolve().parents[2]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])),
    }
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        env.pop(var, None)
    args = ["--device", "cpu", "--preset", "tiny", "--iterations", "2", "--train-steps", "2"]
    args += ["--packed"] if packed else []
    proc = subprocess.run(
        [
            sys.executable,
            str(root / "examples" / "rl_loop.py"),
            *args,
            "--rollout-tokens",
            "4",
            "--reference",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    iterations = [r for r in records if "iteration" in r]
    summary = records[-1]
    assert [r["iteration"] for r in iterations] == [0, 1]
    for r in iterations:
        assert r["counted_gib"] > 0 and len(r["generated"]) == 4
        assert r["offload_s"] >= 0 and r["onload_s"] >= 0 and r["first_step_ms"] > 0
    assert summary["summary"] and summary["mode"] == "recapture"
    assert summary["packed"] is packed
    assert len(summary["losses"]) == 6 and summary["bit_identical"] is True
    assert "the model is on cpu" in summary["notice"]


class _RecordingSaver:
    """Stands in for torch-memory-saver in a unit test of our wrapper (no CUDA here)."""

    def __init__(self) -> None:
        self.events: list[tuple] = []

    @contextlib.contextmanager
    def cuda_graph(self, graph, tag: str, **kwargs):
        self.events.append(("enter", tag, torch._C._is_multithreading_enabled(), kwargs))
        yield
        self.events.append(("exit", tag))


def test_preload_capture_enters_where_torch_cuda_graph_would():
    """Callers build the capture context, run capture-time hooks, then enter it: the memory
    saver's capture (and autograd on the capturing thread) starts at the enter, not before."""
    saver = _RecordingSaver()
    backend = ak.MemorySaverBackend(saver, preload=True)
    assert backend.releases_graph_pools and "preload hook" in backend.description
    before = torch._C._is_multithreading_enabled()
    ctx = backend.capture(None, "graph_fsdp.9.graphs", pool=None, stream=None)
    assert saver.events == []  # built, not entered
    with ctx:
        assert saver.events == [
            ("enter", "graph_fsdp.9.graphs", False, {"pool": None, "stream": None})
        ]
    assert saver.events[-1] == ("exit", "graph_fsdp.9.graphs")
    assert torch._C._is_multithreading_enabled() == before
    torch_hook = ak.MemorySaverBackend(saver, preload=False)
    assert not torch_hook.releases_graph_pools and "LD_PRELOAD" in torch_hook.description
