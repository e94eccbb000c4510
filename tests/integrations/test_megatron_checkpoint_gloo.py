"""Megatron-Core ``dist_checkpointing`` checkpoints in and out of graph_fsdp, on 2 gloo ranks.

Needs megatron-core (0.16 on Python 3.11, as CI installs it, or 0.19 on Python >= 3.12).

TP 1: a plain Megatron GPTModel (local spec, fp32) writes ``dist_checkpointing.save(
gpt.sharded_state_dict(), dir)``; a graph_fsdp model sharded over both ranks (other seed)
loads it with ``gm.load_megatron_checkpoint`` - its gathered weights equal Megatron's bit for
bit - trains a step, writes ``gm.save_megatron_checkpoint``, and a fresh plain GPTModel's
``dist_checkpointing.load`` reads weights bit-equal to graph_fsdp's gathered ones.
TP 2 (SwiGLU, 2 query groups): Megatron at TP 2 writes; graph_fsdp at TP 2 and at TP 1 x DP 2
load it (bit-equal to the global weights, which Megatron's CPU initialisation draws the same
at every TP size, and which Megatron itself reads back at TP 1); graph_fsdp at TP 2 trains a
step and writes, and Megatron at TP 1 reads graph_fsdp's gathered weights bit for bit.

Megatron's CUDA-only details are bridged in the workers (:func:`_dist_checkpointing_on_cpu`).
"""

from __future__ import annotations

import os

import pytest
import torch
from graph_fsdp_testing import TINY_MCORE_SHAPE, megatron_imports, megatron_on_cpu, spawn_cases

pytestmark = pytest.mark.skipif(not megatron_imports(), reason="megatron-core does not import")

CFG = dict(TINY_MCORE_SHAPE, transformer_impl="local", position_embedding_type="learned_absolute")
SWIGLU = dict(CFG, swiglu=True, num_query_groups=2)


def _dist_checkpointing_on_cpu() -> None:
    """megatron_on_cpu, and dist_checkpointing's torch_dist writer: it calls
    ``torch.cuda.synchronize()`` before writing (filesystem_async.py ``preload_tensors``) and
    logs each writer process's memory through psutil, which megatron-core does not require."""
    import megatron.core.dist_checkpointing.strategies.filesystem_async as fs

    megatron_on_cpu()
    torch.cuda.synchronize = lambda *_: None
    fs._process_memory = lambda: 0
    fs.HAVE_PSUTIL = True  # what save_megatron_checkpoint checks before writing


def _build(tp: int, seed: int, *, shard: bool, **cfg):
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import initialize_rng_tracker

    from graph_fsdp.integrations import megatron as gm

    if ps.model_parallel_is_initialized():  # the cases switch TP sizes
        ps.destroy_model_parallel()
    gm.init_parallel_state(tensor_model_parallel_size=tp)
    lm = gm.build_gpt(gm.MCoreGPTConfig(**cfg, tensor_model_parallel_size=tp, seed=seed), "cpu")
    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    return gm.shard_gpt(lm) if shard else lm


def _params(lm) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in lm.named_parameters()}


def _gathered(lm) -> dict[str, torch.Tensor]:
    from graph_fsdp.fsdp.checkpoint import full_state_dict

    return {k: v.clone() for k, v in full_state_dict(lm).items()}


def _megatron_reads(lm, path: str) -> dict[str, torch.Tensor]:
    """What Megatron's own loader puts in the plain model ``lm``."""
    from megatron.core import dist_checkpointing

    lm.module.load_state_dict(dist_checkpointing.load(lm.module.sharded_state_dict(), path))
    return _params(lm)


def _train_step(lm, rank: int, vocab: int, seq: int) -> None:
    g = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, vocab, (2, seq + 1), generator=g)
    opt = torch.optim.AdamW(lm.parameters(), lr=1e-2)
    lm(tokens[:, :-1], tokens[:, 1:].contiguous()).backward()
    opt.step()


def _mismatches(a: dict, b: dict) -> list[str]:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))[:6]
    return [k for k in a if not torch.equal(a[k], b[k])]


def _tp1_round_trip(rank: int, world: int, root: str) -> dict:
    from megatron.core import dist_checkpointing

    from graph_fsdp.integrations import megatron as gm

    _dist_checkpointing_on_cpu()
    meg, ours = os.path.join(root, "tp1_megatron"), os.path.join(root, "tp1_graph_fsdp")
    plain = _build(1, 1, shard=False, **CFG)
    megatron_weights = _params(plain)
    dist_checkpointing.save(plain.module.sharded_state_dict(), _mkdir(meg))
    lm = _build(1, 2, shard=True, **CFG)
    before = _mismatches(_gathered(lm), megatron_weights)
    gm.load_megatron_checkpoint(lm, meg)
    loaded = _mismatches(_gathered(lm), megatron_weights)
    _train_step(lm, rank, CFG["vocab_size"], CFG["seq_length"])
    trained = _gathered(lm)
    moved = _mismatches(trained, megatron_weights)
    gm.save_megatron_checkpoint(lm, ours)
    read = _megatron_reads(_build(1, 3, shard=False, **CFG), ours)
    return dict(before=before, loaded=loaded, moved=moved, read=_mismatches(read, trained))


def _tp2_round_trip(rank: int, world: int, root: str) -> dict:
    from megatron.core import dist_checkpointing

    from graph_fsdp.integrations import megatron as gm

    _dist_checkpointing_on_cpu()
    meg, ours = os.path.join(root, "tp2_megatron"), os.path.join(root, "tp2_graph_fsdp")
    global_weights = _params(_build(1, 1, shard=False, **SWIGLU))  # the same at every TP size
    plain = _build(2, 1, shard=False, **SWIGLU)
    dist_checkpointing.save(plain.module.sharded_state_dict(), _mkdir(meg))
    out = {}
    lm = _build(2, 2, shard=True, **SWIGLU)
    gm.load_megatron_checkpoint(lm, meg)
    out["tp2 loaded"] = _mismatches(_gathered(lm), global_weights)
    _train_step(lm, 0, SWIGLU["vocab_size"], SWIGLU["seq_length"])  # TP ranks: one batch
    trained = _gathered(lm)
    out["tp2 moved"] = _mismatches(trained, global_weights)
    gm.save_megatron_checkpoint(lm, ours)
    megatron_tp1 = _build(1, 3, shard=False, **SWIGLU)
    out["megatron reads its tp2 at tp1"] = _mismatches(
        _megatron_reads(megatron_tp1, meg), global_weights
    )
    out["megatron reads ours at tp1"] = _mismatches(_megatron_reads(megatron_tp1, ours), trained)
    lm = _build(1, 4, shard=True, **SWIGLU)
    gm.load_megatron_checkpoint(lm, meg)
    out["tp1 x dp2 loaded"] = _mismatches(_gathered(lm), global_weights)
    return out


def _mkdir(path: str) -> str:
    os.makedirs(path, exist_ok=True)
    return path


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("mcore_checkpoint"))
    cases = {"tp1": (_tp1_round_trip, root), "tp2": (_tp2_round_trip, root)}
    return spawn_cases(cases, world_size=2, timeout=600)


def test_tp1_megatron_checkpoint_round_trip(results):
    for out in results["tp1"]:
        assert out["before"], "the graph_fsdp model started with Megatron's weights"
        assert out["loaded"] == [], out["loaded"]
        assert out["moved"], "the training step changed nothing"
        assert out["read"] == [], out["read"]


def test_tp2_swiglu_megatron_checkpoint_round_trip(results):
    for out in results["tp2"]:
        assert out["megatron reads its tp2 at tp1"] == [], out
        assert out["tp2 loaded"] == [], out
        assert out["tp1 x dp2 loaded"] == [], out
        assert out["tp2 moved"], "the training step changed nothing"
        assert out["megatron reads ours at tp1"] == [], out


def test_save_refuses_without_psutil_before_writing(monkeypatch, tmp_path):
    import megatron.core.dist_checkpointing.strategies.filesystem_async as fs

    from graph_fsdp.integrations import megatron as gm

    monkeypatch.setattr(fs, "HAVE_PSUTIL", False)
    with pytest.raises(ImportError, match="pip install psutil"):
        gm.save_megatron_checkpoint(torch.nn.Module(), str(tmp_path / "never"))
    assert not (tmp_path / "never").exists()
