"""Megatron-FSDP (the ``megatron_fsdp`` package), the engine graph_fsdp is compared against.

:func:`megatron_fsdp_shard` wraps a model and its AdamW the way both comparisons need it:
the benchmark's megatron_fsdp row (bench/peers.py) and the Megatron-Core loop's
``engine="megatron_fsdp"`` (integrations/megatron/train.py). ``megatron_fsdp`` is imported
only when it runs (``pip install graph-fsdp[megatron]``).
"""

from __future__ import annotations

import torch


def megatron_fsdp_shard(model, mesh, dp_dim: str, unit_cls: type, cfg, **extra):
    """``megatron_fsdp.fully_shard`` of ``model`` (units ``unit_cls``, fp32 main params and
    grads) with an AdamW at ``cfg.lr`` / ``cfg.weight_decay`` (fused with
    ``cfg.fused_optimizer``); ``extra`` goes to fully_shard
    (e.g. ``expt_device_mesh``). Returns (model, optimizer)."""
    import megatron_fsdp  # noqa: PLC0415 (optional: pip install graph-fsdp[megatron])

    # megatron_fsdp 0.6.1 runs one optimizer step while wrapping: make it a no-op (lr 0,
    # no decay), then restore the hyperparameters and the step counters.
    fused = getattr(cfg, "fused_optimizer", False) or None
    opt = torch.optim.AdamW(model.parameters(), lr=0.0, weight_decay=0.0, fused=fused)
    model, opt = megatron_fsdp.fully_shard(
        model,
        opt,
        device_mesh=mesh,
        dp_shard_dim=dp_dim,
        tp_dim="tp",
        fsdp_unit_modules=[unit_cls],
        zero_dp_strategy=cfg.strategy,
        mixed_precision_policy=megatron_fsdp.MixedPrecisionPolicy(
            main_params_dtype=torch.float32, main_grads_dtype=torch.float32
        ),
        **extra,
    )
    for group in opt.param_groups:
        group["lr"], group["weight_decay"] = cfg.lr, cfg.weight_decay
    for state in opt.state.values():
        if "step" in state:
            step = state["step"]
            state["step"] = step.zero_() if torch.is_tensor(step) else 0
    return model, opt
