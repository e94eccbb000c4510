"""Layerwise graphs refuse modules that run under activation checkpointing
(``torch.utils.checkpoint``, HuggingFace ``gradient_checkpointing_enable()``): the recompute in
backward would run eagerly what the forward replayed. Checked with the real LayerwiseGraphs and
CUDA faked as in tools/host_overhead.py; the GPU test (tests/core/test_third_party_gpu.py) runs
a checkpointed HuggingFace Llama."""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from graph_fsdp.capture.layerwise import under_activation_checkpoint
from graph_fsdp.training.processes import spawn


def test_checkpoint_regions_are_recognised():
    seen = []

    def probe(x):
        seen.append(under_activation_checkpoint())
        return x.sin()

    x = torch.randn(3, requires_grad=True)
    probe(x)
    checkpoint(probe, x, use_reentrant=False).sum().backward()  # forward + recompute
    with torch.autograd.graph.save_on_cpu():  # other saved-tensor hooks are not checkpoints
        probe(x)
    assert seen == [False, True, False, False]


def _checkpointed(rank: int, world: int) -> str:
    from tools.host_overhead import install_fakes

    install_fakes(cuda_comm=True)
    from graph_fsdp.capture.layerwise import LayerwiseGraphs
    from graph_fsdp.capture.scopes import GraphConfigError
    from graph_fsdp.models import GPTConfig, build_model
    from graph_fsdp.training.train import TrainConfig, shard_model

    mcfg = GPTConfig(
        vocab_size=64, num_layers=2, hidden_size=16, num_attention_heads=2, seq_length=8
    )
    cfg = TrainConfig(model=mcfg, allocator="double_buffer", persist_on_alloc_fail=True)
    model = shard_model(build_model(mcfg, device="cpu"), cfg)
    graphs = LayerwiseGraphs(model, impl="torch", scopes=["attn"], warmup_steps=1)
    x = torch.randint(0, 64, (1, 8))
    model(x, x).backward()  # an eager step: nothing checkpointed, nothing refused
    graphs.before_step()
    try:
        checkpoint(model, x, x, use_reentrant=False).backward()
    except GraphConfigError as err:
        return str(err)
    return "not refused"


def test_layerwise_graphs_refuse_checkpointed_modules():
    text = spawn(_checkpointed, 1)[0]
    assert text.startswith("layers.0.self_attention runs under activation checkpointing"), text
    assert "gradient_checkpointing_disable()" in text and "full_iteration" in text
