"""The whole-step runner's eager path (``WholeStepGraph(..., eager=True)``) on gloo, 2 ranks.

The eager step is the graphed step's reference (tests/capture/test_whole_step_gpu.py proves the
replay equal to it); here it must equal the usual loop bit for bit - forward+backward per
microbatch, ``torch.nn.utils.clip_grad_norm_``, ``optimizer.step()``, ``zero_grad``, an LR
scheduler - including a step whose gradients are made non-finite on one rank only: the
update is skipped on every rank and the optimizer state is left as a host-side skip
(``if finite: optimizer.step()``) leaves it.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from graph_fsdp_testing import BF16_MP, SMALLEST_GPT

from graph_fsdp.capture import GraphConfigError
from graph_fsdp.capture.step_optimizer import (
    DeviceLearningRates,
    changed_hyperparameter,
    check_optimizer,
    hyperparameters,
)
from graph_fsdp.capture.whole_step import StepPolicy, WholeStepGraph
from graph_fsdp.fsdp.checkpoint import full_state_dict
from graph_fsdp.training.data import batch_for
from graph_fsdp.training.processes import spawn
from graph_fsdp.training.train import TrainConfig, build_for, shard_model

TINY = SMALLEST_GPT
STEPS, INF_STEP = 6, 3
CPU = torch.device("cpu")

VARIANTS = {
    # bf16 compute, 2 microbatches (no_sync accumulation), ZeRO-3, fused AdamW, clipping on
    "adamw_bf16_accum2_clip": (
        TrainConfig(model=TINY, micro_batch_size=2, grad_accum=2, mp=BF16_MP, device="cpu"),
        "adamw",
        0.05,
    ),
    # fp32, one microbatch, ZeRO-1, fused SGD with momentum, no clipping
    "sgd_zero1": (
        TrainConfig(model=TINY, micro_batch_size=2, grad_accum=1, strategy="optim", device="cpu"),
        "sgd",
        None,
    ),
}


def _optimizer(kind: str, model) -> torch.optim.Optimizer:
    # The learning rate a float32 tensor in both loops: what the runner keeps on the device
    # (step_optimizer.py [Note: learning rate on the device]).
    if kind == "adamw":
        return torch.optim.AdamW(
            model.parameters(), lr=torch.tensor(1e-2), weight_decay=0.01, fused=True
        )
    return torch.optim.SGD(model.parameters(), lr=torch.tensor(0.05), momentum=0.9, fused=True)


def _schedule(opt) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 1.0 / (1.0 + e))


def _poison(step: int, micro: int, rank: int) -> torch.Tensor:
    """Inf on rank 0's first microbatch of INF_STEP: that rank's gradients go non-finite."""
    bad = step == INF_STEP and micro == 0 and rank == 0
    return torch.tensor(math.inf if bad else 1.0)


def _loss(model, x, y, poison, n: int) -> torch.Tensor:
    return (model(x, y) / n) * poison


def _snapshot(model, opt) -> dict:
    state = {
        f"{i}.{k}": v.clone()
        for i, p in enumerate(p for g in opt.param_groups for p in g["params"])
        for k, v in opt.state.get(p, {}).items()
        if torch.is_tensor(v)
    }
    return {"weights": {k: v.clone() for k, v in full_state_dict(model).items()}, "opt": state}


def _usual_loop(cfg: TrainConfig, kind: str, clip: float | None, rank: int) -> dict:
    model = shard_model(build_for(cfg, CPU), cfg)
    opt = _optimizer(kind, model)
    sched = _schedule(opt)
    out = {"losses": [], "norms": [], "skipped": [], "snapshots": {}}
    for step in range(STEPS):
        for micro in range(cfg.grad_accum):
            model.set_requires_gradient_sync(micro == cfg.grad_accum - 1)
            x, y = batch_for(cfg, step * cfg.grad_accum + micro, rank, CPU)
            loss = _loss(model, x, y, _poison(step, micro, rank), cfg.grad_accum)
            loss.backward()
            out["losses"].append(loss.detach())
        # torch's own function (routed to the global norm); inf: the norm, grads unchanged
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip or math.inf)
        finite = bool(torch.isfinite(norm))
        if finite:  # the host-side skip the runner does on the device
            opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        out["norms"].append(norm)
        out["skipped"].append(0.0 if finite else 1.0)
        if step in (INF_STEP - 1, INF_STEP):
            out["snapshots"][step] = _snapshot(model, opt)
    out["final"] = _snapshot(model, opt)
    out["lr"] = sched.get_last_lr()
    return out


def _whole_step(cfg: TrainConfig, kind: str, clip: float | None, rank: int) -> dict:
    model = shard_model(build_for(cfg, CPU), cfg)
    opt = _optimizer(kind, model)
    sched = _schedule(opt)
    runner = WholeStepGraph(model, opt, policy=StepPolicy(clip_grad=clip), eager=True)

    def step_fn(x, y, poison, *, n):
        loss = _loss(model, x, y, poison, n)
        loss.backward()
        return loss.detach()

    step = runner.capture(step_fn)
    out = {"losses": [], "norms": [], "skipped": [], "snapshots": {}, "sums": []}
    for i in range(STEPS):
        mbs = [
            (*batch_for(cfg, i * cfg.grad_accum + m, rank, CPU), _poison(i, m, rank))
            for m in range(cfg.grad_accum)
        ]
        res = step(mbs, n=cfg.grad_accum)
        sched.step()
        out["losses"] += res.outputs
        out["sums"].append((res.loss, sum(o.float() for o in res.outputs)))
        out["norms"].append(res.grad_norm)
        out["skipped"].append(float(res.skipped))
        if i in (INF_STEP - 1, INF_STEP):
            out["snapshots"][i] = _snapshot(model, opt)
    out["final"] = _snapshot(model, opt)
    out["lr"] = sched.get_last_lr()
    out["lr_is_tensor"] = opt.param_groups[0]["lr"] is runner.learning_rates.tensors[0]
    out["report"] = runner.report()
    with torch.no_grad():  # an eval forward: the root's pre-forward releases main grads
        model(*batch_for(cfg, 0, rank, CPU, eval=True))
    out["memory"] = model.fsdp_memory_report()
    out["errors"] = _call_errors(step, cfg, rank)
    return out


def _call_errors(step, cfg: TrainConfig, rank: int) -> dict[str, str]:
    x, y = batch_for(cfg, 0, rank, CPU)
    one = torch.tensor(1.0)
    attempts = {
        "count": lambda: step([(x, y, one)] * (cfg.grad_accum + 1), n=cfg.grad_accum),
        "shape": lambda: step([(x[:, :4], y[:, :4], one)] * cfg.grad_accum, n=cfg.grad_accum),
        "constant": lambda: step([(x, y, one)] * cfg.grad_accum, n=cfg.grad_accum + 1),
        "function": lambda: step.runner.step(lambda *a, **k: None, [(x, y, one)], n=1),
        "not_a_list": lambda: step(x, n=1),
    }
    out = {}
    for name, call in attempts.items():
        try:
            call()
            out[name] = "no error"
        except (GraphConfigError, TypeError) as err:
            out[name] = str(err)
    return out


def _worker(rank: int, world: int) -> dict:
    out = {}
    for name, (cfg, kind, clip) in VARIANTS.items():
        out[name] = {
            "usual": _usual_loop(cfg, kind, clip, rank),
            "whole": _whole_step(cfg, kind, clip, rank),
        }
        dist.barrier()
    static = TrainConfig(model=TINY, device="cpu", allocator="double_buffer")
    model = shard_model(build_for(static, CPU), static)
    try:
        WholeStepGraph(model, torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True))
        out["cpu_graphs_error"] = "no error"
    except GraphConfigError as err:
        out["cpu_graphs_error"] = str(err)
    return out


@pytest.fixture(scope="module")
def results():
    return spawn(_worker, 2)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical, NaNs included (torch.equal says NaN != NaN)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.contiguous().view(ints), b.contiguous().view(ints))


def _same_dict(a: dict, b: dict) -> list[str]:
    assert a.keys() == b.keys()
    return [k for k in a if not _same_bits(a[k], b[k])]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_eager_whole_step_equals_the_usual_loop(results, variant):
    for rank, r in enumerate(results):
        usual, whole = r[variant]["usual"], r[variant]["whole"]
        assert len(usual["losses"]) == len(whole["losses"])
        for i, (a, b) in enumerate(zip(usual["losses"], whole["losses"])):
            assert _same_bits(a, b), (rank, i, a, b)
        for i, (a, b) in enumerate(zip(usual["norms"], whole["norms"])):
            assert _same_bits(a, b), (rank, i, a, b)
        for total, summed in whole["sums"]:
            assert _same_bits(total, summed.reshape(()))  # the loss is the outputs' sum
        assert _same_dict(usual["final"]["weights"], whole["final"]["weights"]) == []
        assert _same_dict(usual["final"]["opt"], whole["final"]["opt"]) == []
        assert usual["lr"] == whole["lr"] and whole["lr_is_tensor"]
        clip = VARIANTS[variant][2]
        if clip is not None:  # every finite step was clipped
            assert min(float(n) for n in usual["norms"] if torch.isfinite(n)) > clip
        assert whole["report"]["captures"] == 0 and whole["report"]["impl"] == "eager"


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_non_finite_step_is_skipped_on_every_rank(results, variant):
    expected = [1.0 if i == INF_STEP else 0.0 for i in range(STEPS)]
    for r in results:  # rank 1's own gradients were finite: the global norm decides
        usual, whole = r[variant]["usual"], r[variant]["whole"]
        assert whole["skipped"] == expected == usual["skipped"]
        assert not torch.isfinite(whole["norms"][INF_STEP])
        before, after = whole["snapshots"][INF_STEP - 1], whole["snapshots"][INF_STEP]
        # weights and the whole optimizer state (step counts, moments, momentum) unchanged
        assert _same_dict(before["weights"], after["weights"]) == []
        assert _same_dict(before["opt"], after["opt"]) == []
        assert _same_dict(usual["snapshots"][INF_STEP]["opt"], after["opt"]) == []


def test_whole_step_memory_report_and_released_main_grads(results):
    memory = results[0]["adamw_bf16_accum2_clip"]["whole"]["memory"]
    # No CUDA graph on CPU, but the role is reported.
    assert memory["graph_pool_bytes"] == {"reserved": 0, "allocated": 0}
    # The eager whole step leaves main gradients releasable (nothing pins them): after the
    # step and the next forward they hold no bytes, as in the usual loop.
    assert memory["persistent_bytes"].get("main_grads", 0) == 0


def test_whole_step_refuses_calls_that_cannot_replay(results):
    errors = results[0]["adamw_bf16_accum2_clip"]["whole"]["errors"]
    assert "first run with 2 microbatches, now with 3" in errors["count"], errors["count"]
    assert "whole-step microbatch 0: tensor args[0] is (2, 4)" in errors["shape"], errors
    assert "kwargs['n'] is 3, captured as 2" in errors["constant"], errors["constant"]
    assert "first run with step function" in errors["function"], errors["function"]
    assert "must be a list of the microbatches" in errors["not_a_list"], errors
    assert "eager=True" in results[0]["cpu_graphs_error"], results[0]["cpu_graphs_error"]


def _tiny_params():
    return [torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(3))]


def test_optimizer_checks_name_what_works():
    params = _tiny_params()
    unfused = torch.optim.AdamW(params, lr=1e-3)
    with pytest.raises(GraphConfigError, match=r"fused=None: the Inf/NaN skip.*fused=True"):
        check_optimizer(unfused, skip_nonfinite=True, graphs=False)
    check_optimizer(unfused, skip_nonfinite=False, graphs=False)  # eager, no skip: any
    with pytest.raises(GraphConfigError, match=r"fused=True or capturable=True"):
        check_optimizer(unfused, skip_nonfinite=False, graphs=True)
    capturable = torch.optim.AdamW(params, lr=1e-3, capturable=True)
    check_optimizer(capturable, skip_nonfinite=False, graphs=True)
    with pytest.raises(GraphConfigError, match="only fused=True takes"):
        check_optimizer(capturable, skip_nonfinite=True, graphs=True)
    sgd = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    with pytest.raises(GraphConfigError, match=r"create SGD\(\.\.\., fused=True\)"):
        check_optimizer(sgd, skip_nonfinite=False, graphs=True)
    rms = torch.optim.RMSprop(params, lr=0.1)
    with pytest.raises(GraphConfigError, match=r"RMSprop cannot run inside.*AdamW"):
        check_optimizer(rms, skip_nonfinite=False, graphs=True)
    check_optimizer(rms, skip_nonfinite=False, graphs=False)
    for fused in (torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD):
        check_optimizer(fused(params, lr=0.1, fused=True), skip_nonfinite=True, graphs=True)
    with pytest.raises(ValueError, match="clip_grad=0"):
        StepPolicy(clip_grad=0)


def test_learning_rate_lives_in_one_device_tensor():
    params = _tiny_params()
    opt = torch.optim.AdamW(params, lr=1e-3, fused=True)
    opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(2))], "lr": 5e-4})
    lrs = DeviceLearningRates(opt)
    first = opt.param_groups[0]["lr"]
    assert first is lrs.tensors[0] and first.dtype == torch.float32 and first.dim() == 0
    assert float(opt.param_groups[1]["lr"]) == pytest.approx(5e-4)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    opt.step()
    sched.step()  # the scheduler fills the tensor in place
    assert opt.param_groups[0]["lr"] is first and float(first) == pytest.approx(5e-4)
    opt.param_groups[0]["lr"] = 0.25  # the host assigns a value: copied in before a step
    lrs.sync()
    assert opt.param_groups[0]["lr"] is first and float(first) == 0.25
    later = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 1.0)  # made after: float bases
    assert later.base_lrs == [1e-3, 5e-4] and opt.param_groups[0]["lr"] is first
    opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(2))]})
    with pytest.raises(GraphConfigError, match="after the last add_param_group"):
        lrs.sync()


def test_changed_hyperparameters_are_named():
    opt = torch.optim.AdamW(_tiny_params(), lr=1e-3, betas=(0.9, 0.95), fused=True)
    recorded = hyperparameters(opt)
    opt.param_groups[0]["lr"] = 0.5  # the learning rate may change
    assert changed_hyperparameter(opt, recorded) is None
    opt.param_groups[0]["betas"] = (0.8, 0.95)
    why = changed_hyperparameter(opt, recorded)
    assert why == "param group 0's betas is (0.8, 0.95), captured as (0.9, 0.95)", why
