"""Verification (per-module checksums, first differing module, same-state replays) and
capture-failure diagnosis, on CPU: the logic the GPU runners use, with real modules and gloo."""

from __future__ import annotations

import pytest
import torch
from graph_fsdp_testing import SMALLEST_GPT, spawn_cases
from torch import nn
from torch.nn.modules import module as module_globals

from graph_fsdp.capture.diagnosis import ModuleTracker, explain_capture_failure
from graph_fsdp.capture.scopes import Target
from graph_fsdp.capture.step import eager_forward_backward
from graph_fsdp.capture.torch_backend import (
    CallSignature,
    CapturedCallable,
    backward_step,
    forward_step,
)
from graph_fsdp.capture.verify import (
    ChecksumRecorder,
    VerifyResult,
    first_difference,
    tensor_checksum,
    verify_step,
)
from graph_fsdp.fsdp.state import collect_states
from graph_fsdp.models import build_model
from graph_fsdp.training.data import batch_for
from graph_fsdp.training.train import TrainConfig, build_for, shard_model

TINY = SMALLEST_GPT


def _perturb(module: nn.Module, rel: float = 1e-6) -> None:
    """Make ``module`` compute a (slightly) different output, as a graph might."""
    forward = module.forward

    def perturbed(*args, **kwargs):
        return forward(*args, **kwargs) * (1 + rel)

    module.forward = perturbed


def test_checksums_see_every_bit_and_position():
    a = torch.tensor([1.0, 2.0, 0.0])
    for b in (torch.tensor([2.0, 1.0, 0.0]), torch.tensor([1.0, 2.0, -0.0])):
        (sa, ha), (sb, hb) = tensor_checksum(a), tensor_checksum(b)
        assert torch.equal(sa, sb) and not torch.equal(ha, hb)  # same sum, other bits
    x = torch.randn(64, dtype=torch.bfloat16)
    assert torch.equal(tensor_checksum(x)[1], tensor_checksum(x.clone())[1])
    assert tensor_checksum(torch.arange(5))[0].item() == 10.0


def _run(model, recorder, x, y):
    recorder.reset_values()
    with recorder.recording():
        model(x, y).backward()
    return list(recorder.order), recorder.snapshot()


def test_first_differing_module_is_the_perturbed_one():
    torch.manual_seed(0)
    model = build_model(TINY)
    recorder = ChecksumRecorder(model)
    x = torch.randint(0, 64, (2, 8))
    order, eager = _run(model, recorder, x, x)
    assert order[0][0] == "embedding" and ("layers.1.mlp.fc2", 0) in order
    _, again = _run(model, recorder, x, x)
    assert first_difference(order, eager, again) is None  # eager is reproducible
    _perturb(model.layers[1].mlp.fc2)
    _, changed = _run(model, recorder, x, x)
    name, call, detail = first_difference(order, eager, changed)
    # fc2 finishes before its parents (mlp, the layer, the model), whose outputs differ too.
    assert (name, call) == ("layers.1.mlp.fc2", 0), (name, detail)
    assert "eager vs" in detail
    assert not module_globals._global_forward_hooks  # the recorder's hook is gone


def test_a_perturbation_below_half_a_bf16_ulp_is_no_difference():
    """The GPU test's module perturbed under capture must change bf16 values: ``* 1.001``
    rounds back to the same bf16 value (half an ulp is >= 2**-9), so graphed == eager is the
    right verdict for it; a power of two changes every nonzero value."""
    torch.manual_seed(0)
    model = build_model(TINY).to(torch.bfloat16)
    recorder = ChecksumRecorder(model)
    x = torch.randint(0, 64, (2, 8))
    order, eager = _run(model, recorder, x, x)
    fc2 = model.layers[1].mlp.fc2
    clean = fc2.forward
    _perturb(fc2, 1e-3)
    _, rounded = _run(model, recorder, x, x)
    assert first_difference(order, eager, rounded) is None
    fc2.forward = clean
    _perturb(fc2, 1.0)  # * 2
    _, doubled = _run(model, recorder, x, x)
    assert first_difference(order, eager, doubled)[:2] == ("layers.1.mlp.fc2", 0)


class _TwoBackends(nn.Module):
    """An attention-like module that picks one of two kernels, as TE's DotProductAttention
    picks a backend per call: the second rounds through bf16 (another kernel's numerics)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.fused, self.flash = nn.Identity(), nn.Identity()
        self.use_flash = False

    def forward(self, x):
        h = self.proj(x)
        if self.use_flash:
            return self.flash(h.bfloat16().float())
        return self.fused(h)


def test_a_submodule_that_runs_only_eagerly_names_its_parent_and_the_branch_taken():
    """Under capture the module took another branch: the submodule that ran only eagerly is
    no comparison point; its parent is named, with both submodules (eager vs capture)."""
    torch.manual_seed(0)
    model = nn.Sequential(_TwoBackends(), nn.Linear(8, 4))
    recorder = ChecksumRecorder(model)
    x = torch.randn(3, 8)

    def run():
        recorder.reset_values()
        with recorder.recording():
            model(x)
        return list(recorder.order), recorder.snapshot()

    order, eager = run()
    model[0].use_flash = True
    _, graphed = run()
    name, call, detail = first_difference(order, eager, graphed)
    assert (name, call) == ("0", 0), detail
    assert "inside it 0.fused ran eagerly but not under capture" in detail, detail
    assert "under capture 0.flash ran instead" in detail, detail
    # Without the parent's output to compare, the submodule is named, with the other branch.
    recorded = [k for k in order if k[0] in ("0.fused",)]
    name, call, detail = first_difference(recorded, eager, graphed)
    assert name == "0.fused" and "not recorded in the graphed run" in detail, detail
    assert "under capture 0.flash ran instead" in detail, detail


class _Permuting(nn.Module):
    """Eagerly its input; with ``permute`` the same values in another order, as a kernel that
    writes its output through another index map would under capture."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))  # 1.0: the values stay small integers
        self.permute = False

    def forward(self, x):
        y = x * self.scale
        return y.flip(-1) if self.permute else y


def test_a_permuted_output_is_reported_as_different():
    """Same values, other positions: the float64 sums are equal (small integers, exact in any
    order) and so is the step's output (their sum), only the bits' positions differ. The
    verification must report the step as differing and name the permuting module: the
    position-weighted hash alone tells the runs apart (verify.py ``_differ``)."""
    model = nn.Sequential(nn.Identity(), _Permuting(), nn.Identity())
    recorder = ChecksumRecorder(model)
    counter = _Replays()
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4)

    def step():
        with torch.no_grad():
            return model(x).sum()

    def graphed_step():
        model[1].permute = True
        try:
            return step()
        finally:
            model[1].permute = False

    result, loss = verify_step(
        what="permuted",
        states=[],
        recorder=recorder,
        run_eager=step,
        run_graphed=counter.graphed(graphed_step),
        graph_calls=counter.graph_calls,
        device=torch.device("cpu"),
    )
    assert result.verified and result.outputs_equal and loss.item() == 66.0, result.describe()
    assert not result.identical, result.describe()
    assert (result.first_module, result.first_call) == ("1", 0), result.describe()
    assert "output sum 66.0 eager vs 66.0 graphed" in result.module_detail, result.module_detail
    assert "first module whose output differs: 1 (call 0" in result.describe()
    # The same on the recorder's slots directly: equal sums, differing hashes.
    order, eager = _run_forward(model, recorder, x, permute=False)
    _, permuted = _run_forward(model, recorder, x, permute=True)
    assert eager[("1", 0)][0] == permuted[("1", 0)][0]
    assert eager[("1", 0)][1] != permuted[("1", 0)][1]
    assert first_difference(order, eager, permuted)[:2] == ("1", 0)


def _run_forward(model, recorder, x, *, permute: bool):
    model[1].permute = permute
    recorder.reset_values()
    try:
        with recorder.recording():
            model(x)
    finally:
        model[1].permute = False
    return list(recorder.order), recorder.snapshot()


class _Replays:
    """Stands in for a runner's counters around an eager "graphed" run on CPU (no graphs
    exist there): ``graphed(fn)`` counts one replay per call, as a replayed step would;
    ``graph_calls`` is what the runners hand ``verify_step``. The GPU tests verify real
    replays (tests/capture/test_capture_safety_gpu.py)."""

    def __init__(self) -> None:
        self.replays = self.fallbacks = 0

    def graphed(self, fn):
        def run():
            self.replays += 1
            return fn()

        return run

    def graph_calls(self) -> tuple[int, int]:
        return self.replays, self.fallbacks


def _verify_worker(rank: int, world: int) -> dict:
    cfg = TrainConfig(model=TINY, micro_batch_size=2, grad_accum=2, device="cpu")
    counter = _Replays()
    models = [shard_model(build_for(cfg, torch.device("cpu")), cfg) for _ in range(2)]
    model, twin = models
    recorder = ChecksumRecorder(model)
    out = {}
    for micro in range(2):  # micro 0 accumulates under no_sync: its accum is state too
        x, y = batch_for(cfg, micro, rank, torch.device("cpu"))
        for m in models:
            m.set_requires_gradient_sync(micro == 1)

        def step(x=x, y=y):
            return eager_forward_backward(model, x, y, 2)

        result, loss = verify_step(
            what=f"micro {micro}",
            states=collect_states(model),
            recorder=recorder,
            run_eager=step,
            run_graphed=counter.graphed(step),
            graph_calls=counter.graph_calls,
            device=torch.device("cpu"),
        )
        ref = eager_forward_backward(twin, x, y, 2)
        out[f"identical_{micro}"] = (result.identical, result.describe(), torch.equal(loss, ref))
    # The step counted once: gradients equal the twin's, which ran each step once.
    out["grads_equal"] = all(
        (a.grad is None) == (b.grad is None) and (a.grad is None or torch.equal(a.grad, b.grad))
        for a, b in zip(model.parameters(), twin.parameters())
    )
    x, y = batch_for(cfg, 2, rank, torch.device("cpu"))
    model.set_requires_gradient_sync(True)
    layer = model.layers[1]
    clean = layer.self_attention.proj.forward

    def perturbed_step():
        _perturb(layer.self_attention.proj, 1e-3)
        try:
            return eager_forward_backward(model, x, y, 2)
        finally:
            layer.self_attention.proj.forward = clean

    result, _ = verify_step(
        what="perturbed",
        states=collect_states(model),
        recorder=recorder,
        run_eager=lambda: eager_forward_backward(model, x, y, 2),
        run_graphed=counter.graphed(perturbed_step),
        graph_calls=counter.graph_calls,
        device=torch.device("cpu"),
    )
    out["perturbed"] = (result.identical, result.first_module, result.differing_grads)
    out["perturbed_text"] = result.describe()
    # A "graphed" run that replayed nothing (e.g. every call fell back) is not verified,
    # however equal its numbers: it compared eager with eager.
    for fallbacks in (0, 3):

        def step():
            return eager_forward_backward(model, x, y, 2)

        def graphed(fallbacks=fallbacks):  # 0: nothing replayed; 3: one replay, 3 fell back
            counter.replays += fallbacks > 0
            counter.fallbacks += fallbacks
            return step()

        result, _ = verify_step(
            what="no replay",
            states=collect_states(model),
            recorder=recorder,
            run_eager=step,
            run_graphed=graphed,
            graph_calls=counter.graph_calls,
            device=torch.device("cpu"),
        )
        out[f"unverified_{fallbacks}"] = (
            result.identical,
            result.verified,
            result.replays,
            result.fallbacks,
            result.describe(),
        )
    return out


@pytest.fixture(scope="module")
def two_ranks():
    """Both gloo checks of this file in one spawned group."""
    return spawn_cases({"verify": (_verify_worker,), "capture_like": (_capture_like_worker,)}, 2)


def test_verify_step_restores_state_and_names_the_first_module_on_gloo(two_ranks):
    r = two_ranks["verify"][0]
    for micro in range(2):
        identical, text, same_loss = r[f"identical_{micro}"]
        assert identical and same_loss, text
        assert "graphed == eager bit for bit" in text
    assert r["grads_equal"]
    identical, first, grads = r["perturbed"]
    assert not identical and first == "layers.1.self_attention.proj", r["perturbed_text"]
    assert grads, "the perturbed step's gradients must differ"
    assert "first module whose output differs: layers.1.self_attention.proj" in r["perturbed_text"]
    identical, verified, replays, fallbacks, text = r["unverified_0"]
    assert (identical, verified, replays, fallbacks) == (False, False, 0, 0), text
    assert "NOT VERIFIED: the graphed run replayed no graph (0 replays)" in text, text
    identical, verified, replays, fallbacks, text = r["unverified_3"]
    assert (identical, verified, replays, fallbacks) == (False, False, 1, 3), text
    assert "3 call(s) of captured modules fell back to eager in the graphed run" in text, text


class _Fails(nn.Module):
    def __init__(self, message: str) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.message = message

    def forward(self, x):
        raise RuntimeError(self.message)


class _BackwardFails(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing")


class _FailsInBackward(nn.Module):
    def forward(self, x):
        return _BackwardFails.apply(x)


def _model(inner: nn.Module) -> nn.Module:
    return nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.ReLU(), inner), nn.Linear(4, 1))


@pytest.mark.parametrize(
    "message, cause",
    [
        ("Cannot copy between CPU and CUDA tensors during CUDA graph capture", "CPU<->GPU copy"),
        ("CUDA error: operation not permitted when stream is capturing", "host synchronization"),
        ("a value error", "an operation CUDA graphs cannot record"),
    ],
)
def test_capture_failure_names_the_running_module(message, cause):
    model = _model(_Fails(message))
    tracker = ModuleTracker.for_model(model)
    with pytest.raises(RuntimeError) as raised, tracker.active():
        model(torch.randn(2, 4))
    err = explain_capture_failure(raised.value, tracker, what="full_iteration", layerwise=False)
    assert err.module == "1.1" and err.phase == "forward"
    text = str(err)
    assert "while the forward of 1.1 was running" in text and cause in text, text
    # the model's own line (the innermost frame outside torch and graph_fsdp)
    line = _Fails.forward.__code__.co_firstlineno + 1
    assert f"at {__file__}:{line} in forward" in text, text
    assert "use layerwise graphs instead of full_iteration" in text
    assert message.splitlines()[0] in text
    assert not module_globals._global_forward_hooks and not module_globals._global_forward_pre_hooks


def test_capture_failure_in_backward_names_the_module():
    model = _model(_FailsInBackward())
    tracker = ModuleTracker.for_model(model)
    with pytest.raises(RuntimeError) as raised, tracker.active():
        with tracker.phase("whole step", "backward"):
            model(torch.randn(2, 4, requires_grad=True)).sum().backward()
    err = explain_capture_failure(raised.value, tracker, what="layer 1", layerwise=True)
    assert (err.module, err.phase) == ("1.1", "backward"), str(err)
    assert "pick scopes that leave that module eager" in str(err)


def test_compare_verdict_reports_the_verification():
    from graph_fsdp.cli.compare_cmd import add_verification, format_verdict

    verdict = {"identical": True, "equal_steps": 3, "steps": 3, "params": 2}
    flagged = {
        "identical": False,
        "verified": True,
        "replays": 4,
        "fallbacks": 0,
        "first_module": "model.layers.0.self_attn",
        "summary": "step: graphed != eager: first module whose output differs: ...",
    }
    ok = {"identical": True, "verified": True, "summary": "step: graphed == eager bit for bit"}
    clean = dict(verdict)
    add_verification(clean, {"cuda_graphs": {"verification": [ok]}})
    assert clean["identical"] and "verify: step: graphed == eager" in format_verdict("x", clean)
    add_verification(verdict, {"cuda_graphs": {"verification": [ok, flagged]}})
    assert not verdict["identical"]
    text = format_verdict("torch [full_iteration]", verdict)
    assert "DIFFERENT" in text and "first at model.layers.0.self_attn" in text, text
    # A verification whose graphed run replayed nothing proves nothing: NOT VERIFIED.
    unverified = {
        "identical": False,
        "verified": False,
        "replays": 0,
        "fallbacks": 0,
        "summary": "step: NOT VERIFIED: the graphed run replayed no graph (0 replays): ...",
    }
    plain = {"identical": True, "equal_steps": 3, "steps": 3, "params": 2}
    add_verification(plain, {"cuda_graphs": {"verification": [unverified]}})
    assert not plain["identical"] and "first_differing_module" not in plain
    text = format_verdict("torch [attn]", plain)
    assert "NOT VERIFIED: its verification step's graphed run had 0 replays" in text, text
    assert "(numbers equal the reference)" in text and "IDENTICAL" not in text, text


def _capture_like_worker(rank: int, world: int) -> dict:
    """A full-iteration capture runs the step's Python (FSDP sets accum_pending, attaches
    grads) but none of its kernels; verification must start from the state before it and
    leave the capture's Python state behind. Emulated on gloo: run the step, then put the
    gradient tensors back (flags stay), as a capture leaves them."""
    from graph_fsdp.capture.verify import GradState

    cfg = TrainConfig(model=TINY, micro_batch_size=2, grad_accum=2, device="cpu")
    model, twin = (shard_model(build_for(cfg, torch.device("cpu")), cfg) for _ in range(2))
    states = collect_states(model)
    recorder = ChecksumRecorder(model)
    counter = _Replays()
    results = []
    for micro in range(2):
        x, y = batch_for(cfg, micro, rank, torch.device("cpu"))
        for m in (model, twin):
            m.set_requires_gradient_sync(micro == 1)

        def step(x=x, y=y):
            return eager_forward_backward(model, x, y, 2)

        def replay_like(step=step):  # the kernels' effects without the Python ones
            flags = GradState.save(states, tensors=False)
            out = step()
            flags.restore()
            return out

        before = GradState.save(states)
        step()  # the "capture": Python effects ...
        after = GradState.save(states, tensors=False)
        before.restore()
        after.restore()  # ... without the kernels' effects
        result, _ = verify_step(
            what=f"micro {micro}",
            states=states,
            recorder=recorder,
            run_eager=step,
            run_graphed=counter.graphed(replay_like),
            graph_calls=counter.graph_calls,
            device=torch.device("cpu"),
            saved=before,
            after=after,
        )
        results.append(result.identical)
        eager_forward_backward(twin, x, y, 2)
    same = all(
        (a.grad is None) == (b.grad is None) and (a.grad is None or torch.equal(a.grad, b.grad))
        for a, b in zip(model.parameters(), twin.parameters())
    )
    return {"identical": results, "grads_equal": same}


def test_verification_around_a_capture_keeps_the_accumulation_right(two_ranks):
    r = two_ranks["capture_like"][0]
    assert r["identical"] == [True, True]
    assert r["grads_equal"], "micro 1 must add micro 0's no_sync accumulation"


class _Block(nn.Module):
    """A captured module whose forward fails at ``fault``: "entry" (before any submodule, like
    an ``.item()`` on the input), "inner" (in a submodule) or "backward"."""

    def __init__(self, fault: str) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.inner = _Fails("Cannot copy between CPU and CUDA tensors during CUDA graph capture")
        self.fault = fault

    def forward(self, x):
        if self.fault == "entry":
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
        if self.fault == "inner":
            return self.inner(self.lin(x))
        return _BackwardFails.apply(self.lin(x))


_NO_HOOKS = {
    k: {} for k in ("forward_pre_hooks", "forward_hooks", "backward_pre_hooks", "backward_hooks")
}


@pytest.mark.parametrize(
    "fault, expected",
    [("entry", ("1.1", "forward")), ("inner", ("1.1.inner", "forward")), ("backward", None)],
)
def test_layerwise_capture_failure_names_the_callable(fault, expected):
    """The layerwise torch backend runs the captured module's original forward directly (no
    ``__call__``, so no module hooks): its phase must still name the module after the
    exception unwound it (the diagnosis runs after the capture code)."""
    model = _model(_Block(fault))
    block = model[1][1]
    cap = CapturedCallable(Target("1.1", block, model[1], "mlp"), block.forward)
    x = torch.randn(2, 4, requires_grad=True)
    cap.signature = CallSignature((x,), {})
    cap.prepare()
    tracker = ModuleTracker.for_model(model)
    with pytest.raises(RuntimeError) as raised, tracker.active():
        out = forward_step(cap, _NO_HOOKS, tracker)  # what capture_torch warms up and captures
        backward_step(cap, _NO_HOOKS, out, tracker)
    err = explain_capture_failure(raised.value, tracker, what="layerwise graphs", layerwise=True)
    module, phase = expected or ("1.1", "backward")
    assert (err.module, err.phase) == (module, phase), str(err)
    assert f"while the {phase} of {module} was running" in str(err)
    assert "pick scopes that leave that module eager" in str(err)
    with tracker.active():  # a new capture starts with nothing of the failed one
        assert tracker.running() == (None, None)


def test_a_handled_exception_in_a_phase_is_not_the_failure():
    tracker = ModuleTracker({})
    with tracker.active():
        with pytest.raises(ValueError), tracker.phase("a", "forward"):
            raise ValueError("handled by the caller")
        with tracker.phase("b", "backward"):
            pass
        assert tracker.running() == (None, None)


class _BranchesOnCapture(nn.Module):
    """What HuggingFace's mask code does: another computation while a graph is captured."""

    def forward(self, x):
        if torch.cuda.is_current_stream_capturing():
            return x * 2
        return x


def test_capture_state_queries_name_the_site_and_module(monkeypatch):
    from graph_fsdp import cuda_streams
    from graph_fsdp.capture.step import record_verification

    model = _model(_BranchesOnCapture())
    tracker = ModuleTracker.for_model(model)

    def capturing(value: bool) -> None:  # stand-in for the CUDA query (CPU builds lack it)
        for owner in (torch.cuda, torch.cuda.graphs):
            monkeypatch.setattr(owner, "is_current_stream_capturing", lambda: value)

    capturing(False)
    with tracker.active():  # no capture running: nothing asked got True
        model(torch.randn(2, 4))
    assert tracker.capture_queries == {}
    capturing(True)
    with tracker.active():
        model(torch.randn(2, 4))
        assert torch.cuda.graphs.is_current_stream_capturing()  # this file is the model's
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        assert cuda_streams.stream_capturing()  # graph_fsdp's own check: no branch of the model
    # Restored: the (patched) originals, not the watchers.
    assert torch.cuda.is_current_stream_capturing.__name__ == "<lambda>"
    sites = list(tracker.capture_queries.items())
    assert len(sites) == 2, sites
    (site, module), (site2, module2) = sites
    assert "test_verify_and_diagnosis.py:" in site and " in forward <- " in site
    assert module == "1.1"
    assert " in test_capture_state_queries_name_the_site_and_module" in site2 and module2 is None
    results = []
    with pytest.warns(UserWarning) as warned:
        record_verification(
            results,
            VerifyResult("step", identical=False, outputs_equal=False, replays=1),
            True,
            tracker,
        )
    assert results[0].capture_queries[0].endswith("(in 1.1)")
    text = str(warned[0].message)
    assert "got True at " in text and "in forward <- " in text, text
    same = VerifyResult("step", identical=True, outputs_equal=True, replays=1)
    record_verification(results, same, True, tracker)
    assert same.capture_queries == []  # named only when graphed != eager


def test_a_difference_in_gradients_only_names_the_summation_order():
    """Forward bit-identical, gradients not: the summary says so and names the usual cause
    under partial scopes (a captured module's input also used outside it), not a branch."""
    grads_only = VerifyResult(
        "layerwise step, scopes [attn mlp]",
        identical=False,
        outputs_equal=True,
        differing_grads=["layers.0/accum"],
        modules_checked=12,
        replays=4,
    )
    text = grads_only.describe()
    assert "forward is bit-identical (12 module outputs) and only gradients differ" in text
    assert "in another order than in eager" in text and "another branch" not in text
    forward = VerifyResult(
        "step", identical=False, outputs_equal=True, first_module="1.1", replays=1
    )
    assert "another branch" in forward.describe()


def test_a_tensor_or_module_output_missing_on_one_side_is_a_difference():
    """Never compared with itself: a gradient accumulator the graphed run lacks (or has
    alone) differs, and so does a module recorded in only one of the runs."""
    from graph_fsdp.capture.verify import differing_tensors

    g = torch.ones(3)
    assert differing_tensors({"a/main_grad": g}, {"a/main_grad": g.clone()}) == []
    assert differing_tensors({"a/main_grad": g, "b/accum": g}, {"a/main_grad": g}) == [
        "b/accum (only in the eager run)"
    ]
    assert differing_tensors({}, {"b/accum": g}) == ["b/accum (only in the graphed run)"]
    assert differing_tensors({"a": g}, {"a": g + 1}) == ["a"]
    # Module checksums (slot values as ChecksumRecorder.snapshot gives them): a module only
    # the graphed run recorded.
    from graph_fsdp.capture.verify import _UNSET

    nan = float("nan")
    order = [("a", 0), ("b", 0)]
    eager = {("a", 0): (1.0, 5), ("b", 0): (2.0, 6), ("c", 0): (nan, _UNSET)}
    assert first_difference(order, eager, dict(eager)) is None
    graphed = {**eager, ("c", 0): (3.0, 7)}
    name, call, detail = first_difference(order, eager, graphed)
    assert (name, call) == ("c", 0) and "recorded only in the graphed run" in detail, detail
