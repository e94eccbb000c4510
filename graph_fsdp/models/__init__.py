"""Reference models for graph_fsdp: deterministic, static-shape, CUDA-graph-capturable GPTs.

They exist so the engine's tests and benchmarks share one model family whose weights and data
depend only on a config, making eager-vs-graph and sharded-vs-unsharded runs comparable.
"""

from graph_fsdp.models.config import GPTConfig, model_flops_per_token, moe_capacity
from graph_fsdp.models.gpt import (
    MLP,
    GPTModel,
    SelfAttention,
    TransformerLayer,
    build_model,
    partition_experts,
    sharding_units,
    synthetic_batch,
    transformer_layers,
)
from graph_fsdp.models.moe import MoEExperts, MoELayer, MoEPreprocess, MoERouter
from graph_fsdp.models.seeded import init_weights
from graph_fsdp.models.tp_plans import parallelize_gpt, parallelize_hf_decoder

__all__ = [
    "MLP",
    "GPTConfig",
    "GPTModel",
    "MoEExperts",
    "MoELayer",
    "MoEPreprocess",
    "MoERouter",
    "SelfAttention",
    "TransformerLayer",
    "build_model",
    "init_weights",
    "model_flops_per_token",
    "moe_capacity",
    "parallelize_gpt",
    "parallelize_hf_decoder",
    "partition_experts",
    "sharding_units",
    "synthetic_batch",
    "transformer_layers",
]
