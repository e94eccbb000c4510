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
* Hybrid models (a layer per character of a pattern): 0.19's ``HybridModel``
  (``models/hybrid/hybrid_model.py``; ``GPTModel`` logs a deprecation pointing to it) takes
  ``hybrid_layer_pattern`` and a ``HybridStack`` spec (``models/hybrid/hybrid_block.py``,
  ``HybridStackSubmodules``: seven layer kinds plus ``mtp_block_spec``); 0.16's is
  ``MambaModel`` (``models/mamba/mamba_model.py``) with ``hybrid_override_pattern`` and a
  ``MambaStack`` spec (``ssm/mamba_block.py``, ``MambaStackSubmodules``: ``mamba_layer``,
  ``attention_layer``, ``mlp_layer``, ``moe_layer``). Both build ``*`` as ``TransformerLayer``,
  ``-`` as ``MLPLayer``, ``E`` as ``MoETransformerLayer`` and ``M`` as ``MambaLayer`` in
  ``decoder.layers`` and end with a ``TENorm`` ``decoder.final_norm``; their TE specs are
  ``hybrid_stack_spec`` (``models/hybrid/hybrid_layer_specs.py``) and ``mamba_stack_spec``
  (``models/mamba/mamba_layer_specs.py``). :func:`hybrid_model_class`,
  :func:`hybrid_stack_class`, :func:`hybrid_stack_submodules`, :func:`hybrid_pattern_kwargs`,
  :func:`te_mamba_layer_spec` and :func:`hybrid_symbols` pick them.
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


def hybrid_model_class() -> type:
    """``HybridModel`` (0.19) or ``MambaModel`` (0.16): the model of a layer pattern."""
    if MCORE_VERSION >= (0, 17):
        from megatron.core.models.hybrid.hybrid_model import HybridModel  # noqa: PLC0415 (imports TE-era modules only a hybrid model needs)

        return HybridModel
    from megatron.core.models.mamba.mamba_model import MambaModel  # noqa: PLC0415 (as above)

    return MambaModel


def hybrid_stack_class() -> type:
    """``HybridStack`` (0.19) or ``MambaStack`` (0.16): the decoder of a hybrid model."""
    if MCORE_VERSION >= (0, 17):
        from megatron.core.models.hybrid.hybrid_block import HybridStack  # noqa: PLC0415 (as above)

        return HybridStack
    from megatron.core.ssm.mamba_block import MambaStack  # noqa: PLC0415 (as above)

    return MambaStack


def hybrid_stack_submodules(*, attention_layer, mlp_layer, moe_layer, mamba_layer):
    """The installed release's stack submodules (``HybridStackSubmodules`` /
    ``MambaStackSubmodules``) with these four layer specs; 0.19's other kinds stay
    ``IdentityOp`` and its ``mtp_block_spec`` None."""
    if MCORE_VERSION >= (0, 17):
        from megatron.core.models.hybrid.hybrid_block import HybridStackSubmodules as Sub  # noqa: PLC0415 (as above)
    else:
        from megatron.core.ssm.mamba_block import MambaStackSubmodules as Sub  # noqa: PLC0415 (as above)
    return Sub(
        attention_layer=attention_layer,
        mlp_layer=mlp_layer,
        moe_layer=moe_layer,
        mamba_layer=mamba_layer,
    )


def hybrid_pattern_kwargs(pattern: str) -> dict:
    """The model's pattern argument: ``hybrid_layer_pattern`` (0.19; ``hybrid_override_pattern``
    is deprecated there) or ``hybrid_override_pattern`` (0.16, whose pattern must be
    ``config.num_layers`` long)."""
    if MCORE_VERSION >= (0, 17):
        return {"hybrid_layer_pattern": pattern}
    return {"hybrid_override_pattern": pattern}


def te_mamba_layer_spec():
    """Megatron's TE spec of a Mamba layer (``MambaLayer`` with ``MambaMixer``): the
    ``mamba_layer`` of 0.19's ``hybrid_stack_spec`` / 0.16's ``mamba_stack_spec``. Importing
    those spec modules needs TransformerEngine (and triton)."""
    if MCORE_VERSION >= (0, 17):
        from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec as spec  # noqa: PLC0415 (needs TE)
    else:
        from megatron.core.models.mamba.mamba_layer_specs import mamba_stack_spec as spec  # noqa: PLC0415 (needs TE)
    return spec.submodules.mamba_layer


def hybrid_symbols() -> frozenset[str]:
    """The layer characters the installed release's pattern parser accepts: 0.16
    ``{M, *, -, E}`` (``ssm/mamba_hybrid_layer_allocation.py`` ``Symbols.VALID``); 0.19 adds
    ``G``, ``D`` and ``+`` (``models/hybrid/hybrid_layer_allocation.py``
    ``Symbols.VALID_LAYERS``)."""
    if MCORE_VERSION >= (0, 17):
        from megatron.core.models.hybrid.hybrid_layer_allocation import Symbols  # noqa: PLC0415 (as above)

        return frozenset(Symbols.VALID_LAYERS)
    from megatron.core.ssm.mamba_hybrid_layer_allocation import Symbols  # noqa: PLC0415 (as above)

    return frozenset(Symbols.VALID)
