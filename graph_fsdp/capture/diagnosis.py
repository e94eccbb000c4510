"""Which module was running when a capture failed, and what the user can do about it.

[Note: capture failure diagnosis] torch reports a failed stream capture with the CUDA call
that broke it ("operation not permitted when stream is capturing", "Cannot copy between CPU
and CUDA tensors during CUDA graph capture", ...) and nothing about the model. While a
capture runs, :class:`ModuleTracker` keeps the stack of module forwards in flight (global
forward pre/post hooks, filtered to the captured model) and, for the backward, the last
module whose backward began (a pre-hook on the ``grad_fn`` of each module output). A layerwise
capture calls the captured module's original forward directly (no ``__call__``, no hooks):
it marks that call with :meth:`ModuleTracker.phase`, which keeps the place an exception left
it (the diagnosis runs after the capture code unwound). Both hooks are
installed only for the capture and removed in ``finally``; they do host bookkeeping only,
so nothing of them enters a graph. :func:`explain_capture_failure` turns the exception
into a :class:`CaptureFailedError` naming that module and the fix for the kind of failure.

[Note: capture-state queries] A capture that succeeds can still record other work than an
eager step runs: code that asks ``torch.cuda.is_current_stream_capturing()`` gets True only
while a graph is recorded, and may branch on it (HuggingFace transformers does, to keep its
attention-mask shortcut, which reads a tensor on the host, out of captures: the graph then
runs SDPA with a materialized mask where eager runs it with ``is_causal=True``). While the
tracker is active, that function (``torch.cuda`` and ``torch.cuda.graphs`` both export it)
is wrapped: each call outside torch and graph_fsdp that gets True records its call site and
two callers', with the module running (:attr:`ModuleTracker.capture_queries`, kept over the
tracker's life; code that bound the function to a name of its own at import is not seen).
A verification step that finds graphed != eager names these sites (verify.py), so the
report points at the line that branched, not only at the first module whose output differs.
Host bookkeeping only: nothing enters a graph.

[Note: RNG after a failed capture] torch marks each CUDA generator as capturing when a graph
capture begins and clears the mark when ``capture_end`` succeeds. A capture that fails at
its end (e.g. a side stream forked into it and left unjoined because an exception unwound
the step) never clears it: every later eager random op on that device (dropout) then fails
with "Offset increment outside graph capture encountered unexpectedly", far from the cause.
:func:`explain_capture_failure` (every failed capture goes through it) first ends an empty
capture on the device, which clears the mark of every generator a graph registers and
records nothing (its random offset increment is zero); eager random numbers then continue
from where they were before the failed capture, as if it had not run.
"""

from __future__ import annotations

import functools
import gc
import os
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.nn.modules.module import (
    register_module_forward_hook,
    register_module_forward_pre_hook,
)
from torch.utils._pytree import tree_flatten

from graph_fsdp.capture.scopes import GraphConfigError

_QUERY_OWNERS = (torch.cuda, torch.cuda.graphs)
"""Modules exporting ``is_current_stream_capturing`` (see [Note: capture-state queries])."""
_OURS = (
    os.path.dirname(torch.__file__) + os.sep,
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,
)
"""Directories of torch and graph_fsdp: their own capture checks are not the model's."""

_TAG = "graph_fsdp_module"
"""Key in ``grad_fn.metadata``: the innermost tracked module whose output the node made."""


class CaptureFailedError(RuntimeError):
    """A CUDA graph capture failed; the message names the running module and the fix."""

    def __init__(self, message: str, *, module: str | None, phase: str | None) -> None:
        super().__init__(message)
        self.module = module
        self.phase = phase


class ModuleTracker:
    """The innermost module forward in flight and the last module backward begun.

    ``names``: ``{id(module): fqn}`` of the modules to track (others are ignored).
    """

    def __init__(self, names: dict[int, str]) -> None:
        self.names = names
        self.stack: list[str] = []
        self.last_backward: str | None = None
        self.context: list[tuple[str, str]] = []
        self.failure: tuple[str | None, str | None] | None = None
        """Where an exception left a :meth:`phase` (kept: unwinding pops the phase)."""
        self.capture_queries: dict[str, str | None] = {}
        """Call site -> module running, of code outside torch and graph_fsdp that asked
        ``is_current_stream_capturing()`` during a capture and got True ([Note: capture-state
        queries])."""
        self._handles: list = []
        self._active = False

    @classmethod
    def for_model(cls, model: nn.Module) -> ModuleTracker:
        return cls({id(m): n or type(model).__name__ for n, m in model.named_modules()})

    @contextmanager
    def active(self) -> Iterator[ModuleTracker]:
        # Nothing from an earlier capture (a failed one leaves its stack behind).
        self.stack, self.context, self.last_backward, self.failure = [], [], None, None
        self._handles = [
            register_module_forward_pre_hook(self._pre_forward),
            register_module_forward_hook(self._post_forward),
        ]
        self._active = True
        originals = [(m, m.is_current_stream_capturing) for m in _QUERY_OWNERS]
        for owner, original in originals:
            owner.is_current_stream_capturing = self._watched(original)
        try:
            yield self
        finally:
            for owner, original in originals:
                owner.is_current_stream_capturing = original
            for h in self._handles:
                h.remove()
            self._handles = []
            self._active = False

    def _watched(self, original):
        @functools.wraps(original)
        def is_current_stream_capturing() -> bool:
            capturing = original()
            if capturing:
                self._note_query(sys._getframe(1))
            return capturing

        return is_current_stream_capturing

    def _note_query(self, frame) -> None:
        if frame.f_code.co_filename.startswith(_OURS):
            return  # torch's or our own check: not a branch of the model
        # The asking line and two callers: helpers wrap the query (transformers:
        # is_cuda_stream_capturing <- is_tracing <- the mask code that branches).
        sites = []
        while frame is not None and len(sites) < 3:
            sites.append(_site(frame))
            frame = frame.f_back
        self.capture_queries.setdefault(" <- ".join(sites), self._current()[0])

    @contextmanager
    def phase(self, name: str, kind: str) -> Iterator[None]:
        """What the capture code itself runs (a layerwise callable's forward or backward),
        for modules whose ``__call__`` is bypassed (hooks do not see them).

        An exception leaving the phase records where it happened (:attr:`failure`) before
        the phase is popped: the diagnosis runs after the capture code unwound, when the
        phase alone no longer says which module was running.
        """
        self.context.append((name, kind))
        self.last_backward = None  # a backward begun in an earlier phase is not this one's
        self.failure = None  # a new phase began: an earlier exception was handled
        try:
            yield
        except BaseException:
            if self.failure is None:  # the innermost phase the exception left
                self.failure = self._current()
            raise
        finally:
            self.context.pop()

    def _pre_forward(self, module: nn.Module, args) -> None:
        name = self.names.get(id(module))
        if name is not None:
            self.stack.append(name)

    def _post_forward(self, module: nn.Module, args, output) -> None:
        name = self.names.get(id(module))
        if name is None:
            return
        if self.stack and self.stack[-1] == name:
            self.stack.pop()
        for t in tree_flatten(output)[0]:
            node = t.grad_fn if isinstance(t, torch.Tensor) else None
            # A node that is also an inner module's output keeps the inner (first) name. No
            # handle is kept (it would keep the node and its saved tensors alive): the hook
            # dies with the node and does nothing once the tracker is inactive.
            if node is not None and _TAG not in node.metadata:
                node.metadata[_TAG] = name
                node.register_prehook(self._backward_hook(name))

    def _backward_hook(self, name: str):
        def hook(grad_outputs):
            if self._active:
                self.last_backward = name

        return hook

    def running(self) -> tuple[str | None, str | None]:
        """``(module fqn, "forward" | "backward")`` of what ran last, innermost first; after
        an exception left a phase, where it was raised."""
        if self.failure is not None:
            return self.failure
        return self._current()

    def _current(self) -> tuple[str | None, str | None]:
        if self.stack:
            return self.stack[-1], "forward"
        if self.last_backward is not None and self.context and self.context[-1][1] == "backward":
            return self.last_backward, "backward"
        if self.context:
            return self.context[-1]
        if self.last_backward is not None:
            return self.last_backward, "backward"
        return None, None


def _site(frame, line: int | None = None) -> str:
    """``path:line in function`` (``line``: default the frame's current one), the path from
    its package down (site-packages cut off)."""
    path = frame.f_code.co_filename
    for marker in ("site-packages" + os.sep, "dist-packages" + os.sep):
        if marker in path:
            path = path.rsplit(marker, 1)[1]
            break
    return f"{path}:{frame.f_lineno if line is None else line} in {frame.f_code.co_name}"


_NOT_MODEL_CODE = ("torch", "graph_fsdp", "contextlib", "functools")
"""Modules whose frames a capture-failure site skips: the model's own line is the one to fix."""


def _failing_line(err: BaseException) -> str | None:
    """``path:line in function`` of the innermost frame of ``err``'s traceback in model code
    (not torch, graph_fsdp or the standard helpers around them)."""
    site = None
    tb = err.__traceback__
    while tb is not None:
        name = tb.tb_frame.f_globals.get("__name__", "")
        if name.split(".", 1)[0] not in _NOT_MODEL_CODE:
            site = _site(tb.tb_frame, tb.tb_lineno)
        tb = tb.tb_next
    return site


_CAUSES = (
    (
        ("cannot copy between cpu and cuda",),
        "a CPU<->GPU copy: a tensor made on the CPU and moved to the GPU (torch.tensor(...)"
        ".cuda(), .to(device) of a host value), or .cpu()/.tolist() of a GPU tensor - make such "
        "tensors once on the device outside the step, or keep the module eager",
    ),
    (
        ("synchroniz", ".item()", "is_nonzero", "nonzero", "local_scalar"),
        "a host synchronization: .item(), bool(tensor) / an `if` on a tensor, .nonzero(), "
        "torch.cuda.synchronize() or printing a tensor - the host cannot read GPU values "
        "while a graph is recorded",
    ),
    (
        ("not permitted when stream is capturing", "capture", "invalidated"),
        "work the capture cannot record: a host synchronization (.item(), an `if` on a tensor, "
        ".nonzero(), boolean-mask indexing), a data-dependent (dynamic) shape, a CPU<->GPU copy, "
        "or an operation on another stream that was not joined",
    ),
)


_MEGATRON_RNG = os.path.join("megatron", "core", "tensor_parallel", "random.py")
"""Megatron-Core's CUDA RNG tracker (``get_cuda_rng_tracker().fork()``)."""

MEGATRON_RNG_FIX = (
    "Megatron-Core's default CUDA RNG tracker, whose fork() reads and sets the CUDA "
    "generator's state (torch.cuda.get_rng_state / set_rng_state), which torch refuses during "
    "graph capture - use its graph-safe tracker: call "
    "megatron.core.tensor_parallel.model_parallel_cuda_manual_seed(seed, "
    "use_cudagraphable_rng=True, force_reset_rng=True) after building the model and before "
    "the first step (graph_fsdp.integrations.megatron.build_gpt does)"
)
"""[Note: Megatron's RNG tracker under capture] Megatron-Core's layers fork its CUDA RNG tracker
in forward (e.g. around attention dropout, even with dropout 0). The default tracker swaps
generator states through get/set_rng_state, host reads of the generator that torch forbids
inside a capture; the graph-safe one (``use_cudagraphable_rng=True``) swaps registered
generator states, which graphs record. A capture that fails inside the tracker's code is
reported with this fix rather than the generic host-synchronization cause."""


def _rng_cause(chain: list[BaseException], low: str) -> str | None:
    """The fix for a capture that failed on a random-number generator's state: Megatron's
    default RNG tracker (a frame of its code in a traceback), or any code reading or
    setting a CUDA generator's state (torch's message)."""
    for e in chain:
        tb = e.__traceback__
        while tb is not None:
            if tb.tb_frame.f_code.co_filename.endswith(_MEGATRON_RNG):
                return MEGATRON_RNG_FIX
            tb = tb.tb_next
    if "cudageneratorimpl" in low:
        if _megatron_default_tracker_in_use():
            return MEGATRON_RNG_FIX
        return (
            "reading or setting a CUDA generator's state (torch.cuda.get_rng_state / "
            "set_rng_state / manual_seed, or an RNG tracker that uses them) - seed outside "
            "the captured step, or switch states with the graph-safe "
            "Generator.graphsafe_get_state / graphsafe_set_state"
        )
    return None


def _megatron_default_tracker_in_use() -> bool:
    """Megatron-Core's RNG tracker holds states and is not the graph-safe one (read without
    creating a tracker; False where megatron-core is not loaded)."""
    random = sys.modules.get("megatron.core.tensor_parallel.random")
    tracker = getattr(random, "_CUDA_RNG_STATE_TRACKER", None)
    try:
        return bool(tracker.is_initialized()) and not random.is_graph_safe_cuda_rng_tracker(tracker)
    except Exception:  # noqa: BLE001 - another megatron-core version: no guess
        return False


# [Note: generator states of a graph] A capture records the philox seed and offset of every
# CUDA generator state it draws from; torch registers the default generator's state with each
# graph, and refuses an offset increment ("Attempt to increase offset for a CUDA generator not
# in capture mode") on any other. Megatron-Core's graph-safe RNG tracker switches the default
# generator to its own states (``graphsafe_set_state``) inside forward - TransformerEngine's
# fused attention draws from the "model-parallel-rng" state under tensor parallelism - so, as
# Megatron's own graphs do, every graph registers the tracker's states before its capture,
# and a replay advances them as the eager step would. Where a step runs twice and the
# generators are put back in between (layerwise warmups before a capture, a verification's
# eager run), the tracker's states are put back with the default generator's (verify.py
# ``rng_state``), or the graphed run would draw other dropout masks than its eager twin.
def megatron_generator_states() -> list:
    """The states of Megatron-Core's graph-safe RNG tracker ([Note: generator states of a
    graph]); empty where megatron-core is not loaded or its tracker is not graph-safe."""
    random = sys.modules.get("megatron.core.tensor_parallel.random")
    if random is None or not getattr(random, "_CUDA_RNG_STATE_TRACKER_INITIALIZED", False):
        return []
    try:
        if not random.is_graph_safe_cuda_rng_tracker(random.get_cuda_rng_tracker()):
            return []
        return list(random.get_all_rng_states().values())
    except Exception:  # noqa: BLE001 - another megatron-core version: register nothing
        return []


def snapshot_generator_states() -> list[tuple]:
    """``(generator, state)`` of each of the RNG tracker's states, for
    :func:`restore_generator_states` after a step ran twice ([Note: generator states of a
    graph])."""
    return [(g, g.get_state()) for g in megatron_generator_states()]


def restore_generator_states(snapshot: list[tuple]) -> None:
    for generator, state in snapshot:
        generator.set_state(state)


def new_cuda_graph() -> torch.cuda.CUDAGraph:
    """A ``torch.cuda.CUDAGraph`` with the RNG tracker's generator states registered
    ([Note: generator states of a graph])."""
    graph = torch.cuda.CUDAGraph()
    for state in megatron_generator_states():
        graph.register_generator_state(state)
    return graph


def _chain(err: BaseException) -> list[BaseException]:
    """``err`` and the exceptions it was raised from or during (torch's graph context can
    replace the original error with a capture-end error)."""
    out, seen = [], set()
    e: BaseException | None = err
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        out.append(e)
        e = e.__cause__ or e.__context__
    return out


@contextmanager
def no_collection() -> Iterator[None]:
    """Python's garbage collector off for the block ([Note: no garbage collection during a
    capture]); back to what it was after."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


CAPTURE_ERROR_MODE = "thread_local"
"""``capture_error_mode`` of every capture graph_fsdp makes ([Note: no garbage collection
during a capture])."""


def release_generators() -> None:
    """Clear the capturing mark a failed capture left on the current device's CUDA
    generators ([Note: RNG after a failed capture]); nothing changes after a capture that
    ended."""
    if not torch.cuda.is_initialized():
        return  # nothing was captured
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "the CUDA Graph is empty"
        graph = new_cuda_graph()  # the RNG tracker's states, marked by the failed capture too
        with torch.cuda.stream(torch.cuda.Stream()):
            graph.capture_begin(capture_error_mode=CAPTURE_ERROR_MODE)
            graph.capture_end()
        del graph


def explain_capture_failure(
    err: BaseException, tracker: ModuleTracker, *, what: str, layerwise: bool
) -> Exception:
    """A :class:`CaptureFailedError` for ``err``, raised while capturing ``what`` (a
    :class:`GraphConfigError` graph_fsdp raised during the capture as it is); the CUDA
    generators are usable again ([Note: RNG after a failed capture])."""
    try:
        release_generators()
        unreleased = ""
    except Exception as exc:  # noqa: BLE001 - the diagnosis of ``err`` comes first
        unreleased = (
            f" (the CUDA generators could not be released: {exc}; random ops on this device "
            "may fail until the process restarts)"
        )
    chain = _chain(err)
    if isinstance(chain[-1], GraphConfigError):
        # graph_fsdp's own refusal raised during the capture (it names its cause and fix)
        return type(chain[-1])(f"{chain[-1]}{unreleased}")
    low = "\n".join(str(e) for e in chain).lower()
    cause = _rng_cause(chain, low) or next(
        (hint for keys, hint in _CAUSES if any(k in low for k in keys)),
        "an operation CUDA graphs cannot record",
    )
    module, phase = tracker.running()
    root = chain[-1]  # the first error; the later ones are consequences
    line = _failing_line(root)
    if module:
        where = f"while the {phase} of {module} was running"
    elif layerwise:
        where = "outside the captured modules (in FSDP's capture-time hooks or the backend)"
    else:
        where = "outside every module of the model (in the step function itself)"
    where += f", at {line}" if line else ""
    if layerwise:
        move = (
            "capture less: pick scopes that leave that module eager (e.g. scopes=['attn'] or "
            "scope_modules={'attn': 'self_attn'}), or cuda_graph_impl='none'"
        )
    else:
        move = (
            "use layerwise graphs instead of full_iteration (LayerwiseGraphs / --cuda-graph-scope "
            "attn mlp ...) with that module outside the captured scopes, or run it eagerly"
        )
    lines = str(root).strip().splitlines()
    first = f"{type(root).__name__}: {lines[0] if lines else ''}"
    return CaptureFailedError(
        f"CUDA graph capture of {what} failed {where}: {first}. "
        f"Likely cause: {cause}. Fix the model there, or {move}.{unreleased}",
        module=module,
        phase=phase,
    )
