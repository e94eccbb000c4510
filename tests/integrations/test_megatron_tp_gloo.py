"""Megatron-Core tensor (and sequence) parallelism under graph_fsdp on 4 gloo ranks.

Needs megatron-core (0.16 on Python 3.11, as CI installs it, or 0.19 on Python >= 3.12).

Megatron's GPT (local layers, learned positions) at TP 2 x DP 2 - every TP rank's local pieces
sharded over Megatron's data-parallel group - against Megatron at TP 2 alone (no FSDP) training
on the same global batch: the data-parallel ranks' microbatches in turn, their gradients summed
in order and halved, then (sequence parallel) the norms' gradients summed over TP, the order of
Megatron's ``finalize_model_grads``. The arithmetic is the same, so losses and final weights
are compared bit for bit (``torch.equal``) while clipping does not bite; the global gradient
norm to 1e-6 relative (another order of fp32 additions). Checkpoints: TP 2 x DP 2 -> TP 1 x DP 4
-> TP 2 x DP 2, bit-identical weights, and a TP 1 model matches the TP 2 one's first losses
(the same global weights: Megatron's CPU initialisation draws every full weight).

SwiGLU (``swiglu=True``: fc1 holds ``[gate; up]``, each TP rank ``[gate_r; up_r]``,
``partition_stride=2``) at TP 2 x DP 2 with sequence parallelism: bit-identical to Megatron at
TP 2 alone; its global weights those of the TP 1 model bit for bit and its first gradients
within 1e-6; checkpoints TP 2 -> TP 1 -> TP 2 bit-identical, training resumed at TP 1 within
1e-5 of TP 2.

Megatron's CPU gaps are bridged in the spawned processes only (:func:`_megatron_on_cpu`): its
sequence-parallel collectives and attention allocate on ``torch.cuda.current_device()`` (made
the CPU), its attention forks the CUDA RNG tracker (a no-op: dropout is 0), and its local spec's
torch norms refuse sequence parallelism (an RMSNorm that marks its weight ``sequence_parallel``,
as Megatron's fused and TE norms do). The GPU tests (tests/core/test_tensor_parallel_gpu.py) run the
TE spec unpatched.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os

import pytest
import torch
import torch.distributed as dist
from graph_fsdp_testing import TINY_MCORE_SHAPE, megatron_imports

from graph_fsdp.integrations import megatron as gm
from graph_fsdp.training.processes import spawn

TP_CFG = dict(
    TINY_MCORE_SHAPE,
    transformer_impl="local",
    position_embedding_type="learned_absolute",
)
SWIGLU_CFG = dict(TP_CFG, swiglu=True, normalization="RMSNorm")
"""Llama-style MLP: linear_fc1 = [gate; up], each TP rank [gate_r; up_r] (partition_stride=2)."""
MICRO = 2
STEPS = 3


needs_megatron = pytest.mark.skipif(
    not megatron_imports(), reason="megatron-core does not import here"
)


# ----------------------------------------------------------------------------- config rules
@pytest.mark.parametrize(
    ("fields", "words"),
    [
        (dict(tensor_model_parallel_size=3), ["must divide", "num_attention_heads"]),
        (dict(sequence_parallel=True), ["sequence_parallel=True", "tensor_model_parallel_size=1"]),
        (dict(tensor_model_parallel_size=0), ["positive integer"]),
        (dict(normalization="LN"), ["normalization='LN'", "RMSNorm"]),
        (
            dict(tensor_model_parallel_size=2, num_query_groups=1),
            ["'num_query_groups': 1", "key/value groups"],
        ),
        (dict(tensor_model_parallel_size=2, num_experts=4), ["dense GPTs", "num_experts=4"]),
        (
            dict(tensor_model_parallel_size=4, sequence_parallel=True, seq_length=18),
            ["seq_length", "sequence_parallel"],
        ),
    ],
)
def test_config_refuses_shapes_tp_cannot_split(fields, words):
    with pytest.raises(ValueError) as err:
        gm.MCoreGPTConfig(**{**TP_CFG, **fields})
    for word in words:
        assert word in str(err.value), str(err.value)


# ----------------------------------------------------------------------------- the spawn
def _megatron_on_cpu() -> None:
    """See the module docstring (spawned processes only)."""
    import megatron.core.tensor_parallel.random as mr

    torch.cuda.current_device = lambda: "cpu"

    @contextlib.contextmanager
    def fork(self, name=None):
        yield

    mr.CudaRNGStatesTracker.fork = fork


class _SequenceParallelRMSNorm(torch.nn.RMSNorm):
    """Megatron's norm interface on CPU; marks its weight as Megatron's norms do."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_) -> None:
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = config.sequence_parallel


def _build(cfg: gm.MCoreGPTConfig) -> gm.MCoreLM:
    """``gm.build_gpt`` with the CPU norm in the local spec."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import initialize_rng_tracker
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
    )
    from megatron.core.transformer.transformer_layer import TransformerLayer

    sub = dataclasses.replace(
        get_gpt_layer_local_spec().submodules,
        input_layernorm=_SequenceParallelRMSNorm,
        pre_mlp_layernorm=_SequenceParallelRMSNorm,
    )
    layer = ModuleSpec(module=TransformerLayer, submodules=sub)
    spec = TransformerBlockSubmodules(
        layer_specs=[layer] * cfg.num_layers, layer_norm=_SequenceParallelRMSNorm
    )
    torch.manual_seed(cfg.seed)
    initialize_rng_tracker(use_cudagraphable_rng=False, force_reset=True)
    gpt = GPTModel(
        config=gm.transformer_config(cfg, torch.device("cpu")),
        transformer_layer_spec=spec,
        vocab_size=cfg.vocab_size,
        max_sequence_length=cfg.seq_length,
        position_embedding_type=cfg.position_embedding_type,
        share_embeddings_and_output_weights=False,
    )
    return gm.MCoreLM(gpt, cfg.seq_length)


def _state(tp: int) -> None:
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    gm.init_parallel_state(tensor_model_parallel_size=tp)


def _batch(step: int, micro: int, cfg: gm.MCoreGPTConfig):
    g = torch.Generator().manual_seed(1000 * step + micro)
    seq = torch.randint(0, cfg.vocab_size, (1, cfg.seq_length + 1), generator=g)
    return seq[:, :-1], seq[:, 1:].contiguous()


def _dp_rank() -> tuple[int, int]:
    from megatron.core import parallel_state as ps

    return ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()


def _global(lm: torch.nn.Module, grads: bool = False) -> dict[str, torch.Tensor]:
    """The reference's global weights (or gradients): TP pieces all-gathered along their
    partition dim, a strided piece's blocks put back in Megatron's order (rank r holds blocks
    r, r + TP, ...: ``_initialize_affine_weight_cpu``)."""
    from megatron.core import parallel_state as ps

    group = ps.get_tensor_model_parallel_group()
    size = dist.get_world_size(group)
    out = {}
    for name, p in lm.named_parameters():
        t = (p.grad if grads else p).detach()
        if getattr(p, "tensor_model_parallel", False) and size > 1:
            parts = [torch.empty_like(t) for _ in range(size)]
            dist.all_gather(parts, t.contiguous(), group=group)
            stride, d = p.partition_stride, p.partition_dim
            blocks = [part.chunk(stride, dim=d) for part in parts]
            t = torch.cat([blocks[r][k] for k in range(stride) for r in range(size)], dim=d)
        out[name] = t.clone()
    return out


def _reference(cfg: gm.MCoreGPTConfig, clip: float) -> dict:
    """Megatron at TP 2 alone: the global batch's microbatches in turn, Megatron's order of
    reductions (DP sum, then the TP sum of sequence-parallel gradients)."""
    from megatron.core import parallel_state as ps

    from graph_fsdp.integrations.megatron import tp as megatron_tp

    lm = _build(cfg)
    tp_group = ps.get_tensor_model_parallel_group()
    reduced = megatron_tp.tp_reduced_params(lm, lm.module.config)
    params = [p for p in lm.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)
    losses, norms = [], []
    for step in range(STEPS):
        acc, mine = {}, []
        for micro in range(MICRO):
            loss = lm(*_batch(step, micro, cfg))
            loss.backward()
            mine.append(loss.detach())
            for p in params:
                acc[p] = p.grad.clone() if micro == 0 else acc[p] + p.grad
                p.grad = None
        for p in params:
            p.grad = acc[p] * (1.0 / MICRO)
            if id(p) in reduced:
                dist.all_reduce(p.grad, group=tp_group)
        squares = []
        for p in params:
            sq = p.grad.square().sum()
            if getattr(p, "tensor_model_parallel", False):
                dist.all_reduce(sq, group=tp_group)
            squares.append(sq)
        norm = torch.stack(squares).sum().sqrt()
        coef = torch.clamp(clip / (norm + 1e-6), max=1.0)
        for p in params:
            p.grad.mul_(coef)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(torch.stack(mine))
        norms.append(norm)
    return {"losses": losses, "norms": torch.stack(norms), "params": _global(lm)}


def _graph_fsdp(cfg: gm.MCoreGPTConfig, clip: float, save: str | None = None) -> dict:
    from graph_fsdp.fsdp import checkpoint as ckpt

    lm = gm.shard_gpt(_build(cfg))
    opt = torch.optim.AdamW(lm.parameters(), lr=1e-2, weight_decay=0.01)
    d, dp = _dp_rank()
    accum = MICRO // dp
    losses, norms = [], []
    for step in range(STEPS):
        mine = torch.zeros(MICRO)
        for i in range(accum):
            lm.set_requires_gradient_sync(i == accum - 1)
            loss = lm(*_batch(step, d * accum + i, cfg))
            (loss / accum).backward()
            mine[d * accum + i] = loss.detach()
        dist.all_reduce(mine)  # each microbatch's loss, held by the TP ranks of its DP rank
        losses.append(mine / (dist.get_world_size() // dp))
        norms.append(torch.nn.utils.clip_grad_norm_(lm.parameters(), clip))
        opt.step()
        opt.zero_grad(set_to_none=True)
    if save:
        ckpt.save(save, lm, opt)
    return {"losses": losses, "norms": torch.stack(norms), "params": ckpt.full_state_dict(lm)}


def _load(cfg: gm.MCoreGPTConfig, path: str) -> dict[str, torch.Tensor]:
    from graph_fsdp.fsdp import checkpoint as ckpt

    lm = gm.shard_gpt(_build(cfg))
    opt = torch.optim.AdamW(lm.parameters(), lr=1e-2, weight_decay=0.01)
    with torch.no_grad():
        for p in lm.parameters():
            p.zero_()
    ckpt.load(path, lm, opt)
    return ckpt.full_state_dict(lm)


def _grads_and_weights(cfg: gm.MCoreGPTConfig, sharded: bool) -> dict:
    """The first step's gradients of the global batch (the mean over its microbatches) and
    the initial weights, as global tensors: through graph_fsdp (``sharded``; the gradients
    copied into the weights to gather them) or of a plain Megatron model."""
    from graph_fsdp.fsdp import checkpoint as ckpt

    lm = _build(cfg)
    if not sharded:
        weights = _global(lm)
        for m in range(MICRO):
            (lm(*_batch(0, m, cfg)) / MICRO).backward()
        return {"weights": weights, "grads": _global(lm, grads=True)}
    lm = gm.shard_gpt(lm)
    weights = ckpt.full_state_dict(lm)
    d, dp = _dp_rank()
    accum = MICRO // dp
    for i in range(accum):
        lm.set_requires_gradient_sync(i == accum - 1)
        (lm(*_batch(0, d * accum + i, cfg)) / accum).backward()
    with torch.no_grad():
        for p in lm.parameters():  # a rank with an empty piece has no gradient
            p.copy_(p.grad) if p.grad is not None else p.zero_()
    return {"weights": weights, "grads": ckpt.full_state_dict(lm)}


def _resumed_loss(cfg: gm.MCoreGPTConfig, path: str) -> torch.Tensor:
    """A graph_fsdp model loaded from ``path`` takes a training step; its next loss."""
    from graph_fsdp.fsdp import checkpoint as ckpt

    lm = gm.shard_gpt(_build(cfg))
    opt = torch.optim.AdamW(lm.parameters(), lr=1e-2, weight_decay=0.01)
    ckpt.load(path, lm, opt)
    d, dp = _dp_rank()
    accum = 4 // dp  # a global batch of 4 microbatches at DP 2 and DP 4 alike
    for i in range(accum):
        lm.set_requires_gradient_sync(i == accum - 1)
        (lm(*_batch(STEPS, d * accum + i, cfg)) / accum).backward()
    opt.step()
    with torch.no_grad():
        return lm(*_batch(STEPS + 1, 0, cfg))


def _first_losses(cfg: gm.MCoreGPTConfig) -> torch.Tensor:
    lm = _build(cfg)
    with torch.no_grad():
        return torch.stack([lm(*_batch(0, m, cfg)) for m in range(MICRO)])


def _masked_loss_sum(cfg: gm.MCoreGPTConfig) -> torch.Tensor:
    """The packed loss's reduction (``token_loss_sum``: a third of the labels ignored) of the
    first batch: at TP 1 over whole-vocabulary logits, at TP 2 Megatron's vocabulary-parallel
    cross entropy."""
    from graph_fsdp.integrations.megatron.packed import token_loss_sum
    from graph_fsdp.models.packed import IGNORE_INDEX

    lm = _build(cfg)
    ids, labels = _batch(0, 0, cfg)
    s = cfg.seq_length
    labels = labels.masked_fill(torch.arange(s) % 3 == 0, IGNORE_INDEX)
    causal = torch.ones(s, s, dtype=torch.bool).triu(1)[None, None]
    with torch.no_grad():
        return token_loss_sum(lm.module, ids, torch.arange(s)[None], causal, labels)


def _four_ranks(rank: int, world: int, root: str) -> dict:
    _megatron_on_cpu()
    out: dict = {}
    _state(2)
    try:  # the public builder (the local spec's torch norms: no sequence parallelism on CPU)
        gm.build_gpt(gm.MCoreGPTConfig(**TP_CFG, tensor_model_parallel_size=2), "cpu")
        out["build_gpt at TP 2"] = "built"
    except ValueError as err:
        out["build_gpt at TP 2"] = str(err)
    for sp in (False, True):
        cfg = gm.MCoreGPTConfig(**TP_CFG, tensor_model_parallel_size=2, sequence_parallel=sp)
        for clip in (1e9, 0.5):
            key = f"sp={sp} clip={clip}"
            save = os.path.join(root, "tp2") if sp and clip > 1 else None
            out[key] = {"fsdp": _graph_fsdp(cfg, clip, save), "ref": _reference(cfg, clip)}
        out[f"sp={sp} first"] = _first_losses(cfg)
        out[f"sp={sp} masked loss sum"] = _masked_loss_sum(cfg)
    swiglu2 = gm.MCoreGPTConfig(**SWIGLU_CFG, tensor_model_parallel_size=2, sequence_parallel=True)
    out["swiglu"] = {
        "fsdp": _graph_fsdp(swiglu2, 1e9, os.path.join(root, "swiglu2")),
        "ref": _reference(swiglu2, 1e9),
        "first": _first_losses(swiglu2),
        "step 0": _grads_and_weights(swiglu2, sharded=True),
        "resumed at tp2": _resumed_loss(swiglu2, os.path.join(root, "swiglu2")),
    }
    out["swiglu fc1 stride"] = (
        _build(swiglu2).get_submodule(FC1.rsplit(".", 1)[0]).weight.partition_stride
    )
    tp2 = gm.MCoreGPTConfig(**TP_CFG, tensor_model_parallel_size=2, sequence_parallel=True)
    _state(1)
    swiglu1 = gm.MCoreGPTConfig(**SWIGLU_CFG)
    out["swiglu tp1"] = {
        "first": _first_losses(swiglu1),
        "step 0": _grads_and_weights(swiglu1, sharded=False),
        "tp2 -> tp1": _load(swiglu1, os.path.join(root, "swiglu2")),
        "resumed at tp1": _resumed_loss(swiglu1, os.path.join(root, "swiglu2")),
    }
    _resave(swiglu1, os.path.join(root, "swiglu2"), os.path.join(root, "swiglu1"))
    tp1 = gm.MCoreGPTConfig(**TP_CFG)
    out["tp1 first"] = _first_losses(tp1)
    out["tp1 masked loss sum"] = _masked_loss_sum(tp1)
    out["tp2 -> tp1"] = _load(tp1, os.path.join(root, "tp2"))
    _resave(tp1, os.path.join(root, "tp2"), os.path.join(root, "tp1"))
    out["errors"] = _errors(tp2)
    _state(2)
    out["tp2 -> tp1 -> tp2"] = _load(tp2, os.path.join(root, "tp1"))
    out["swiglu tp2 -> tp1 -> tp2"] = _load(swiglu2, os.path.join(root, "swiglu1"))
    out["swiglu global state dict"] = _load_global(swiglu2, out["swiglu tp1"]["tp2 -> tp1"])
    return out


def _load_global(cfg: gm.MCoreGPTConfig, state: dict) -> dict[str, torch.Tensor]:
    """``load_state_dict`` of global tensors (a pretrained TP 1 model's) into a sharded model."""
    from graph_fsdp.fsdp import checkpoint as ckpt

    lm = gm.shard_gpt(_build(cfg))
    lm.load_state_dict(state, strict=False)
    return ckpt.full_state_dict(lm)


def _resave(cfg: gm.MCoreGPTConfig, src: str, dst: str) -> None:
    """Load ``src`` into a model of ``cfg`` and save it to ``dst``."""
    from graph_fsdp.fsdp import checkpoint as ckpt

    lm = gm.shard_gpt(_build(cfg))
    opt = torch.optim.AdamW(lm.parameters(), lr=1e-2, weight_decay=0.01)
    ckpt.load(src, lm, opt)
    ckpt.save(dst, lm, opt)


def _errors(tp2: gm.MCoreGPTConfig) -> dict[str, str]:
    """At TP 1 of 4 ranks: a model built for TP 2, then TP 3, then TP 2 over the state."""
    out = {}
    try:
        gm.shard_gpt(_build(tp2))
    except ValueError as err:
        out["built at another TP"] = str(err)
    for tp in (3, 2):
        try:
            gm.init_parallel_state(tensor_model_parallel_size=tp)
        except ValueError as err:
            out[f"init {tp}"] = str(err)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    if not megatron_imports():
        pytest.skip("megatron-core does not import here")
    return spawn(_four_ranks, 4, str(tmp_path_factory.mktemp("mcore_tp")))


def _assert_bit_identical(rank: int, fsdp: dict, ref: dict) -> None:
    """graph_fsdp's run equals Megatron's: every step's loss, every final parameter and the
    gradient norms."""
    for step, (a, b) in enumerate(zip(fsdp["losses"], ref["losses"], strict=True)):
        assert torch.equal(a, b), (rank, step, a, b)
    assert sorted(fsdp["params"]) == sorted(ref["params"])
    for name, value in ref["params"].items():
        assert torch.equal(fsdp["params"][name], value), (rank, name)
    torch.testing.assert_close(fsdp["norms"], ref["norms"], rtol=1e-6, atol=0)


@needs_megatron
@pytest.mark.parametrize("sp", [False, True])
def test_tp_fsdp_bit_identical_to_megatron_tp(results, sp):
    for rank, res in enumerate(results):
        run = res[f"sp={sp} clip=1000000000.0"]
        fsdp, ref = run["fsdp"], run["ref"]
        _assert_bit_identical(rank, fsdp, ref)
        norm = ref["params"]["module.decoder.layers.0.input_layernorm.weight"]
        assert not torch.equal(norm, torch.ones_like(norm))  # trained


@needs_megatron
@pytest.mark.parametrize("sp", [False, True])
def test_clipped_runs_within_fp32(results, sp):
    for res in results:
        run = res[f"sp={sp} clip=0.5"]
        fsdp, ref = run["fsdp"], run["ref"]
        assert (ref["norms"] > 0.5).all()
        torch.testing.assert_close(fsdp["norms"], ref["norms"], rtol=1e-6, atol=0)
        for name, value in ref["params"].items():
            torch.testing.assert_close(fsdp["params"][name], value, rtol=0, atol=1e-6)


@needs_megatron
def test_sequence_parallel_norms_stay_equal_across_tp(results):
    """Without the TP sum the two TP ranks of a DP rank would step different norm weights."""
    first = results[0]["sp=True clip=1000000000.0"]["fsdp"]["params"]
    for res in results[1:]:
        for name, value in res["sp=True clip=1000000000.0"]["fsdp"]["params"].items():
            assert torch.equal(value, first[name]), name


@needs_megatron
def test_tp1_and_tp2_compute_the_same_model(results):
    for res in results:
        for sp in (False, True):
            torch.testing.assert_close(res[f"sp={sp} first"], res["tp1 first"], rtol=0, atol=1e-6)


@needs_megatron
def test_packed_loss_sum_is_the_same_at_tp2(results):
    """The packed loss at TP 2 (Megatron's vocabulary-parallel cross entropy, ignored labels
    zeroed) sums what TP 1's whole-vocabulary cross entropy sums: the same tokens, to fp32."""
    for res in results:
        tp1 = res["tp1 masked loss sum"]
        assert tp1 > 0
        for sp in (False, True):
            torch.testing.assert_close(res[f"sp={sp} masked loss sum"], tp1, rtol=1e-5, atol=0)


@needs_megatron
def test_checkpoints_move_between_tp_sizes(results):
    for res in results:
        saved = res["sp=True clip=1000000000.0"]["fsdp"]["params"]
        for path in ("tp2 -> tp1", "tp2 -> tp1 -> tp2"):
            assert sorted(res[path]) == sorted(saved)
            for name, value in saved.items():
                assert torch.equal(res[path][name], value), (path, name)


@needs_megatron
def test_build_gpt_builds_tensor_parallel_models(results):
    """gm.build_gpt at TP 2: Megatron's data-parallel group is half the world, which the EP
    check (dense parameters over the whole world) must not refuse."""
    assert [res["build_gpt at TP 2"] for res in results] == ["built"] * 4


@needs_megatron
def test_errors_name_the_fix(results):
    for res in results:
        errors = res["errors"]
        assert (
            "init_parallel_state(tensor_model_parallel_size=2)" in errors["built at another TP"]
        ), errors
        assert "positive divisor of the world size 4" in errors["init 3"], errors
        assert "initialised elsewhere" in errors["init 2"], errors


# ----------------------------------------------------------------------------- SwiGLU
FC1 = "module.decoder.layers.0.mlp.linear_fc1.weight"


@needs_megatron
def test_swiglu_fc1_is_strided(results):
    """The layout these tests rest on: Megatron builds the gated fc1 with partition_stride=2."""
    for res in results:
        assert res["swiglu fc1 stride"] == 2, res["swiglu fc1 stride"]


@needs_megatron
def test_swiglu_tp_fsdp_bit_identical_to_megatron_tp(results):
    for rank, res in enumerate(results):
        fsdp, ref = res["swiglu"]["fsdp"], res["swiglu"]["ref"]
        _assert_bit_identical(rank, fsdp, ref)


@needs_megatron
def test_swiglu_tp2_is_the_unsharded_tp1_model(results):
    """graph_fsdp's global tensors at TP 2 x DP 2 are the TP 1 model's: the initial weights bit
    for bit (fc1 = [gate; up], Megatron's CPU initialisation draws that full weight at every TP
    size), the first gradients and losses within fp32 rounding of the other GEMM splits."""
    for res in results:
        tp2, tp1 = res["swiglu"]["step 0"], res["swiglu tp1"]["step 0"]
        assert sorted(tp2["weights"]) == sorted(tp1["weights"])
        for name, value in tp1["weights"].items():
            assert torch.equal(tp2["weights"][name], value), name
        for name, value in tp1["grads"].items():
            torch.testing.assert_close(tp2["grads"][name], value, rtol=0, atol=1e-6, msg=name)
        assert tp1["grads"][FC1].abs().max() > 1e-4  # the MLP trained
        torch.testing.assert_close(
            res["swiglu"]["first"], res["swiglu tp1"]["first"], rtol=0, atol=1e-6
        )


@needs_megatron
def test_swiglu_checkpoints_move_between_tp_sizes(results):
    """TP 2 -> TP 1 (where fc1 is simply [gate; up]) -> TP 2, bit-identical; training resumed
    at TP 1 continues the TP 2 run (the GEMM splits differ: within 1e-5)."""
    for res in results:
        saved = res["swiglu"]["fsdp"]["params"]
        for loaded in (res["swiglu tp1"]["tp2 -> tp1"], res["swiglu tp2 -> tp1 -> tp2"]):
            assert sorted(loaded) == sorted(saved)
            for name, value in saved.items():
                assert torch.equal(loaded[name], value), name
        torch.testing.assert_close(
            res["swiglu tp1"]["resumed at tp1"], res["swiglu"]["resumed at tp2"], rtol=0, atol=1e-5
        )
        loaded = res["swiglu global state dict"]  # load_state_dict of the TP 1 weights at TP 2
        for name, value in saved.items():
            assert torch.equal(loaded[name], value), name
