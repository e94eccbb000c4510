"""What the CUDA-graph tools are doing with one root's units, in the one place the core reads it.

[Note: capture context] FSDP's core (state.py, param_group.py, reduce.py) does not know which
tool captures it. A root owns one ``CaptureContext`` (``RootContext.capture``, shared by
every group under it as ``group.capture``); a capture tool (capture/) switches the core's
behaviour only through it and through the public methods of states and groups, and the core
only reads it:

- ``capturing_layers`` (``layerwise_capture()``): layerwise warmup and capture run FSDP's
  handlers around each callable, but the gradients they see are the capture's: each unit's
  post-backward frees its unsharded gradients instead of reducing them, and the final
  callback exposes no sharded ``.grad``. The once-per-backward guards are cleared after it
  (``reset_backward_guards``).
- ``refresh_weights`` (``refreshing_weights()``): a full-iteration capture records the main ->
  compute weight copy at every gather (the optimizer updates the main weights between
  replays, outside the graph), and its verification's eager run does the same.
- ``comm_graphs`` (``lend_comm_graphs``): a layerwise runner's communication graphs, through
  which every group gathers and reduces (capture/comm_graphs.py [Note: communication graphs]).
- ``forget_events()``: a whole-step capture starts and ends with no stream event pending
  (full_iteration.py [Note: full-iteration capture]).

Per unit, a replay that runs the unit's handlers itself takes them with the state's
``hand_handlers_to_replay``/``take_handlers_back`` (state.py [Note: forward handlers in the
dispatcher]). Every switch is restored in ``finally`` (a failed capture leaves eager FSDP).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Protocol


class _Allocator(Protocol):
    """The root's ``BufferAllocator`` (buffers/allocator.py), as far as the context uses it."""

    def forget_events(self) -> None: ...


class _Group(Protocol):
    """What the context switches in a ``FlatParamGroup`` (param_group.py imports this file)."""

    ag_event: object

    def pin_main_grad(self) -> None: ...


class _Unit(Protocol):
    """What the context switches in an ``FSDPState`` (state.py imports this file)."""

    groups: Sequence[_Group]

    def reset_backward_guards(self) -> None: ...


class CommGraphRunner(Protocol):
    """What a group asks of the communication graphs a capture tool lends (comm_graphs.py)."""

    def run(self, key: Hashable, owner: Hashable, fn: Callable[[], None]) -> None:
        """Run the kernels ``fn`` queues on the current stream, as a graph when it can."""


class CaptureContext:
    """The capture switches of one root's units ([Note: capture context])."""

    def __init__(self, states: Sequence[_Unit] = (), allocator: _Allocator | None = None) -> None:
        self._states = states
        self._allocator = allocator
        self.capturing_layers = False
        """A layerwise warmup/capture runs: post-backward frees the gradients unreduced."""
        self.refresh_weights = False
        """Every gather casts the main weights (a full-iteration capture records the copy)."""
        self.comm_graphs: CommGraphRunner | None = None
        """The communication graphs lent to every group; None: every collective eager."""
        self.reductions: list | None = None
        """While a whole-step body records them (:meth:`recording_reductions`): per gradient
        reduction, ``(group, event)`` in the order they were queued - the event recorded
        on the reduce-scatter stream after it, None where it ends on another stream
        (grad_norm.py [Note: the norm beside the last reduction])."""

    def layerwise_capture(self) -> AbstractContextManager[None]:
        return self._switched_on("capturing_layers")

    def refreshing_weights(self) -> AbstractContextManager[None]:
        return self._switched_on("refresh_weights")

    @contextmanager
    def _switched_on(self, switch: str) -> Iterator[None]:
        """``switch`` (a bool attribute) on for the block, off after it, whatever happens."""
        setattr(self, switch, True)
        try:
            yield
        finally:
            setattr(self, switch, False)

    @contextmanager
    def recording_reductions(self) -> Iterator[list]:
        """The block's gradient reductions, in order (:attr:`reductions`)."""
        self.reductions = []
        try:
            yield self.reductions
        finally:
            self.reductions = None

    def lend_comm_graphs(self, graphs: CommGraphRunner) -> None:
        self.comm_graphs = graphs

    def take_comm_graphs_back(self) -> None:
        self.comm_graphs = None

    def forget_events(self) -> None:
        """After a device synchronize, around a whole-step capture: the events recorded outside
        it (slot hand-offs, pending gathers) cannot be waited on inside it, and those recorded
        inside belong to the graph once it ends."""
        if self._allocator is not None:
            self._allocator.forget_events()
        for state in self._states:
            for group in state.groups:
                group.ag_event = None

    def reset_backward_guards(self) -> None:
        """Let every unit's backward handlers run again (after a capture ran them)."""
        for state in self._states:
            state.reset_backward_guards()
