"""Offload and onload of sharded state, for RL loops that alternate training and rollout.

    model.offload_params(); model.offload_grads(); model.offload_optimizer(opt)  # rollout
    ...                                                   # the inference engine uses the GPU
    model.onload_params(); model.onload_grads(); model.onload_optimizer(opt)     # train again
    for name, tensor in graph_fsdp.iter_full_params([chunk0, chunk1], dtype=torch.bfloat16):
        engine.load_weight(name, tensor)                  # weight sync, one unit at a time

Offload moves the sharded state to (pinned) CPU memory and frees the device copies; onload
brings it back. Every call returns the bytes it freed (or re-allocated), by kind.

[Note: offload keeps identities] The optimizer and checkpoints hold the sharded parameters
(1-D views of each group's ``main_flat``), so those objects must survive offload. Each group
swaps its flat tensor's storage in place (``main_flat.data = cpu_copy``) and re-points every
sharded parameter at a view of it (``param.data = main_flat[a:b]``): the objects, and the
version counter they share with ``main_flat`` (what ``FlatParamGroup.stale`` reads), are kept;
the views stay consistent with the flat tensor on either side. ``main_grad`` and its
``.grad`` views move the same way; gradients are detached while the two sides differ and
re-attached on onload.

[Note: CUDA graphs across offload] Onload cannot give the buffers their old addresses back
(the caching allocator decides), so graphs are *recaptured*: offload_params suspends every
live runner of the model (its graphs are reset and their pool freed now) and releases the
static allocator's slots (bumping its generation), and the runner's next ``before_step``
captures again (layerwise) or its next step does (full_iteration). The first step after an
onload therefore pays one capture, and replays bit-identically afterwards.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from graph_fsdp.param_group import FlatParamGroup
from graph_fsdp.state import FSDPState, TrainingState, collect_states, in_backward, state_of


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


# ---------------------------------------------------------------------- checks
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


def check_idle(states: list[FSDPState], action: str) -> None:
    if in_backward():
        raise RuntimeError(
            f"{action} during a backward pass: call it between training steps (after "
            "optimizer.step()), never from a hook or autograd function"
        )
    busy = [f"{s.fqn} ({s.training_state.value})" for s in states]
    busy = [b for b, s in zip(busy, states) if s.training_state is not TrainingState.IDLE]
    if busy:
        raise RuntimeError(
            f"{action} while units are mid-step: {busy[:4]}; call it between training steps "
            "(after backward and optimizer.step())"
        )


def _offloaded(states: list[FSDPState]) -> set[str]:
    return states[0].root.offloaded


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


# ---------------------------------------------------------------------- gradients' views
def _detach_grads(group: FlatParamGroup) -> None:
    """Remember which sharded params have a ``.grad`` and unset it (it is re-attached as a
    view of ``main_grad`` once params and grads are on the same device again)."""
    pending = group.__dict__.setdefault("_lifecycle_grads", set())
    for i, ref in enumerate(group.params):
        p = ref.sharded
        if p.grad is not None:
            if p.grad is not ref.grad_view:
                ref.grad_view.copy_(p.grad)  # a grad the user replaced: keep its values
            pending.add(i)
            p.grad = None


def _reattach_grads(group: FlatParamGroup) -> None:
    pending = group.__dict__.get("_lifecycle_grads", set())
    for i in sorted(pending):
        ref = group.params[i]
        if ref.sharded.device == ref.grad_view.device:
            ref.sharded.grad = ref.grad_view
            pending.discard(i)


def _repoint_params(group: FlatParamGroup) -> None:
    """Sharded params as views of ``main_flat`` again, and grad views of ``main_grad``."""
    lo = group.owned[0]
    grad_lo = lo if group.placements.grads else 0
    for ref in group.params:
        offset = group.layout.offsets[ref.index]
        start = ref.global_offset
        end = start + ref.sharded.numel()
        ref.sharded.data = group.main_flat[offset + start - lo : offset + end - lo]
        ref.grad_view = group.main_grad[offset + start - grad_lo : offset + end - grad_lo]


# ---------------------------------------------------------------------- params
def offload_params(model: nn.Module) -> dict[str, int]:
    """Move every unit's sharded main weights to (pinned) CPU memory and free the device
    copies, the compute-weight buffers, the allocator's slots and the graphs' pools.

    Returns bytes freed by kind (``total`` included). Training and forward are refused
    until :func:`onload_params`.
    """
    states = root_states(model, "offload_params")
    offloaded = _offloaded(states)
    if "params" in offloaded:
        raise RuntimeError("offload_params: the parameters are already offloaded")
    freed = {"graph_pools": _suspend_graphs(states)}
    root = states[0].root
    slots = _slot_bytes(root.allocator)
    device = states[0].groups[0].device
    for state in states:
        state.reshard()
        for group in state.groups:
            _detach_grads(group)
            freed["main_params"] = freed.get("main_params", 0) + _nbytes(group.main_flat)
            group.main_flat.data = _to_host(group.main_flat)
            if group.compute_shard is not None:  # HSDP optim_over_replicas only
                freed["compute_shard"] = freed.get("compute_shard", 0) + _nbytes(
                    group.compute_shard
                )
                group.compute_shard = torch.empty(0, dtype=group.compute_dtype, device=device)
            persistent = getattr(group, "_persistent_full", None)
            if persistent is not None:
                freed["compute_full"] = freed.get("compute_full", 0) + _nbytes(persistent)
                group._persistent_full = None
            _drop_unsharded(group)
    _sync(device)
    for state in states:
        for group in state.groups:
            _repoint_params(group)
    root.allocator.release()  # slots (and graphs that read them) must be re-made
    freed["allocator_slots"] = slots
    offloaded.add("params")
    freed["total"] = sum(freed.values())
    return freed


def _slot_bytes(allocator) -> int:
    """Bytes of the static allocator's slots that exist now (``release`` frees them)."""
    slots = getattr(allocator, "slots", None)
    if slots is None:
        return 0
    return sum(slot.nbytes for slot in slots() if slot.tensor is not None)


def _drop_unsharded(group: FlatParamGroup) -> None:
    """Forget the unsharded params and gathered buffers (their bytes go with them)."""
    for ref in group.params:
        ref.unsharded = None
    group.full = group.grad_full = None
    group._unsharded_built = False
    group._holds_full = False
    group._grads_attached_to = None
    group._gather_views = group._grad_views = None
    group.ag_event = None


def onload_params(model: nn.Module) -> dict[str, int]:
    """Bring the main weights back to the device and re-create the compute buffers (their
    contents are refreshed from the main weights by the next unshard). Returns the bytes
    allocated on the device by kind."""
    states = root_states(model, "onload_params")
    offloaded = _offloaded(states)
    if "params" not in offloaded:
        raise RuntimeError(
            "onload_params without offload_params: the parameters are on the device already"
        )
    device = states[0].groups[0].device
    moved: dict[str, int] = {}
    for state in states:
        for group in state.groups:
            group.main_flat.data = _to_device(group.main_flat, device)
            moved["main_params"] = moved.get("main_params", 0) + _nbytes(group.main_flat)
            if group.compute_shard is not None:  # HSDP optim_over_replicas only
                group.compute_shard = torch.empty(
                    group.shard_numel, dtype=group.compute_dtype, device=device
                )
                moved["compute_shard"] = moved.get("compute_shard", 0) + _nbytes(
                    group.compute_shard
                )
            if not group.placements.params:
                group._persistent_full = torch.empty(
                    group.layout.total, dtype=group.compute_dtype, device=device
                )
                moved["compute_full"] = moved.get("compute_full", 0) + _nbytes(
                    group._persistent_full
                )
            _repoint_params(group)
            group.dirty = True  # compute weights are rebuilt from the main weights
    _sync(device)
    for state in states:
        for group in state.groups:
            _reattach_grads(group)
    offloaded.discard("params")
    moved["total"] = sum(moved.values())
    return moved


# ---------------------------------------------------------------------- grads
def offload_grads(model: nn.Module) -> dict[str, int]:
    """Move the sharded main gradients (and ``no_sync`` accumulators) to (pinned) CPU memory,
    values kept. Returns bytes freed by kind; training is refused until :func:`onload_grads`."""
    states = root_states(model, "offload_grads")
    offloaded = _offloaded(states)
    if "grads" in offloaded:
        raise RuntimeError("offload_grads: the gradients are already offloaded")
    freed: dict[str, int] = {}
    device = states[0].groups[0].device
    for state in states:
        for group in state.groups:
            _detach_grads(group)
            freed["main_grads"] = freed.get("main_grads", 0) + _nbytes(group.main_grad)
            group.main_grad.data = _to_host(group.main_grad)
            if group.accum is not None:
                freed["grad_accum"] = freed.get("grad_accum", 0) + _nbytes(group.accum)
                group.accum.data = _to_host(group.accum)
    _sync(device)
    for state in states:
        for group in state.groups:
            _repoint_params(group)
    offloaded.add("grads")
    freed["total"] = sum(freed.values())
    return freed


def onload_grads(model: nn.Module) -> dict[str, int]:
    """Bring the main gradients back; ``.grad`` views are re-attached where they were."""
    states = root_states(model, "onload_grads")
    offloaded = _offloaded(states)
    if "grads" not in offloaded:
        raise RuntimeError(
            "onload_grads without offload_grads: the gradients are on the device already"
        )
    device = states[0].groups[0].device
    moved: dict[str, int] = {}
    for state in states:
        for group in state.groups:
            group.main_grad.data = _to_device(group.main_grad, device)
            moved["main_grads"] = moved.get("main_grads", 0) + _nbytes(group.main_grad)
            if group.accum is not None:
                group.accum.data = _to_device(group.accum, device)
                moved["grad_accum"] = moved.get("grad_accum", 0) + _nbytes(group.accum)
            _repoint_params(group)
    _sync(device)
    for state in states:
        for group in state.groups:
            _reattach_grads(group)
    offloaded.discard("grads")
    moved["total"] = sum(moved.values())
    return moved


# ---------------------------------------------------------------------- optimizer
_OPT_ATTR = "_graph_fsdp_offloaded"


def offload_optimizer(optimizer: torch.optim.Optimizer, device: torch.device) -> dict[str, int]:
    """Move every optimizer state tensor on ``device`` (``exp_avg``, ``exp_avg_sq``, ...) to
    (pinned) CPU memory; ``optimizer.step()`` is refused until :func:`onload_optimizer`.
    The state dicts and their keys (the sharded params) are kept."""
    if getattr(optimizer, _OPT_ATTR, None) is not None:
        raise RuntimeError("offload_optimizer: this optimizer's state is already offloaded")
    check_idle([], "offload_optimizer")
    moved: dict[tuple[int, str], torch.device] = {}
    freed = 0
    for p, st in optimizer.state.items():
        for name, value in st.items():
            if torch.is_tensor(value) and value.device == device and value.numel():
                st[name] = _to_host(value)
                moved[(id(p), name)] = value.device
                freed += _nbytes(value)
    _sync(device)
    handle = optimizer.register_step_pre_hook(_refuse_step)
    setattr(optimizer, _OPT_ATTR, (moved, handle))
    return {"optimizer_state": freed, "total": freed}


def onload_optimizer(optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bring the state :func:`offload_optimizer` moved back to its device."""
    record = getattr(optimizer, _OPT_ATTR, None)
    if record is None:
        raise RuntimeError(
            "onload_optimizer without offload_optimizer: the optimizer's state was not "
            "offloaded (call model.offload_optimizer(optimizer) first)"
        )
    moved, handle = record
    total = 0
    device = None
    for p, st in optimizer.state.items():
        for name, value in st.items():
            target = moved.get((id(p), name))
            if target is not None:
                st[name] = _to_device(value, target)
                total += _nbytes(value)
                device = target
    if device is not None:
        _sync(device)
    handle.remove()
    setattr(optimizer, _OPT_ATTR, None)
    return {"optimizer_state": total, "total": total}


def _refuse_step(optimizer, args, kwargs) -> None:
    raise RuntimeError(
        "optimizer.step() with offloaded optimizer state: call "
        "model.onload_optimizer(optimizer) first"
    )


# ---------------------------------------------------------------------- export
def iter_full_params(
    chunks: nn.Module | Iterable[nn.Module],
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
    modules = [chunks] if isinstance(chunks, nn.Module) else list(chunks)
    for module in modules:
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
