"""Bytes per role, computed from the model's shape: graph_fsdp (ZeRO-3) next to torch FSDP2.

No tensor is allocated: the model is built on the meta device for its parameter sizes, and
graph_fsdp's layout (:class:`~graph_fsdp.buffers.layout.FlatLayout`: aligned, padded to the
world size) and allocator rules give every role's bytes on rank 0. ``tests/bench`` checks
the graph_fsdp numbers against a real 2-rank gloo run (``graph-fsdp profile --memory``).

What each role is (see ``param_group.py``'s table):

- persistent for the whole run: ``main_params`` (fp32 shard), ``optimizer_state`` (AdamW:
  two fp32 tensors per owned element); ``main_grads`` (fp32 shard) from the reduction until
  the next forward after ``zero_grad(set_to_none=True)`` (pinned under full_iteration
  graphs), as FSDP2 holds its sharded grads. No compute-dtype shard: each gather casts
  straight into the param slot (``param_group.py`` [Note: copy-in all-gather]);
- double-buffer slots, reserved for the run (these are their sizes; their bytes come and go:
  weight slots no unit holds are given back after forward and between steps, backward-only
  slots between steps - ``allocator.py`` [Note: weight slots during backward], [Note: backward slots between
  steps]): ``slot:param`` / ``slot:grad`` (unsharded compute-dtype
  weights and gradients, ``min(num_slots, units of that size)`` per size class),
  ``slot:grad_comm`` (the fp32 copy of the gradients that feeds an fp32 reduce-scatter:
  per size class, or one slot shared by all classes when ``serial_comm``);
- FSDP2 keeps the fp32 shards (params, grads while they exist, AdamW state) and creates its
  unsharded bf16 weights, the bf16 gradients and the fp32 reduce-scatter input per unit from
  the caching allocator, releasing them after use.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from graph_fsdp.buffers.layout import FlatLayout
from graph_fsdp.models import GPTConfig, build_model, sharding_units


@dataclass(frozen=True, kw_only=True)
class Shape:
    model: GPTConfig
    world_size: int
    compute_bytes: int = 2
    """bf16 compute weights."""
    comm_bytes: int = 4
    """fp32 gradient reduction."""
    num_slots: int = 2
    serial_comm: bool = True
    """One grad_comm slot shared by all size classes (the engine's default since the memory
    work; False: the older per-class slots)."""


def unit_numels(model_cfg: GPTConfig) -> list[tuple[str, list[int]]]:
    """(unit name, parameter numels in graph_fsdp's flat order) per unit (sharding_units, then the root)."""
    model = build_model(model_cfg, device="meta")
    names = {id(m): n for n, m in model.named_modules()}
    modules = [m for m, _ in sharding_units(model)]
    in_units = {id(p) for m in modules for p in m.parameters()}
    units = [(names[id(m)], [p.numel() for p in m.parameters()]) for m in modules]
    units.append(("root", [p.numel() for p in model.parameters() if id(p) not in in_units]))
    return units


def graph_fsdp_roles(shape: Shape) -> dict[str, int]:
    """Rank 0's persistent and slot bytes per role (ZeRO-3, double buffer); the grad and grad_comm
    slots hold their bytes only during backward ([Note: backward slots between steps])."""
    W = shape.world_size
    out: dict[str, int] = {}

    def add(role: str, nbytes: int) -> None:
        out[role] = out.get(role, 0) + nbytes

    classes: dict[tuple[str, int, int], int] = {}
    for _, numels in unit_numels(shape.model):
        layout = FlatLayout(tuple(numels), W)
        add("main_params", layout.shard_numel * 4)
        add("main_grads", layout.shard_numel * 4)
        owned = sum(e - s for s, e in (layout.local_range(i, 0) for i in range(len(numels))))
        add("optimizer_state", 2 * owned * 4)
        for role, nbytes in (("param", shape.compute_bytes), ("grad", shape.compute_bytes)):
            classes[(role, layout.total, nbytes)] = classes.get((role, layout.total, nbytes), 0) + 1
        if shape.comm_bytes != shape.compute_bytes:
            key = ("grad_comm", layout.total, shape.comm_bytes)
            classes[key] = classes.get(key, 0) + 1
    serial = 0
    for (role, total, nbytes), members in classes.items():
        if role == "grad_comm" and shape.serial_comm:
            serial = max(serial, total * nbytes)
            continue
        add(f"slot:{role}", min(shape.num_slots, members) * total * nbytes)
    if serial:
        add("slot:grad_comm", serial)
    return out


def fsdp2_roles(shape: Shape) -> dict[str, int]:
    """Rank 0's bytes of torch FSDP2's sharded state (dim-0 sharding, padded chunks), and its
    largest per-unit transient buffers (for comparison with graph_fsdp's slots)."""
    W = shape.world_size
    model = build_model(shape.model, device="meta")
    sharded = 0
    for p in model.parameters():
        rows = p.shape[0] if p.dim() else 1
        sharded += -(-rows // W) * (p.numel() // max(rows, 1))
    units = unit_numels(shape.model)
    largest_layer = max(sum(n) for name, n in units if name != "root")
    root = sum(units[-1][1])
    return {
        "main_params": sharded * 4,
        "main_grads (while they exist)": sharded * 4,
        "optimizer_state": 2 * sharded * 4,
        "unsharded params, root + one layer (transient)": (root + largest_layer)
        * shape.compute_bytes,
        "reduce-scatter input, largest unit (transient)": root * shape.comm_bytes,
    }


def table(shapes: dict[str, Shape]) -> str:
    """Markdown: graph_fsdp's roles per shape (GiB), then FSDP2's."""
    lines = []
    for name, shape in shapes.items():
        g, f = graph_fsdp_roles(shape), fsdp2_roles(shape)
        lines += [f"| {name}: graph_fsdp role | GiB | FSDP2 | GiB |", "|---|--:|---|--:|"]
        g_rows, f_rows = list(g.items()), list(f.items())
        for i in range(max(len(g_rows), len(f_rows))):
            gl = g_rows[i] if i < len(g_rows) else ("", None)
            fl = f_rows[i] if i < len(f_rows) else ("", None)
            cell = lambda v: "" if v is None else f"{v / 2**30:.3f}"  # noqa: E731
            lines.append(f"| {gl[0]} | {cell(gl[1])} | {fl[0]} | {cell(fl[1])} |")
        lines.append(f"| **total** | {sum(g.values()) / 2**30:.3f} | | |")
        lines.append("")
    return "\n".join(lines)


def issue_shapes(world_size: int = 2, *, serial_comm: bool = True) -> dict[str, Shape]:
    """The shapes of issue 12 (16 layers, vocab 32768, bf16 compute, fp32 reduction)."""
    out = {}
    for h, seq in ((1024, 1024), (2048, 2048)):
        cfg = GPTConfig(
            num_layers=16,
            hidden_size=h,
            num_attention_heads=16,
            seq_length=seq,
            vocab_size=32768,
        )
        out[f"h{h} seq{seq}"] = Shape(model=cfg, world_size=world_size, serial_comm=serial_comm)
    return out


if __name__ == "__main__":  # python -m graph_fsdp.bench.memory_model
    torch.set_grad_enabled(False)
    print("Before (per-class grad_comm slots):\n")
    print(table(issue_shapes(serial_comm=False)))
    print("After (one serial grad_comm slot):\n")
    print(table(issue_shapes(serial_comm=True)))
