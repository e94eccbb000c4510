"""Scope vocabulary, target selection and every documented configuration error (CPU)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from graph_fsdp_testing import SMALLEST_GPT, spawn_cases

from graph_fsdp.capture import GraphConfigError, check_scopes, check_static_buffers, select_targets
from graph_fsdp.capture.policy import GraphPolicy
from graph_fsdp.capture.torch_backend import CallSignature
from graph_fsdp.fsdp.api import BufferPolicy
from graph_fsdp.models import GPTConfig, build_model, transformer_layers
from graph_fsdp.training.train import TrainConfig, run

TINY = SMALLEST_GPT
MOE = dataclasses.replace(TINY, num_experts=4, moe_layer_freq=2, ffn_hidden_size=None)


@pytest.mark.parametrize(
    "scopes, match",
    [
        (["attention"], "unknown scope 'attention'; accepted scopes are attn, mlp"),
        (["attn", "attn"], "scope 'attn' is given more than once"),
        (["full_iteration", "attn"], "cannot be combined with attn"),
        (["moe_preprocess"], "moe_preprocess requires moe_router"),
        (["moe", "moe_router"], "use either moe, or moe_router"),
    ],
)
def test_invalid_scopes(scopes, match):
    with pytest.raises(GraphConfigError, match=match):
        check_scopes(scopes)


@pytest.mark.parametrize(
    "scopes", [[], ["attn"], ["attn", "mlp"], ["moe_router", "moe_preprocess"]]
)
def test_valid_scopes(scopes):
    check_scopes(scopes)


def test_layerwise_graphs_need_static_buffers():
    with pytest.raises(GraphConfigError) as err:
        check_static_buffers(BufferPolicy(), ["attn"])
    msg = str(err.value)
    assert "--fsdp-double-buffer" in msg and "--fsdp-db-use-persist-buf-on-alloc-fail" in msg
    with pytest.raises(GraphConfigError, match="persist_on_alloc_fail=True"):
        check_static_buffers(BufferPolicy(allocator="double_buffer"), [])
    check_static_buffers(BufferPolicy(allocator="trace_pool", persist_on_alloc_fail=True), [])


def _units(cfg: GPTConfig):
    model = build_model(cfg)
    return [(f"layers.{i}", layer) for i, layer in enumerate(transformer_layers(model))]


def test_targets_per_scope():
    dense, moe = _units(TINY), _units(MOE)
    assert [t.name for t in select_targets(dense, [])] == ["layers.0", "layers.1"]
    assert [t.name for t in select_targets(dense, ["attn", "mlp"])] == [
        "layers.0.self_attention",
        "layers.0.mlp",
        "layers.1.self_attention",
        "layers.1.mlp",
    ]
    # Layer 0 is MoE, layer 1 dense (moe_layer_freq=2).
    assert [t.name for t in select_targets(moe, ["attn", "moe_router", "moe_preprocess"])] == [
        "layers.0.self_attention",
        "layers.0.moe.router",
        "layers.0.moe.preprocess",
        "layers.1.self_attention",
    ]
    targets = select_targets(moe, ["moe"])
    assert [t.name for t in targets] == ["layers.0.moe"] and targets[0].unit is moe[0][1]


def test_scope_that_matches_nothing_is_an_error():
    with pytest.raises(GraphConfigError, match="moe_router: no module of the model matches"):
        select_targets(_units(TINY), ["moe_router"])
    all_moe = dataclasses.replace(MOE, moe_layer_freq=1)
    with pytest.raises(GraphConfigError, match="mlp: no module"):
        select_targets(_units(all_moe), ["mlp"])
    with pytest.raises(GraphConfigError, match="full_iteration is not a layerwise scope"):
        select_targets(_units(TINY), ["full_iteration"])


def test_call_signature_matches_only_identical_calls():
    x = torch.randn(2, 3, requires_grad=True)
    sig = CallSignature((x, torch.float32), {"k": torch.ones(3, dtype=torch.long)})
    same = sig.tensors_of(
        (torch.zeros(2, 3, requires_grad=True), torch.float32),
        {"k": torch.zeros(3, dtype=torch.long)},
    )
    assert same is not None and len(same) == 2
    assert (
        sig.tensors_of(
            (torch.zeros(2, 4, requires_grad=True), torch.float32),
            {"k": torch.zeros(3, dtype=torch.long)},
        )
        is None
    )
    assert (
        sig.tensors_of((torch.zeros(2, 3), torch.float32), {"k": torch.zeros(3, dtype=torch.long)})
        is None
    )  # requires_grad
    assert sig.tensors_of((x, torch.bfloat16), {"k": torch.zeros(3, dtype=torch.long)}) is None
    assert sig.tensors_of((x, torch.float32), {}) is None
    args, kwargs = sig.rebuild(same)
    assert args[1] is torch.float32 and kwargs["k"] is same[1]


def _run_expecting_error(rank: int, world: int, cfg: TrainConfig) -> str:
    try:
        run(rank, world, cfg)
    except (GraphConfigError, ValueError) as err:
        return str(err)
    return "no error"


INVALID = [
    (dict(cuda_graph_impl="torch"), "needs static|must be static"),
    (
        dict(cuda_graph_impl="torch", allocator="double_buffer", persist_on_alloc_fail=True),
        "CUDA graphs need a CUDA device, but the model is on cpu",
    ),
    (dict(cuda_graph_impl="torch", cuda_graph_scope=["full_iteration"]), "full_iteration"),
    (dict(cuda_graph_impl="torch", recompute=True), "recompute=True"),
    (
        dict(
            cuda_graph_impl="torch",
            allocator="double_buffer",
            persist_on_alloc_fail=True,
            cuda_graph_warmup_steps=0,
        ),
        "cuda_graph_warmup_steps=0 must be >= 1",
    ),
]


@pytest.fixture(scope="module")
def invalid_runs():
    """Every invalid configuration's run, in one spawned group."""
    cases = {
        repr(overrides): (
            _run_expecting_error,
            dataclasses.replace(TrainConfig(model=TINY, steps=1), **overrides),
        )
        for overrides, _ in INVALID
    }
    return spawn_cases(cases, 2)


@pytest.mark.parametrize("overrides, match", INVALID)
def test_train_run_rejects_invalid_graph_configs(invalid_runs, overrides, match):
    (msg, _) = invalid_runs[repr(overrides)]
    assert pytest.importorskip("re").search(match, msg), msg


def test_train_config_rejects_unknown_graph_impl():
    """An unknown backend is refused when the config is made (its GraphPolicy), before any
    run: in the sectioned form and in the flat spelling alike."""
    with pytest.raises(GraphConfigError, match="cuda_graph_impl='graph'"):
        TrainConfig(model=TINY, steps=1, graphs=GraphPolicy(impl="graph"))
    with pytest.raises(GraphConfigError, match="cuda_graph_impl='graph'"):
        dataclasses.replace(TrainConfig(model=TINY, steps=1), cuda_graph_impl="graph")


# ------------------------------------------------------------------ TE attention under capture
@pytest.mark.parametrize(
    ("impl", "scopes", "env", "expected"),
    [
        ("torch", ["attn"], None, "Torch graphs would record it"),
        ("torch", ["full_iteration"], None, "Torch graphs would record it"),
        ("te", [], None, "not be bit-identical"),
        ("te", ["mlp"], None, None),  # the attention runs eagerly
        ("torch", ["attn"], "0", None),  # NVTE_FUSED_ATTN=0: no cuDNN attention anywhere
    ],
)
def test_te_attention_capture_check_for_the_reference_model(
    monkeypatch, impl, scopes, env, expected
):
    """train.make_graphs runs te_backend.check_attention_capture for TE-layer models: seq 64
    with TE's cuDNN 9.10 (set here; TE is not installed) faults under a torch capture and
    differs under TE's; the fix it names is NVTE_FUSED_ATTN=0."""
    from graph_fsdp.capture import te_backend
    from graph_fsdp.training.train import make_graphs

    monkeypatch.setattr(te_backend, "te_cudnn_version", lambda: (9, 10, 2))
    monkeypatch.setattr(te_backend, "_warned", set())  # warnings come once per process
    if env is None:
        monkeypatch.delenv("NVTE_FUSED_ATTN", raising=False)
    else:
        monkeypatch.setenv("NVTE_FUSED_ATTN", env)
    model = GPTConfig(transformer_impl="transformer_engine", seq_length=64)
    cfg = TrainConfig(model=model, cuda_graph_impl=impl, cuda_graph_scope=scopes)
    stop = RuntimeError("past the attention check")

    def reached(*args, **kwargs):
        raise stop

    # Past the check the GraphPolicy builds the runners, which need a sharded CUDA model.
    monkeypatch.setattr("graph_fsdp.capture.policy.LayerwiseGraphs", reached)
    monkeypatch.setattr("graph_fsdp.capture.policy.FullIterationGraphs", reached)
    if expected is None:
        with pytest.raises(RuntimeError, match="past the attention check"):
            make_graphs(torch.nn.Linear(2, 2), cfg)
    elif impl == "torch":
        with pytest.raises(GraphConfigError, match=expected) as err:
            make_graphs(torch.nn.Linear(2, 2), cfg)
        assert "NVTE_FUSED_ATTN=0" in str(err.value)
    else:
        with pytest.warns(UserWarning, match=expected), pytest.raises(RuntimeError):
            make_graphs(torch.nn.Linear(2, 2), cfg)


class _FakeDotProductAttention(torch.nn.Module):
    """Stands in for transformer_engine.pytorch.DotProductAttention (not installed here):
    the attributes and call convention the capture guard reads."""

    def __init__(self, qkv_format: str = "sbhd", attn_mask_type: str = "causal") -> None:
        super().__init__()
        self.qkv_format, self.attn_mask_type = qkv_format, attn_mask_type

    def forward(self, query, key, value, attention_mask=None):
        return query


class _Attn(torch.nn.Module):
    def __init__(self, **kw) -> None:
        super().__init__()
        self.core_attention = _FakeDotProductAttention(**kw)

    def forward(self, q, k):
        return self.core_attention(q, k, k)


class _Model(torch.nn.Module):
    def __init__(self, block: torch.nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, q, k):
        return self.block(q, k)


@pytest.fixture
def fake_te(monkeypatch):
    """A transformer_engine.pytorch module with the fake attention, TE's cuDNN 9.10.2."""
    import sys
    import types

    from graph_fsdp.capture import te_backend

    module = types.ModuleType("transformer_engine.pytorch")
    module.DotProductAttention = _FakeDotProductAttention
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", module)
    monkeypatch.setattr(te_backend, "te_cudnn_version", lambda: (9, 10, 2))
    monkeypatch.setattr(te_backend, "_warned", set())
    for var in ("NVTE_FUSED_ATTN", "NVTE_FLASH_ATTN", "NVTE_UNFUSED_ATTN"):
        monkeypatch.delenv(var, raising=False)
    return te_backend


def _call_under_guard(te_backend, impl, model, q, k):
    names = {id(m): n for n, m in model.named_modules()}
    with te_backend.attention_capture_guard(impl, names):
        return model(q, k)


@pytest.mark.parametrize(
    ("layout", "shape", "seq"),
    [("sbhd", (64, 2, 4, 8), 64), ("bshd", (2, 96, 4, 8), 96), ("sbhd_2bshd", (2, 80, 4, 8), 80)],
)
def test_the_capture_guard_refuses_any_models_te_attention_for_torch_graphs(
    fake_te, layout, shape, seq
):
    """Whatever the model and its scopes, a torch capture running TE attention at a key
    length that is not a multiple of 128 stops with the module and the length named."""
    model = _Model(_Attn(qkv_format=layout))
    x = torch.zeros(shape)
    with pytest.raises(GraphConfigError) as err:
        _call_under_guard(fake_te, "torch", model, x, x)
    text = str(err.value)
    assert "block.core_attention" in text and f"sequence length {seq}" in text, text
    assert "NVTE_FUSED_ATTN=0" in text, text
    model(x, x)  # the guard is gone after the capture


def test_the_capture_guard_warns_once_for_te_graphs_and_passes_safe_calls(fake_te, monkeypatch):
    model = _Attn()
    short, long = torch.zeros(64, 2, 4, 8), torch.zeros(128, 2, 4, 8)
    with pytest.warns(UserWarning, match="not be bit-identical") as seen:
        _call_under_guard(fake_te, "te", model, short, short)
        _call_under_guard(fake_te, "te", model, short, short)
    assert len([w for w in seen if "bit-identical" in str(w.message)]) == 1
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _call_under_guard(fake_te, "torch", model, long, long)  # a multiple of 128
        _call_under_guard(fake_te, "torch", _Attn(attn_mask_type="padding_causal"), short, short)
        _call_under_guard(fake_te, "torch", _Attn(qkv_format="thd"), short, short)
        monkeypatch.setenv("NVTE_FUSED_ATTN", "0")  # no cuDNN attention in either run
        _call_under_guard(fake_te, "torch", model, short, short)
    monkeypatch.setenv("NVTE_FUSED_ATTN", "1")
    monkeypatch.setenv("NVTE_FLASH_ATTN", "0")
    monkeypatch.setenv("NVTE_UNFUSED_ATTN", "0")  # Megatron's attention_backend=fused
    with pytest.raises(GraphConfigError, match="pinned to fused"):
        _call_under_guard(fake_te, "te", model, short, short)


def test_the_capture_guard_leaves_models_without_te_alone(monkeypatch):
    import sys

    from graph_fsdp.capture import te_backend

    monkeypatch.delitem(sys.modules, "transformer_engine.pytorch", raising=False)
    model = _Attn()
    x = torch.zeros(64, 2, 4, 8)
    with te_backend.attention_capture_guard("torch", {}):
        model(x, x)
