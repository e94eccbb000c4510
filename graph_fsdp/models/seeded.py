"""Deterministic, construction-order-independent initialisation of the reference models:
each parameter's values depend only on ``config.seed`` and its qualified name."""

from __future__ import annotations

import contextlib
import hashlib
import math
import threading
from collections.abc import Iterator

import torch
from torch import nn

from graph_fsdp.models.config import _NORM_EPS, GPTConfig

# --------------------------------------------------------------------------------------------
# Deterministic, construction-order-independent initialisation
# --------------------------------------------------------------------------------------------


def _stable_seed(*parts: object) -> int:
    """A 63-bit seed from ``parts``; unlike ``hash()`` it is stable across processes."""
    digest = hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _seeded_normal(shape: tuple[int, ...], std: float, seed: int, fqn: str) -> torch.Tensor:
    """Normal(0, std) values for parameter ``fqn``, generated on CPU in float32.

    Generating on CPU with a private generator makes the values independent of the target
    device, of the global RNG state and of the order in which parameters are initialised.
    """
    gen = torch.Generator(device="cpu")
    gen.manual_seed(_stable_seed(seed, "param", fqn))
    out = torch.empty(shape, dtype=torch.float32, device="cpu")
    return out.normal_(0.0, std, generator=gen)


def _copy_full_(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy a full (unsharded) CPU tensor into ``param``, which may be a DTensor shard."""
    with torch.no_grad():
        if not _is_dtensor(param):
            param.copy_(full)
            return
        # torch.distributed.tensor exists only where torch.distributed does (_is_dtensor)
        from torch.distributed.tensor import DTensor, distribute_tensor  # noqa: PLC0415 (slow import)

        assert isinstance(param, DTensor)
        # Every rank generated the same full tensor, so each cuts out its own shard locally
        # (src_data_rank=None) instead of receiving it from one rank: no communication.
        mesh = param.device_mesh
        full = full.to(device=mesh.device_type, dtype=param.dtype)
        param.copy_(distribute_tensor(full, mesh, param.placements, src_data_rank=None))


def _is_dtensor(tensor: torch.Tensor) -> bool:
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor  # noqa: PLC0415 (needs torch.distributed)

    return isinstance(tensor, DTensor)


class _SeededInit:
    """Mixin for modules that own parameters and initialise them from their qualified name.

    ``_init_fqn`` is the module's name relative to the construction root (set once, when the
    outermost module finishes construction), so re-running ``reset_parameters`` later -- e.g.
    after ``to_empty`` -- regenerates exactly the same values.
    """

    _init_fqn: str | None = None
    _init_config: GPTConfig
    _init_residual_out: bool = False

    def _init_std(self) -> float:
        std = self._init_config.init_std
        if self._init_residual_out:
            std /= math.sqrt(2.0 * self._init_config.num_layers)
        return std

    def _seeded_normal_init_(self, name: str, param: torch.Tensor, std: float) -> None:
        if self._init_fqn is None or param.is_meta:
            return  # still under construction, or nothing to write into yet
        fqn = f"{self._init_fqn}.{name}" if self._init_fqn else name
        full = _seeded_normal(tuple(param.shape), std, self._init_config.seed, fqn)
        _copy_full_(param, full)


_BUILD_STATE = threading.local()


@contextlib.contextmanager
def _construction(module: nn.Module) -> Iterator[None]:
    """Defer initialisation to the outermost module under construction.

    Nested modules skip their own init; the root names every parameter relative to itself and
    initialises each once. This keeps init cost O(params) and makes a standalone submodule
    (e.g. a bare ``SelfAttention``) deterministic too.
    """
    depth = getattr(_BUILD_STATE, "depth", 0)
    _BUILD_STATE.depth = depth + 1
    try:
        yield
    finally:
        _BUILD_STATE.depth = depth
    if depth == 0:
        for name, sub in module.named_modules():
            if isinstance(sub, _SeededInit):
                sub._init_fqn = name
        init_weights(module)


def init_weights(module: nn.Module, config: GPTConfig | None = None) -> nn.Module:
    """(Re)initialise ``module`` and all submodules deterministically; returns ``module``.

    Calls ``reset_parameters`` on every submodule that has one, which is what a meta-device
    build needs after ``to_empty``. With ``config``, its ``seed``/``init_std``/``num_layers``
    replace the ones the modules were built with (shapes must still match).
    """
    for sub in module.modules():
        if config is not None and isinstance(sub, _SeededInit):
            sub._init_config = config
        reset = getattr(sub, "reset_parameters", None)
        if callable(reset):
            reset()
    return module


class _SeededLinear(_SeededInit, nn.Linear):
    """Bias-free ``nn.Linear`` whose ``reset_parameters`` is seeded by the weight's name."""

    def __init__(
        self, in_features: int, out_features: int, config: GPTConfig, *, residual_out: bool = False
    ) -> None:
        with _construction(self):
            super().__init__(in_features, out_features, bias=False)
            self._init_config = config
            self._init_residual_out = residual_out

    def reset_parameters(self) -> None:
        if self._init_fqn is not None:
            self._seeded_normal_init_("weight", self.weight, self._init_std())


class _SeededEmbedding(_SeededInit, nn.Embedding):
    """``nn.Embedding`` whose ``reset_parameters`` is seeded by the weight's name."""

    def __init__(self, num_embeddings: int, embedding_dim: int, config: GPTConfig) -> None:
        with _construction(self):
            super().__init__(num_embeddings, embedding_dim)
            self._init_config = config

    def reset_parameters(self) -> None:
        if self._init_fqn is not None:
            self._seeded_normal_init_("weight", self.weight, self._init_std())


def _rms_norm(config: GPTConfig) -> nn.RMSNorm:
    # RMSNorm.reset_parameters fills ones, which is already deterministic.
    return nn.RMSNorm(config.hidden_size, eps=_NORM_EPS)
