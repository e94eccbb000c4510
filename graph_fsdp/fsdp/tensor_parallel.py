"""Tensor parallelism under FSDP: each TP rank's local parameters sharded over data parallel.

    mesh = init_device_mesh("cuda", (dp, tp), mesh_dim_names=("dp", "tp"))
    parallelize_module(model, mesh["tp"], plan)   # parameters become DTensors over tp
    for layer in model.layers:
        fully_shard(layer, mesh=mesh["dp"])        # their local tensors sharded over dp
    fully_shard(model, mesh=mesh["dp"])

This is torchtitan's order (``apply_tp`` then ``apply_fsdp``). Megatron-Core's tensor-parallel
layers hold plain tensors with its ``tensor_model_parallel`` / ``partition_dim`` attributes
instead; :func:`mark_tensor_parallel` describes them the same way (integrations/megatron/tp.py).

[Note: tensor-parallel parameters]
- What graph_fsdp shards: a parameter's *local* tensor (this TP rank's piece), flattened into
  the unit's flat buffer like any plain parameter; the data-parallel mesh is the TP mesh's
  other dimension (the two groups meet only in this rank). :class:`TPSpec` keeps where the
  local tensor lies in the global one.
- What ``model.parameters()``, the optimizer and ``model.state_dict()`` see between steps: plain
  1-D views of this rank's fp32 main shard, as for every parameter (elementwise optimizers
  need nothing more). The global view lives in :class:`TPSpec` (``param._graph_fsdp_tp``):
  ``clip_grad_norm_`` sums a TP-sharded parameter's squares over the TP group too and counts a
  replicated one once (grad_norm.py); checkpoints save each piece at its place in the *global*
  tensor (checkpoint.py), so they load at any (dp, tp) shape; ``full_state_dict`` and
  ``iter_full_params`` gather over dp, then over tp.
- What the module sees in forward and backward: the gathered local tensor, wrapped again as a
  DTensor with the parameter's TP placements (DTensor parameters), so the TP plan's modules
  and their collectives run as under TP alone; Megatron's layers get the plain local tensor.
- Gradients of replicated parameters that see sharded activations (norms under sequence
  parallelism) arrive as ``Partial`` DTensors; before the data-parallel reduction they are
  redistributed to the parameter's placements (an all-reduce over tp), as torch FSDP2 does
  (``FSDPParam._get_grad_inner_tensor``). Under layerwise CUDA graphs the preset ``.grad`` is a
  DTensor with the parameter's placements and autograd's accumulation into it does the same
  all-reduce inside the backward graph. Megatron all-reduces its own (``sequence_parallel``)
  ones after the data-parallel reduction, in ``finalize_model_grads``
  (integrations/megatron/tp.py).

[Note: strided tensor-parallel pieces]
Megatron's gated MLP (SwiGLU: ``gated_linear_unit``) builds ``linear_fc1`` with
``partition_stride=2`` (megatron/core/transformer/mlp.py, ``fc1_stride``): the global weight is
``[gate; up]`` (2 x ffn rows) and TP rank r of N holds ``[gate_r; up_r]``, its slice of the gate
rows then its slice of the up rows, so that its local output chunks into (gate, up) for the
GLU. In general (``_initialize_affine_weight_cpu`` in megatron/core/tensor_parallel/layers.py)
the partition dim is cut into ``N * stride`` equal blocks and rank r holds blocks
``r, r + N, r + 2N, ...`` in that order. :class:`TPSpec` keeps ``partition_stride`` and maps
both ways: :meth:`TPSpec.full_tensor` puts the gathered blocks back in global order,
:meth:`TPSpec.local_of` cuts a rank's blocks out of a global tensor, and
:meth:`TPSpec.global_boxes` gives the checkpoint each local block as its box of the global
tensor. So checkpoints and full state dicts hold the *logical* weight (``[gate; up]``, which is
what a TP 1 model holds), and load at any TP size. Norms need nothing: the squares of a rank's
blocks are its share of the global sum whatever their order.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor

TP_ATTR = "_graph_fsdp_tp"
"""Attribute holding a parameter's :class:`TPSpec`: set by :func:`mark_tensor_parallel` on a
plain (Megatron) parameter, by ``fully_shard`` on the sharded parameter."""


def data_address(t: torch.Tensor) -> int:
    """The address of ``t``'s bytes: a DTensor's local tensor's (``DTensor.data_ptr()`` is 0
    for every DTensor, so comparing it would take any two DTensors for one buffer - a graph
    replay would then skip copying a new input into its static one)."""
    local = getattr(t, "_local_tensor", None)
    return (t if local is None else local).data_ptr()


@dataclass(frozen=True, eq=False)
class TPSpec:
    """Where one rank's local tensor of a tensor-parallel parameter lies in the global one."""

    group: dist.ProcessGroup
    """The tensor-parallel group."""
    size: int
    rank: int
    dim: int | None
    """The dimension split over the group (None: every TP rank holds the whole tensor)."""
    shape: torch.Size
    """The global shape."""
    offsets: tuple[int, ...]
    """The local tensor's first index in the global tensor, per dimension."""
    local_shape: torch.Size
    mesh: object = None
    """DTensor parameters: the 1-D TP DeviceMesh their compute weights are DTensors on (None:
    plain compute weights, as Megatron's layers take them)."""
    placements: tuple = ()
    stride: tuple[int, ...] = ()
    """The global tensor's stride (DTensor metadata)."""
    partition_stride: int = 1
    """Blocks of ``dim`` per TP rank, interleaved across ranks ([Note: strided tensor-parallel
    pieces]); 1 = one contiguous piece (``offsets`` is then where it lies; with more, where the
    first block lies)."""

    @property
    def sharded(self) -> bool:
        return self.dim is not None and self.size > 1

    @property
    def strided(self) -> bool:
        return self.sharded and self.partition_stride > 1

    def describe(self) -> str:
        where = "replicated" if self.dim is None else f"split along dim {self.dim}"
        if self.strided:
            where += f" in {self.partition_stride} interleaved blocks per rank"
        return f"{where} over a TP group of {self.size}, global shape {tuple(self.shape)}"

    def blocks(self) -> list[tuple[int, int, int]]:
        """The local tensor's pieces along ``dim``: ``(local offset, global offset, length)``
        ([Note: strided tensor-parallel pieces])."""
        d = self.dim
        if d is None:
            return []
        if not self.strided:
            return [(0, self.offsets[d], self.local_shape[d])]
        block = self.local_shape[d] // self.partition_stride
        return [
            (k * block, (k * self.size + self.rank) * block, block)
            for k in range(self.partition_stride)
        ]

    # ----------------------------------------------------------------- compute weights
    def compute_param(self, local: torch.Tensor, requires_grad: bool) -> nn.Parameter:
        """The parameter the module uses in forward: ``local`` (a view of the gathered
        flat buffer), as a DTensor with the TP placements for DTensor parameters."""
        if self.mesh is None:
            return nn.Parameter(local, requires_grad=requires_grad)
        return nn.Parameter(self._dtensor(local), requires_grad=requires_grad)

    def grad_holder(self, local: torch.Tensor) -> torch.Tensor:
        """A preset ``.grad`` over ``local`` for the compute parameter (layerwise graphs)."""
        return local if self.mesh is None else self._dtensor(local)

    def _dtensor(self, local: torch.Tensor):
        from torch.distributed.tensor import DTensor  # noqa: PLC0415 (slow import, DTensors only)

        with torch.no_grad():
            return DTensor.from_local(
                local,
                self.mesh,
                self.placements,
                run_check=False,
                shape=self.shape,
                stride=self.stride,
            )

    def local_grad(self, grad: torch.Tensor) -> torch.Tensor:
        """This rank's local gradient in the parameter's own layout: a DTensor gradient of
        other placements (``Partial`` under sequence parallelism, ``Replicate`` for a sharded
        embedding) is redistributed first ([Note: tensor-parallel parameters])."""
        if self.mesh is None:
            return grad
        if tuple(grad.placements) != self.placements:
            grad = grad.redistribute(self.mesh, self.placements)
        local = grad._local_tensor
        if isinstance(local, AsyncCollectiveTensor):
            local = local.wait()
        return local

    # ----------------------------------------------------------------- global tensors
    def full_tensor(self, local: torch.Tensor) -> torch.Tensor:
        """The global tensor from every TP rank's ``local`` (a collective over the group)."""
        if not self.sharded:
            return local
        d = self.dim
        chunk = -(-self.shape[d] // self.size)
        moved = local.movedim(d, 0)
        padded = torch.zeros((chunk, *moved.shape[1:]), dtype=local.dtype, device=local.device)
        padded[: moved.shape[0]].copy_(moved)
        out = torch.empty(
            (self.size * chunk, *moved.shape[1:]), dtype=local.dtype, device=local.device
        )
        dist.all_gather_into_tensor(out, padded, group=self.group)
        if self.strided:  # [rank][block] -> [block][rank]: the global order (even split)
            k = self.partition_stride
            out = out.view(self.size, k, chunk // k, *moved.shape[1:]).transpose(0, 1)
            out = out.reshape(self.size * chunk, *moved.shape[1:])
        return out[: self.shape[d]].movedim(0, d).contiguous()

    def local_of(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's piece of a global tensor ``full`` (a copy for strided pieces)."""
        if self.dim is None:
            return full
        if self.strided:
            return torch.cat([full.narrow(self.dim, g, n) for _, g, n in self.blocks()], self.dim)
        return full.narrow(self.dim, self.offsets[self.dim], self.local_shape[self.dim])

    def global_boxes(self, start: int, stop: int) -> list[tuple[int, tuple, tuple]]:
        """``[start, stop)`` of the row-major flattening of the local tensor as boxes of the
        global tensor: ``(flat position in the local tensor of the box's first element, global
        offsets, sizes)``, each contiguous in the local flattening (a checkpoint's chunks)."""
        local = tuple(self.local_shape)
        if not self.strided:
            base = self.offsets
            return [
                (s, tuple(o + b for o, b in zip(offs, base)), z)
                for s, offs, z in flat_boxes(local, start, stop)
            ]
        # The local tensor seen with its blocks as an axis before ``dim``: (..., k, block, ...).
        d, k = self.dim, self.partition_stride
        block = local[d] // k
        split = (*local[:d], k, block, *local[d + 1 :])
        strides = [math.prod(split[i + 1 :]) for i in range(len(split))]
        out = []
        for _, offs, sizes in flat_boxes(split, start, stop):
            # One block per box: fix every axis up to the block axis (the box covers the ones
            # after its first ranged axis whole, so each part stays contiguous).
            lead = itertools.product(*(range(o, o + z) for o, z in zip(offs[: d + 1], sizes)))
            for index in lead:
                first = (*index, *offs[d + 1 :])
                pos = sum(i * st for i, st in zip(first, strides))
                g = [*index[:d], (index[d] * self.size + self.rank) * block + offs[d + 1]]
                g += list(offs[d + 2 :])
                z = (*[1] * d, *sizes[d + 1 :])
                out.append((pos, tuple(g), z))
        return out


def _chunk(size: int, parts: int, rank: int) -> tuple[int, int]:
    """(offset, length) of ``rank``'s piece of ``size`` split like ``torch.chunk`` (DTensor's
    ``Shard``, Megatron's equal split)."""
    full = -(-size // parts)
    start = min(rank * full, size)
    return start, max(min(size, start + full) - start, 0)


def make_spec(
    group: dist.ProcessGroup,
    dim: int | None,
    local_shape: torch.Size,
    global_shape: torch.Size,
    partition_stride: int = 1,
    **dtensor,
) -> TPSpec:
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    offsets = [0] * len(global_shape)
    if dim is not None:  # strided: the first block's (rank r's blocks are r, r + size, ...)
        offsets[dim] = _chunk(global_shape[dim] // partition_stride, size, rank)[0]
    return TPSpec(
        group,
        size,
        rank,
        dim,
        torch.Size(global_shape),
        tuple(offsets),
        torch.Size(local_shape),
        partition_stride=partition_stride,
        **dtensor,
    )


def mark_tensor_parallel(
    params: Iterable[tuple[nn.Parameter, int | None] | tuple[nn.Parameter, int | None, int]],
    group: dist.ProcessGroup,
) -> None:
    """Describe plain parameters holding this rank's piece of a tensor-parallel parameter
    (Megatron's ``tensor_model_parallel`` ones: ``(param, partition_dim)`` or ``(param,
    partition_dim, partition_stride)``; dim ``None`` for the ones every TP rank holds whole)
    before ``fully_shard``: the global shape is the local one with ``dim`` times the group size
    (an even split, as Megatron requires); a stride above 1 says the piece is that many
    interleaved blocks ([Note: strided tensor-parallel pieces])."""
    size = dist.get_world_size(group)
    for p, dim, *rest in params:
        stride = rest[0] if rest else 1
        if getattr(p, "_graph_fsdp_sharded", False) or getattr(p, "_graph_fsdp_sharded_as", None):
            raise ValueError(
                "mark_tensor_parallel after fully_shard: describe the parameters before "
                "sharding the unit that holds them"
            )
        shape = list(p.shape)
        if dim is not None:
            if not 0 <= dim < len(shape):
                raise ValueError(
                    f"mark_tensor_parallel: partition dim {dim} of a parameter of shape "
                    f"{tuple(p.shape)} is out of range"
                )
            shape[dim] *= size
        if stride != 1 and (dim is None or stride < 1 or p.shape[dim] % stride):
            raise ValueError(
                f"mark_tensor_parallel: partition_stride={stride} for a parameter of shape "
                f"{tuple(p.shape)} split along dim {dim}: the stride must be a positive divisor "
                "of the local size along a partition dim (Megatron's blocks are equal)"
            )
        spec = make_spec(group, dim, p.shape, torch.Size(shape), partition_stride=stride)
        setattr(p, TP_ATTR, spec)


def dtensor_spec(p: torch.Tensor, fqn: str, owner: str) -> TPSpec:
    """The :class:`TPSpec` of DTensor parameter ``p`` (a 1-D mesh, Shard or Replicate)."""
    from torch.distributed.tensor import Replicate, Shard  # noqa: PLC0415 (slow import, DTensors only)

    mesh = p.device_mesh
    placements = tuple(p.placements)
    fix = (
        "parallelize the model over the 1-D tensor-parallel sub-mesh (parallelize_module(model, "
        "mesh['tp'], plan)) with ColwiseParallel / RowwiseParallel / SequenceParallel styles"
    )
    if mesh.ndim != 1:
        raise ValueError(
            f"fully_shard({owner}): parameter {fqn} is a DTensor on a {mesh.ndim}-D mesh "
            f"{tuple(mesh.shape)} {mesh.mesh_dim_names}; graph_fsdp shards DTensor parameters "
            f"of a 1-D tensor-parallel mesh: {fix}"
        )
    placement = placements[0]
    if isinstance(placement, Replicate):
        dim = None
    elif type(placement) is Shard:  # not a subclass (_StridedShard)
        dim = placement.dim % p.ndim
    else:
        raise ValueError(
            f"fully_shard({owner}): parameter {fqn} has placement {placement} on the "
            f"tensor-parallel mesh; graph_fsdp shards Shard(dim) and Replicate() parameters: {fix}"
        )
    local = p._local_tensor
    spec = make_spec(
        mesh.get_group(),
        dim,
        local.shape,
        p.shape,
        mesh=mesh,
        placements=placements,
        stride=tuple(p.stride()),
    )
    if dim is not None and _chunk(p.shape[dim], spec.size, spec.rank)[1] != local.shape[dim]:
        raise ValueError(
            f"fully_shard({owner}): parameter {fqn} of global shape {tuple(p.shape)} holds a "
            f"local tensor of shape {tuple(local.shape)} on TP rank {spec.rank} of {spec.size}, "
            f"not torch.chunk's split of dim {dim}: {fix}"
        )
    return spec


def spec_of(p: torch.Tensor, fqn: str, owner: str) -> TPSpec | None:
    """A parameter's :class:`TPSpec`: from its DTensor layout or :func:`mark_tensor_parallel`."""
    if is_dtensor(p):
        return dtensor_spec(p, fqn, owner)
    return getattr(p, TP_ATTR, None)


def is_dtensor(t: torch.Tensor) -> bool:
    if not dist.is_available():
        return False
    from torch.distributed.tensor import DTensor  # noqa: PLC0415 (slow import, DTensors only)

    return isinstance(t, DTensor)


def localize(
    entries: list, dp_group: dist.ProcessGroup, owner: str
) -> tuple[list, dict[str, TPSpec]]:
    """``fully_shard``'s entries with every tensor-parallel parameter replaced by its local
    tensor (a plain leaf with the parameter's ``requires_grad``), and FQN -> spec."""
    specs: dict[str, TPSpec] = {}
    out = []
    for fqn, owners, p in entries:
        spec = spec_of(p, fqn, owner)
        if spec is None:
            out.append((fqn, owners, p))
            continue
        _check_orthogonal(spec.group, dp_group, fqn, owner)
        specs[fqn] = spec
        local = p._local_tensor if is_dtensor(p) else p
        out.append((fqn, owners, local.detach().requires_grad_(p.requires_grad)))
    return out, specs


def _check_orthogonal(
    tp_group: dist.ProcessGroup, dp_group: dist.ProcessGroup, fqn: str, owner: str
) -> None:
    """The data-parallel group must be the tensor-parallel group's other mesh dimension."""
    tp = dist.get_process_group_ranks(tp_group)
    dp = dist.get_process_group_ranks(dp_group)
    common = sorted(set(tp) & set(dp))
    if common != [dist.get_rank()]:
        raise ValueError(
            f"fully_shard({owner}): parameter {fqn} is tensor-parallel over ranks {tp}, and the "
            f"data-parallel mesh covers ranks {dp}: they share ranks {common}, but they must be "
            "two dimensions of one mesh (sharing only this rank). Pass mesh=mesh['dp'] of the "
            "(dp, tp) mesh whose mesh['tp'] parallelized the model (Megatron: the "
            "data-parallel group of its parallel state)"
        )


# --------------------------------------------------------------------- checkpoint pieces
def flat_boxes(
    shape: tuple[int, ...], start: int, stop: int
) -> list[tuple[int, tuple[int, ...], tuple[int, ...]]]:
    """``[start, stop)`` of the row-major flattening of ``shape`` as boxes, each contiguous
    in that order: ``(flat position of its first element, offsets, sizes)``; at most
    ``2 * ndim - 1`` of them."""
    if start >= stop:
        return []
    if not shape:
        return [(start, (), ())]
    inner = math.prod(shape[1:])
    (r0, c0), (r1, c1) = divmod(start, inner), divmod(stop, inner)

    def row(r: int, lo: int, hi: int) -> list:
        return [(r * inner + s, (r, *o), (1, *z)) for s, o, z in flat_boxes(shape[1:], lo, hi)]

    if r0 == r1:
        return row(r0, c0, c1)
    boxes = []
    if c0:
        boxes += row(r0, c0, inner)
        r0 += 1
    if r1 > r0:
        boxes.append((r0 * inner, (r0, *[0] * (len(shape) - 1)), (r1 - r0, *shape[1:])))
    if c1:
        boxes += row(r1, 0, c1)
    return boxes


def box_runs(
    shape: tuple[int, ...], offsets: tuple[int, ...], sizes: tuple[int, ...]
) -> list[tuple[int, int]]:
    """A box of a tensor of ``shape`` as runs of its row-major flattening, in the box's own
    row-major order: ``(flat offset, length)``."""
    k = len(shape)  # the trailing dims the box covers whole fold into one run
    while k > 0 and sizes[k - 1] == shape[k - 1] and offsets[k - 1] == 0:
        k -= 1
    if k == 0:
        return [(0, math.prod(shape))]
    run = sizes[k - 1] * math.prod(shape[k:])
    strides = [math.prod(shape[i + 1 :]) for i in range(len(shape))]
    runs = []
    for index in itertools.product(*(range(o, o + z) for o, z in zip(offsets[: k - 1], sizes))):
        start = sum(i * s for i, s in zip(index, strides)) + offsets[k - 1] * strides[k - 1]
        runs.append((start, run))
    return runs
