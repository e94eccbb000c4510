"""From a ``BufferPolicy`` to the allocator a root's units draw their buffers from.

The one place the core maps the policy's allocator names to ``buffers/``'s classes, and says
which buffer roles of a group (param_group.py's allocator keys) are used in order on one
stream: ``buffers/`` knows sizes, dtypes, roles and streams, never a policy or a config.
"""

from __future__ import annotations

from graph_fsdp.buffers.allocator import BufferAllocator, DynamicAllocator
from graph_fsdp.buffers.double_buffer import DoubleBufferAllocator
from graph_fsdp.buffers.trace_pool import TracePoolAllocator
from graph_fsdp.fsdp.api import BufferPolicy


def make_allocator(policy: BufferPolicy) -> BufferAllocator:
    if policy.allocator == "double_buffer":
        return DoubleBufferAllocator(
            num_slots=policy.num_slots,
            persist_on_alloc_fail=policy.persist_on_alloc_fail,
            # Copied into, reduced and released on the reduce-scatter stream, in order.
            serial_roles=("grad_comm", "rs_out"),
        )
    if policy.allocator == "trace_pool":
        return TracePoolAllocator(persist_on_alloc_fail=policy.persist_on_alloc_fail)
    return DynamicAllocator()
