"""Optimizer CPU offload: the optimizer state of the local shards lives in CPU memory.

    opt = CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, offload_fraction=0.5,
                              lr=1e-4, weight_decay=0.01)
    ... loss.backward(); opt.step(); opt.zero_grad()    # any torch optimizer class

The parameters ``fully_shard`` registers are plain 1-D tensors holding this rank's shard (no
DTensor), so everything here operates on local shards. The first ``offload_fraction`` of
the parameters (in order, by element count) are stepped on the CPU by one optimizer of
``optimizer_cls`` per bucket, over fp32 *master copies* in pinned memory; the rest are
stepped on the device by one more optimizer of that class. ``offload_fraction=0`` is the
plain device optimizer, 1 puts all the state on the CPU.

[Note: offloaded step] One step, on CUDA:
1. on a copy stream, after the backward: gradients (and master weights that changed on the
   device since the last step, e.g. loaded) device -> pinned host, bucket by bucket, one
   event per bucket;
2. meanwhile the device part's optimizer steps on the main stream;
3. per bucket: wait for its event, step it on the CPU, queue its updated weights host ->
   device on a second copy stream - the CPU steps bucket b+1 while bucket b travels;
4. the main stream waits for both copy streams (the next forward reads the new weights).
On CPU (gloo CI) the same code runs with synchronous copies. The math is the CPU optimizer's
over fp32 copies of the same values, so an offloaded fp32 run equals the same optimizer on
the CPU bit for bit (tests/lifecycle), and equals a device run up to the device kernels'
rounding.

State lives in ``self.state`` keyed by the *model's* parameters (aliases of the inner
optimizers' state dicts), so ``state_dict()``, ``load_state_dict()`` and
``graph_fsdp.fsdp.checkpoint`` treat it like any optimizer's: a checkpoint saved with offload
loads into a run without it (or with another fraction, or onto another world size) and
back, bit-exactly.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

_STEP_KEYS = ("step",)


def check_offload_config(*, recompute: bool, pipeline_parallel_size: int = 1) -> None:
    """Refuse optimizer CPU offload where it is not validated (Megatron-Bridge's rule).

    CPU offload is supported with ``pipeline_parallel_size == 1`` and activation recompute
    off; the CLI and configs call this before building the optimizer.
    """
    problems = []
    if recompute:
        problems.append("activation recompute is on (--recompute-activations)")
    if pipeline_parallel_size != 1:
        problems.append(f"pipeline_parallel_size={pipeline_parallel_size} (must be 1)")
    if problems:
        raise ValueError(
            "optimizer CPU offload is only supported with pipeline parallel size 1 and "
            f"activation recompute off, but {' and '.join(problems)}: turn recompute off and "
            "use pipeline_parallel_size=1, or set the offload fraction to 0"
        )


class _Bucket:
    """Consecutive offloaded parameters stepped by one CPU optimizer."""

    def __init__(self) -> None:
        self.params: list[torch.Tensor] = []
        self.masters: list[torch.Tensor] = []
        self.grads: list[torch.Tensor] = []
        self.optimizer: torch.optim.Optimizer | None = None
        self.event = None


class CPUOffloadOptimizer(torch.optim.Optimizer):
    """``optimizer_cls`` with the state of ``offload_fraction`` of the params on the CPU."""

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict],
        optimizer_cls: type[torch.optim.Optimizer] = torch.optim.AdamW,
        *,
        offload_fraction: float = 1.0,
        num_buckets: int = 4,
        cpu_kwargs: dict | None = None,
        **optimizer_kwargs,
    ) -> None:
        if not 0.0 <= offload_fraction <= 1.0:
            raise ValueError(
                f"offload_fraction={offload_fraction} must be in [0, 1] (the share of the "
                "parameters, by element count, whose optimizer state lives on the CPU)"
            )
        if num_buckets < 1:
            raise ValueError(f"num_buckets={num_buckets} must be >= 1")
        probe = optimizer_cls([torch.zeros(1)], **optimizer_kwargs)
        super().__init__(params, dict(probe.defaults))
        self.optimizer_cls = optimizer_cls
        self.offload_fraction = offload_fraction
        self.cpu_kwargs = dict(cpu_kwargs or {})
        """Overrides for the CPU buckets' optimizers only, e.g. ``{"fused": True}``: torch's
        fused CPU AdamW is several times faster than the default foreach path, but its
        rounding may differ in the last bit from the device optimizer's."""
        for p in self._all_params():
            if p.is_cuda and p.dtype != torch.float32:
                raise ValueError(
                    f"CPUOffloadOptimizer steps fp32 main weights; got a {p.dtype} parameter "
                    f"of shape {tuple(p.shape)} (fully_shard's main_params_dtype must be fp32)"
                )
        self._partition(num_buckets)

    # ------------------------------------------------------------------ construction
    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "buckets", None) is not None:
            raise RuntimeError(
                "CPUOffloadOptimizer places its parameters at construction: pass every param "
                "group to the constructor (add_param_group after it is not supported)"
            )
        super().add_param_group(param_group)

    def _all_params(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def _hparams(self, group: dict) -> dict:
        return {k: v for k, v in group.items() if k != "params"}

    def _partition(self, num_buckets: int) -> None:
        params = [p for p in self._all_params() if p.numel()]  # empty shards: no optimizer
        total = sum(p.numel() for p in params)
        limit = self.offload_fraction * total
        group_of = {id(p): i for i, g in enumerate(self.param_groups) for p in g["params"]}
        offloaded, on_device, seen = [], [], 0
        for p in params:
            (offloaded if seen < limit else on_device).append(p)
            seen += p.numel()
        pin = torch.cuda.is_available()
        per_bucket = -(-sum(p.numel() for p in offloaded) // num_buckets) if offloaded else 0
        self.buckets: list[_Bucket] = []
        bucket = None
        for p in offloaded:
            if bucket is None or sum(m.numel() for m in bucket.masters) >= per_bucket:
                bucket = _Bucket()
                self.buckets.append(bucket)
            master = torch.empty(p.shape, dtype=p.dtype, device="cpu", pin_memory=pin)
            master.copy_(p.detach())
            bucket.params.append(p)
            bucket.masters.append(master)
            bucket.grads.append(torch.empty(p.shape, dtype=p.dtype, device="cpu", pin_memory=pin))
        for b in self.buckets:
            b.optimizer = self._inner(b.params, b.masters, group_of, self.cpu_kwargs)
        self.device_params = on_device
        self.device_optimizer = self._inner(on_device, on_device, group_of) if on_device else None
        self._versions: dict[int, int] = {id(p): -1 for p in offloaded}
        """Device param version after our last write: another value means it changed."""
        self._copy_streams = None

    def _inner(self, params, tensors, group_of, overrides=None) -> torch.optim.Optimizer:
        """One optimizer over ``tensors`` (stand-ins for ``params``) with per-group
        hyperparameters; its state dicts become ``self.state[param]``."""
        groups: dict[int, list] = {}
        for p, t in zip(params, tensors):
            groups.setdefault(group_of[id(p)], []).append((p, t))
        overrides = dict(overrides or {})
        inner = self.optimizer_cls(
            [
                {
                    "params": [t for _, t in pairs],
                    **self._hparams(self.param_groups[gi]),
                    **overrides,
                }
                for gi, pairs in groups.items()
            ]
        )
        inner._outer_groups = list(groups)  # outer group index of each inner group
        inner._overrides = overrides
        for pairs in groups.values():
            for p, t in pairs:
                self.state[p] = inner.state[t]  # the same dict: one state, two keys
        return inner

    def _sync_hparams(self, inner: torch.optim.Optimizer) -> None:
        """LR schedulers change the outer groups: pass the values on before each step."""
        for group, gi in zip(inner.param_groups, inner._outer_groups):
            group.update(self._hparams(self.param_groups[gi]), **inner._overrides)

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("CPUOffloadOptimizer.step does not take a closure")
        cuda = any(p.is_cuda for b in self.buckets for p in b.params)
        if cuda and self._copy_streams is None:
            device = self.buckets[0].params[0].device
            self._copy_streams = (torch.cuda.Stream(device), torch.cuda.Stream(device))
        main = torch.cuda.current_stream() if cuda else None
        d2h, h2d = self._copy_streams if cuda else (None, None)
        if cuda:
            d2h.wait_stream(main)
        for b in self.buckets:
            with _on(d2h):
                self._to_host(b, non_blocking=cuda)
                b.event = torch.cuda.Event() if cuda else None
                if cuda:
                    b.event.record(d2h)
        if self.device_optimizer is not None:
            self._sync_hparams(self.device_optimizer)
            self.device_optimizer.step()
        if cuda:
            h2d.wait_stream(main)  # writes into main_flat after the device part's step
        for b in self.buckets:
            if b.event is not None:
                b.event.synchronize()
            self._sync_hparams(b.optimizer)
            b.optimizer.step()
            with _on(h2d):
                for p, m in zip(b.params, b.masters):
                    if m.grad is not None:
                        p.copy_(m, non_blocking=cuda)
        # After every write: the params of one FSDP group share main_flat's version counter.
        for b in self.buckets:
            for p in b.params:
                self._versions[id(p)] = p._version
        if cuda:
            main.wait_stream(d2h)
            main.wait_stream(h2d)
        return None

    def _to_host(self, b: _Bucket, *, non_blocking: bool) -> None:
        for p, m, g in zip(b.params, b.masters, b.grads):
            if p._version != self._versions[id(p)]:
                m.copy_(p, non_blocking=non_blocking)  # changed on the device (load, init)
            if p.grad is None:
                m.grad = None  # skipped by the optimizer, as the param would be
            else:
                g.copy_(p.grad, non_blocking=non_blocking)
                m.grad = g

    # ------------------------------------------------------------------ state dicts
    def load_state_dict(self, state_dict: dict) -> None:
        """Standard optimizer format (what ``state_dict()`` of any optimizer over the same
        params writes); tensors go to each param's side (CPU or device)."""
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(
                f"loaded state has {len(saved_groups)} param groups, this optimizer has "
                f"{len(self.param_groups)}"
            )
        index: dict = {}
        for group, saved in zip(self.param_groups, saved_groups):
            if len(group["params"]) != len(saved["params"]):
                raise ValueError(
                    f"a loaded param group has {len(saved['params'])} params, this "
                    f"optimizer's has {len(group['params'])}"
                )
            index.update(zip(saved["params"], group["params"]))
            group.update({k: v for k, v in saved.items() if k != "params"})
        stand_in = {id(p): m for b in self.buckets for p, m in zip(b.params, b.masters)}
        for key, values in state_dict["state"].items():
            p = index[key]
            target = stand_in.get(id(p), p)
            st = self.state[p]
            st.clear()
            for name, value in values.items():
                st[name] = _cast(name, value, target)
        for p in self._versions:
            self._versions[p] = -1  # masters re-read from the (loaded) device params


def _cast(name: str, value, like: torch.Tensor):
    """What ``Optimizer.load_state_dict`` does with a state value: steps stay as saved,
    other floating tensors take the param's dtype and device."""
    if not torch.is_tensor(value):
        return value
    if name in _STEP_KEYS:
        return value.clone()
    dtype = like.dtype if value.is_floating_point() else value.dtype
    return value.to(device=like.device, dtype=dtype, copy=True)


class _NoStream:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc) -> None:
        return None


def _on(stream):
    return torch.cuda.stream(stream) if stream is not None else _NoStream()


def offloaded_bytes(optimizer: CPUOffloadOptimizer) -> dict[str, int]:
    """Bytes of optimizer state and master weights held on the CPU and on the device."""
    out = {"cpu_state": 0, "device_state": 0, "cpu_master_weights": 0}
    for b in optimizer.buckets:
        out["cpu_master_weights"] += sum(m.numel() * m.element_size() for m in b.masters)
    for st in optimizer.state.values():
        for value in st.values():
            if torch.is_tensor(value):
                key = "cpu_state" if value.device.type == "cpu" else "device_state"
                out[key] += value.numel() * value.element_size()
    return out
