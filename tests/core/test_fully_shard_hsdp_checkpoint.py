"""DCP checkpoints across 1-D and 2-D (HSDP) meshes: 2x2 -> 1x4 and 1-D -> 2x2.

Saving and loading run in one spawn of 4 ranks (a spawn costs seconds). The checks are those
of test_fully_shard_checkpoint.py: the loaded main weights and optimizer state equal the
saved ones element for element (gathered independently of the checkpoint code), the
optimizer's hyperparameters come from the checkpoint, and training continues.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from test_fully_shard_checkpoint import CPU, EVAL_STEP, TINY, _load, _train_and_save

from graph_fsdp.models import build_model, synthetic_batch
from graph_fsdp.training.processes import spawn
from graph_fsdp.training.train import TrainConfig

SAVED = {
    # HFSDP: ZeRO-3, optimizer sharded over both dims -> 1x4 ZeRO-2 (optimizer over 4 shards).
    "2x2_to_1x4": (
        TrainConfig(
            model=TINY, strategy="optim_grads_params", mesh_shape=(2, 2), optim_over_replicas=True
        ),
        TrainConfig(model=TINY, strategy="optim_grads", mesh_shape=(1, 4), lr=0.0, weight_decay=0),
    ),
    # 1-D ZeRO-3 over 4 ranks -> 2x2 ZeRO-1, optimizer replicated across the replicas.
    "1d_to_2x2": (
        TrainConfig(model=TINY, strategy="optim_grads_params"),
        TrainConfig(model=TINY, strategy="optim", mesh_shape=(2, 2), lr=0.0, weight_decay=0),
    ),
    # 2x2 ZeRO-2 (replicas write identical pieces, deduplicated) -> 4x1 optimizer over replicas.
    "2x2_to_4x1": (
        TrainConfig(model=TINY, strategy="optim_grads", mesh_shape=(2, 2)),
        TrainConfig(
            model=TINY,
            strategy="optim_grads_params",
            mesh_shape=(4, 1),
            optim_over_replicas=True,
            lr=0.0,
            weight_decay=0,
        ),
    ),
}


def _save_then_load(rank: int, world: int, root: str) -> dict:
    out = {}
    for name, (save_cfg, load_cfg) in SAVED.items():
        path = os.path.join(root, name)
        saved = _train_and_save(rank, world, save_cfg, 2, path)
        out[name] = {"saved": saved, "loaded": _load(rank, world, load_cfg, path, 2)}
    return out


@pytest.mark.slow
def test_checkpoints_load_across_1d_and_2d_meshes(tmp_path):
    results = spawn(_save_then_load, 4, str(tmp_path))
    for name in SAVED:
        path = str(tmp_path / name)
        metadata = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
        # Pieces from several ranks, without overlap: replicas' duplicates were written once.
        for key, md in metadata.items():
            if key.startswith(("model.", "optim.")) and key != "optim.param_groups":
                offsets = [tuple(c.offsets) for c in getattr(md, "chunks", [])]
                assert len(offsets) == len(set(offsets)), (name, key, offsets)
        assert any(len(getattr(md, "chunks", [])) > 1 for md in metadata.values()), name

        saved = results[0][name]["saved"]
        for rank, res in enumerate(results):
            # every rank saved the same full state (replicas agree) ...
            for key, value in res[name]["saved"]["params"].items():
                assert torch.equal(value, saved["params"][key]), (name, rank, key)
            loaded = res[name]["loaded"]
            # ... and loads it back on the other mesh, element for element.
            assert loaded["hparams"] == saved["hparams"], name
            assert loaded["params"].keys() == saved["params"].keys()
            for key, value in saved["params"].items():
                assert torch.equal(loaded["params"][key], value), (name, rank, key)
            assert loaded["optim"].keys() == saved["optim"].keys()
            for key, value in saved["optim"].items():
                assert torch.equal(loaded["optim"][key], value), (name, rank, key)
            assert math.isfinite(loaded["loss"])
            moved = loaded["params_after_step"]
            assert any(not torch.equal(moved[n], v) for n, v in saved["params"].items()), name
        # The compute weights after the load are the loaded ones (not those gathered before).
        reference = build_model(TINY, device=CPU)
        reference.load_state_dict(saved["params"], strict=False)
        x, y = synthetic_batch(TINY, 1, EVAL_STEP, rank=0, device=CPU)
        with torch.no_grad():
            expected = reference(x, y).item()
        for res in results:
            assert res[name]["loaded"]["eval_loss"] == pytest.approx(expected, rel=1e-5), name
