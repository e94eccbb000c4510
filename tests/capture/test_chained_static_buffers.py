"""Which static buffers the torch backend chains ([Note: chained static buffers],
capture/torch_backend.py): a callable's recorded input that *was* the previous callable's output
(same address, shape, stride, dtype) is read in place; anything else keeps its own buffer.
The replay side needs a GPU (tests/capture/test_cuda_graphs_gpu.py, bit-exact with eager)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from graph_fsdp.capture.torch_backend import CallSignature, _chain


def _prev(outputs, recorded):
    return SimpleNamespace(
        static_outputs=outputs, recorded_output_ptrs=[t.data_ptr() for t in recorded]
    )


def _cap(recorded_args, static_inputs):
    return SimpleNamespace(signature=CallSignature(recorded_args, {}), static_inputs=static_inputs)


def test_an_input_that_was_the_previous_output_is_chained():
    h = torch.randn(2, 4, 8)
    mask = torch.ones(2, 4)
    prev = _prev([torch.empty(2, 4, 8)], [h])
    cap = _cap((mask, h), [torch.empty(2, 4), torch.empty(2, 4, 8)])
    assert _chain(prev, cap) == ((1, 0),)


def test_views_other_layouts_and_unrelated_tensors_are_not_chained():
    h = torch.randn(2, 4, 8)
    prev = _prev([torch.empty(2, 4, 8)], [h])
    # The same address, another shape (a view of the output): its own buffer.
    view = h[:, :2]
    assert _chain(prev, _cap((view,), [torch.empty(2, 2, 8)])) == ()
    # Another tensor of the same shape.
    assert _chain(prev, _cap((torch.randn(2, 4, 8),), [torch.empty(2, 4, 8)])) == ()
    # The same tensor, but the static buffers disagree in dtype.
    assert _chain(prev, _cap((h,), [torch.empty(2, 4, 8, dtype=torch.float64)])) == ()


def _flow_with_fake_graphs(rank: int, world: int) -> dict:
    """The real LayerwiseGraphs (whole layers, torch backend) with CUDA graphs, streams and
    events faked as in tools/host_overhead.py: a fake replay runs nothing and returns its
    capture's outputs, so only the flow is checked here - which buffers chain, which hooks
    come off, when a call falls back - not values (those are the GPU tests')."""
    import warnings

    from tools.host_overhead import install_fakes

    install_fakes(cuda_comm=True)
    from graph_fsdp.capture.layerwise import LayerwiseGraphs
    from graph_fsdp.models import GPTConfig, build_model, transformer_layers
    from graph_fsdp.training.train import TrainConfig, make_optimizer, shard_model

    mcfg = GPTConfig(
        vocab_size=64, num_layers=3, hidden_size=16, num_attention_heads=2, seq_length=8
    )
    cfg = TrainConfig(model=mcfg, allocator="double_buffer", persist_on_alloc_fail=True)
    model = shard_model(build_model(mcfg, device="cpu"), cfg)
    opt = make_optimizer(model.parameters(), cfg)
    graphs = LayerwiseGraphs(model, impl="torch", scopes=[], warmup_steps=2, warmup_iters=1)
    x = torch.randint(0, 64, (1, 8))
    layers = transformer_layers(model)

    def step():
        graphs.before_step()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model(x, x).backward()
        opt.step()
        opt.zero_grad()
        return [str(w.message) for w in caught if "running it eagerly" in str(w.message)]

    for _ in range(3):
        step()
    caps = {cap.name: cap for cap in graphs.caps}
    out = {
        "chained": [caps[n].chained for n in sorted(caps) if n.startswith("layers")],
        "hooks": [len(m._forward_pre_hooks) + len(m._forward_hooks) for m in layers],
        "by_dispatcher": [m._fsdp_state.forward_by_dispatcher for m in layers],
        "replays_before": graphs.report()["replays"],
        "quiet": step(),
    }
    # The third layer's input no longer is the second layer's output: it runs eagerly.
    layers[2].register_forward_pre_hook(lambda m, args: (args[0] * 1,))
    out["unchained"] = step()
    out["fallbacks"] = {n: c.fallbacks for n, c in caps.items()}
    graphs.drop()
    out["hooks_after_drop"] = [len(m._forward_pre_hooks) + len(m._forward_hooks) for m in layers]
    return out


def test_layer_graphs_chain_and_fall_back_when_the_chain_breaks():
    from graph_fsdp.training.processes import spawn

    r = spawn(_flow_with_fake_graphs, 1)[0]
    assert r["chained"] == [(), ((0, 0),), ((0, 0),)], r
    assert r["hooks"] == [0, 0, 0] and r["by_dispatcher"] == [True] * 3, r
    assert r["replays_before"] > 0 and r["quiet"] == [], r
    assert (
        len(r["unchained"]) == 1 and "not the previous graphed module's output" in r["unchained"][0]
    )
    assert r["fallbacks"]["layers.2"] == 1 and r["fallbacks"]["layers.1"] == 0, r
    # drop(): FSDP's four hooks are back (the third layer keeps the test's hook too).
    assert r["hooks_after_drop"] == [4, 4, 5], r


def test_an_address_a_dead_output_left_behind_is_not_chained():
    # The previous output was freed before this call (a residual add consumed it) and its
    # bytes went to this input (the next norm's output): same address, unrelated values.
    h = torch.randn(2, 4, 8)
    prev = _prev([torch.empty(2, 4, 8)], [h])
    signature = CallSignature((h,), {})
    signature.keep_sources(set())  # no recorded output is alive any more
    cap = SimpleNamespace(signature=signature, static_inputs=[torch.empty(2, 4, 8)])
    assert _chain(prev, cap) == ()
    signature = CallSignature((h,), {})
    signature.keep_sources({h.data_ptr()})  # still alive: the input is that output
    cap = SimpleNamespace(signature=signature, static_inputs=[torch.empty(2, 4, 8)])
    assert _chain(prev, cap) == ((0, 0),)
