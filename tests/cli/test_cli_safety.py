"""Safe by default: a user's files are never destroyed, bad input is refused before any rank
starts (exit 2, one line), a failing rank is reported in one line, SIGINT/SIGTERM stop the
run within seconds (exit 130, no KeyboardInterrupt tracebacks), and a save killed at any
moment leaves the previous checkpoint loadable.

The refusals run ``main()`` in this process (nothing may be launched); the rest are real
``graph-fsdp`` processes with 2 gloo ranks and a 2-layer model.
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
from _cli_helpers import REPO, SETTINGS, TINY, run_cli, saved_meta

from graph_fsdp.cli.main import main
from graph_fsdp.fsdp import checkpoint
from graph_fsdp.training import checkpoints as run_checkpoints


def _refused(capsys: pytest.CaptureFixture, *argv: str) -> str:
    """The one line ``graph-fsdp argv`` is refused with (exit 2, no usage block)."""
    with pytest.raises(SystemExit) as exc:
        main(list(argv))
    assert exc.value.code == 2, f"graph-fsdp {' '.join(argv)} exited with {exc.value.code}"
    captured = capsys.readouterr()
    lines = [ln for ln in captured.err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "usage:" not in captured.err, captured.err
    assert not captured.out, captured.out
    return lines[0]


def _tree(root) -> dict[str, bytes]:
    out = {}
    for d, _, files in os.walk(root):
        for f in files:
            path = os.path.join(d, f)
            with open(path, "rb") as fh:
                out[os.path.relpath(path, root)] = fh.read()
    return out


def test_bad_paths_and_values_are_refused_before_any_rank_starts(capsys, tmp_path) -> None:
    """--save / --log-json / --output-dir targets, optimizer values, and the one-line form of
    every semantic error; nothing in the user's directory is created or changed."""
    user = tmp_path / "userdata"
    user.mkdir()
    (user / "thesis.txt").write_text("my work")
    afile = tmp_path / "afile"
    afile.write_text("my file")
    run_dir = tmp_path / "ck"
    (run_dir / "iter_0000002.tmp").mkdir(parents=True)  # a save of iteration 2 replaces it
    (run_dir / "iter_0000002.tmp" / "notes.txt").write_text("not a checkpoint")
    single = tmp_path / "single"  # the layout before iter_NNNNNNN directories
    single.mkdir()
    (single / checkpoint.META_FILE).write_text("{}")
    train = ["train", *TINY, "--train-iters", "2"]
    cases = [
        (["--save", str(user)], [str(user), "thesis.txt", "new or empty directory"]),
        (["--save", str(afile)], [str(afile), "is a file, not a checkpoint directory"]),
        (["--save", str(afile / "ck")], [f"{afile} is a file", "nothing can be created"]),
        (["--save", str(run_dir)], ["iter_0000002.tmp", "notes.txt", "never deletes"]),
        (["--save", str(single)], ["is a single checkpoint", "new or empty directory"]),
        (["--log-json", str(user)], [f"--log-json {user} is a directory"]),
        (["--log-json", str(afile / "x.jsonl")], [f"{afile} is a file"]),
        (["--lr", "-1"], ["--lr -1.0 must be a finite number >= 0"]),
        (["--lr", "nan"], ["--lr nan must be a finite number >= 0"]),
        (["--weight-decay", "-1"], ["--weight-decay -1.0 must be a finite number >= 0"]),
        (["--weight-decay", "inf"], ["--weight-decay inf must be"]),
        (["--save-on-interrupt"], ["--save-on-interrupt (--exit-signal-handler)", "add --save"]),
        (["--exit-signal-handler"], ["add --save DIR"]),
        (["--num-attention-heads", "5"], ["does not divide --hidden-size 32"]),
        (
            ["--cuda-graph-impl", "te", "--train-iters", "10"],  # before the buffer flags
            ["--cuda-graph-impl te needs a CUDA device"],
        ),
        (["--load", str(user)], [f"--load {user}: not a DCP checkpoint"]),
    ]
    readonly = tmp_path / "readonly"
    readonly.mkdir()
    if os.geteuid() != 0:
        os.chmod(readonly, 0o555)
        cases.append((["--save", str(readonly / "ck")], [f"cannot write in {readonly}"]))
    else:  # root writes anywhere a permission allows: /proc refuses new files to everyone
        cases.append((["--save", "/proc/graph_fsdp_ck"], ["cannot write in /proc"]))
    before = _tree(tmp_path)
    for argv, expected in cases:
        line = _refused(capsys, *train, *argv)
        assert line.startswith("graph-fsdp train: error: "), line
        for text in expected:
            assert text in line, f"{text!r} not in {line!r}"
    line = _refused(capsys, "profile", *TINY, "--output-dir", str(afile))
    assert f"--output-dir {afile} is a file" in line
    assert _tree(tmp_path) == before, "a refused command changed the user's files"
    os.chmod(readonly, 0o755)
    # argparse's own syntax errors keep the usage block (they are about the flags' spelling)
    with pytest.raises(SystemExit):
        main(["train", "--num-layers", "two"])
    assert "usage:" in capsys.readouterr().err


def test_profile_default_warmup_covers_the_graph_warmup(capsys) -> None:
    """With graphs the default --warmup-iters is --cuda-graph-warmup-steps + 1: the warmup
    rule is met (on CPU the command then stops at the device check, before any rank)."""
    for warmup in ("2", "5"):
        line = _refused(
            capsys,
            "profile",
            *TINY,
            "--cuda-graph-impl",
            "torch",
            "--cuda-graph-warmup-steps",
            warmup,
            "--fsdp-double-buffer",
            "--fsdp-db-use-persist-buf-on-alloc-fail",
        )
        assert "needs a CUDA device" in line and "--warmup-iters" not in line, line


# --------------------------------------------------------------------------------------------
# With a checkpoint: --load checks, a failing rank, a save killed half-way
# --------------------------------------------------------------------------------------------


@pytest.fixture
def saved(saved_run) -> str:
    """The checkpoint directory conftest.py's ``saved_run`` wrote (read-only use; its layout and
    records are checked in test_cli_long_runs.py): ``iter_0000004``, ``iter_0000005`` and the
    tracker naming 5."""
    return str(saved_run["ck"])


LATEST = 5
"""The iteration the tracker of ``saved`` names."""


def _copy(saved: str, dest) -> str:
    shutil.copytree(saved, dest)
    return str(dest)


def test_load_is_checked_against_the_model_before_any_rank_starts(capsys, saved, tmp_path):
    """Another shape, a truncated file, no iteration record: one line each, exit 2."""
    line = _refused(capsys, "train", *TINY, "--hidden-size", "64", "--load", saved)
    assert "embedding.weight" in line and "another model shape" in line, line
    more = ["--train-iters", str(LATEST + 2)]
    truncated = _copy(saved, tmp_path / "truncated")
    data = os.path.join(truncated, f"iter_{LATEST:07d}", "__1_0.distcp")
    os.truncate(data, os.path.getsize(data) // 2)
    line = _refused(capsys, "train", *TINY, *more, "--load", truncated)
    assert "__1_0.distcp" in line and "truncated" in line, line
    bare = _copy(saved, tmp_path / "bare")
    os.unlink(os.path.join(bare, f"iter_{LATEST:07d}", checkpoint.META_FILE))
    line = _refused(capsys, "train", *TINY, *more, "--load", bare)
    assert "iteration to resume at is unknown" in line and '"iteration": N' in line, line


def _stderr_lines(proc) -> list[str]:
    """stderr without the progress bar's redraws."""
    text = proc.stderr.replace("\r", "\n")
    return [ln for ln in text.splitlines() if ln.strip() and not ln.startswith("train:")]


@pytest.mark.slow
def test_a_failing_rank_is_one_line_naming_the_log(saved, tmp_path) -> None:
    """A checkpoint file corrupted inside (its size intact: only the ranks can tell): the
    launcher prints which rank failed, how, and the log holding every rank's traceback; with
    --verbose the tracebacks come first. A single flipped byte is named the same way (the
    --verbose run loads a copy with one)."""
    bad = _copy(saved, tmp_path / "bad")
    data = os.path.join(bad, f"iter_{LATEST:07d}", "__1_0.distcp")
    raw = bytearray(open(data, "rb").read())
    raw[::7] = bytes(b ^ 0xFF for b in raw[::7])
    with open(data, "wb") as f:
        f.write(raw)
    proc = run_cli("train", *TINY, "--train-iters", str(LATEST + 2), "--load", bad)
    assert proc.returncode == 1, proc.stderr
    lines = _stderr_lines(proc)
    assert len(lines) == 1, lines
    line = lines[0]
    assert line.startswith("graph-fsdp train: rank ") and "CheckpointError" in line, line
    assert f"{data} is corrupt" in line, line  # its checksum, not DCP's dump
    log = line.rsplit("tracebacks: ", 1)[1].rstrip("]")
    text = open(log).read()
    assert text.count("--- rank") == 2 and "Traceback (most recent call last)" in text
    os.unlink(log)
    # --verbose, and the smallest corruption: one byte of a shard flipped, the size unchanged
    # (the checksum still names the file).
    flipped = _copy(saved, tmp_path / "flipped")
    shard = os.path.join(flipped, f"iter_{LATEST:07d}", "__1_0.distcp")
    raw = bytearray(open(shard, "rb").read())
    raw[len(raw) // 2] ^= 0x01
    with open(shard, "wb") as f:
        f.write(raw)
    verbose = run_cli(
        "train", *TINY, "--train-iters", str(LATEST + 2), "--load", flipped, "--verbose"
    )
    assert verbose.returncode == 1
    assert "Traceback (most recent call last)" in verbose.stderr
    assert verbose.stderr.rstrip().endswith("[tracebacks above]"), verbose.stderr[-500:]
    (line,) = [ln for ln in _stderr_lines(verbose) if ln.startswith("graph-fsdp train: rank ")]
    assert f"CheckpointError: checkpoint file {shard} is corrupt" in line, line


def _start(*args: str, env: dict | None = None) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return subprocess.Popen(
        [sys.executable, "-m", "graph_fsdp", *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as under a supervisor
    )


def _wait_for(path, proc: subprocess.Popen, limit_s: float = 120) -> None:
    end = time.monotonic() + limit_s
    while not (os.path.exists(path) and os.path.getsize(path) > 0):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < end, f"{path} did not appear"
        time.sleep(0.05)


def _finish(proc: subprocess.Popen, limit_s: float = 60) -> tuple[float, str, str]:
    t0 = time.monotonic()
    try:
        out, err = proc.communicate(timeout=limit_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"still running {limit_s} s after the signal:\n{err[-2000:]}")
    return time.monotonic() - t0, out, err


@pytest.mark.parametrize("to", ["launcher", "process group"])
def test_sigint_stops_the_run_within_10_s(tmp_path, to: str) -> None:
    """SIGINT to the launcher alone (a supervisor, an IDE's stop button) or to its whole
    process group (a terminal's Ctrl-C): the ranks stop at the next step boundary, exit 130
    within 10 s, no traceback; with --save-on-interrupt the checkpoint holds that step."""
    log, ck = tmp_path / "steps.jsonl", tmp_path / "ck"
    proc = _start(
        "train", *TINY, "--train-iters", "100000", "--log-json", str(log), "--save", str(ck),
        "--save-on-interrupt",
    )  # fmt: skip
    _wait_for(log, proc)
    if to == "launcher":
        os.kill(proc.pid, signal.SIGINT)
    else:
        os.killpg(proc.pid, signal.SIGINT)
    seconds, out, err = _finish(proc)
    assert proc.returncode == 130, err
    assert seconds < 10, f"{seconds:.1f} s to exit"
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert "interrupted by SIGINT: the ranks stopped at a step boundary" in err
    stopped = int(out.split("stopped after iteration ")[1].split()[0])
    assert 0 < stopped < 100000
    assert f"checkpoint: {ck} (iteration {stopped})" in out
    assert saved_meta(ck, stopped)["iteration"] == stopped
    assert sorted(os.listdir(ck)) == [f"iter_{stopped:07d}", "latest_checkpointed_iteration.txt"]


def _children(pid: int) -> list[int]:
    """Child processes of ``pid`` (Linux /proc)."""
    out = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            out += [int(c) for c in f.read().split()]
    return out


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="needs Linux /proc")
def test_sigint_while_the_ranks_start(tmp_path) -> None:
    """A Ctrl-C before the ranks handle signals (still importing): no KeyboardInterrupt
    traceback from them, and the command still ends with 130 within 10 s."""
    proc = _start("train", *TINY, "--train-iters", "100000")
    end = time.monotonic() + 60
    while len(_children(proc.pid)) < 3:  # both ranks and multiprocessing's resource tracker
        assert proc.poll() is None and time.monotonic() < end, proc.communicate()
        time.sleep(0.01)
    time.sleep(0.2)  # past the launcher's window (supervision.py), the ranks still importing
    os.killpg(proc.pid, signal.SIGINT)
    seconds, _, err = _finish(proc)
    assert proc.returncode == 130, err
    assert seconds < 10, f"{seconds:.1f} s to exit"
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err


@pytest.mark.slow
def test_second_signal_stops_at_once_even_in_a_save(tmp_path) -> None:
    """A save that hangs (paused by the test hook) after the first SIGTERM: the second one
    ends the ranks at once; the half-written checkpoint directory is refused by nothing later
    (a new --save of the same path works)."""
    log, ck, marker = tmp_path / "steps.jsonl", tmp_path / "ck", tmp_path / "paused"
    # A grace the first signal alone would wait out for a minute: the second one must end it.
    env = {checkpoint.PAUSE_ENV: f"write:{marker}", "GRAPH_FSDP_STOP_GRACE_S": "60"}
    proc = _start(
        "train", *TINY, "--train-iters", "100000", "--log-json", str(log), "--save", str(ck),
        "--exit-signal-handler", env=env,
    )  # fmt: skip
    _wait_for(log, proc)
    os.kill(proc.pid, signal.SIGTERM)
    _wait_for(marker, proc)  # rank 0 is in the save, stuck
    time.sleep(1.2)  # later than a duplicate of the first signal
    os.kill(proc.pid, signal.SIGTERM)
    seconds, _, err = _finish(proc)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert seconds < 15, f"{seconds:.1f} s after the second signal"
    assert "Traceback" not in err, err
    (half,) = os.listdir(ck)  # no tracker: nothing complete
    assert half.startswith("iter_") and half.endswith(".tmp"), half
    checkpoint.check_save_target(str(ck / half.removesuffix(".tmp")))  # ours: accepted
    assert run_checkpoints.run_dir_problem(str(ck)) is None  # a new --save of it works


@pytest.mark.slow
def test_kill_during_save_leaves_the_previous_checkpoint_loadable(saved, tmp_path) -> None:
    """Rank 0 killed while a new checkpoint of iteration 6 replaces the one there (the old one
    moved aside, the new one not yet in place): the run fails in one line, and the previous
    checkpoint of iteration 6 is what the next --load of the directory resumes from."""
    ck, marker = _copy(saved, tmp_path / "ck"), tmp_path / "paused"
    nxt = LATEST + 1
    later = os.path.join(ck, f"iter_{nxt:07d}")  # as if an earlier run had saved iteration 6
    shutil.copytree(os.path.join(ck, f"iter_{LATEST:07d}"), later)
    with open(os.path.join(later, checkpoint.META_FILE), "w") as f:
        json.dump({"iteration": nxt, "model": "gpt", "optimizer": SETTINGS}, f)
    with open(os.path.join(ck, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(nxt))
    env = {checkpoint.PAUSE_ENV: f"swap:{marker}"}
    latest = os.path.join(ck, f"iter_{LATEST:07d}")
    proc = _start(
        "train", *TINY, "--train-iters", str(nxt), "--load", latest, "--save", ck, env=env
    )
    _wait_for(marker, proc)
    os.kill(int(marker.read_text()), signal.SIGKILL)
    _, _, err = _finish(proc, limit_s=120)
    assert proc.returncode == 1, err
    lines = [ln for ln in err.replace("\r", "\n").splitlines() if ln.startswith("graph-fsdp")]
    assert len(lines) == 1 and "rank 0 died without an error (exit signal SIGKILL" in lines[0]
    assert not os.path.exists(later) and os.path.exists(f"{later}.old")  # between renames
    resumed = run_cli("train", *TINY, "--train-iters", str(nxt + 1), "--load", ck)
    assert resumed.returncode == 0, resumed.stderr
    assert "the previous checkpoint was put back" in resumed.stderr
    assert "1 steps on 2 x cpu" in resumed.stdout  # iteration 6 -> 7
    assert saved_meta(ck, nxt)["iteration"] == nxt
