"""tools/gpu_tests.sh on a CPU: each log names its commit, ``BUNDLE`` packs the logs into one
archive, and a chunk that collects no test fails (pytest exit 5 is not a pass)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

from graph_fsdp.bench.provenance import COMMIT_ENV, stamp_line

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "gpu_tests.sh"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def _run(script: Path, out: Path, *chunks: str, **extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != COMMIT_ENV}
    return subprocess.run(
        ["bash", str(script), *chunks],
        cwd=ROOT,
        env={**env, "OUT": str(out), "PYTHONPATH": str(ROOT), **extra},
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.slow
def test_chunk_logs_name_the_commit_and_an_empty_chunk_fails(tmp_path: Path) -> None:
    # The bench chunk on a CPU: every test skips (no GPU), pytest exits 0.
    bundle = tmp_path / "logs.tgz"
    proc = _run(SCRIPT, tmp_path / "a", "bench", BUNDLE=str(bundle))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "===== bench (rc=0, passed)" in proc.stdout
    with tarfile.open(bundle) as tar:  # BUNDLE: the chunk logs in one archive
        assert "./gpu_bench.log" in tar.getnames()
    log = (tmp_path / "a" / "gpu_bench.log").read_text().splitlines()
    assert log[0].startswith("# chunk bench, ")
    assert log[1] == f"# code: {stamp_line()}"
    assert log[2].startswith("# machine: torch ")
    # The same chunk with a keyword no test matches: nothing collected is a failure.
    text = SCRIPT.read_text()
    chunk = '[bench]="tests/bench/test_bench_gpu.py"'
    assert chunk in text
    empty = tmp_path / "gpu_tests_empty.sh"
    empty.write_text(text.replace(chunk, chunk[:-1] + ' -k no_test_has_this_name"'))
    proc = _run(empty, tmp_path / "b", "bench")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "===== bench (rc=5, FAILED: no test collected)" in proc.stdout
