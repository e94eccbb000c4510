"""The megatron-core releases graph_fsdp supports, and every difference between them in one place.

Supported: 0.16.x (the newest release with a Python 3.11 wheel; what CI installs) and 0.19.x
(Python >= 3.12; the GPU host's). The rest of the integration calls these functions instead
of testing versions itself. What differs, read from the two releases' sources:

* A layer spec's MoE block: 0.19's ``get_gpt_layer_*_spec`` give ``submodules.mlp`` as a
  ``functools.partial(MoELayer, submodules=...)``, which ``TransformerLayer`` calls with
  ``config``, ``pg_collection`` and ``is_mtp_layer``; 0.16's give a ``ModuleSpec``, which
  ``build_module`` instantiates with ``config`` (plus ``pg_collection`` only when the module is
  exactly ``MoELayer``). :func:`mlp_spec` builds a replacement of the same kind as the one it
  replaces.
* A builder inside an MoE spec (``MoESubmodules.experts``, ...): 0.19's ``MoELayer`` calls it
  (``experts(n, config, pg_collection=..., name=...)``), 0.16's hands it to ``build_module``,
  which calls a class or a ``ModuleSpec`` and returns a plain function uncalled.
  :func:`build` builds from either kind; :func:`builder_spec` wraps a callable of ours so that
  both releases call it.
* The local (no TransformerEngine) spec's experts: 0.19's are always ``SequentialMLP``; 0.16's
  are the legacy ``GroupedMLP`` (which needs the ``grouped_gemm`` package) when asked for
  grouped GEMMs. :func:`local_layer_spec` gives 0.19's choice on both.
* ``MoELayer.__init__`` takes ``is_mtp_layer`` and ``name`` in 0.19, neither in 0.16:
  :func:`moe_layer_kwargs` passes what the installed class accepts.
"""

from __future__ import annotations

import functools
import inspect

import megatron.core
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.spec_utils import ModuleSpec, build_module

SUPPORTED = ((0, 16), (0, 19))
"""(major, minor) of the megatron-core releases tested: CI runs the CPU tests on 0.16.1
(Python 3.11), the GPU host runs the GPU tests on 0.19.2 (Python 3.12)."""

MCORE_VERSION: tuple[int, ...] = tuple(
    int(part) for part in megatron.core.__version__.split(".")[:2] if part.isdigit()
)


def mlp_spec(like, module: type, submodules, params: dict):
    """A layer spec's ``mlp`` entry building ``module(submodules=submodules, **params)``, of the
    same kind as ``like`` (the entry it replaces): a ``functools.partial`` where the installed
    megatron-core's specs use one, else a ``ModuleSpec``."""
    if isinstance(like, functools.partial):
        return functools.partial(module, submodules=submodules, **params)
    return ModuleSpec(module=module, submodules=submodules, params=dict(params))


def mlp_spec_parts(mlp) -> tuple[object, object, dict]:
    """``(module, submodules, params)`` of a layer spec's ``mlp`` entry, whichever kind it is;
    ``(None, None, {})`` for an entry that is neither."""
    if isinstance(mlp, functools.partial):
        params = dict(mlp.keywords)
        return mlp.func, params.pop("submodules", None), params
    if isinstance(mlp, ModuleSpec):
        return mlp.module, mlp.submodules, dict(mlp.params)
    return None, None, {}


@functools.cache
def _moe_layer_parameters() -> frozenset[str]:
    return frozenset(inspect.signature(MoELayer.__init__).parameters)


def moe_layer_kwargs(**optional) -> dict:
    """Those of ``optional`` (``is_mtp_layer``, ``name``, ...) that the installed
    ``MoELayer.__init__`` takes."""
    accepted = _moe_layer_parameters()
    return {key: value for key, value in optional.items() if key in accepted}


def build(spec_or_builder, *args, **kwargs):
    """The module ``spec_or_builder`` (a spec entry of the installed megatron-core) builds from
    ``args``/``kwargs``; ``None`` keyword values are left out (0.16's builders take no ``name``)."""
    kwargs = {key: value for key, value in kwargs.items() if value is not None}
    if isinstance(spec_or_builder, (ModuleSpec, type)):
        return build_module(spec_or_builder, *args, **kwargs)
    return spec_or_builder(*args, **kwargs)


class _CallBuilder:
    """A "class" whose construction returns ``builder(*args, **kwargs)``: what 0.16's
    ``build_module`` instantiates for a :func:`builder_spec`."""

    def __new__(cls, *args, builder, **kwargs):
        return builder(*args, **kwargs)


def builder_spec(builder):
    """``builder`` (a callable building a module) as a spec entry the installed megatron-core
    calls with its usual arguments: itself where specs hold callables (0.19), a ``ModuleSpec``
    that ``build_module`` instantiates by calling it where they hold specs (0.16)."""
    if MCORE_VERSION >= (0, 17):
        return builder
    return ModuleSpec(module=_CallBuilder, params={"builder": builder})


def local_layer_spec(num_experts: int | None = None, moe_grouped_gemm: bool = False):
    """``get_gpt_layer_local_spec``: SequentialMLP experts on every release (see above)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: PLC0415 (the GPT specs import more of megatron-core than this module needs elsewhere)

    if MCORE_VERSION < (0, 17):
        moe_grouped_gemm = False
    return get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=moe_grouped_gemm)


def build_mlp(layer_spec, config, pg_collection=None):
    """The ``mlp`` module a layer spec builds (what ``TransformerLayer`` does with it), outside a
    layer: for tests and tools that look at one MoE block."""
    mlp = layer_spec.submodules.mlp
    if isinstance(mlp, functools.partial):
        return mlp(config=config, pg_collection=pg_collection, is_mtp_layer=False)
    return build_module(mlp, config=config, pg_collection=pg_collection)
