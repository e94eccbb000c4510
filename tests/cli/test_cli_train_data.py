"""--data-path end to end: a real uint16 token file trains through train.run (2 gloo ranks)
and through ``graph-fsdp train``; a resumed run reads the same batches."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from graph_fsdp_testing import spawn_cases

from graph_fsdp.models import GPTConfig
from graph_fsdp.training.checkpoints import CheckpointPolicy
from graph_fsdp.training.train import TrainConfig, run

MODEL = GPTConfig(
    vocab_size=128, num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16
)
"""The model TINY's flags build."""


@pytest.fixture
def token_file(tmp_path):
    """A learnable stream: every token determines the next (period 13), 400 samples of 16 (the
    file of conftest.py's ``token_file_run``)."""
    path = tmp_path / "tokens.bin"
    ((np.arange(400 * 16 + 1) * 7) % 13).astype(np.uint16).tofile(path)
    return str(path)


def test_train_run_learns_the_token_file_and_resumes_on_the_same_batches(
    tmp_path, token_file
) -> None:
    ckpt = str(tmp_path / "ckpt")
    cfg = TrainConfig(
        model=MODEL, micro_batch_size=2, lr=1e-2, data_path=token_file, eval_interval=2
    )
    # One spawned group: the saving run, a synthetic-data run, the resume from the checkpoint.
    runs = spawn_cases(
        {
            "full": (
                run,
                replace(cfg, steps=6, checkpoint=CheckpointPolicy(save_path=ckpt, save_at=3)),
            ),
            "synthetic": (run, replace(cfg, steps=6, data_path=None)),
            "resumed": (
                run,
                replace(cfg, steps=3, checkpoint=CheckpointPolicy(load_path=ckpt), start_step=3),
            ),
        },
        2,
    )
    full, synthetic = runs["full"][0], runs["synthetic"][0]
    # The file's deterministic successor is learned; uniform synthetic tokens are not.
    assert full["losses"][-1] < full["losses"][0] - 1.0
    assert full["losses"][-1] < synthetic["losses"][-1] - 1.0
    assert len(full["eval_losses"]) == 3
    # Resume at step 3 from the checkpoint: the same batches, so bit-identical losses.
    resumed = runs["resumed"][0]
    assert resumed["losses"] == full["losses"][3:]
    assert resumed["eval_losses"] == full["eval_losses"][1:]  # after steps 3+1 and 5+1
    for name, value in full["params"].items():
        assert (resumed["params"][name] == value).all(), name
    # Each rank read its own samples: the unsharded reference on the global batch agrees.
    reference = run(0, 2, replace(cfg, steps=2, mode="reference", eval_interval=0))
    assert reference["losses"] == pytest.approx(full["losses"][:2], rel=1e-5)


@pytest.mark.slow
def test_graph_fsdp_train_data_path_reaches_train_run(token_file_run) -> None:
    """conftest.py's ``token_file_run``: ``graph-fsdp train --data-path FILE`` for 4 iterations
    (lr 1e-2, deterministic) trains on the file like train.run does."""
    proc, token_file = token_file_run["proc"], token_file_run["path"]
    assert f"data: {token_file} (uint16 token file)" in proc.stdout
    assert "synthetic tokens" not in proc.stderr
    cli_losses = token_file_run["losses"]
    # The CLI's defaults (micro batch 2, ZeRO-3, seed 1234) as a TrainConfig.
    cfg = TrainConfig(
        model=MODEL,
        micro_batch_size=2,
        lr=1e-2,
        steps=4,
        data_path=token_file,
        deterministic=True,
        return_params=False,
    )
    runs = spawn_cases({"direct": (run, cfg), "synthetic": (run, replace(cfg, data_path=None))}, 2)
    direct = runs["direct"][0]["losses"]
    assert cli_losses == pytest.approx(direct, rel=1e-5)
    synthetic = runs["synthetic"][0]["losses"]
    assert cli_losses[-1] < synthetic[-1] - 0.5
