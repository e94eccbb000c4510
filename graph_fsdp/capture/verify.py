"""Graphed == eager? Run one step both ways from the same state; name the first difference.

[Note: verification] With ``verify=True`` a graph runner checks its first replayed step:

1. snapshot the step's mutable state - FSDP's gradient accumulators (``main_grad``, the
   no_sync ``accum``, which sharded ``.grad`` are attached) and the CPU/CUDA RNG states
   (the step is forward+backward: weights are read, not written);
2. run the step eagerly with :class:`ChecksumRecorder` on, keep its outputs, gradients and
   per-module checksums; restore the snapshot;
3. run the step graphed (replay), keep the same; compare bitwise.

The graphed run must have replayed: the runner hands ``verify_step`` its replay and
eager-fallback counters, and a graphed run that replayed no graph, or in which a call fell
back to eager, is *not verified* (``VerifyResult.verified``), never "identical" - it would
compare eager with eager. A gradient accumulator or a module output present in one run and
absent in the other is a difference, never compared with itself.

The checksums are one float64 sum and one bit-pattern hash of each module's forward
outputs, per ``(module, call)``. Inside a graph no host code runs at replay, so the recorder
is armed while the graphs are *captured*: its hooks then record kernels that write each
checksum into a preallocated static slot, and every replay rewrites those slots. Outside
graphs (eager modules, eager runs) the same hooks write the same slots live. The first slot
in the eager run's execution order whose values differ names the first module whose output
differs. Cost: the checksum kernels stay in the verified graphs (one reduction per module
output per replay) - verify in a separate run (``graph-fsdp compare`` does) when that
matters.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_hook
from torch.utils._pytree import tree_flatten

from graph_fsdp.capture.diagnosis import restore_generator_states, snapshot_generator_states

_INT_OF = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_UNSET = -(2**62)
"""Bit-hash value of a slot no module wrote in this run."""


class GraphVerificationError(RuntimeError):
    """Graphed and eager execution of the same step differ (``verify='raise'``)."""


def tensor_checksum(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float64 sum, int64 position-weighted hash of the bit patterns) of ``t``, on device.

    Kernels only (no host sync), so it can be recorded into a graph. The hash sees every
    bit of every element and its position; int64 overflow wraps, identically in both runs.
    """
    t = t.detach()
    flat = t.reshape(-1)
    if t.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    if flat.is_floating_point():
        fsum = flat.double().sum()
        bits = flat.contiguous().view(_INT_OF[flat.element_size()]).long()
    else:
        fsum = flat.double().sum()
        bits = flat.long()
    weights = torch.arange(bits.numel(), device=t.device, dtype=torch.int64) % 1009 + 1
    return fsum, (bits * weights).sum()


class ChecksumRecorder:
    """Per-module output checksums into static slots (see [Note: verification]).

    ``armed``: None (off), ``"always"`` (every forward of a tracked module, eager runs) or
    ``"capturing"`` (only forwards recorded into a graph).
    """

    def __init__(self, model: nn.Module, *, capacity: int | None = None) -> None:
        self.names = {id(m): n or "<root>" for n, m in model.named_modules()}
        self.capacity = capacity or 4 * len(self.names) + 64
        device = next(model.parameters()).device
        self.fsum = torch.full((self.capacity,), float("nan"), dtype=torch.float64, device=device)
        self.bits = torch.full((self.capacity,), _UNSET, dtype=torch.int64, device=device)
        self.slots: dict[tuple[str, int], int] = {}
        self.order: list[tuple[str, int]] = []
        self.calls: dict[str, int] = {}
        self.overflow = 0
        self.unsupported: set[str] = set()
        self.armed: str | None = None
        self._handle = None

    @contextmanager
    def recording(self, mode: str = "always") -> Iterator[ChecksumRecorder]:
        """Record one run: call counts and the execution order start afresh."""
        self.calls, self.order, self.armed = {}, [], mode
        self._handle = register_module_forward_hook(self._hook)
        try:
            yield self
        finally:
            self._handle.remove()
            self.armed = None

    def reset_values(self) -> None:
        self.fsum.fill_(float("nan"))
        self.bits.fill_(_UNSET)

    def _hook(self, module: nn.Module, args, output) -> None:
        name = self.names.get(id(module))
        if name is None or self.armed is None:
            return
        if self.armed == "capturing" and not torch.cuda.is_current_stream_capturing():
            return
        k = self.calls.get(name, 0)
        self.calls[name] = k + 1
        key = (name, k)
        self.order.append(key)
        slot = self.slots.get(key)
        if slot is None:
            if len(self.slots) >= self.capacity:
                self.overflow += 1
                return
            slot = self.slots[key] = len(self.slots)
        tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor)]
        if not tensors:
            return
        try:
            sums = [tensor_checksum(t) for t in tensors]
        except (TypeError, RuntimeError, KeyError):
            # A tensor subclass without plain storage (e.g. an FP8 tensor): not checksummed.
            self.unsupported.add(name)
            return
        self.fsum[slot].copy_(torch.stack([s for s, _ in sums]).sum())
        self.bits[slot].copy_(torch.stack([b for _, b in sums]).sum())

    def snapshot(self) -> dict[tuple[str, int], tuple[float, int]]:
        """The slot values of the last run, by key (one host sync)."""
        fsum, bits = self.fsum.cpu().tolist(), self.bits.cpu().tolist()
        return {key: (fsum[i], bits[i]) for key, i in self.slots.items()}


def _differ(a: tuple[float, int], b: tuple[float, int]) -> bool:
    (fa, ba), (fb, bb) = a, b
    same_sum = fa == fb or (fa != fa and fb != fb)  # NaN == NaN here
    return ba != bb or not same_sum


def _written(sums: dict[tuple[str, int], tuple[float, int]]) -> set[tuple[str, int]]:
    """The ``(module, call)`` slots a run wrote (a module that ran in it)."""
    return {key for key, (_, bits) in sums.items() if bits != _UNSET}


def _names(keys: list[tuple[str, int]], limit: int = 3) -> str:
    shown = ", ".join(name if call == 0 else f"{name} (call {call})" for name, call in keys[:limit])
    return shown + (f" and {len(keys) - limit} more" if len(keys) > limit else "")


def first_difference(
    order: list[tuple[str, int]],
    eager: dict[tuple[str, int], tuple[float, int]],
    graphed: dict[tuple[str, int], tuple[float, int]],
) -> tuple[str, int, str] | None:
    """The first ``(module, call, detail)`` in ``order`` whose checksums differ, else None.

    A module that ran eagerly but wrote nothing in the graphed run (under capture its parent
    took another branch) is no comparison point: the first module both runs recorded whose
    output differs is named, with the submodules that ran in only one of the runs - e.g. an
    attention module that picked another kernel backend under capture. A module recorded in
    only one of the runs is itself a difference when nothing before it differs.
    """
    ran_eager, ran_graphed = _written(eager), _written(graphed)
    only_graphed = sorted(ran_graphed - ran_eager)
    skipped: list[tuple[str, int]] = []
    for key in order:
        if key not in ran_eager:
            continue
        if key not in ran_graphed:
            skipped.append(key)
            continue
        a, b = eager[key], graphed[key]
        if _differ(a, b):
            detail = f"output sum {a[0]!r} eager vs {b[0]!r} graphed"
            return key[0], key[1], detail + _branch_note(key[0], skipped, only_graphed)
    if skipped:
        name, call = skipped[0]
        note = f"; under capture {_names(only_graphed)} ran instead" if only_graphed else ""
        return name, call, "its output was not recorded in the graphed run" + note
    if only_graphed:
        name, call = only_graphed[0]
        return name, call, "its output was recorded only in the graphed run (it ran only there)"
    return None


def _branch_note(parent: str, skipped, only_graphed) -> str:
    """Which submodules of ``parent`` ran only eagerly / only under capture."""
    eager_only = [k for k in skipped if k[0].startswith(f"{parent}.")]
    graphed_only = [k for k in only_graphed if k[0].startswith(f"{parent}.")]
    note = ""
    if eager_only:
        note += f"; inside it {_names(eager_only)} ran eagerly but not under capture"
    if graphed_only:
        note += f"; under capture {_names(graphed_only)} ran instead"
    return note


@dataclass
class GradState:
    """FSDP's gradient accumulators of every unit (the state a forward+backward changes)."""

    tensors: list[tuple[object, str, torch.Tensor | None]] = field(default_factory=list)
    flags: list[tuple[object, bool]] = field(default_factory=list)
    attached: list[tuple[nn.Parameter, torch.Tensor | None]] = field(default_factory=list)

    @classmethod
    def save(cls, states, *, tensors: bool = True) -> GradState:
        """``tensors=False``: only the Python side (which accumulator holds pending grads,
        which ``.grad`` are attached)."""
        out = cls()
        for state in states:
            for g in state.groups:
                for attr in ("main_grad", "accum") if tensors else ():
                    out.tensors.append((g, attr, _held(getattr(g, attr, None))))
                out.flags.append((g, g.accum_pending))
                out.attached.extend((ref.sharded, ref.sharded.grad) for ref in g.params)
        return out

    def restore(self) -> None:
        for g, attr, saved in self.tensors:
            live = getattr(g, attr, None)
            if saved is not None and live is not None:
                if attr == "main_grad":
                    g.ensure_main_grad()  # a forward since the save may have released it
                live.copy_(saved)
        for g, pending in self.flags:
            g.restore_accumulation(pending)
        for p, grad in self.attached:
            p.grad = grad

    def grads_by_group(self, states) -> dict[str, torch.Tensor]:
        """The live accumulators, cloned, by ``group fqn/attr``."""
        out = {}
        for state in states:
            for g in state.groups:
                for attr in ("main_grad", "accum"):
                    t = _held(getattr(g, attr, None))
                    if t is not None:
                        out[f"{g.fqn or '<root>'}/{attr}"] = t
        return out


def _held(t: torch.Tensor | None) -> torch.Tensor | None:
    """A clone of ``t``; None when there is none or its storage is released (a main grad
    between steps, param_group.py [Note: releasable main grads]: nothing reads it)."""
    if t is None or t.untyped_storage().nbytes() == 0:
        return None
    return t.detach().clone()


@dataclass
class VerifyResult:
    """The outcome of one verified step (see [Note: verification])."""

    what: str
    identical: bool
    """Verified (see ``verified``) and graphed == eager bit for bit."""
    outputs_equal: bool
    first_module: str | None = None
    first_call: int | None = None
    module_detail: str = ""
    differing_grads: list[str] = field(default_factory=list)
    modules_checked: int = 0
    note: str = ""
    capture_queries: list[str] = field(default_factory=list)
    """Code that branched on ``is_current_stream_capturing()`` while the graphs were captured
    (diagnosis.py [Note: capture-state queries]), with the module running; set only when the
    step differs."""
    replays: int = 0
    """Graph replays during the graphed run."""
    fallbacks: int = 0
    """Calls of captured modules that ran eagerly during the graphed run."""

    @property
    def verified(self) -> bool:
        """The graphed run replayed and nothing in it fell back to eager: a comparison of
        graphed with eager, not of eager with eager."""
        return self.replays > 0 and self.fallbacks == 0

    def not_verified_reason(self) -> str | None:
        if self.replays == 0:
            return "the graphed run replayed no graph (0 replays): it ran eagerly"
        if self.fallbacks:
            return (
                f"{self.fallbacks} call(s) of captured modules fell back to eager in the "
                f"graphed run ({self.replays} replays)"
            )
        return None

    def describe(self) -> str:
        reason = self.not_verified_reason()
        if reason is not None:
            return f"{self.what}: NOT VERIFIED: {reason}; nothing was compared against a replay"
        if self.identical:
            return (
                f"{self.what}: graphed == eager bit for bit ({self.replays} replays; outputs "
                f"and gradients by torch.equal, the forward outputs of {self.modules_checked} "
                "module calls by a float64 sum and a position-weighted hash of their bits)"
            )
        parts = []
        if self.first_module is not None:
            parts.append(
                f"first module whose output differs: {self.first_module} (call "
                f"{self.first_call}; {self.module_detail})"
            )
        if not self.outputs_equal:
            parts.append("the step's outputs (loss) differ")
        if self.differing_grads:
            parts.append(f"gradients differ in {', '.join(self.differing_grads[:4])}")
        if self.capture_queries:
            hint = (
                " - the model asked torch.cuda.is_current_stream_capturing() while the graphs "
                f"were captured and got True at {'; '.join(self.capture_queries[:3])}: that "
                "code runs another branch in the graph than in an eager step. Keep it out of "
                "the captured scopes (layerwise scopes that leave it eager), or make both "
                "branches compute the same (e.g. hand HuggingFace models a ready 4-D attention "
                "mask)"
            )
        elif self.first_module is None and self.outputs_equal:
            hint = (
                f" - the forward is bit-identical ({self.modules_checked} module outputs) and "
                "only gradients differ. With partial scopes the usual cause is a tensor that a "
                "captured module takes as input and that is also used outside it or by another "
                "captured module (a parallel attention + MLP block, attention reading the "
                "residual stream): autograd adds up that tensor's gradient in another order "
                "than in eager, with last-bit differences. Whole layers (no scopes) keep such "
                "sums inside one graph; otherwise a backward kernel differs (run with "
                "deterministic algorithms)"
            )
        else:
            hint = (
                " - the module's Python may take another branch under stream capture or pick "
                "other kernels: keep it out of the captured scopes, or run with deterministic "
                "algorithms"
            )
        return f"{self.what}: graphed != eager: " + "; ".join(parts) + hint + self.note


def equal_trees(a, b) -> bool:
    fa, sa = tree_flatten(a)
    fb, sb = tree_flatten(b)
    if sa != sb:
        return False
    for x, y in zip(fa, fb):
        if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            return False
        if isinstance(x, torch.Tensor):
            if x.shape != y.shape or x.dtype != y.dtype or not torch.equal(x, y):
                return False
        elif x != y:
            return False
    return True


def rng_state(device: torch.device):
    """The CPU generator's state, the device's default CUDA generator's and those of
    Megatron-Core's graph-safe RNG tracker (its forks draw dropout in tensor-parallel regions:
    diagnosis.py [Note: generator states of a graph])."""
    if device.type != "cuda":
        return torch.get_rng_state(), None, []
    return torch.get_rng_state(), torch.cuda.get_rng_state(device), snapshot_generator_states()


def set_rng_state(state, device: torch.device) -> None:
    """Back to a :func:`rng_state`."""
    cpu, cuda, tracker = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda, device)
    restore_generator_states(tracker)


def _coverage_note(recorder: ChecksumRecorder) -> str:
    notes = []
    if recorder.overflow:
        notes.append(f"{recorder.overflow} module calls beyond the checksum slots")
    if recorder.unsupported:
        notes.append(f"outputs not checksummed: {', '.join(sorted(recorder.unsupported)[:4])}")
    return f" ({'; '.join(notes)})" if notes else ""


def differing_tensors(eager: dict[str, torch.Tensor], graphed: dict[str, torch.Tensor]) -> list:
    """Keys whose tensors differ (``torch.equal``), and keys present in one run only (named
    so): a missing tensor is a difference, never compared with itself."""
    out = []
    for key in dict.fromkeys([*eager, *graphed]):
        a, b = eager.get(key), graphed.get(key)
        if a is None or b is None:
            out.append(f"{key} (only in the {'eager' if b is None else 'graphed'} run)")
        elif not torch.equal(a, b):
            out.append(key)
    return out


def verify_step(
    *,
    what: str,
    states,
    recorder: ChecksumRecorder,
    run_eager,
    run_graphed,
    graph_calls,
    device: torch.device,
    saved: GradState | None = None,
    after: GradState | None = None,
) -> tuple[VerifyResult, object]:
    """Run ``run_eager()`` and ``run_graphed()`` from the same state; compare them.

    Both return the step's outputs. Returns the result and the graphed run's outputs: the
    step counts as run once, graphed (its gradients stay). ``graph_calls()`` returns the
    runner's running totals ``(replays, eager fallbacks)``; their growth during
    ``run_graphed()`` says whether it replayed (else the result is not verified). ``saved``:
    the state to start from when the live one is not it (a full-iteration capture ran the
    step's Python, e.g. set ``accum_pending``, without running its kernels); default: the
    live state. ``after``: the Python side to leave behind (the capture's: a replay runs no
    Python).
    """
    grads = saved if saved is not None else GradState.save(states)
    grads.restore()
    rng = rng_state(device)
    recorder.reset_values()
    with recorder.recording("always"):
        out_eager = run_eager()
    order = list(recorder.order)
    sums_eager = recorder.snapshot()
    grads_eager = grads.grads_by_group(states)
    grads.restore()
    set_rng_state(rng, device)
    recorder.reset_values()
    replays0, fallbacks0 = graph_calls()
    with recorder.recording("always"):
        out_graphed = run_graphed()
    replays1, fallbacks1 = graph_calls()
    if after is not None:
        after.restore()
    sums_graphed = recorder.snapshot()
    grads_graphed = grads.grads_by_group(states)
    first = first_difference(order, sums_eager, sums_graphed)
    differing = differing_tensors(grads_eager, grads_graphed)
    outputs_equal = equal_trees(out_eager, out_graphed)
    result = VerifyResult(
        what=what,
        identical=False,
        outputs_equal=outputs_equal,
        differing_grads=differing,
        modules_checked=len(order),
        note=_coverage_note(recorder),
        replays=replays1 - replays0,
        fallbacks=fallbacks1 - fallbacks0,
    )
    result.identical = result.verified and first is None and not differing and outputs_equal
    if first is not None:
        result.first_module, result.first_call, result.module_detail = first
    return result, out_graphed
