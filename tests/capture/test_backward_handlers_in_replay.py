"""The eager side of [Note: backward handlers in the replay] (capture/graphed.py), on gloo.

While a whole-layer torch graph is captured its unit's ``backward_by_replay`` is set: FSDP's
registration hooks stand aside and the dispatcher registers the handlers for every eager call
(``FSDPState.forward_with_backward_handlers``). The replay side needs a GPU
(tests/gpu/test_cuda_graphs_gpu.py); here every layer takes the eager side, which must train
exactly like the hooks, with the same order of handlers.
"""

from __future__ import annotations

import torch

from graph_fsdp.models import GPTConfig, build_model, synthetic_batch, transformer_layers
from graph_fsdp.testing import spawn
from graph_fsdp.train import TrainConfig, shard_model

TINY = GPTConfig(vocab_size=128, num_layers=3, hidden_size=32, num_attention_heads=4, seq_length=16)


def _dispatch_like_runner(layer: torch.nn.Module) -> None:
    """What runner._dispatcher does for an eager call of a unit whose replay owns its
    backward handlers."""
    state, orig = layer._fsdp_state, layer.forward

    def forward(*args, **kwargs):
        return state.forward_with_backward_handlers(orig, args, kwargs)

    state.backward_by_replay = True
    layer.forward = forward


def _train(rank: int, world: int, by_replay: bool) -> dict:
    cfg = TrainConfig(model=TINY, strategy="optim_grads_params", steps=3)
    torch.manual_seed(0)
    model = shard_model(build_model(TINY, device="cpu"), cfg)
    order: list[str] = []
    for i, layer in enumerate(transformer_layers(model)):
        state = layer._fsdp_state
        for phase in ("pre_backward", "post_backward"):
            inner = getattr(state, phase)

            def traced(inner=inner, name=f"{phase}:{i}"):
                order.append(name)
                inner()

            setattr(state, phase, traced)
        if by_replay:
            _dispatch_like_runner(layer)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(3):
        order.clear()
        x, y = synthetic_batch(TINY, 2, step, rank=rank, device=torch.device("cpu"))
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        model.eval()
        with torch.no_grad():
            losses.append(model(x, y).item())  # eval: no handlers registered, none run
        model.train()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "params": params, "order": list(order)}


def test_dispatcher_registered_handlers_train_like_the_hooks():
    hooks = spawn(_train, 2, False)
    dispatched = spawn(_train, 2, True)
    for h, d in zip(hooks, dispatched):
        assert d["losses"] == h["losses"]
        assert all(torch.equal(d["params"][n], v) for n, v in h["params"].items())
        # Each layer reduces right after its own backward, before the layer below starts:
        # the post-backward handler ran from the backward, not from the final callback.
        assert d["order"] == h["order"]
        assert d["order"][:4] == [
            "pre_backward:2",
            "post_backward:2",
            "pre_backward:1",
            "post_backward:1",
        ]
