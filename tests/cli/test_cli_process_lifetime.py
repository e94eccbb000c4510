"""The ranks live and die with the launcher: ``kill -9`` of ``graph-fsdp`` takes its spawned
ranks with it within a second (prctl's parent-death signal, or the polling watchdog where
that is unavailable), and a rank stopped mid-run (SIGSTOP) ends the command about one
``--distributed-timeout-minutes`` later, exit 1, one line naming that rank.

Real ``graph-fsdp train`` processes with 2 gloo ranks and a 2-layer model (training/lifeline.py
[Note: ranks die with their launcher], processes.py [Note: hung ranks]).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from _cli_helpers import REPO, TINY

from graph_fsdp.training.lifeline import MODE_ENV

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="needs Linux /proc")


def _start(*args: str, env: dict | None = None) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return subprocess.Popen(
        [sys.executable, "-m", "graph_fsdp", "train", *TINY, "--train-iters", "100000", *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def _training_ranks(proc: subprocess.Popen, log) -> list[int]:
    """The rank processes of ``proc`` once rank 0 logged a step (both ranks are training)."""
    end = time.monotonic() + 120
    while not (os.path.exists(log) and os.path.getsize(log) > 0):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < end, "no step was logged"
        time.sleep(0.05)
    ranks = []
    for task in os.listdir(f"/proc/{proc.pid}/task"):
        with open(f"/proc/{proc.pid}/task/{task}/children") as f:
            children = [int(c) for c in f.read().split()]
        for pid in children:  # not multiprocessing's resource tracker
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"spawn_main" in f.read():
                    ranks.append(pid)
    assert len(ranks) == 2, ranks
    return ranks


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("how", ["prctl", pytest.param("watchdog", marks=pytest.mark.slow)])
def test_killing_the_launcher_ends_its_ranks(tmp_path, how: str) -> None:
    log = tmp_path / "steps.jsonl"
    env = {MODE_ENV: "watchdog"} if how == "watchdog" else None
    proc = _start("--log-json", str(log), env=env)
    try:
        ranks = _training_ranks(proc, log)
        os.kill(proc.pid, signal.SIGKILL)
        killed = time.monotonic()
        while any(_running(pid) for pid in ranks) and time.monotonic() - killed < 10:
            time.sleep(0.02)
        gone_after = time.monotonic() - killed
    finally:
        proc.kill()
        proc.communicate()
        for pid in ranks:
            if _running(pid):
                os.kill(pid, signal.SIGKILL)
    assert gone_after < 3, f"the ranks outlived the launcher by {gone_after:.1f} s"
    print(f"{how}: ranks gone {gone_after:.2f} s after kill -9 of the launcher")


_ORPHAN = """
import importlib.util, os, subprocess, sys, time
if sys.argv[1] == "parent":
    child = subprocess.Popen([sys.executable, __file__, "child", str(os.getpid())])
    print(child.pid, flush=True)
    time.sleep(600)
else:  # lifeline.py alone (no torch import): the watchdog must end this process
    spec = importlib.util.spec_from_file_location("lifeline", sys.argv[3])
    lifeline = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lifeline)
    print(lifeline.die_with_parent(int(sys.argv[2])), flush=True)
    time.sleep(600)
"""


def test_the_watchdog_ends_an_orphan_within_a_second(tmp_path) -> None:
    """The fallback of :func:`die_with_parent` where prctl is unavailable, on its own (the
    ``slow`` case above runs it under the command)."""
    script = tmp_path / "orphan.py"
    script.write_text(
        _ORPHAN.replace("sys.argv[3]", repr(str(REPO / "graph_fsdp" / "training" / "lifeline.py")))
    )
    env = {**os.environ, MODE_ENV: "watchdog"}
    parent = subprocess.Popen(
        [sys.executable, str(script), "parent"], stdout=subprocess.PIPE, text=True, env=env
    )
    child = int(parent.stdout.readline())
    assert parent.stdout.readline().strip() == "watchdog"
    parent.kill()
    parent.communicate()
    killed = time.monotonic()
    while _running(child) and time.monotonic() - killed < 10:
        time.sleep(0.02)
    gone_after = time.monotonic() - killed
    if _running(child):
        os.kill(child, signal.SIGKILL)
    assert gone_after < 1.5, f"the orphan outlived its parent by {gone_after:.1f} s"


@pytest.mark.slow
def test_a_stopped_rank_ends_the_run_within_the_distributed_timeout(tmp_path) -> None:
    """--distributed-timeout-minutes 0.05 (3 s): rank 1 stopped by SIGSTOP; the command exits
    1 within the timeout plus a few seconds, its one line naming rank 1 and the timeout."""
    log = tmp_path / "steps.jsonl"
    proc = _start("--log-json", str(log), "--distributed-timeout-minutes", "0.05")
    try:
        ranks = _training_ranks(proc, log)
        os.kill(ranks[1], signal.SIGSTOP)
        stopped = time.monotonic()
        _, err = proc.communicate(timeout=60)
        seconds = time.monotonic() - stopped
    finally:
        proc.kill()
        for pid in ranks:
            if _running(pid):
                os.kill(pid, signal.SIGKILL)
    assert proc.returncode == 1, err
    lines = [ln for ln in err.replace("\r", "\n").splitlines() if ln.startswith("graph-fsdp")]
    assert len(lines) == 1, err
    assert lines[0].startswith("graph-fsdp train: rank 1 hung: stopped (SIGSTOP"), lines[0]
    assert "3 s distributed timeout (--distributed-timeout-minutes); killed" in lines[0]
    assert "Traceback" not in err, err
    assert 3 <= seconds < 3 + 7, f"{seconds:.1f} s after the SIGSTOP"
    assert not any(_running(pid) for pid in ranks)
    print(f"stopped rank: the command ended {seconds:.1f} s after the SIGSTOP")
