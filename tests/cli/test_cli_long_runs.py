"""Long runs on the real command line (2 gloo ranks, a 2-layer model): periodic checkpoints
Megatron's way (``iter_NNNNNNN/`` and ``latest_checkpointed_iteration.txt``) that survive a
Ctrl-C, resume from the latest one, a NaN that stops the run without touching the
checkpoints, resume flags that are obeyed or refused, and a full disk named in one line (a
corrupted shard: test_cli_safety.py).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from _cli_helpers import REPO, SETTINGS, TINY, run_cli, saved_meta
from graph_fsdp_testing import cli_error
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

TRACKER = "latest_checkpointed_iteration.txt"


def _tree(root) -> dict[str, bytes]:
    out = {}
    for d, _, files in os.walk(root):
        for f in files:
            with open(os.path.join(d, f), "rb") as fh:
                out[os.path.relpath(os.path.join(d, f), root)] = fh.read()
    return out


def _iterations(root) -> list[int]:
    return sorted(int(n[5:]) for n in os.listdir(root) if n.startswith("iter_"))


def _finite(checkpoint_dir, tmp_path) -> bool:
    """Every tensor of the checkpoint (model and optimizer state) is finite."""
    out = tmp_path / f"{os.path.basename(checkpoint_dir)}.pt"
    dcp_to_torch_save(str(checkpoint_dir), str(out))
    state = torch.load(out, weights_only=False)
    return all(bool(torch.isfinite(t).all()) for t in state.values() if torch.is_tensor(t))


def _failure(proc: subprocess.CompletedProcess) -> str:
    """The one line a failed run ends with (exit 1); its traceback log removed."""
    assert proc.returncode == 1, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.replace("\r", "\n").splitlines() if ln.startswith("graph")]
    assert len(lines) == 1, lines
    log = lines[0].rsplit("tracebacks: ", 1)[1].rstrip("]")
    os.unlink(log)
    return lines[0]


def test_periodic_checkpoints_every_interval_and_at_the_end(saved_run) -> None:
    """Megatron's layout: iter_NNNNNNN per save, the last 2 kept, the tracker naming the end
    (the run of conftest.py's ``saved_run``: --train-iters 5 --save-interval 2
    --save-keep-last 2)."""
    ck = saved_run["ck"]
    assert sorted(os.listdir(ck)) == ["iter_0000004", "iter_0000005", TRACKER]
    assert saved_meta(ck, 5) == {"iteration": 5, "model": "gpt", "optimizer": SETTINGS}
    line = f"checkpoint: {ck} (iteration 5) - {ck}/iter_0000005, named by {TRACKER}"
    assert line in saved_run["out"], saved_run["out"]


@pytest.mark.slow
def test_ctrl_c_keeps_the_periodic_checkpoints_and_resumes_from_the_latest(tmp_path) -> None:
    """The probe: a long run with --save-interval 2 stopped by SIGINT (no --save-on-interrupt)
    keeps its checkpoints (exit 130), and --load DIR resumes from the tracker's iteration."""
    ck, log = tmp_path / "ck", tmp_path / "steps.jsonl"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "graph_fsdp", "train", *TINY, "--train-iters", "100000"]
        + ["--save", str(ck), "--save-interval", "2", "--log-json", str(log)],
        cwd=REPO,
        env={**env, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    end = time.monotonic() + 120
    while not (log.exists() and log.read_text().count("\n") >= 5):
        assert proc.poll() is None and time.monotonic() < end, proc.communicate()
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    stopped = int(out.split("stopped after iteration ")[1].split()[0])
    latest = stopped // 2 * 2
    assert int((ck / TRACKER).read_text()) == latest and stopped >= 5, (stopped, out)
    assert _iterations(ck) == list(range(2, latest + 1, 2))
    assert f"checkpoint: {ck} (iteration {latest})" in out, out
    resumed = run_cli("train", *TINY, "--train-iters", str(latest + 1), "--load", str(ck))
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed: {ck}/iter_{latest:07d} (iteration {latest})" in resumed.stdout
    assert "1 steps on 2 x cpu" in resumed.stdout, resumed.stdout


def test_resume_refuses_changed_optimizer_settings(capsys, saved_run) -> None:
    """--lr / --weight-decay that differ from the checkpoint's: refused before any rank
    starts, naming both values and the two flags that choose."""
    ck = str(saved_run["ck"])
    more = ["--train-iters", "6", "--load", ck]
    err = cli_error(capsys, "train", *TINY, *more, "--lr", "0.5", "--weight-decay", "0.1")
    assert f"--load {ck}/iter_0000005: the command line's optimizer settings" in err, err
    assert "--lr 0.5 vs 0.001 in the checkpoint" in err, err
    assert "--weight-decay 0.1 vs 0.01 in the checkpoint" in err, err
    assert "--override-opt_param-scheduler" in err and "--use-checkpoint-opt_param-" in err
    err = cli_error(
        capsys, "train", *TINY, *more, "--override-opt_param-scheduler",
        "--use-checkpoint-opt_param-scheduler",
    )  # fmt: skip
    assert "pass one of them" in err, err
    err = cli_error(capsys, "train", *TINY, "--use-checkpoint-opt_param-scheduler")
    assert "applies when resuming: add --load DIR" in err, err
    err = cli_error(capsys, "train", *TINY, "--save-keep-last", "2")
    assert "--save-keep-last is given without --save" in err, err


def test_nan_stops_the_run_and_never_reaches_a_checkpoint(saved_run, tmp_path) -> None:
    """--lr 1e30 taken from the command line (--override-opt_param-scheduler): the first step
    makes the weights ~1e30 (finite, saved at the even iteration 6), a later step's loss is
    NaN: the run stops with exit 1 and one line naming the iteration and the value, before
    any save of a non-finite model; every checkpoint is finite, the log has no bare NaN."""
    ck = shutil.copytree(saved_run["ck"], tmp_path / "ck")
    log = tmp_path / "steps.jsonl"
    proc = run_cli(
        "train", *TINY, "--train-iters", "30", "--load", str(ck), "--save", str(ck),
        "--save-interval", "2", "--lr", "1e30", "--override-opt_param-scheduler",
        "--log-json", str(log),
    )  # fmt: skip
    line = _failure(proc)
    assert "NonFiniteError: iteration " in line and "the loss is nan" in line, line
    stopped_at = int(line.split("NonFiniteError: iteration ")[1].split(":")[0])
    assert stopped_at in (7, 8), line  # the model turns Inf in an update, the loss after it

    def no_bare_constants(name: str):
        raise AssertionError(f"bare {name} in the JSON log")

    records = [json.loads(r, parse_constant=no_bare_constants) for r in log.open()]
    assert records[-1]["step"] == stopped_at - 1 and records[-1]["loss"] == "nan", records
    assert _iterations(ck) == [4, 5, 6] and (ck / TRACKER).read_text() == "6"
    for i in _iterations(ck):
        assert _finite(ck / f"iter_{i:07d}", tmp_path), f"iteration {i} holds NaN/Inf"


@pytest.mark.slow
def test_without_the_check_a_nan_model_is_still_never_saved(saved_run, tmp_path) -> None:
    """--no-check-for-nan-in-loss-and-grad trains on through NaN, but the save at the end
    refuses the model: exit 1, one line; the checkpoint directory is byte for byte as it was."""
    ck = shutil.copytree(saved_run["ck"], tmp_path / "ck")
    before, start = _tree(ck), saved_run["start"]
    proc = run_cli(
        "train", *TINY, "--train-iters", str(start + 3), "--load", str(ck), "--save", str(ck),
        "--lr", "1e30", "--override-opt_param-scheduler", "--no-check-for-nan-in-loss-and-grad",
    )  # fmt: skip
    line = _failure(proc)
    assert f"iteration {start + 3}: the model holds NaN or Inf; not saving it" in line, line
    assert _tree(ck) == before


# A flipped byte in a shard, named by the checksum: the --verbose run of
# test_cli_safety.py::test_a_failing_rank_is_one_line_naming_the_log loads such a copy.


SITE_DISK_FULL = '''
from contextlib import contextmanager
from torch.distributed.checkpoint import filesystem

_create_stream = filesystem.FileSystem.create_stream


@contextmanager
def _disk_full(self, path, mode):
    """Shard files are written to /dev/full: the kernel's ENOSPC, through torch.save."""
    if str(path).endswith(".distcp") and "w" in mode:
        with open("/dev/full", mode) as stream:
            yield stream
    else:
        with _create_stream(self, path, mode) as stream:
            yield stream


filesystem.FileSystem.create_stream = _disk_full
'''


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs Linux /dev/full")
def test_a_full_disk_says_so_and_keeps_the_previous_checkpoint(saved_run, tmp_path) -> None:
    """Every rank's shard write fails with the kernel's ENOSPC (the shards go to /dev/full, in
    every rank through a sitecustomize): one line saying "no space left on device" and the
    path; the directory holds what it held, no half-written iteration."""
    ck = shutil.copytree(saved_run["ck"], tmp_path / "ck")
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITE_DISK_FULL)
    before, start = _tree(ck), saved_run["start"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run(
        [sys.executable, "-m", "graph_fsdp", "train", *TINY, "--train-iters", str(start + 1)]
        + ["--load", str(ck), "--save", str(ck)],
        cwd=REPO,
        env={**env, "PYTHONPATH": os.pathsep.join([str(site), str(REPO)])},
        capture_output=True,
        text=True,
        timeout=120,
    )
    line = _failure(proc)
    target = ck / f"iter_{start + 1:07d}"
    assert f"no space left on device writing {target}.tmp" in line, line
    assert f"{ck} still holds iteration {start}" in line, line
    assert _tree(ck) == before
