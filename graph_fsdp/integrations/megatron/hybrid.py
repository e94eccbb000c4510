"""Megatron-Core hybrid models (a layer per character of ``hybrid_layer_pattern``) under graph_fsdp.

    from graph_fsdp.integrations import megatron as gm

    gm.init_parallel_state()
    cfg = gm.MCoreGPTConfig(hybrid_layer_pattern="*-E-", num_experts=4)
    lm = gm.shard_gpt(gm.build_hybrid(cfg), mp_policy=...)   # fully_shard per decoder layer

Needs megatron-core: import this module only where it imports (``gm.build_hybrid`` does).

[Note: Megatron-Core hybrid models]
- The model: megatron-core 0.19 deprecates ``GPTModel`` for ``HybridModel``, which builds its
  decoder (``HybridStack``) from a pattern string; 0.16 has the same model as ``MambaModel``
  (``MambaStack``, ``hybrid_override_pattern``). versions.py picks the classes and the
  pattern's argument name. graph_fsdp builds ``*`` attention (``TransformerLayer`` with
  ``self_attention``), ``-`` MLP (``MLPLayer`` with a dense ``mlp``), ``E`` MoE
  (``MoETransformerLayer`` with an ``MoELayer`` as ``mlp``) and ``M`` Mamba (``MambaLayer``
  with ``mixer``), in ``decoder.layers`` like a GPTModel's, so ``shard_gpt`` puts one
  ``fully_shard`` on every layer, ``MCoreLM`` calls it like a GPTModel (same forward), and
  checkpoints name parameters ``module.decoder.layers.<i>.*``.
- The layer specs: ``*``, ``-`` and ``E`` are cut from the GPT layer specs graph_fsdp builds
  for the same config (:func:`hybrid_stack_spec`): the attention half, the MLP half of the
  dense spec, the MoE half of the MoE spec - the modules of Megatron's own hybrid TE spec
  (``hybrid_stack_spec``: TE linears with fused input norms, ``TENorm`` before MoE), and with
  the local spec the same on CPU. So every GPT option carries over: the local spec,
  grouped_mm experts, the global expert init of expert parallelism, drop-padding.
  ``M`` is Megatron's TE spec's Mamba layer; ``MambaMixer`` needs ``mamba_ssm``,
  ``causal_conv1d`` and ``einops`` (:func:`check_mamba_kernels` refuses at build time,
  naming the missing ones, rather than Megatron's MagicMock stand-ins failing in a forward).
- The final norm: both releases' stacks build a ``TENorm`` (TransformerEngine only); with the
  local spec :func:`local_norm_stack` builds the local spec's norm in its place, under the
  same name (``decoder.final_norm``).
- Scopes: Megatron's module names apply per layer kind - ``attn`` = the ``*`` layers'
  ``self_attention``, ``mlp`` = the ``-`` layers' ``mlp``, ``moe`` / ``moe_router`` /
  ``moe_preprocess`` = the ``E`` layers' ``mlp`` / ``mlp.router`` / ``mlp.preprocess``; a
  layer's missing half is Megatron's ``IdentityOp`` placeholder, which no scope captures
  (capture/scopes.py). A Mamba layer is captured by the whole layer and ``full_iteration``.
"""

from __future__ import annotations

import functools
import importlib

import torch
from megatron.core.ssm.mlp_layer import MLPLayer
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_layer import (
    MoETransformerLayer,
    TransformerLayer,
    TransformerLayerSubmodules,
)

from graph_fsdp.integrations.megatron import versions
from graph_fsdp.integrations.megatron.config import MCoreGPTConfig

MAMBA_PACKAGES = ("mamba_ssm", "causal_conv1d", "einops")
"""What Megatron-Core's ``MambaMixer`` imports for its kernels (``ssm/mamba_mixer.py``)."""


def check_mamba_kernels(cfg: MCoreGPTConfig) -> None:
    """Refuse a pattern with Mamba layers where Megatron's Mamba kernels do not import."""
    if "M" not in (cfg.hybrid_layer_pattern or ""):
        return
    missing = {}
    for package in MAMBA_PACKAGES:
        try:
            importlib.import_module(package)
        except Exception as err:  # noqa: BLE001 (a kernel package can fail to load in many ways)
            missing[package] = f"{type(err).__name__}: {err}"
    if missing:
        raise ImportError(
            f"MCoreGPTConfig.hybrid_layer_pattern={cfg.hybrid_layer_pattern!r} has Mamba layers "
            f"('M'), whose MambaMixer needs {', '.join(MAMBA_PACKAGES)}; "
            + "; ".join(f"{p} does not import ({e})" for p, e in missing.items())
            + ". Install them (pip install mamba-ssm causal-conv1d einops, built for this "
            "torch and CUDA) or drop 'M' from the pattern"
        )


@functools.cache
def local_norm_stack(base: type) -> type:
    """``base`` (the release's hybrid stack) with the ``final_norm`` a spec gives
    (``final_norm=`` in the spec's params) in place of its ``TENorm``."""

    class LocalNormStack(base):
        def __init__(self, config, *args, final_norm, post_layer_norm: bool = True, **kwargs):
            super().__init__(config, *args, post_layer_norm=False, **kwargs)
            self.post_layer_norm = post_layer_norm
            if self.post_process and post_layer_norm:
                self.final_norm = build_module(
                    final_norm,
                    config=config,
                    hidden_size=config.hidden_size,
                    eps=config.layernorm_epsilon,
                )

    LocalNormStack.__name__ = LocalNormStack.__qualname__ = f"LocalNorm{base.__name__}"
    return LocalNormStack


def _attention_half(sub) -> TransformerLayerSubmodules:
    return TransformerLayerSubmodules(
        input_layernorm=sub.input_layernorm,
        self_attention=sub.self_attention,
        self_attn_bda=sub.self_attn_bda,
    )


def _mlp_half(sub) -> TransformerLayerSubmodules:
    return TransformerLayerSubmodules(
        pre_mlp_layernorm=sub.pre_mlp_layernorm, mlp=sub.mlp, mlp_bda=sub.mlp_bda
    )


def hybrid_stack_spec(cfg: MCoreGPTConfig, dense_spec, moe_spec) -> ModuleSpec:
    """The decoder spec of ``cfg``'s pattern from graph_fsdp's GPT layer specs of the same
    config: ``dense_spec`` (no experts) and ``moe_spec`` (None without 'E' layers)."""
    dense = dense_spec.submodules
    mamba = IdentityOp
    if "M" in cfg.hybrid_layer_pattern:
        check_mamba_kernels(cfg)
        mamba = versions.te_mamba_layer_spec()
    layers = versions.hybrid_stack_submodules(
        attention_layer=ModuleSpec(module=TransformerLayer, submodules=_attention_half(dense)),
        mlp_layer=ModuleSpec(module=MLPLayer, submodules=_mlp_half(dense)),
        moe_layer=IdentityOp
        if moe_spec is None
        else ModuleSpec(module=MoETransformerLayer, submodules=_mlp_half(moe_spec.submodules)),
        mamba_layer=mamba,
    )
    stack = versions.hybrid_stack_class()
    if cfg.transformer_impl == "transformer_engine":
        return ModuleSpec(module=stack, submodules=layers)
    # The local spec's norm (torch's or apex's), where the stack would build a TENorm.
    return ModuleSpec(
        module=local_norm_stack(stack),
        submodules=layers,
        params={"final_norm": dense.input_layernorm},
    )


def build_hybrid_model(cfg: MCoreGPTConfig, config, dense_spec, moe_spec) -> torch.nn.Module:
    """The release's hybrid model (HybridModel / MambaModel) of ``cfg``'s pattern."""
    return versions.hybrid_model_class()(
        config,
        hybrid_stack_spec(cfg, dense_spec, moe_spec),
        cfg.vocab_size,
        cfg.seq_length,
        position_embedding_type=cfg.position_embedding_type,
        share_embeddings_and_output_weights=False,
        **versions.hybrid_pattern_kwargs(cfg.hybrid_layer_pattern),
    )
