"""Sharded checkpoints through torch.distributed.checkpoint (DCP), and full state dicts.

Each parameter (tensor-parallel ones aside, below) is saved as a 1-D tensor of its full
numel; a rank writes the contiguous piece its flat shard holds (arbitrary, uneven ranges -
expressed as DCP chunk metadata), so a checkpoint loads onto any world size or strategy: DCP
reads the overlapping pieces.
Optimizer state tensors shaped like a parameter's shard are saved the same way.

The global offsets depend only on the range a rank owns, so 1-D and 2-D (HSDP) meshes share
the format: a checkpoint loads across 1-D <-> 2-D meshes too. Replicas of one shard write
identical pieces (same index), which DCP's planner deduplicates to one writer.

Expert parameters (experts.py [Note: expert groups]) are saved as pieces of the *global*
parameter, every EP rank's experts, under its global name (``ExpertLayout.global_entry``):
EP rank r's stacked experts are rows ``[r * n, (r + 1) * n)`` of one tensor, Megatron-style
per-expert parameters are renamed to their global expert index. So a checkpoint written at
one expert-parallel size loads at another, and on another world size.

Tensor-parallel parameters (tensor_parallel.py [Note: tensor-parallel parameters]) are saved
at their *global* N-D shape, as DCP stores DTensors: a rank's flat piece of its local tensor is
a few boxes of the global tensor (at most ``2 * ndim - 1``), written as N-D chunks, so a
checkpoint loads at any (dp, tp) shape. Loading reads either layout: a 1-D (non-TP) checkpoint
into a TP model, or a TP checkpoint into a model without TP, by asking DCP for the stored
layout's chunks of this rank's piece.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from graph_fsdp.fsdp.checkpoint_files import (
    CHECKSUM_FILE,
    is_no_space,
    no_space_message,
    verify_checksums,
    write_checksums,
)
from graph_fsdp.fsdp.experts import unknown_layout
from graph_fsdp.fsdp.param_group import ParamRef
from graph_fsdp.fsdp.state import collect_states
from graph_fsdp.fsdp.tensor_parallel import box_runs, flat_boxes


class FlatPiece:
    """This rank's piece of a global tensor of ``size``: the 1-D ``local``, cut into chunks
    ``(start, length, offsets, sizes)`` - ``local[start:start + length]`` is the box at
    ``offsets`` of ``sizes`` in the global tensor (one 1-D chunk ``[offset, offset + n)`` for a
    plain parameter's flat piece; boxes for tensor-parallel ones, tensor_parallel.py)."""

    def __init__(self, local: torch.Tensor, chunks: list[tuple], size: tuple[int, ...]) -> None:
        self.local, self.chunks, self._size = local, chunks, torch.Size(size)
        self._by_offset = {tuple(c[2]): c for c in chunks}

    def size(self) -> torch.Size:
        return self._size

    @staticmethod
    def _meta(chunk) -> ChunkStorageMetadata:
        return ChunkStorageMetadata(offsets=torch.Size(chunk[2]), sizes=torch.Size(chunk[3]))

    def chunk_data(self, offsets) -> torch.Tensor:
        """The local data of the chunk at global ``offsets`` (a view of ``local``)."""
        start, length, _, sizes = self._by_offset[tuple(offsets)]
        return self.local[start : start + length].view(sizes)

    def __create_write_items__(self, fqn: str, obj) -> list[WriteItem]:
        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size(chunk[2])),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=self._meta(chunk),
                    properties=TensorProperties.create_from_tensor(self.local),
                    size=self._size,
                ),
            )
            for chunk in self.chunks
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [self._meta(chunk) for chunk in self.chunks]


class _SavePlanner(DefaultSavePlanner):
    def resolve_data(self, write_item):
        obj = self.state_dict[write_item.index.fqn]
        if isinstance(obj, FlatPiece):
            return obj.chunk_data(write_item.index.offset).detach()
        return super().resolve_data(write_item)


class _LoadPlanner(DefaultLoadPlanner):
    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False) -> None:
        # DefaultLoadPlanner first runs _init_state_dict, which replaces values it does not
        # know (our FlatPiece) with None; our values are never on the meta device, so skip it.
        self.original_state_dict = state_dict
        if self.flatten_state_dict:
            state_dict, self.mappings = flatten_state_dict(state_dict)
        self.state_dict = state_dict
        self.metadata = metadata
        self.is_coordinator = is_coordinator

    def lookup_tensor(self, index):
        obj = self.state_dict[index.fqn]
        if isinstance(obj, FlatPiece):
            return obj.chunk_data(index.offset)
        return super().lookup_tensor(index)


def _refs(model: nn.Module) -> list[ParamRef]:
    states = collect_states(model)
    if not states:
        raise ValueError("model has no fully_shard-ed modules")
    if states[0].root is None:
        states[0].lazy_init()
    return [ref for s in states for g in s.groups for ref in g.params]


class Entry:
    """A parameter as the checkpoint sees it: its name, global ``shape`` and this rank's piece
    (``ref.sharded``): ``[offset, offset + n)`` of the flattened global parameter, or for a
    tensor-parallel parameter (``tp``) that range of its flattened local tensor, whose place in
    the global one ``tp.global_boxes`` gives (tensor_parallel.py [Note: tensor-parallel
    parameters])."""

    __slots__ = ("key", "keys", "numel", "offset", "ref", "shape", "tp")

    def __init__(self, ref: ParamRef) -> None:
        self.ref = ref
        self.tp = ref.tp
        experts = ref.sharded._graph_fsdp_group.expert
        if experts is None:
            self.key, self.offset = ref.fqn, ref.global_offset
            self.shape = ref.shape if ref.tp is None else ref.tp.shape
            self.keys = (self.key,)
        else:
            if ref.expert is None:
                raise CheckpointError(unknown_layout(ref.fqn))
            self.key, base, self.shape = ref.expert.global_entry(
                ref.fqn, ref.shape, experts.ep_rank, experts.ep_size
            )
            self.offset = base + ref.global_offset
            # Per-expert parameters: the other EP ranks' copies are other global names.
            self.keys = tuple(
                dict.fromkeys(
                    ref.expert.global_entry(ref.fqn, ref.shape, r, experts.ep_size)[0]
                    for r in range(experts.ep_size)
                )
            )
        self.numel = self.shape.numel()

    @property
    def saved_size(self) -> tuple[int, ...]:
        """How :func:`save` stores it: tensor-parallel parameters at their global shape (the
        pieces are boxes of it, as DCP stores DTensors), the others flattened (1-D)."""
        if self.tp is not None and len(self.shape) > 0:
            return tuple(self.shape)
        return (self.numel,)

    def accepts(self, size: tuple[int, ...]) -> bool:
        """A stored tensor of ``size`` is this parameter (at its shape or flattened)."""
        return tuple(size) in ((self.numel,), tuple(self.shape))

    def piece(self, local: torch.Tensor, size: tuple[int, ...] | None = None) -> FlatPiece:
        """``local`` (shaped like ``ref.sharded``) as its chunks of the global tensor stored
        at ``size`` (default: :attr:`saved_size`): either layout is read and written."""
        size = self.saved_size if size is None else tuple(size)
        n = self.ref.sharded.numel()
        if n == 0:
            return FlatPiece(local, [], size)
        flat = len(size) == 1 and len(self.shape) != 1
        shape = tuple(self.shape)
        if self.tp is None:
            start = self.offset
            if flat or len(shape) <= 1:
                return FlatPiece(local, [(0, n, (start,), (n,))], size)
            boxes = flat_boxes(shape, start, start + n)
        else:  # strided pieces too (tensor_parallel.py [Note: strided tensor-parallel pieces])
            start = self.offset
            boxes = self.tp.global_boxes(start, start + n)
        chunks = []
        for first, offs, sizes in boxes:
            pos = first - start
            if not flat:
                chunks.append((pos, math.prod(sizes), offs, sizes))
                continue
            for run_start, length in box_runs(shape, offs, sizes):
                chunks.append((pos, length, (run_start,), (length,)))
                pos += length
        return FlatPiece(local, chunks, size)


def entries(model: nn.Module) -> list[Entry]:
    """Every parameter of ``model`` with its checkpoint name and global placement."""
    return [Entry(ref) for ref in _refs(model)]


def sharded_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict:
    ents = entries(model)
    sd: dict = {}
    for e in ents:
        sd[f"model.{e.key}"] = e.piece(e.ref.sharded.detach())
    if optimizer is not None:
        by_param = {id(e.ref.sharded): e for e in ents}
        for p, st in optimizer.state.items():
            e = by_param.get(id(p))
            if e is None:
                continue
            for name, value in st.items():
                key = f"optim.{e.key}.{name}"
                if torch.is_tensor(value) and value.shape == p.shape and value.dim() == 1:
                    sd[key] = e.piece(value)
                elif torch.is_tensor(value):
                    sd[key] = value
        sd["optim.param_groups"] = [
            {k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups
        ]
    return sd


def save(
    path: str,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    meta: dict | None = None,
) -> None:
    """Write a sharded DCP checkpoint of the model's main weights (and optimizer state).

    ``meta`` (JSON-serialisable, e.g. the iteration) is written into the checkpoint as
    :data:`META_FILE`, which also marks the directory as one graph_fsdp wrote.

    [Note: atomic checkpoint replacement] The checkpoint is written to ``<path>.tmp``; once
    every rank finished, the previous checkpoint is moved to ``<path>.old``, ``<path>.tmp``
    becomes ``path`` and ``<path>.old`` is deleted. A kill at any moment leaves a loadable
    checkpoint: before the swap ``path`` is untouched; between the two renames the previous
    checkpoint is ``<path>.old``, which :func:`load` reads and :func:`recover_interrupted_save`
    (called by the next save and by the CLI) puts back. ``path``, ``<path>.tmp`` and
    ``<path>.old`` must be absent, empty or checkpoint directories: anything else is refused
    (:func:`check_save_target`), never deleted. The ranks must share the file system, as DCP
    requires. Before the swap the files get their checksums ([Note: checkpoint checksums]).
    A failed write (a full disk says so, with the path) removes ``<path>.tmp`` and raises
    :class:`CheckpointError`; ``path`` is untouched.
    """
    sd = sharded_state_dict(model, optimizer)
    tmp, old = f"{path}.tmp", f"{path}.old"
    rank0 = dist.get_rank() == 0
    check_save_target(path)  # every rank alike (shared file system), before anything moves
    dist.barrier()
    if rank0:
        recover_interrupted_save(path)
        if os.path.exists(tmp):
            shutil.rmtree(tmp)  # left by an interrupted save
        os.makedirs(tmp)
        try:
            with open(os.path.join(tmp, META_FILE), "w") as f:
                json.dump(meta or {}, f)
        except OSError as exc:
            raise _save_failed(path, tmp, exc) from exc
        _pause_for_test("write")
    dist.barrier()
    try:
        dcp.save(sd, checkpoint_id=tmp, planner=_SavePlanner())
        dist.barrier()
        write_checksums(tmp, skip=(META_FILE,))
    except (OSError, CheckpointException) as exc:  # DCP's: a BaseException, on every rank
        raise _save_failed(path, tmp, exc) from exc
    dist.barrier()
    if rank0:
        if os.path.exists(path):
            shutil.rmtree(old, ignore_errors=True)
            os.replace(path, old)  # the previous checkpoint stays whole until tmp is in place
            _pause_for_test("swap")
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    dist.barrier()


def _save_failed(path: str, tmp: str, exc: BaseException) -> CheckpointError:
    """The error of a save that failed writing ``tmp`` (removed here by rank 0)."""
    why = no_space_message(tmp) if is_no_space(exc) else _root_cause(exc)
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    kept = (
        "the previous checkpoint there is untouched"
        if os.path.exists(path)
        else "nothing was written there"
    )
    return CheckpointError(f"saving checkpoint {path!r} failed: {why}; {kept}")


META_FILE = "graph_fsdp_cli.json"
"""Written into every checkpoint by :func:`save`: the ``meta`` it was given (the CLI's
iteration and ``--model``); its presence marks a directory as a graph_fsdp checkpoint."""

_CHECKPOINT_FILE = re.compile(r"(__\d+_\d+\.distcp|(__\d+)?\.metadata(\.tmp)?)")
"""Names of the files DCP's FileSystemWriter writes into a checkpoint directory."""

PAUSE_ENV = "GRAPH_FSDP_TEST_PAUSE_SAVE"
"""Test-only hook: ``<point>:<marker file>`` makes rank 0 of :func:`save` write its process
id into the marker file and sleep at ``point`` - ``write`` (the new checkpoint's directory
exists, no data in it yet) or ``swap`` (the previous checkpoint was moved to ``<path>.old``,
the new one is not in place yet) - so that a test can kill a rank there. Never set it
outside tests."""


def _pause_for_test(point: str) -> None:
    want, _, marker = os.environ.get(PAUSE_ENV, "").partition(":")
    if want != point:
        return
    with open(marker + ".part", "w") as f:
        f.write(str(os.getpid()))
    os.replace(marker + ".part", marker)
    time.sleep(3600)  # until the test kills this process


def is_checkpoint_dir(path: str, *, require_meta: bool = False) -> bool:
    """``path`` is a directory holding only checkpoint files (DCP's and :data:`META_FILE`;
    empty counts); ``require_meta``: and :data:`META_FILE` is one of them (graph_fsdp wrote
    it), unless the directory is empty."""
    if not os.path.isdir(path):
        return False
    names = os.listdir(path)
    if require_meta and names and META_FILE not in names:
        return False
    return all(n in (META_FILE, CHECKSUM_FILE) or _CHECKPOINT_FILE.fullmatch(n) for n in names)


def check_save_target(path: str, *, require_meta: bool = False) -> None:
    """Refuse to save at ``path`` when the save would replace or delete something that is not a
    checkpoint: ``path``, ``<path>.tmp`` and ``<path>.old`` must each be absent, an empty
    directory or a checkpoint directory (:func:`is_checkpoint_dir`; ``require_meta`` applies to
    ``path``: the other two are this module's own by their names)."""
    for target in (path, f"{path}.tmp", f"{path}.old"):
        strict = require_meta and target == path
        if not os.path.lexists(target) or is_checkpoint_dir(target, require_meta=strict):
            continue
        if not os.path.isdir(target) or os.path.islink(target):
            what = "is a file, not a checkpoint directory"
        else:
            names = sorted(os.listdir(target))
            shown = ", ".join(names[:3]) + (" ..." if len(names) > 3 else "")
            what = f"holds files that are not a graph_fsdp checkpoint's ({shown})"
        role = "" if target == path else f" (a save of {path!r} replaces it)"
        raise CheckpointError(
            f"{target!r} {what}{role}: a checkpoint save never deletes or replaces other files; "
            "save to a new or empty directory, or to a checkpoint directory graph_fsdp wrote"
        )


def recover_interrupted_save(path: str) -> bool:
    """Put the previous checkpoint back at ``path`` when a save was killed between its two
    renames ([Note: atomic checkpoint replacement]): ``path`` absent and ``<path>.old`` a
    complete checkpoint. Returns whether it did."""
    old = f"{path}.old"
    if os.path.lexists(path) or not os.path.isfile(os.path.join(old, ".metadata")):
        return False
    try:
        os.replace(old, path)
    except FileNotFoundError:  # another process (a rank under torchrun) restored it first
        pass
    return True


def _root_cause(exc: BaseException) -> str:
    """``[rank R: ]Type: first line`` of the error a DCP failure started from (the lowest
    failing rank's, followed through ``raise ... from`` to the first exception)."""
    prefix = ""
    failures = getattr(exc, "failures", None)
    if isinstance(exc, CheckpointException) and failures:
        rank = min(failures)
        prefix, exc = f"rank {rank}: ", failures[rank][0]
    seen = set()
    while (exc.__cause__ or exc.__context__) is not None and id(exc) not in seen:
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    lines = str(exc).strip().splitlines()
    return f"{prefix}{type(exc).__name__}: {lines[0] if lines else ''}"


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded into this model (the model is left unchanged)."""


def _read_metadata(path: str):
    meta_file = os.path.join(path, ".metadata")
    if not os.path.isfile(meta_file):
        raise CheckpointError(
            f"no checkpoint at {path!r}: {meta_file} does not exist (was the save completed? "
            "graph_fsdp.fsdp.checkpoint.save writes <path>.tmp first and renames it at the end)"
        )
    try:
        return dcp.FileSystemReader(path).read_metadata()
    except Exception as exc:  # any unpickling failure means a bad file
        raise CheckpointError(
            f"checkpoint metadata {meta_file} is truncated or corrupt ({type(exc).__name__}: "
            f"{exc}); restore it from a copy or load an older checkpoint"
        ) from exc


class _Shape:
    """The fields of an :class:`Entry` that :func:`validate_checkpoint` reads, for a parameter
    of a model that is not built (a launch-time check)."""

    def __init__(self, key: str, shape) -> None:
        self.key, self.keys, self.shape = key, (key,), torch.Size(shape)
        self.numel = self.shape.numel()

    accepts = Entry.accepts


def check_checkpoint(path: str, shapes: dict[str, torch.Size] | None = None) -> None:
    """:func:`validate_checkpoint` without a model or a process group (e.g. before a launch):
    metadata readable, files whole and, with ``shapes`` (global parameter name -> shape), the
    same parameters and sizes."""
    ents = None if shapes is None else [_Shape(k, s) for k, s in shapes.items()]
    validate_checkpoint(path, ents, _read_metadata(path))


def validate_checkpoint(path: str, ents: list[Entry] | None, metadata) -> None:
    """Refuse a checkpoint of another model shape, or one whose files are truncated, naming
    the parameter and the file, before anything is loaded (``ents`` None: the files only).
    Names and sizes are global ones (all experts), so every rank of the model reads the same
    verdict."""
    meta = metadata.state_dict_metadata
    wanted = {f"model.{key}": e for e in ents or [] for key in e.keys}
    missing = sorted({k[len("model.") :] for k in wanted if k not in meta})
    extra = [k[len("model.") :] for k in meta if k.startswith("model.") and k not in wanted]
    if ents is not None and (missing or extra):
        raise CheckpointError(
            f"checkpoint {path!r} is from another model: parameters missing from it "
            f"{missing[:4]}{' ...' if len(missing) > 4 else ''}, parameters only in it "
            f"{extra[:4]}{' ...' if len(extra) > 4 else ''}"
        )
    for key, e in wanted.items():
        size = tuple(meta[key].size)
        if not e.accepts(size):
            raise CheckpointError(
                f"parameter {key[len('model.') :]}: checkpoint {path!r} holds "
                f"{size[0] if len(size) == 1 else size} "
                f"elements, the model's {tuple(e.shape)} has {e.numel}: the checkpoint is from "
                "another model shape (for expert parameters: the same total number of experts "
                "is needed, whatever the expert-parallel size)"
            )
    sizes: dict[str, int] = {}
    for index, info in (metadata.storage_data or {}).items():
        file = os.path.join(path, info.relative_path)
        if file not in sizes:
            sizes[file] = os.path.getsize(file) if os.path.exists(file) else -1
        if sizes[file] < info.offset + info.length:
            have = "is missing" if sizes[file] < 0 else f"has {sizes[file]} bytes"
            raise CheckpointError(
                f"checkpoint file {file} {have} but {index.fqn} (at offset "
                f"{tuple(index.offset) if index.offset is not None else ()}) needs bytes "
                f"[{info.offset}, {info.offset + info.length}): the file is truncated; load an "
                "older checkpoint"
            )


def load(path: str, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Load a checkpoint written by :func:`save`, on any world size or strategy.

    Like ``Optimizer.load_state_dict``, the optimizer's hyperparameters (``lr``,
    ``weight_decay``, ...) are restored from the checkpoint, replacing the values the
    optimizer was constructed with; set them after loading to change them.
    """
    ents = entries(model)
    if not os.path.lexists(path) and os.path.isfile(os.path.join(f"{path}.old", ".metadata")):
        path = f"{path}.old"  # a save was killed mid-swap: [Note: atomic checkpoint replacement]
    metadata = _read_metadata(path)
    validate_checkpoint(path, ents, metadata)
    bad = verify_checksums(path)  # [Note: checkpoint checksums]
    if bad is not None:
        raise CheckpointError(
            f"{bad}; the model and optimizer are unchanged: load an older checkpoint or "
            "restore the file from a copy"
        )
    meta = metadata.state_dict_metadata
    sd: dict = {}
    staged: list[tuple[ParamRef, torch.Tensor]] = []
    for e in ents:
        # Loaded into copies first: a load that fails half-way leaves the model unchanged.
        buf = torch.empty_like(e.ref.sharded.detach())
        staged.append((e.ref, buf))
        sd[f"model.{e.key}"] = e.piece(buf, meta[f"model.{e.key}"].size)
    optim_values: dict = {}
    by_key = {e.key: e for e in ents}
    if optimizer is not None:
        for key, md in meta.items():
            if (
                not key.startswith("optim.")
                or key == "optim.param_groups"
                or key.startswith("optim.param_groups")
            ):
                continue
            pkey, name = key[len("optim.") :].rsplit(".", 1)
            e = by_key.get(pkey)
            if e is None:
                continue
            if len(md.size) > 0 and e.accepts(md.size):
                t = torch.zeros_like(e.ref.sharded, dtype=md.properties.dtype)
                sd[key] = e.piece(t, md.size)
            else:
                t = torch.zeros(md.size, dtype=md.properties.dtype, device="cpu")
                sd[key] = t
            optim_values[(pkey, name)] = t
        sd["optim.param_groups"] = [
            {k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups
        ]
    try:
        dcp.load(sd, checkpoint_id=path, planner=_LoadPlanner())
    except (Exception, CheckpointException) as exc:
        raise CheckpointError(
            f"loading checkpoint {path!r} failed; the model and optimizer are unchanged: "
            f"{_root_cause(exc)}"
        ) from exc
    with torch.no_grad():
        for ref, buf in staged:
            # detach(), not .data: the view shares main_flat's version counter, so the
            # in-place load is visible to FlatParamGroup.stale() (groups are marked dirty too).
            ref.sharded.detach().copy_(buf)
    # The main weights changed in place: compute weights gathered (ZeRO-3) or kept
    # (ZeRO-0/1/2) before the load must be refreshed by the next unshard.
    for state in collect_states(model):
        for g in state.groups:
            g.dirty = True
    if optimizer is not None:
        index = {
            id(p): i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])
        }
        state: dict = {}
        for pkey, name in optim_values:
            ref, value = by_key[pkey].ref, sd[f"optim.{pkey}.{name}"]
            value = value.local if isinstance(value, FlatPiece) else value
            if ref.sharded.numel() == 0 or id(ref.sharded) not in index:
                continue
            state.setdefault(index[id(ref.sharded)], {})[name] = value
        groups = []
        saved_groups = sd["optim.param_groups"]
        for g, saved in zip(optimizer.param_groups, saved_groups):
            groups.append({**saved, "params": [index[id(p)] for p in g["params"]]})
        optimizer.load_state_dict({"state": state, "param_groups": groups})


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter at full shape (main dtype), gathered on every rank (for export/tests);
    expert parameters as their global tensors, under their global names (all experts)."""
    out: dict[str, torch.Tensor] = {}
    for state in collect_states(model):
        if state.root is None:
            state.lazy_init()
        for g in state.groups:
            full = g.main_flat
            if g.over_replicas:  # [Note: HSDP ranges]: the replicas' pieces first
                shard = torch.empty(g.shard_numel, dtype=full.dtype, device=g.device)
                dist.all_gather_into_tensor(shard, full, group=g.comm.replicate_group)
                full = shard
            if g.placements.optim and g.comm.world_size > 1:
                gathered = torch.empty(g.layout.total, dtype=full.dtype, device=g.device)
                dist.all_gather_into_tensor(gathered, full, group=g.comm.group)
                full = gathered
            for name, value in g.full_params(full):  # dense: views of ``full``
                out[name] = value if g.expert is not None else value.clone()
    return out
