"""Graph runners' lifetime: ``close()``, a registry of live runners and a shutdown guard.

[Note: graphs and process-group teardown] A CUDA graph that captured NCCL collectives keeps
a reference on the communicator (NCCL retains it through CUDA user objects owned by the
graph), and ``ncclCommDestroy``/``ncclCommAbort`` wait for it: a script ending with
``dist.destroy_process_group()`` while a ``FullIterationGraphs`` still holds its graphs (often
in reference cycles that only the garbage collector breaks) hangs in that call. So every
runner frees its graphs explicitly - ``graph.reset()``, then drops the objects and the memory
pool - in ``close()``; live runners are tracked in a weak registry, and importing
``graph_fsdp.capture`` wraps ``torch.distributed.destroy_process_group`` (once) so that it
closes the runners of the group first, and registers an ``atexit`` hook doing the same.
"""

from __future__ import annotations

import atexit
import functools
import gc
import types
import warnings
import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from graph_fsdp.fsdp.state import refuse_offloaded

_RUNNERS: weakref.WeakSet = weakref.WeakSet()
_GUARD_ATTR = "_graph_fsdp_shutdown_guard"


class RunnerLifecycle:
    """Mixin of the graph runners: registration, ``close()`` and the context manager.

    Subclasses implement ``_free_graphs()`` (reset and forget every graph, give the modules
    back their eager behaviour); ``close()`` makes it idempotent and unregisters the runner.
    """

    closed = False
    owns_optimizer_step = False
    """True for a runner whose captured step also reduces, clips and steps the optimizer (the
    loop then calls it once per step with every microbatch, and steps nothing itself)."""

    def close(self) -> None:
        """Free every CUDA graph and its memory pool and restore the modules (idempotent).

        The model keeps training eagerly afterwards; this runner cannot capture again.
        """
        if self.closed:
            return
        self.closed = True
        _RUNNERS.discard(self)
        for state in getattr(self, "states", None) or ():
            state.graph_runners.discard(self)
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()  # no replay may still run on what is freed below
        self._free_graphs()

    @property
    def _groups(self) -> list:
        """Every parameter group of the runner's units (``self.states``)."""
        return [g for s in getattr(self, "states", None) or () for g in s.groups]

    @property
    def _allocator(self):
        """The root unit's buffer allocator (None before the root's lazy init)."""
        root = self.states[0].root
        return root.allocator if root is not None else None

    def _register_with_units(self) -> None:
        """The last step of a runner's ``__init__``: register with every unit of
        ``self.states`` (offload suspends a unit's runners before it moves the buffers their
        graphs address: offload.py [Note: CUDA graphs across offload]) and as a live runner.
        Live graphs keep NCCL communicators alive, so from the first runner on
        ``destroy_process_group`` closes the runners first (:func:`install_shutdown_guard`).
        A runner whose ``__init__`` raised is neither: there is nothing to close."""
        for state in self.states:
            state.graph_runners.add(self)
        install_shutdown_guard()
        _RUNNERS.add(self)

    def _free_graphs(self) -> None:
        raise NotImplementedError

    @contextmanager
    def eagerly(self) -> Iterator[None]:
        """Inside, the model's forward+backward runs eagerly, outside every graph, and the
        graphs replay again after it (no recapture, not counted as eager fallbacks): the
        repeat of a step whose dropless exchange overflowed (parallel/dropless_ep.py [Note:
        dropless overflow reports]). The runners whose graphs hold the optimizer step too run
        their own eager step instead (``WholeStep.eagerly``)."""
        yield

    def _check_open(self) -> None:
        """Before a step: the runner is open and its model's state is on the device (with
        addresses kept, offload leaves the graphs in place over released memory: a replay
        now would read unmapped addresses)."""
        if self.closed:
            raise RuntimeError(
                f"{type(self).__name__} was closed (close(), its context manager, or "
                "destroy_process_group): create a new runner to capture again"
            )
        states = getattr(self, "states", None)
        root = states[0].root if states else None
        if root is not None and root.offloaded:
            refuse_offloaded(root, f"a {type(self).__name__} step")

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def reset_graphs(graphs: Iterable[torch.cuda.CUDAGraph | None]) -> None:
    """``reset()`` each graph: frees its executable (and the NCCL references it holds) and
    its share of the memory pool now, not whenever the object happens to be collected."""
    for graph in graphs:
        if graph is not None:
            graph.reset()


def find_graphs(root: object, max_depth: int = 10) -> list[torch.cuda.CUDAGraph]:
    """CUDA graphs reachable from ``root`` (e.g. the module TransformerEngine returned, whose
    graphs live in closures of the classes it made): a bounded walk over attributes,
    containers and closures that never enters torch's or Python's own modules."""
    found: dict[int, torch.cuda.CUDAGraph] = {}
    seen: set[int] = set()
    frontier = [root]
    for _ in range(max_depth):
        nxt: list = []
        for obj in frontier:
            if id(obj) in seen or isinstance(obj, _LEAVES):
                continue
            seen.add(id(obj))
            if isinstance(obj, torch.cuda.CUDAGraph):
                found[id(obj)] = obj
            else:
                nxt.extend(_children(obj))
        frontier = nxt
    return list(found.values())


_LEAVES = (torch.Tensor, str, bytes, int, float, bool, type(None), types.ModuleType)


def _children(obj: object) -> list:
    if isinstance(obj, dict):
        return list(obj.values())
    if isinstance(obj, list | tuple | set | frozenset):
        return list(obj)
    if isinstance(obj, types.FunctionType):
        cells = obj.__closure__ or ()
        out = []
        for cell in cells:
            try:
                out.append(cell.cell_contents)
            except ValueError:  # an empty cell
                pass
        return out + list(obj.__defaults__ or ())
    if isinstance(obj, types.MethodType):
        return [obj.__func__, obj.__self__]
    if isinstance(obj, staticmethod | classmethod):
        return [obj.__func__]
    if isinstance(obj, functools.partial):
        return [obj.func, obj.args, obj.keywords]
    if isinstance(obj, type):
        if obj.__module__.split(".")[0] in ("torch", "builtins", "typing", "abc"):
            return []
        return list(vars(obj).values())
    try:
        return list(vars(obj).values())
    except TypeError:
        return []


def live_runners() -> list[RunnerLifecycle]:
    """Runners created and not yet closed or collected."""
    return [r for r in list(_RUNNERS) if not r.closed]


def _runner_groups(runner: RunnerLifecycle) -> list:
    """The process groups the runner's graphs may hold communicators of: the data-parallel
    group, and the expert-data-parallel and expert-parallel groups (the model's token
    dispatch runs over the latter; experts.py [Note: expert groups]), and the all-gathers'
    own (comm.py [Note: a communicator for the all-gathers])."""
    states = getattr(runner, "states", None)
    if not states:
        return []
    found = [states[0].comm.group, states[0].comm.gather_group]
    for state in states:
        for group in state.groups:
            found += [group.comm.group, group.comm.gather_group]
            if group.expert is not None:
                found.append(group.expert.ep)
    return list({id(pg): pg for pg in found}.values())


def close_live_runners(group: dist.ProcessGroup | None = None) -> int:
    """Close the live runners (of ``group``; all of them for None or WORLD); returns how many.

    A runner that fails to close is reported as a warning: shutdown must go on.
    """
    gc.collect()  # runners only reachable from cycles are still in the registry: close them
    world = dist.group.WORLD if dist.is_initialized() else None
    closed = 0
    for runner in live_runners():
        if (
            group is not None
            and group is not world
            and all(g is not group for g in _runner_groups(runner))
        ):
            continue
        try:
            runner.close()
            closed += 1
        except Exception as exc:  # noqa: BLE001 - report and continue the shutdown
            warnings.warn(
                f"graph_fsdp: closing {type(runner).__name__} before process-group teardown "
                f"failed: {exc!r}",
                stacklevel=2,
            )
    if closed:
        gc.collect()
    return closed


def _guarded(original):
    @functools.wraps(original)
    def destroy_process_group(*args, **kwargs):
        group = kwargs.get("group", args[0] if args else None)
        close_live_runners(group)
        return original(*args, **kwargs)

    setattr(destroy_process_group, _GUARD_ATTR, True)
    return destroy_process_group


def install_shutdown_guard() -> None:
    """Make ``torch.distributed.destroy_process_group`` close live graph runners first, and
    close them at interpreter exit. Idempotent; the original function still does the work."""
    for module in (dist, c10d):
        current = getattr(module, "destroy_process_group", None)
        if current is not None and not getattr(current, _GUARD_ATTR, False):
            module.destroy_process_group = _guarded(current)
    if not getattr(install_shutdown_guard, "_atexit_done", False):
        atexit.register(close_live_runners)
        install_shutdown_guard._atexit_done = True
