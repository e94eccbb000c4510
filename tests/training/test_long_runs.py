"""The training loop's long-run safety on 2 gloo ranks (one spawned group): the one-graph
step's device-side skip of non-finite updates counted and stopped after too many in a row,
checkpoints that stay finite; and the optimizer settings on resume - refused when they
differ, the config's or the checkpoint's when asked (checkpoints.py [Note: optimizer settings
on resume]). The command line's probes are in tests/cli/test_cli_long_runs.py."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from graph_fsdp_testing import error_of, spawn_cases
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from graph_fsdp.models import GPTConfig
from graph_fsdp.training import checkpoints
from graph_fsdp.training.checkpoints import CheckpointPolicy
from graph_fsdp.training.nonfinite import NonFiniteGuard, json_number
from graph_fsdp.training.train import TrainConfig, run

TINY = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=128)
BASE = TrainConfig(model=TINY, steps=2, return_params=False)
WHOLE_STEP = dict(cuda_graph_optimizer=True, fused_optimizer=True)  # its eager twin on CPU


def _losses_or_error(rank: int, world: int, cfg: TrainConfig):
    out = {}
    message = error_of(lambda: out.update(run(rank, world, cfg)))
    return out.get("losses"), message, out.get("skipped_steps")


def _resume(path: str, mode: str) -> CheckpointPolicy:
    return CheckpointPolicy(load_path=path, resume_optimizer_settings=mode)


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("long_runs"))
    base = os.path.join(root, "base")
    resume = dataclasses.replace(
        BASE, checkpoint=CheckpointPolicy(load_path=base), start_step=2, steps=2
    )
    cases = {
        "save": (
            run,
            dataclasses.replace(BASE, checkpoint=CheckpointPolicy(save_path=base, save_at=2)),
        ),
        "same lr": (_losses_or_error, resume),
        "lr 1e6 refused": (_losses_or_error, dataclasses.replace(resume, lr=1e6)),
        "lr 1e6 of the checkpoint": (
            _losses_or_error,
            dataclasses.replace(resume, lr=1e6, checkpoint=_resume(base, "checkpoint")),
        ),
        "lr 1e6 of the config": (
            _losses_or_error,
            dataclasses.replace(
                resume,
                lr=1e6,
                weight_decay=0.5,
                checkpoint=_resume(base, "config"),
                check_for_nan_in_loss_and_grad=False,
            ),
        ),
        "skipped": (
            _losses_or_error,
            dataclasses.replace(
                BASE,
                **WHOLE_STEP,
                lr=1e6,
                steps=30,
                max_consecutive_skipped_steps=2,
                checkpoint=CheckpointPolicy(
                    save_path=os.path.join(root, "skipped"), save_interval=1
                ),
            ),
        ),
    }
    return root, spawn_cases(cases, 2)


def test_resume_refuses_changed_settings_unless_told_which(spawned) -> None:
    """Same lr: resumes. lr 1e6 by default: refused naming both values. With "checkpoint":
    the checkpoint's lr (bit-identical to the same-lr resume). With "config": lr 1e6 and
    weight decay 0.5 are used (the losses leave the same-lr run's)."""
    _, results = spawned
    same, message, _ = results["same lr"][0]
    assert message == "no error" and len(same) == 2
    _, message, _ = results["lr 1e6 refused"][0]
    assert "lr 1e+06 (this run) vs 0.001" in message and "resume_optimizer_settings" in message
    kept, message, _ = results["lr 1e6 of the checkpoint"][0]
    assert message == "no error" and kept == same
    took, message, _ = results["lr 1e6 of the config"][0]
    assert message == "no error" and took[0] == same[0] and took[1] != same[1], (took, same)


def test_whole_step_skips_are_counted_and_too_many_in_a_row_stop(spawned, tmp_path) -> None:
    """lr 1e6 under the one-graph step (its eager twin): the non-finite updates are skipped
    on the device, so the model stays finite; the third skip in a row (over the limit of 2)
    stops the run naming the iteration; every checkpoint written is finite."""
    root, results = spawned
    for rank_result in results["skipped"]:
        _, message, _ = rank_result
        assert "steps in a row skipped for a non-finite gradient norm" in message, message
        assert "more than max_consecutive_skipped_steps=2" in message, message
    stopped = int(message.split("iteration ")[1].split(":")[0])
    run_dir = os.path.join(root, "skipped")
    saved = checkpoints.saved_iterations(run_dir)
    assert saved == list(range(1, stopped)), (saved, stopped)  # every iteration before it
    assert checkpoints.read_tracker(run_dir) == stopped - 1
    for i in saved:
        out = tmp_path / f"{i}.pt"
        dcp_to_torch_save(checkpoints.iteration_dir(run_dir, i), str(out))
        state = torch.load(out, weights_only=False)
        assert all(bool(torch.isfinite(t).all()) for t in state.values() if torch.is_tensor(t))


def test_guard_and_log_numbers() -> None:
    """The guard's rules on their own, and the log's spelling of non-finite numbers."""
    guard = NonFiniteGuard(max_consecutive_skips=2)
    guard.after_step(1, 2.0, 1.0, skipped=False)
    guard.after_step(2, float("nan"), float("nan"), skipped=True)
    guard.after_step(3, float("nan"), float("nan"), skipped=True)
    guard.after_step(4, 2.0, 1.0, skipped=False)  # a good step resets the run of skips
    assert (guard.skipped, guard.consecutive) == (2, 0)
    with pytest.raises(RuntimeError, match=r"iteration 5: the gradient norm is inf"):
        guard.after_step(5, 2.0, float("inf"), skipped=False)
    NonFiniteGuard(check=False).after_step(6, float("nan"), None, skipped=False)
    assert [json_number(v) for v in (1.5, float("nan"), float("inf"), -float("inf"))] == [
        1.5,
        "nan",
        "inf",
        "-inf",
    ]
