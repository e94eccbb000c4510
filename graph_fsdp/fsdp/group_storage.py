"""The storage moves of a ``FlatParamGroup``: offload, onload and kept addresses.

The group's persistent tensors (param_group.py's table) change place in two ways, both through
these methods of the group and nowhere else: offload swaps their storage in place, to the host
and back (offload.py [Note: offload keeps identities]), and a model whose addresses are kept
moves them into the regions whose memory offload releases (address_keeping.py [Note: offload
keeps addresses]). What the group does in a step is param_group.py's; this is where its tensors
live between steps.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from graph_fsdp.fsdp.address_keeping import AddressKeeper

_SWAPPABLE = ("main_flat", "main_grad", "accum")
"""The persistent tensors whose storage offload swaps in place ([Note: offload keeps
identities])."""


class StorageMoves:
    """Mixed into ``FlatParamGroup`` (its tensors, layout and ``ParamRef`` s are the group's)."""

    def move_storage(self, name: str, tensor: torch.Tensor) -> None:
        """``main_flat``, ``main_grad`` or ``accum`` now use ``tensor``'s storage (the object
        stays; the views follow at :meth:`repoint_views`). New main weights make the compute
        weights stale."""
        if name not in _SWAPPABLE:
            raise ValueError(f"move_storage: {name!r} is none of {_SWAPPABLE}")
        getattr(self, name).data = tensor
        if name == "main_flat":
            self.dirty = True

    def persistent_grads(self) -> dict[str, torch.Tensor]:
        """The gradient tensors kept between steps: ``main_grad`` and, once made, ``accum``."""
        grads = {"main_grad": self.main_grad}
        if self.accum is not None:
            grads["accum"] = self.accum
        return grads

    def compute_weights(self) -> dict[str, torch.Tensor]:
        """The compute-weight tensors kept between steps, by offload's kind: ZeRO-1/2's
        ``compute_full``, HSDP's ``compute_shard`` (``optim_over_replicas`` only)."""
        kept = {"compute_full": self.persistent_full, "compute_shard": self.compute_shard}
        return {kind: t for kind, t in kept.items() if t is not None}

    def drop_compute_weights(self) -> None:
        """Give the compute weights' memory back (offload without kept addresses)."""
        if self.compute_shard is not None:
            self.compute_shard = torch.empty(0, dtype=self.compute_dtype, device=self.device)
        self.persistent_full = None

    def renew_compute_weights(self, empty: Callable | None = None) -> None:
        """New compute-weight tensors from ``empty(numel, dtype)`` (default: on the device),
        their values rebuilt from the main weights at the next gather (``dirty``)."""
        if empty is None:

            def empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
                return torch.empty(numel, dtype=dtype, device=self.device)

        if not self.placements.params:
            self.persistent_full = empty(self.layout.total, self.compute_dtype)
        if self.compute_shard is not None:
            self.compute_shard = empty(self.shard_numel, self.compute_dtype)
        self.dirty = True

    def repoint_views(self) -> None:
        """Sharded params as views of ``main_flat`` again, and grad views of ``main_grad``,
        after either's storage was swapped (offload.py [Note: offload keeps identities])."""
        lo = self.owned[0]
        grad_lo = lo if self.placements.grads else 0
        # A released main grad ([Note: releasable main grads]) has no bytes to slice: its
        # views stay on its storage, which gets its bytes back before the next use.
        grads = self.main_grad.untyped_storage().nbytes() > 0
        for ref in self.params:
            offset = self.layout.offsets[ref.index]
            start = ref.global_offset
            end = start + ref.sharded.numel()
            ref.sharded.data = self.main_flat[offset + start - lo : offset + end - lo]
            if grads:
                ref.grad_view = self.main_grad[offset + start - grad_lo : offset + end - grad_lo]

    def detach_grads(self) -> None:
        """Remember which sharded params have a ``.grad`` and unset it (re-attached as a view
        of ``main_grad`` once params and grads are on the same device again)."""
        for i, ref in enumerate(self.params):
            p = ref.sharded
            if p.grad is not None:
                if p.grad is not ref.grad_view:
                    ref.grad_view.copy_(p.grad)  # a grad the user replaced: keep its values
                self._detached_grads.add(i)
                p.grad = None

    def reattach_grads(self) -> None:
        for i in sorted(self._detached_grads):
            ref = self.params[i]
            if ref.sharded.device == ref.grad_view.device:
                ref.sharded.grad = ref.grad_view
                self._detached_grads.discard(i)

    def grads_live(self) -> bool:
        """Whether ``main_grad`` holds values someone reads: a sharded ``.grad`` is attached
        (or detached by an offload, to be re-attached). Otherwise the next reduction
        overwrites it."""
        return self.grads_defined() or bool(self._detached_grads)

    def adopt_addresses(self, keeper: AddressKeeper) -> None:
        """Move the persistent device tensors into ``keeper``'s regions (at lazy init: nothing
        has captured their addresses yet; address_keeping.py [Note: offload keeps
        addresses])."""
        self.move_storage("main_flat", keeper.adopt("params", self.main_flat))
        self.ensure_main_grad()
        self.move_storage("main_grad", keeper.adopt("grads", self.main_grad))
        self.pin_main_grad()  # its storage never comes and goes: graphs may write it
        if self.accum is not None:
            self.move_storage("accum", keeper.adopt("grads", self.accum))
        self.persistent_region = keeper.region_of("grads")
        self.renew_compute_weights(lambda numel, dtype: keeper.empty("params", (numel,), dtype))
        self.repoint_views()
