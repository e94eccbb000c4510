"""Offload and onload of sharded state, for RL loops that alternate training and rollout.

    from graph_fsdp.fsdp import offload
    offload.offload_params(chunks); offload.offload_grads(chunks)        # before the rollout
    offload.offload_optimizer(chunks, optimizer)
    for name, tensor in graph_fsdp.iter_full_params(chunks, dtype=torch.bfloat16):
        engine.load_weight(name, tensor)                  # weight sync, one unit at a time
    ...                                                   # the inference engine uses the GPU
    offload.onload_params(chunks); offload.onload_grads(chunks)          # train again
    offload.onload_optimizer(chunks, optimizer)

``chunks`` is a ``fully_shard``-ed root module or a list of them (virtual pipeline stages, an
RL backend's model chunks): every function here takes either, and the root's ``FSDPModule``
methods (``model.offload_params()``, ...) call them for one. Offload moves the sharded state to
(pinned) CPU memory and frees the device copies; onload brings it back. Every call returns the
bytes it freed (or re-allocated), by kind, summed over the chunks. Offload is refused inside a
step (between a training forward and its backward, during a backward) and for a kind already
offloaded; a forward, a graph runner's step or an optimizer step with offloaded state is
refused until the matching onload.

Two modes, decided per model at its lazy init and named once per process by a one-line notice
(address_keeping.py ``announce``):

- addresses kept: with ``BufferPolicy(keep_addresses_on_offload=True)`` and torch-memory-saver,
  the device memory is released and mapped back at the same addresses, so CUDA graphs replay
  right after onload (address_keeping.py [Note: offload keeps addresses]);
- recapture (the default, and the fallback without torch-memory-saver): [Note: CUDA graphs
  across offload].

[Note: offload keeps identities] The optimizer and checkpoints hold the sharded parameters
(1-D views of each group's ``main_flat``), so those objects must survive offload. Each group
swaps its flat tensor's storage in place (``main_flat.data = cpu_copy``) and re-points every
sharded parameter at a view of it (``param.data = main_flat[a:b]``): the objects, and the
version counter they share with ``main_flat`` (what ``FlatParamGroup.stale`` reads), are kept;
the views stay consistent with the flat tensor on either side. ``main_grad`` and its
``.grad`` views move the same way; gradients are detached while the two sides differ and
re-attached on onload. With addresses kept, onload swaps the *same* device storage back in.

[Note: CUDA graphs across offload] Without kept addresses, onload cannot give the buffers
their old addresses back (the caching allocator decides), so graphs are *recaptured*:
offload_params suspends every live runner of the model (its graphs are reset and their pool
freed now) and releases the static allocator's slots (bumping its generation), and the
runner's next ``before_step`` captures again (layerwise) or its next step does
(full_iteration, after its warmup steps again). It then replays bit-identically.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn

from graph_fsdp.fsdp.address_keeping import AddressKeeper, OffloadMode, announce
from graph_fsdp.fsdp.param_group import FlatParamGroup
from graph_fsdp.fsdp.state import FSDPState, TrainingState, collect_states, in_backward, state_of

ModelOrChunks = nn.Module | Iterable[nn.Module]
"""A ``fully_shard``-ed root module, or a list of them (model chunks)."""


def _pin() -> bool:
    return torch.cuda.is_available()


def _nbytes(t: torch.Tensor | None) -> int:
    """Bytes the tensor's storage holds (a released main grad holds none)."""
    return 0 if t is None else t.untyped_storage().nbytes()


def _to_host(t: torch.Tensor) -> torch.Tensor:
    host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=_pin() and t.is_cuda)
    # A released main grad (param_group.py [Note: releasable main grads]) has no values
    # anyone can read: the next reduction overwrites it.
    if t.untyped_storage().nbytes():
        host.copy_(t, non_blocking=t.is_cuda)
    return host


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    out = torch.empty(t.shape, dtype=t.dtype, device=device)
    out.copy_(t, non_blocking=t.is_pinned())
    return out


def _sync(device: torch.device) -> None:
    """Copies were queued non-blocking: make them complete before anyone reads the bytes."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def _add(counts: dict[str, int], kind: str, nbytes: int) -> None:
    counts[kind] = counts.get(kind, 0) + nbytes


_GRAD_KINDS = {"main_grad": "main_grads", "accum": "grad_accum"}
"""A group's persistent gradient tensors by the kind offload counts them under."""


def _totalled(counts: dict[str, int]) -> dict[str, int]:
    counts["total"] = sum(v for k, v in counts.items() if k != "total")
    return counts


# ---------------------------------------------------------------------- checks
def chunks_of(model_or_chunks: ModelOrChunks, action: str) -> list[nn.Module]:
    """``model_or_chunks`` as a list of modules (one module: a list of one)."""
    if isinstance(model_or_chunks, nn.Module):
        return [model_or_chunks]
    if isinstance(model_or_chunks, torch.optim.Optimizer) or not isinstance(
        model_or_chunks, Iterable
    ):
        raise TypeError(
            f"{action}: expected a fully_shard-ed module or a list of them, got "
            f"{type(model_or_chunks).__name__}"
        )
    chunks = list(model_or_chunks)
    bad = [type(c).__name__ for c in chunks if not isinstance(c, nn.Module)]
    if not chunks or bad:
        raise TypeError(
            f"{action}: expected a fully_shard-ed module or a non-empty list of them, got a "
            f"list of {len(chunks)}{f' holding {bad[:3]}' if bad else ''}"
        )
    return chunks


def root_states(model: nn.Module, action: str) -> list[FSDPState]:
    """The FSDP states of ``model``, which must be a root, idle (between steps)."""
    state = state_of(model)
    if state is None:
        raise TypeError(
            f"{action}: {type(model).__name__} is not fully_shard-ed; call it on the module "
            "you passed to fully_shard last (the root)"
        )
    if state.root is None:
        state.lazy_init()
    if not state.is_root:
        raise ValueError(
            f"{action} was called on the unit {state.fqn!r}, not on the root of its model: "
            "call it on the outermost fully_shard-ed module (it covers every unit)"
        )
    check_idle(state.root.states, action)
    return collect_states(model)


def _roots(model_or_chunks: ModelOrChunks, action: str) -> list[list[FSDPState]]:
    """Every chunk's states; all chunks are checked before anything changes."""
    per_root = [root_states(chunk, action) for chunk in chunks_of(model_or_chunks, action)]
    seen: set[int] = set()
    for states in per_root:
        if id(states[0].root) in seen:
            raise ValueError(f"{action}: the same model was passed twice in the chunk list")
        seen.add(id(states[0].root))
    return per_root


def check_idle(states: list[FSDPState], action: str) -> None:
    if in_backward():
        raise RuntimeError(
            f"{action} during a backward pass: call it between training steps (after "
            "optimizer.step()), never from a hook or autograd function"
        )
    root = states[0].root if states else None
    if root is not None and root.awaiting_backward:
        raise RuntimeError(
            f"{action} between a training forward and its backward (the step is open): call "
            "it after backward() (and optimizer.step()); run forwards that need no backward "
            "(a rollout's log-probs, an evaluation) under torch.no_grad()"
        )
    busy = [f"{s.fqn} ({s.training_state.value})" for s in states]
    busy = [b for b, s in zip(busy, states) if s.training_state is not TrainingState.IDLE]
    if busy:
        raise RuntimeError(
            f"{action} while units are mid-step: {busy[:4]}; call it between training steps "
            "(after backward and optimizer.step())"
        )


def _check_kind(per_root: list[list[FSDPState]], kind: str, offloading: bool) -> None:
    for states in per_root:
        offloaded = states[0].root.offloaded
        if offloading and kind in offloaded:
            raise RuntimeError(f"offload_{kind}: the {kind} are already offloaded")
        if not offloading and kind not in offloaded:
            raise RuntimeError(
                f"onload_{kind} without offload_{kind}: the {kind} are on the device already"
            )


def offload_mode(model: nn.Module) -> OffloadMode:
    """How offload treats ``model``'s CUDA graphs: ``.keeper`` is not None when addresses are
    kept (address_keeping.py), ``.notice`` says which mode runs and why."""
    state = state_of(model)
    if state is None:
        raise TypeError(f"offload_mode: {type(model).__name__} is not fully_shard-ed")
    if state.root is None:
        state.lazy_init()
    return state.root.offload_mode


def _keeper(states: list[FSDPState]) -> AddressKeeper | None:
    mode = states[0].root.offload_mode
    return mode.keeper if mode is not None else None


def _suspend_graphs(states: list[FSDPState]) -> int:
    """Reset the live graph runners of this model (see [Note: CUDA graphs across offload]);
    returns the device bytes their pools gave back (0 on CPU or without runners)."""
    runners = {id(r): r for s in states for r in list(s.graph_runners)}
    if not runners:
        return 0
    before = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
    for runner in runners.values():
        runner.suspend()
    if not torch.cuda.is_available():
        return 0
    torch.cuda.synchronize()
    return max(before - torch.cuda.memory_allocated(), 0)


def _move_kind(
    model_or_chunks: ModelOrChunks,
    kind: str,
    *,
    offloading: bool,
    move: Callable[[list[FSDPState], AddressKeeper | None], dict[str, int]],
) -> dict[str, int]:
    """What every offload and onload of a ``kind`` does around its own ``move``: check every
    chunk first, then ``move(states, keeper)`` each root's units (offload names the mode
    first), mark the kind offloaded or onloaded, and sum the bytes by kind over the chunks."""
    action = f"{'offload' if offloading else 'onload'}_{kind}"
    per_root = _roots(model_or_chunks, action)
    _check_kind(per_root, kind, offloading=offloading)
    counts: dict[str, int] = {}
    for states in per_root:
        root = states[0].root
        if offloading:
            announce(root.offload_mode)
        for k, nbytes in move(states, _keeper(states)).items():
            _add(counts, k, nbytes)
        if offloading:
            root.offloaded.add(kind)
        else:
            root.offloaded.discard(kind)
    return _totalled(counts)


# ---------------------------------------------------------------------- params
def offload_params(model_or_chunks: ModelOrChunks) -> dict[str, int]:
    """Move every unit's sharded main weights to (pinned) CPU memory and free the device
    copies, the compute-weight buffers, the allocator's slots and the graphs' pools.

    Returns bytes freed by kind (``total`` included). Training and forward are refused
    until :func:`onload_params`.
    """
    return _move_kind(
        model_or_chunks,
        "params",
        offloading=True,
        move=lambda states, keeper: (
            _offload_kept(states, keeper) if keeper else _offload_recapture(states)
        ),
    )


def _offload_recapture(states: list[FSDPState]) -> dict[str, int]:
    freed = {"graph_pools": _suspend_graphs(states)}
    root = states[0].root
    slots = _slot_bytes(root.allocator)
    device = states[0].groups[0].device
    for state in states:
        state.reshard()
        for group in state.groups:
            group.detach_grads()
            _add(freed, "main_params", _nbytes(group.main_flat))
            group.move_storage("main_flat", _to_host(group.main_flat))
            for kind, t in group.compute_weights().items():
                _add(freed, kind, _nbytes(t))
            group.drop_compute_weights()
            group.drop_unsharded()
    _sync(device)
    for state in states:
        for group in state.groups:
            group.repoint_views()
    root.allocator.release()  # slots (and graphs that read them) must be re-made
    freed["allocator_slots"] = slots
    return freed


def _offload_kept(states: list[FSDPState], keeper: AddressKeeper) -> dict[str, int]:
    """The main weights to the host; the params, buffers and graphs regions released
    (address_keeping.py [Note: offload keeps addresses]): the graphs stay valid."""
    freed: dict[str, int] = {}
    saved, compute = [], []
    for state in states:
        state.reshard()
        for group in state.groups:
            group.detach_grads()
            device_flat = group.main_flat.detach()
            group.move_storage("main_flat", _to_host(device_flat))
            saved.append((group, device_flat))
            _add(freed, "main_params", _nbytes(device_flat))
            for kind, t in group.compute_weights().items():
                _add(freed, kind, _nbytes(t))
                compute.append(t)
    _sync(keeper.device)
    for group, _ in saved:
        group.repoint_views()
    slots = _live_slots(states[0].root.allocator)
    freed["allocator_slots"] = sum(_nbytes(t) for t in slots)
    keeper.saved["params"] = saved
    keeper.release("params", [t for _, t in saved] + compute)
    keeper.release("buffers", slots)
    freed["graph_pools"] = keeper.release("graphs", [])
    return freed


def _live_slots(allocator) -> list[torch.Tensor]:
    """The slot tensors that hold bytes now."""
    slots = getattr(allocator, "slots", None)
    if slots is None:
        return []
    return [s.tensor for s in slots() if s.tensor is not None and _nbytes(s.tensor)]


def _slot_bytes(allocator) -> int:
    """Bytes the static allocator's slots hold now (``release`` frees them). A slot whose
    storage was given back between steps holds none: after a full-iteration capture every
    slot's bytes live in the graph's pool, which ``graph_pools`` counts."""
    return sum(_nbytes(t) for t in _live_slots(allocator))


def onload_params(model_or_chunks: ModelOrChunks) -> dict[str, int]:
    """Bring the main weights back to the device and re-create the compute buffers (their
    contents are refreshed from the main weights by the next unshard). Returns the bytes
    allocated on the device by kind."""
    return _move_kind(model_or_chunks, "params", offloading=False, move=_onload_params)


def _onload_params(states: list[FSDPState], keeper: AddressKeeper | None) -> dict[str, int]:
    moved = _onload_kept(states, keeper) if keeper else _onload_recapture(states)
    for state in states:
        for group in state.groups:
            group.reattach_grads()
    return moved


def _onload_recapture(states: list[FSDPState]) -> dict[str, int]:
    device = states[0].groups[0].device
    moved: dict[str, int] = {}
    for state in states:
        for group in state.groups:
            group.move_storage("main_flat", _to_device(group.main_flat, device))
            _add(moved, "main_params", _nbytes(group.main_flat))
            group.renew_compute_weights()  # rebuilt from the main weights at the next gather
            for kind, t in group.compute_weights().items():
                _add(moved, kind, _nbytes(t))
            group.repoint_views()
    _sync(device)
    return moved


def _onload_kept(states: list[FSDPState], keeper: AddressKeeper) -> dict[str, int]:
    """The regions mapped again; the main weights copied back into the same device storage."""
    for kind in ("graphs", "buffers", "params"):
        keeper.restore(kind)
    moved: dict[str, int] = {}
    for group, device_flat in keeper.saved.pop("params"):
        device_flat.copy_(group.main_flat, non_blocking=group.main_flat.is_pinned())
        group.move_storage("main_flat", device_flat)  # compute weights: rebuilt from it
        group.repoint_views()
        _add(moved, "main_params", _nbytes(device_flat))
        for kind, t in group.compute_weights().items():
            _add(moved, kind, _nbytes(t))
    _sync(keeper.device)
    return moved


# ---------------------------------------------------------------------- grads
def offload_grads(model_or_chunks: ModelOrChunks) -> dict[str, int]:
    """Move the sharded main gradients (and ``no_sync`` accumulators) to (pinned) CPU memory,
    values kept. Returns bytes freed by kind; training is refused until :func:`onload_grads`.
    With addresses kept, values nobody can read (no ``.grad`` attached, nothing accumulating:
    the next reduction overwrites them) are not copied."""
    return _move_kind(model_or_chunks, "grads", offloading=True, move=_offload_grads)


def _offload_grads(states: list[FSDPState], keeper: AddressKeeper | None) -> dict[str, int]:
    freed: dict[str, int] = {}
    saved = []
    for state in states:
        for group in state.groups:
            live = {"main_grad": group.grads_live(), "accum": group.accum_pending}
            group.detach_grads()
            for attr, t in group.persistent_grads().items():
                _add(freed, _GRAD_KINDS[attr], _nbytes(t))
                device_t = t.detach()
                if keeper is None or live[attr]:
                    group.move_storage(attr, _to_host(device_t))
                else:  # nothing to keep: a host tensor of the shape, never written
                    host = torch.empty(t.shape, dtype=t.dtype, device="cpu")
                    group.move_storage(attr, host)
                saved.append((group, attr, device_t, live[attr]))
    _sync(states[0].groups[0].device)
    for state in states:
        for group in state.groups:
            group.repoint_views()
    if keeper is not None:
        keeper.saved["grads"] = saved
        keeper.release("grads", [t for _, _, t, _ in saved])
    return freed


def onload_grads(model_or_chunks: ModelOrChunks) -> dict[str, int]:
    """Bring the main gradients back; ``.grad`` views are re-attached where they were."""
    return _move_kind(model_or_chunks, "grads", offloading=False, move=_onload_grads)


def _onload_grads(states: list[FSDPState], keeper: AddressKeeper | None) -> dict[str, int]:
    moved: dict[str, int] = {}
    device = states[0].groups[0].device
    if keeper is None:
        for state in states:
            for group in state.groups:
                for attr, t in group.persistent_grads().items():
                    group.move_storage(attr, _to_device(t, device))
                    _add(moved, _GRAD_KINDS[attr], _nbytes(t))
    else:
        keeper.restore("grads")
        for group, attr, device_t, live in keeper.saved.pop("grads"):
            t = group.persistent_grads()[attr]
            if live:
                device_t.copy_(t, non_blocking=t.is_pinned())
            group.move_storage(attr, device_t)
            _add(moved, _GRAD_KINDS[attr], _nbytes(t))
    for state in states:
        for group in state.groups:
            group.repoint_views()
    _sync(device)
    for state in states:
        for group in state.groups:
            group.reattach_grads()
    return moved


# ---------------------------------------------------------------------- optimizer
_OPT_ATTR = "_graph_fsdp_offloaded"
_OPT_KEEPER = "_graph_fsdp_address_keeper"


def _optimizer_keeper(
    per_root: list[list[FSDPState]], optimizer: torch.optim.Optimizer
) -> AddressKeeper | None:
    """The optimizer's own region (its state keeps its addresses) when its model's do."""
    model_keeper = _keeper(per_root[0])
    if model_keeper is None:
        return None
    keeper = getattr(optimizer, _OPT_KEEPER, None)
    if keeper is None:
        keeper = AddressKeeper(model_keeper.backend, model_keeper.device)
        setattr(optimizer, _OPT_KEEPER, keeper)
    return keeper


def _check_optimizer(optimizer, action: str) -> None:
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"{action}(model_or_chunks, optimizer): the second argument must be a "
            f"torch.optim.Optimizer, got {type(optimizer).__name__}"
        )


def offload_optimizer(
    model_or_chunks: ModelOrChunks, optimizer: torch.optim.Optimizer
) -> dict[str, int]:
    """Move every optimizer state tensor on the model's device (``exp_avg``, ...) to (pinned)
    CPU memory; ``optimizer.step()`` is refused until :func:`onload_optimizer`. The state dicts
    and their keys (the sharded params) are kept."""
    _check_optimizer(optimizer, "offload_optimizer")
    per_root = _roots(model_or_chunks, "offload_optimizer")
    if getattr(optimizer, _OPT_ATTR, None) is not None:
        raise RuntimeError("offload_optimizer: this optimizer's state is already offloaded")
    announce(per_root[0][0].root.offload_mode)
    device = per_root[0][0].groups[0].device
    keeper = _optimizer_keeper(per_root, optimizer)
    moved: dict[tuple[int, str], torch.Tensor | None] = {}
    freed = 0
    for p, st in optimizer.state.items():
        for name, value in st.items():
            if torch.is_tensor(value) and value.device == device and value.numel():
                st[name] = _to_host(value)
                # Kept: the region's storage comes back at its address; else re-made.
                kept = keeper is not None and keeper.owns(value)
                moved[(id(p), name)] = value if kept else None
                freed += _nbytes(value)
    _sync(device)
    if keeper is not None:
        keeper.release("optim", [t for t in moved.values() if t is not None])
    handle = optimizer.register_step_pre_hook(_refuse_step)
    setattr(optimizer, _OPT_ATTR, (moved, device, handle))
    return {"optimizer_state": freed, "total": freed}


def onload_optimizer(
    model_or_chunks: ModelOrChunks, optimizer: torch.optim.Optimizer
) -> dict[str, int]:
    """Bring the state :func:`offload_optimizer` moved back to the device (with addresses
    kept: into the optimizer's region, at the addresses it had there)."""
    _check_optimizer(optimizer, "onload_optimizer")
    per_root = _roots(model_or_chunks, "onload_optimizer")
    record = getattr(optimizer, _OPT_ATTR, None)
    if record is None:
        raise RuntimeError(
            "onload_optimizer without offload_optimizer: the optimizer's state was not "
            "offloaded (call offload_optimizer(model, optimizer) first)"
        )
    moved, device, handle = record
    keeper = _optimizer_keeper(per_root, optimizer)
    if keeper is not None:
        keeper.restore("optim")
    total = 0
    for p, st in optimizer.state.items():
        for name, value in st.items():
            key = (id(p), name)
            if key not in moved:
                continue
            target = moved[key]
            if target is not None:
                target.copy_(value, non_blocking=value.is_pinned())
            elif keeper is not None:  # first onload: the state moves into its region
                target = keeper.empty("optim", value.shape, value.dtype)
                target.copy_(value, non_blocking=value.is_pinned())
            else:
                target = _to_device(value, device)
            st[name] = target
            total += _nbytes(target)
    _sync(device)
    handle.remove()
    setattr(optimizer, _OPT_ATTR, None)
    return {"optimizer_state": total, "total": total}


def _refuse_step(optimizer, args, kwargs) -> None:
    raise RuntimeError(
        "optimizer.step() with offloaded optimizer state: call "
        "onload_optimizer(model, optimizer) (model.onload_optimizer(optimizer)) first"
    )


# ---------------------------------------------------------------------- export
def iter_full_params(
    model_or_chunks: ModelOrChunks,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(fqn, full tensor)`` for every parameter of every model chunk, unit by unit.

    Memory is bounded by one unit: its flat main weights are all-gathered, its parameters
    are yielded (as independent tensors, cast to ``dtype`` and moved to ``device`` when
    given), then the gathered buffer is released before the next unit. Every rank must
    iterate to the end (the gathers are collectives). Names are relative to each chunk.
    Works while the parameters are offloaded (each unit visits the device for its gather).
    """
    for module in chunks_of(model_or_chunks, "iter_full_params"):
        states = collect_states(module)
        if not states:
            raise ValueError(
                f"iter_full_params: {type(module).__name__} has no fully_shard-ed units"
            )
        if states[0].root is None:
            states[0].lazy_init()
        check_idle(states[0].root.states, "iter_full_params")
        for state in states:
            for group in state.groups:
                yield from _group_full_params(group, dtype, device)


def _group_full_params(group: FlatParamGroup, dtype, device) -> Iterator[tuple[str, torch.Tensor]]:
    local = group.main_flat
    if local.device != group.device:  # offloaded: gather on the device
        local = local.to(group.device)
    if group.placements.optim and group.comm.world_size > 1:
        full = torch.empty(group.layout.total, dtype=local.dtype, device=group.device)
        torch.distributed.all_gather_into_tensor(full, local, group=group.comm.group)
    else:
        full = local
    del local
    # Expert groups: the global parameters under their global names (every EP rank's experts,
    # experts.py [Note: expert groups]), so an inference engine of any EP size can load them.
    for name, view in group.full_params(full):
        out = view.to(dtype=dtype or view.dtype, device=device or view.device, copy=True)
        yield name, out
    del full
