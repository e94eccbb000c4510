"""Where the bytes are at the peak: ``graph-fsdp profile --memory ENGINE``.

    graph-fsdp profile --memory graph_fsdp --bf16 --fsdp-double-buffer \\
        --fsdp-db-use-persist-buf-on-alloc-fail --cuda-graph-impl torch \\
        --cuda-graph-scope full_iteration --warmup-iters 3 --train-iters 2 ...
    graph-fsdp profile --memory fsdp2 --bf16 ...        # torch FSDP2, same model and data

Each rank records the CUDA caching allocator's history from before the model is built
(``torch.cuda.memory._record_memory_history``, Python stacks), trains ``warmup + steps``
steps, takes a snapshot and replays the allocation trace to find the moment of the highest
allocated bytes (the moment ``torch.cuda.max_memory_allocated`` reports). Every block live at that moment is given a role:

1. by address: the engine's known tensors (graph_fsdp: ``main_params``, ``main_grads``,
   ``compute_shard``, the allocator's slots by role, ``accum``; FSDP2: the sharded
   parameters and gradients; both: ``optimizer_state``), read at the end of the run: they
   claim a block only if that very allocation is still live at the end of the trace (a
   storage that comes and goes - a released main grad, a dynamic buffer - may sit at
   another address, or its old address may hold something else, at the peak);
2. by stack: allocations made through graph_fsdp's allocator carry a frame
   ``alloc__<role>`` (the tool wraps the allocator's ``allocate``: the dynamic allocator's
   buffers change address; its re-allocations are ``storage.resize_`` calls inside that
   frame); main grads re-allocated by ``ensure_main_grad`` (param_group.py [Note: releasable
   main grads]); FSDP2's all-gather and reduce-scatter buffers by their functions;
   optimizer temporaries under ``torch/optim``; the model's forward (activations); no
   Python frame at all: autograd's backward thread (gradients and backward temporaries).

Besides the roles at the peak (``by_role``), ``peak_by_role`` gives each role's own highest
live bytes over the whole trace: buffers that are freed before the peak (the dynamic
allocator's gathered weights when the peak is the optimizer step) show there.

A captured step allocates nothing when it replays: its memory is the graph pool, reported
as reserved bytes per pool at the end (``reserved_by_pool``; for graph_fsdp also the model's
own account of its runners' pools, ``graph_pool_bytes``, a row of the table), next to the
peak attribution (which, for a captured run, is the peak of the capture itself). On CPU there is no
allocator history: only the known tensors' bytes are reported.
"""

from __future__ import annotations

import inspect
import json
import os
import pickle
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import nn

from graph_fsdp.bench.memory_trace import (
    TAG_PREFIX,
    Known,
    attribute,
    format_sites,
    format_table,
    known_bytes,
)
from graph_fsdp.bench.peers import accumulating_step, fsdp2_model
from graph_fsdp.bench.provenance import code_version, stamp_line
from graph_fsdp.buffers.allocator import SlotAllocator, key_role
from graph_fsdp.capture.step import eager_forward_backward
from graph_fsdp.capture.whole_step import WholeStepGraph
from graph_fsdp.fsdp.state import collect_states
from graph_fsdp.training.data import batch_for
from graph_fsdp.training.loop import MicrobatchStep
from graph_fsdp.training.train import (
    build_for,
    device_of,
    make_graphs,
    make_optimizer,
    shard_model,
)

# ------------------------------------------------------------------------------------------
# Known tensors
# ------------------------------------------------------------------------------------------


def _known(role: str, t: torch.Tensor | None) -> Iterable[Known]:
    if t is None:
        return []
    if hasattr(t, "to_local"):  # DTensor (FSDP2's params, grads and optimizer state)
        t = t.to_local()
    storage = t.untyped_storage()
    if storage.nbytes() == 0:
        return []
    return [Known(role, storage.data_ptr(), storage.nbytes())]


def _optimizer_state(opt: torch.optim.Optimizer | None) -> list[Known]:
    out = []
    for state in opt.state.values() if opt is not None else []:
        for value in state.values():
            if torch.is_tensor(value) and value.numel() > 1:
                out += _known("optimizer_state", value)
    return out


def slot_roles(allocator) -> list[tuple[str, torch.Tensor]]:
    """(role, tensor) of every materialised slot of a slot allocator (else empty)."""
    if not isinstance(allocator, SlotAllocator):
        return []
    roles: dict[int, set[str]] = {}
    for key, slot in allocator._assignment.items():
        roles.setdefault(id(slot), set()).add(key_role(key))
    for key, slot in allocator._dedicated.items():
        roles.setdefault(id(slot), set()).add(key_role(key) + " (dedicated)")
    out = []
    for slot in allocator.slots():
        if slot.tensor is not None:
            out.append(("slot:" + "+".join(sorted(roles.get(id(slot), {"?"}))), slot.tensor))
    return out


def known_graph_fsdp(model: nn.Module, opt: torch.optim.Optimizer | None) -> list[Known]:
    states = collect_states(model)
    out: list[Known] = []
    for s in states:
        for g in s.groups:
            out += _known("main_params", g.main_flat)
            out += _known("main_grads", g.main_grad)
            out += _known("compute_shard", g.compute_shard)
            out += _known("compute_full_persistent", g.persistent_full)
            out += _known("accum", g.accum)
    root = states[0].root if states else None
    if root is not None:
        for role, tensor in slot_roles(root.allocator):
            out += _known(role, tensor)
    return out + _optimizer_state(opt)


def known_fsdp2(model: nn.Module, opt: torch.optim.Optimizer | None) -> list[Known]:
    out: list[Known] = []
    for p in model.parameters():
        out += _known("fsdp2:sharded_params", p)
        out += _known("fsdp2:sharded_grads", p.grad)
    return out + _optimizer_state(opt)


# ------------------------------------------------------------------------------------------
# Role tags on graph_fsdp's allocator
# ------------------------------------------------------------------------------------------

_TAGGERS: dict[str, Callable] = {}


def _tagger(role: str) -> Callable:
    """A pass-through function named ``alloc__<role>``: the name shows in the stack."""
    fn = _TAGGERS.get(role)
    if fn is None:
        name = TAG_PREFIX + "".join(c if c.isalnum() else "_" for c in role)
        namespace: dict = {}
        exec(f"def {name}(fn, *args):\n    return fn(*args)\n", namespace)
        fn = _TAGGERS[role] = namespace[name]
    return fn


def tag_allocations(allocator) -> None:
    """Wrap ``allocator.allocate`` so that every allocation it makes carries its key's role
    in the Python stack (see module docstring)."""
    inner = allocator.allocate

    def allocate(key, numel, dtype, device):
        return _tagger(key_role(key))(inner, key, numel, dtype, device)

    allocator.allocate = allocate


# ------------------------------------------------------------------------------------------
# The measured run (one engine per launch)
# ------------------------------------------------------------------------------------------

ENGINES = ("graph_fsdp", "fsdp2")


@dataclass(frozen=True, kw_only=True)
class MemoryJob:
    cfg: object
    """A ``TrainConfig``: ``cfg.steps`` measured steps after ``warmup``."""
    engine: str
    warmup: int
    output_dir: str
    max_entries: int = 2_000_000
    save_snapshot: bool = False
    """Also write rank 0's raw snapshot pickle (for pytorch.org/memory_viz)."""


def _graph_fsdp_run(cfg, device: torch.device, rank: int, world_size: int):
    model = build_for(cfg, device)
    shard_model(model, cfg)
    opt = make_optimizer(model.parameters(), cfg)
    graphs = make_graphs(model, cfg, optimizer=opt)
    root = collect_states(model)[0]
    root.lazy_init()  # what the first forward does first: creates the root's allocator
    tag_allocations(root.root.allocator)

    def batch(i: int, micro: int):
        return batch_for(cfg, i * cfg.grad_accum + micro, rank, device, world_size=world_size)

    if isinstance(graphs, WholeStepGraph):  # --cuda-graph-optimizer: one replay per step
        whole = graphs.capture(MicrobatchStep(model, cfg.grad_accum))

        def whole_step(i: int) -> None:
            whole([batch(i, m) for m in range(cfg.grad_accum)])

        return model, opt, whole_step, known_graph_fsdp

    def step(i: int) -> None:
        if graphs is not None:
            graphs.before_step()
        for micro in range(cfg.grad_accum):
            model.set_requires_gradient_sync(micro == cfg.grad_accum - 1)
            x, y = batch(i, micro)
            if graphs is not None:
                graphs.forward_backward(micro, x, y, cfg.grad_accum)
            else:
                eager_forward_backward(model, x, y, cfg.grad_accum)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return model, opt, step, known_graph_fsdp


def _fsdp2_run(cfg, device: torch.device, rank: int, world_size: int):
    model, opt = fsdp2_model(cfg, world_size, device)
    step = accumulating_step(cfg, model, opt, rank, device, model.set_requires_gradient_sync)
    return model, opt, step, known_fsdp2


def _start_history(max_entries: int) -> None:
    kwargs = {"max_entries": max_entries, "stacks": "python"}
    if "clear_history" in inspect.signature(torch.cuda.memory._record_memory_history).parameters:
        kwargs["clear_history"] = True
    torch.cuda.memory._record_memory_history("all", **kwargs)


def memory_worker(rank: int, world_size: int, job: MemoryJob) -> dict | None:
    if job.engine not in ENGINES:
        raise ValueError(f"memory engine {job.engine!r}: choose one of {', '.join(ENGINES)}")
    cfg = replace(job.cfg, steps=job.warmup + job.cfg.steps)
    device = device_of(cfg)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        _start_history(job.max_entries)
    build = _graph_fsdp_run if job.engine == "graph_fsdp" else _fsdp2_run
    model, opt, step, known_fn = build(cfg, device, rank, world_size)
    for i in range(cfg.steps):
        step(i)
    known = known_fn(model, opt)
    result: dict = {"engine": job.engine, "rank": rank, "world_size": world_size}
    if job.engine == "graph_fsdp":
        result["graph_pool_bytes"] = model.fsdp_memory_report()["graph_pool_bytes"]
    if cuda:
        torch.cuda.synchronize(device)
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(None)
        result.update(attribute(snapshot, known, device.index or 0))
        result["max_memory_allocated"] = torch.cuda.max_memory_allocated(device)
        result["max_memory_reserved"] = torch.cuda.max_memory_reserved(device)
        if job.save_snapshot and rank == 0:
            os.makedirs(job.output_dir, exist_ok=True)
            with open(os.path.join(job.output_dir, f"snapshot_{job.engine}.pickle"), "wb") as f:
                pickle.dump(snapshot, f)
        if result["trace_events"] >= job.max_entries:
            result["note"] = (
                f"the allocation trace hit max_entries={job.max_entries}: its start was dropped, "
                "so the peak is approximate; raise --memory-max-entries or use fewer steps"
            )
    else:
        result["known_bytes"] = known_bytes(known)
        result["note"] = "CPU: no allocator history; known tensors' bytes only"
    peaks = torch.tensor(
        [result.get("peak_allocated_bytes", 0)], dtype=torch.float64, device=device
    )
    if world_size > 1:
        dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
    result["peak_allocated_bytes_max_over_ranks"] = int(peaks.item())
    return result if rank == 0 else None


def write_result(result: dict, label: str, output_dir: str) -> str:
    """``memory_<label>.json``, stamped with the code that produced it (provenance.py)."""
    os.makedirs(output_dir, exist_ok=True)
    path = os.path.join(output_dir, f"memory_{label}.json")
    with open(path, "w") as f:
        json.dump({"label": label, **result, "code": code_version()}, f, indent=2)
    return path


def merge(paths: list[str]) -> str:
    """Side-by-side markdown table of several ``memory_<label>.json`` files."""
    if not paths:
        return "(no memory results: every --memory run failed or was skipped)\n"
    results = {}
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        results[data.get("label", os.path.basename(path))] = data
    stamps = {
        label: stamp_line(data["code"]) if data.get("code") else "not recorded"
        for label, data in results.items()
    }
    if len(set(stamps.values())) == 1:
        text = f"Code: {next(iter(stamps.values()))}.\n\n"
    else:
        text = "Code:\n" + "".join(f"- {k}: {v}\n" for k, v in stamps.items()) + "\n"
    text += format_table(results)
    for label, data in results.items():
        if data.get("top_sites"):
            text += f"\n{label}: largest blocks at the peak that no known tensor claims\n\n"
            text += format_sites(data)
    return text


if __name__ == "__main__":  # python -m graph_fsdp.bench.memory a.json b.json ... -> table
    import sys

    print(merge(sys.argv[1:]), end="")
