"""What a benchmark row may claim: its own peak memory, and that its graphs replayed.

Shared by ``graph-fsdp bench`` (bench/runner.py) and its Megatron-Core rows
(bench/megatron.py).

[Note: a row's own peak] The rows of one launch run back to back in the same processes, so
a row starts with whatever earlier rows left: cached workspaces, objects still referenced,
graph pools of graphs still alive. Before a row, :meth:`RowMemory.start` collects garbage
(graph runners and models in reference cycles die here, and their graphs' private pools
with them), empties the caching allocator's cache (segments no live block uses go back to
the driver), resets the peak counters and reads ``memory_allocated`` / ``memory_reserved``.
The row's own peaks are the process peaks during the row minus those starting values:
``own allocated = max_memory_allocated - start allocated`` and ``own reserved =
max_memory_reserved - start reserved``. What this leaves out, and how much:

- cuBLAS keeps a workspace per handle and stream that ran a GEMM (32 MiB each on H100/H200
  with ``CUBLAS_WORKSPACE_CONFIG=:4096:8``; the forward's thread and autograd's have a handle
  each) for the process's lifetime. :meth:`RowMemory.start` clears them, so every row pays
  for the workspaces it makes, as a process running that row alone would: an eager row its
  stream's, a graphed row its eager steps' and its capture stream's. (Clearing is safe only
  between rows: no graph of an earlier row replays again; a live graph replays into the
  workspace it was captured with - capture/pools.py [Note: capture memory].) Other lifetime
  bytes - TransformerEngine's workspace, NCCL's buffers - count for the first row that makes
  them only;
- a row can place blocks in free space inside segments the leftovers hold instead of
  reserving segments for them: its own reserved peak can be low by up to that free space,
  ``start reserved - start allocated`` (reported as ``start_reserved_slack_bytes``; after
  ``empty_cache`` only segments with a live block remain), plus the rounding of each segment
  it then did not create (the caching allocator reserves 2 MiB for blocks up to 1 MiB,
  20 MiB for blocks up to 10 MiB, larger ones rounded up to 2 MiB).

For graphed rows peak *allocated* is the wrong measure of what the step needs: a replay does
not call the allocator, so what a graph uses in its private pool is never counted as
allocated (only its capture's allocations are); peak *reserved* holds the pools. Every row
reports both.

[Note: graphed rows must replay] A graphed row is only a graphed time if its graphs
replayed: :func:`graph_verdict` marks the row failed - no time reported - when its runner
reports no graphs, zero replays, fewer replays than timed steps, any eager fallback of a
captured module, or communication graphs that failed (or were lent and never replayed).
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import Protocol

import torch


class MemoryCounters(Protocol):
    """The allocator counters a row's memory is read from (torch.cuda's, on one device)."""

    def memory_allocated(self) -> int: ...
    def memory_reserved(self) -> int: ...
    def max_memory_allocated(self) -> int: ...
    def max_memory_reserved(self) -> int: ...
    def reset_peak_memory_stats(self) -> None: ...
    def clear_workspaces(self) -> None: ...
    def empty_cache(self) -> None: ...


class CudaCounters:
    """``torch.cuda``'s caching-allocator counters of ``device``."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def memory_allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def memory_reserved(self) -> int:
        return torch.cuda.memory_reserved(self.device)

    def max_memory_allocated(self) -> int:
        return torch.cuda.max_memory_allocated(self.device)

    def max_memory_reserved(self) -> int:
        return torch.cuda.max_memory_reserved(self.device)

    def reset_peak_memory_stats(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def clear_workspaces(self) -> None:
        torch.cuda.synchronize(self.device)
        clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear is not None:
            clear()

    def empty_cache(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()


MEMORY_KEYS = (
    "own_peak_allocated_bytes",
    "own_peak_reserved_bytes",
    "start_allocated_bytes",
    "start_reserved_bytes",
    "process_peak_allocated_bytes",
    "process_peak_reserved_bytes",
)
"""A row's memory fields (JSON), each the max over ranks; see [Note: a row's own peak]."""


@dataclass
class RowMemory:
    """One row's memory window (see [Note: a row's own peak])."""

    start_allocated: int
    start_reserved: int
    peak_allocated: int = 0
    peak_reserved: int = 0

    @classmethod
    def start(cls, counters: MemoryCounters) -> RowMemory:
        gc.collect()
        counters.clear_workspaces()  # between rows only: [Note: a row's own peak]
        counters.empty_cache()
        counters.reset_peak_memory_stats()
        return cls(counters.memory_allocated(), counters.memory_reserved())

    def stop(self, counters: MemoryCounters) -> RowMemory:
        self.peak_allocated = counters.max_memory_allocated()
        self.peak_reserved = counters.max_memory_reserved()
        return self

    def values(self) -> list[int]:
        """The values of :data:`MEMORY_KEYS`, in order."""
        return [
            self.peak_allocated - self.start_allocated,
            self.peak_reserved - self.start_reserved,
            self.start_allocated,
            self.start_reserved,
            self.peak_allocated,
            self.peak_reserved,
        ]


def memory_fields(values: list[float]) -> dict:
    """:data:`MEMORY_KEYS` -> bytes (ints), plus ``start_reserved_slack_bytes``."""
    out = {k: int(v) for k, v in zip(MEMORY_KEYS, values, strict=True)}
    out["start_reserved_slack_bytes"] = out["start_reserved_bytes"] - out["start_allocated_bytes"]
    return out


# --------------------------------------------------------------------------------------------
# Did the graphs replay?
# --------------------------------------------------------------------------------------------

COMM_INSIDE = "inside the step graph"
"""The collectives are recorded in the step's graph (full_iteration, FSDP2 + graph)."""
COMM_NONE = "none (no collectives)"


def comm_status(report: dict, requested: bool) -> tuple[str, bool]:
    """(status, failed) of a runner's communication graphs (comm_graphs.py [Note:
    communication graphs]): ``requested`` is ``GraphPolicy.comm_graphs``."""
    if "comm_status" in report:  # a runner that says it itself (the step graphs of peers)
        return report["comm_status"], False
    if "full_iteration" in report.get("scopes", ()):
        return COMM_INSIDE, False
    if not requested:
        return "off", False
    comm = report.get("comm_graphs")
    if comm is None:
        return "not lent (one rank, or not NCCL)", False
    if comm.get("failed"):
        return f"failed: {comm['failed']}", True
    if comm["replays"] == 0:
        return f"none replayed ({comm['eager_calls']} eager calls)", True
    return (
        f"{comm['graphs']} graphs, {comm['replays']} replays, {comm['eager_calls']} eager calls",
        False,
    )


def graph_verdict(
    report: dict | None, *, timed_steps: int, comm_requested: bool = True
) -> tuple[dict, str | None]:
    """A graphed row's graph fields and why it fails (None: it replayed as it claims).

    ``report``: the runner's ``report()`` (``captures``, ``replays``, ``eager_fallbacks``,
    ``comm_graphs``, ``scopes``), None when it reported none.
    """
    if report is None:
        return {"graphs": "no report"}, "NOT GRAPHED: no graph report (it may have run eagerly)"
    comm, comm_failed = comm_status(report, comm_requested)
    fields = {
        "graph_captures": report.get("captures", 0),
        "graph_replays": report.get("replays", 0),
        "graph_eager_fallbacks": report.get("eager_fallbacks", 0),
        "comm_graphs": comm,
    }
    replays, fallbacks = fields["graph_replays"], fields["graph_eager_fallbacks"]
    if replays == 0:
        return fields, "NOT GRAPHED: 0 replays (every step ran eagerly)"
    if fallbacks:
        return fields, f"FELL BACK: {fallbacks} calls of captured modules ran eagerly"
    if replays < timed_steps:
        return fields, (
            f"NOT GRAPHED: {replays} replays over {timed_steps} timed steps (some timed steps "
            "ran eagerly)"
        )
    if comm_failed:
        return fields, f"COMMUNICATION GRAPHS {comm}"
    return fields, None


def graph_label(row: dict) -> str:
    """``captures/replays/fallbacks`` and the communication graphs, for a table cell."""
    if "graph_replays" not in row:
        return "-" if "graphs" not in row else str(row["graphs"])
    counts = f"{row['graph_captures']}/{row['graph_replays']}/{row['graph_eager_fallbacks']}"
    return f"{counts}, comm {row['comm_graphs']}"
