"""Tensor-parallel plans (torch DTensor) for the reference GPT and Llama-style HF decoders.

    mesh = init_device_mesh("cuda", (dp, tp), mesh_dim_names=("dp", "tp"))
    parallelize_gpt(model, mesh["tp"])                 # or parallelize_hf_decoder(hf, mesh["tp"])
    for unit, reshard in sharding_units(model):
        fully_shard(unit, mesh=mesh["dp"], reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh["dp"])

Megatron's (and torchtitan's) layout: attention's query/key/value and the MLP's first linears
split by output (``ColwiseParallel``: heads and hidden units per rank), the output projections
by input (``RowwiseParallel``), the embedding and output layer by vocabulary. With
``sequence_parallel`` the activations between those blocks - the residual stream, the norms -
hold this rank's slice of the sequence (``Shard(1)``): the row-parallel outputs are
reduce-scattered over the sequence instead of all-reduced and the column-parallel inputs
all-gathered; the norms' weights are replicated and their gradients, computed from a slice of
the tokens, are summed over the TP group (tensor_parallel.py [Note: tensor-parallel
parameters]). The logits come out whole on every TP rank (``Replicate``), so any loss works.
"""

from __future__ import annotations

import torch
from torch import nn

from graph_fsdp.models.config import GPTConfig
from graph_fsdp.models.gpt import GPTModel


def _styles():
    from torch.distributed.tensor import Replicate, Shard  # noqa: PLC0415 (slow import, TP plans only)
    from torch.distributed.tensor.parallel import (  # noqa: PLC0415 (slow import, TP plans only)
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    return Replicate, Shard, ColwiseParallel, RowwiseParallel, SequenceParallel, PrepareModuleInput


def _check_divides(what: str, sizes: dict[str, int], tp: int, fix: str) -> None:
    bad = {name: size for name, size in sizes.items() if size % tp}
    if bad:
        raise ValueError(
            f"{what}: a tensor-parallel size of {tp} must divide {bad} (each TP rank holds whole "
            f"heads and an equal share of the hidden units); {fix}"
        )


def check_gpt_plan(cfg: GPTConfig, tp: int, *, sequence_parallel: bool) -> None:
    """What :func:`parallelize_gpt` needs of the model's shape (the command line checks it
    before launch): the dense torch layers, and a TP size dividing the heads, the MLP and
    (sequence parallel) the sequence."""
    if cfg.num_experts is not None or cfg.transformer_impl != "local":
        raise ValueError(
            "parallelize_gpt: the plan covers the dense torch layers (GPTConfig.num_experts=None, "
            f"transformer_impl='local'), got num_experts={cfg.num_experts}, transformer_impl="
            f"{cfg.transformer_impl!r}; shard MoE experts with expert parallelism instead"
        )
    _check_divides(
        "parallelize_gpt",
        {
            "num_attention_heads": cfg.num_attention_heads,
            "ffn_hidden_size": cfg.ffn_hidden_size,
            **({"seq_length": cfg.seq_length} if sequence_parallel else {}),
        },
        tp,
        "pick a TP size that divides them",
    )


def parallelize_gpt(model: GPTModel, tp_mesh, *, sequence_parallel: bool = True) -> GPTModel:
    """Tensor parallelism over the 1-D ``tp_mesh`` for graph_fsdp's dense reference GPT
    (``transformer_impl='local'``): its parameters become DTensors. Before ``fully_shard``."""
    from torch.distributed.tensor.parallel import parallelize_module  # noqa: PLC0415 (slow import)

    Replicate, Shard, Colwise, Rowwise, Sequence, _ = _styles()
    cfg = model.config
    check_gpt_plan(cfg, tp_mesh.size(), sequence_parallel=sequence_parallel)
    between = Shard(1) if sequence_parallel else Replicate()  # activations between blocks
    norm = Sequence() if sequence_parallel else None
    top = {
        "embedding": Rowwise(input_layouts=Replicate(), output_layouts=between),
        # positions [s, h]: the sequence is dimension 0 here
        "position_embedding": Rowwise(
            input_layouts=Replicate(), output_layouts=Shard(0) if sequence_parallel else between
        ),
        "output": Colwise(input_layouts=between, output_layouts=Replicate()),
    }
    if norm is not None:
        top["final_norm"] = norm
    parallelize_module(model, tp_mesh, top)
    for layer in model.layers:
        plan = {
            "self_attention.qkv": Colwise(input_layouts=between),
            "self_attention.proj": Rowwise(output_layouts=between),
            "mlp.fc1": Colwise(input_layouts=between),
            "mlp.fc2": Rowwise(output_layouts=between),
        }
        if norm is not None:
            plan.update({"self_attention.norm": Sequence(), "mlp.norm": Sequence()})
        parallelize_module(layer, tp_mesh, plan)
    return model


_LLAMA_LAYER = {
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
    "input_layernorm",
    "post_attention_layernorm",
}
"""The parameterised modules of a Llama-style decoder layer (Llama, Mistral, Qwen2)."""


def parallelize_hf_decoder(model: nn.Module, tp_mesh, *, sequence_parallel: bool = True):
    """Tensor parallelism over the 1-D ``tp_mesh`` for a HuggingFace Llama-style causal LM
    (``model.embed_tokens``, layers of ``self_attn.{q,k,v,o}_proj`` and
    ``mlp.{gate,up,down}_proj``, ``model.norm``, ``lm_head``: Llama, Mistral, Qwen2). A layer
    with other parameters (Qwen3's per-head q/k norms, ...) is refused, naming them.

    With ``sequence_parallel`` the decoder layers' input is this rank's slice of the sequence,
    so the model would derive positions (rotary embedding, causal mask) from that slice: a
    forward pre-hook on ``model`` passes the whole sequence's ``position_ids`` and
    ``cache_position`` when the caller gives none.
    """
    from torch.distributed.tensor.parallel import parallelize_module  # noqa: PLC0415 (slow import)

    Replicate, Shard, Colwise, Rowwise, Sequence, Prepare = _styles()
    cfg = model.config
    tp = tp_mesh.size()
    layers = model.model.layers
    for i, layer in enumerate(layers):
        held = {name.rsplit(".", 1)[0] for name, _ in layer.named_parameters()}
        other = sorted(held - _LLAMA_LAYER)
        if other:
            raise ValueError(
                f"parallelize_hf_decoder: layer {i} of {type(model).__name__} holds parameters "
                f"in {other}, which the Llama-style plan does not place (left replicated, their "
                "gradients would cover only this rank's heads); use a Llama, Mistral or Qwen2 "
                "model, or write a plan for these modules"
            )
    kv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    _check_divides(
        "parallelize_hf_decoder",
        {
            "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": kv,
            "intermediate_size": cfg.intermediate_size,
        },
        tp,
        "pick a TP size that divides them (or more key/value heads)",
    )
    between = Shard(1) if sequence_parallel else Replicate()
    top = {
        "model.embed_tokens": Rowwise(input_layouts=Replicate(), output_layouts=between),
        "lm_head": Colwise(input_layouts=between, output_layouts=Replicate()),
    }
    if sequence_parallel:
        top["model.norm"] = Sequence()
    parallelize_module(model, tp_mesh, top)
    for layer in layers:
        plan = {
            "self_attn.q_proj": Colwise(),
            "self_attn.k_proj": Colwise(),
            "self_attn.v_proj": Colwise(),
            "self_attn.o_proj": Rowwise(output_layouts=between),
            "mlp.gate_proj": Colwise(),
            "mlp.up_proj": Colwise(),
            "mlp.down_proj": Rowwise(output_layouts=between),
        }
        if sequence_parallel:
            plan.update(
                {
                    "input_layernorm": Sequence(),
                    "post_attention_layernorm": Sequence(),
                    "self_attn": Prepare(
                        input_kwarg_layouts={"hidden_states": Shard(1)},
                        desired_input_kwarg_layouts={"hidden_states": Replicate()},
                    ),
                    "mlp": Prepare(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                }
            )
        parallelize_module(layer, tp_mesh, plan)
    if sequence_parallel:
        model.register_forward_pre_hook(_whole_sequence_positions, with_kwargs=True)
    return model


def _whole_sequence_positions(module: nn.Module, args: tuple, kwargs: dict):
    """Positions of the whole sequence (see :func:`parallelize_hf_decoder`)."""
    ids = kwargs.get("input_ids", args[0] if args else None)
    if not isinstance(ids, torch.Tensor) or kwargs.get("position_ids") is not None:
        return None
    positions = torch.arange(ids.shape[1], device=ids.device)
    kwargs = dict(kwargs)
    kwargs["position_ids"] = positions.unsqueeze(0)
    kwargs.setdefault("cache_position", positions)
    return args, kwargs
