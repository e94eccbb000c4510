"""The markers FSDP's hook methods carry for capture (hooks/module_hooks.py [Note: sentinel
hooks]).

The core (state.py) marks its hooks with them; the capture layer's hook transform
(hooks/module_hooks.py) reads them. A marker is the *name* of a method on the hook's owner:
the method to run around warmup and capture instead of the hook.
"""

from __future__ import annotations

BACKWARD_HANDLER = "_cuda_graph_backward_handler"
"""On a hook that only registers the post-backward handler: the handler method's name."""
BACKWARD_PRE_HANDLER = "_cuda_graph_backward_pre_handler"
"""On a hook that only registers the pre-backward handler: the handler method's name."""
CAPTURE_TIME_FN = "_capture_time_fn"
"""On any other FSDP hook: the owner's method to call as ``fn()`` at capture time."""


def mark(attr: str, handler_name: str):
    """Decorator for hook methods: set a sentinel naming the owner's capture-time method."""

    def decorate(fn):
        setattr(fn, attr, handler_name)
        return fn

    return decorate
