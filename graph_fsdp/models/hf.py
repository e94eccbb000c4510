"""HuggingFace decoder families at test size: random init, no download.

    model = hf_decoder("qwen2", vocab=128, hidden=64, intermediate=128, layers=2, heads=4, seq=32)
    for layer in hf_decoder_layers(model):
        fully_shard(layer)

The tests and GPU checks train these beside graph_fsdp's own GPT (:mod:`graph_fsdp.models.gpt`).
``transformers`` is imported only when a builder runs; a family the installed version lacks
is reported by :func:`hf_family_available`.
"""

from __future__ import annotations

import torch

HF_DECODERS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    # biased q/k/v projections; tied embedding and output layer (as Qwen2-0.5B)
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": True}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4}),  # top-2 MoE
    # Learned positions, LayerNorm + GELU, Conv1D projections, tied by default, layers in
    # ``transformer.h`` and attention named ``attn``.
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", {}),
    # Parallel residual, partial rotary, attention named ``attention``, untied ``embed_out``.
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),  # q/k RMSNorm per head
    # MoE, top-2 of 4 experts, the router at ``mlp.gate``
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {"num_experts": 4}),
    # + a shared expert with its own sigmoid gate
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", {"num_experts": 4}),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", {"num_experts": 4}),
    # Multi-head latent attention; the first layer dense, the others MoE (router ``mlp.gate``
    # with a bias-corrected top-k); attention heads only (no grouping)
    "deepseek_v3": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        {
            "n_routed_experts": 4,
            "first_k_dense_replace": 1,
            "n_group": 1,
            "topk_group": 1,
            "kv_lora_rank": 16,
            "q_lora_rank": 16,
        },
    ),
    # Embedding scaled by sqrt(hidden), (1 + w) RMSNorm, tied
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {}),
    # Logit soft-capping, sandwich norms, alternating sliding-window layers (eager attention)
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"attn_implementation": "eager"}),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"sliding_window": 32}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),  # fused qkv and gate/up projections
    "phi": ("PhiConfig", "PhiForCausalLM", {}),  # parallel attention + MLP, partial rotary
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),  # norms after attention and MLP
    # Parallel attention + MLP (new decoder architecture), ``self_attention``
    "falcon": ("FalconConfig", "FalconForCausalLM", {"new_decoder_architecture": True}),
    # Learned positions with an offset, no ``mlp`` module (``fc1``/``fc2`` on the layer)
    "opt": ("OPTConfig", "OPTForCausalLM", {}),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", {}),
    # Multi-query attention with fused c_attn, layers in ``transformer.h``
    "gpt_bigcode": ("GPTBigCodeConfig", "GPTBigCodeForCausalLM", {"multi_query": True}),
    "granite": ("GraniteConfig", "GraniteForCausalLM", {}),  # scaled residuals and logits
    "cohere": ("CohereConfig", "CohereForCausalLM", {}),  # parallel block, LayerNorm
    "stablelm": ("StableLmConfig", "StableLmForCausalLM", {}),  # partial rotary, LayerNorm
    # MoE with attention sinks, clamped SwiGLU, the router at ``mlp.router`` (eager attention)
    "gpt_oss": (
        "GptOssConfig",
        "GptOssForCausalLM",
        {"num_local_experts": 4, "sliding_window": 32, "attn_implementation": "eager"},
    ),
}
"""HuggingFace decoder families the tests train: (config class, model class, its settings).
:func:`hf_decoder` sizes them alike; a family the installed transformers lacks is skipped
(:func:`hf_family_available`)."""

_HF_SIZE_ALIASES = (
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "ffn_dim",
    "ffn_hidden_size",
    "n_inner",
)
"""Config fields that size an MLP or expert under another name (a config ignores the fields
it does not have): all set to ``intermediate``."""


def hf_family_available(family: str) -> bool:
    """The installed transformers has ``family``'s config and model classes."""
    import transformers  # noqa: PLC0415 (optional: only these builders need it)

    config_cls, model_cls, _ = HF_DECODERS[family]
    return hasattr(transformers, config_cls) and hasattr(transformers, model_cls)


def hf_decoder(
    family: str,
    *,
    vocab: int,
    hidden: int,
    intermediate: int,
    layers: int,
    heads: int,
    seq: int,
    **config,
):
    """A HuggingFace causal LM of ``family`` (:data:`HF_DECODERS`; random init from seed 0, no
    download, SDPA attention unless the family says otherwise, 2 key/value heads, head size
    ``hidden / heads``, top-2 routing, every MLP and expert of width ``intermediate``);
    ``config`` adds or overrides settings."""
    import transformers  # noqa: PLC0415 (optional: only these builders need it)

    config_cls, model_cls, extra = HF_DECODERS[family]
    head = hidden // heads
    if family == "deepseek_v3":  # latent attention: its own head sizes, no key/value groups
        sizes = {"qk_rope_head_dim": head // 2, "qk_nope_head_dim": head // 2, "v_head_dim": head}
        sizes["num_key_value_heads"] = heads
    else:
        sizes = {"num_key_value_heads": 2, "num_kv_heads": 2}  # Falcon's name for it
        if not isinstance(getattr(getattr(transformers, config_cls), "head_dim", None), property):
            sizes["head_dim"] = head  # Falcon derives it
    settings = {
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        **{k: intermediate for k in _HF_SIZE_ALIASES},
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "max_position_embeddings": seq,
        "attn_implementation": "sdpa",
        "num_experts_per_tok": 2,
        **sizes,
        **extra,
        **config,
    }
    cfg = getattr(transformers, config_cls)(**settings)
    for special in ("pad_token_id", "bos_token_id", "eos_token_id"):
        value = getattr(cfg, special, None)
        if isinstance(value, int) and value >= vocab and special not in config:
            setattr(cfg, special, None)  # past the small vocabulary (Phi-3's padding id)
    torch.manual_seed(0)
    return getattr(transformers, model_cls)(cfg)


def hf_decoder_layers(model) -> list:
    """A HuggingFace causal LM's decoder layers (``transformer.h``, ``model.layers`` or OPT's
    ``model.decoder.layers``)."""
    base = model.base_model
    base = getattr(base, "decoder", base)
    return base.h if hasattr(base, "h") else base.layers
