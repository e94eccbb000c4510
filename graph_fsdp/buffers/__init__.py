"""Static-address buffers: one allocator interface, three implementations."""

from graph_fsdp.buffers.allocator import (
    BACKWARD_ROLES,
    BufferAllocator,
    DynamicAllocator,
    SlotReuseError,
)
from graph_fsdp.buffers.double_buffer import DoubleBufferAllocator
from graph_fsdp.buffers.layout import FlatLayout
from graph_fsdp.buffers.trace_pool import TracePoolAllocator, plan_slots

__all__ = [
    "BACKWARD_ROLES",
    "BufferAllocator",
    "DoubleBufferAllocator",
    "DynamicAllocator",
    "FlatLayout",
    "SlotReuseError",
    "TracePoolAllocator",
    "plan_slots",
]
