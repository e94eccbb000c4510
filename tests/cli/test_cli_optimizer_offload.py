"""``graph-fsdp train --optimizer-cpu-offload``: Megatron-LM's optimizer-offload flags reach
graph_fsdp.fsdp.optim_offload.CPUOffloadOptimizer (2 gloo ranks, real processes)."""

from __future__ import annotations

import json

import pytest
from _cli_helpers import TINY, run_cli


def _losses(path) -> list[float]:
    return [json.loads(line)["loss"] for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_offloaded_optimizer_trains_like_the_device_one_and_resumes(
    tmp_path, token_file_run
) -> None:
    """Against conftest.py's ``token_file_run`` (4 iterations on the device optimizer, the
    same flags and token file): the offloaded optimizer's first 2 iterations and a resume of
    its checkpoint without offload."""
    base = ["train", *TINY, "--lr", "1e-2", "--deterministic"]
    base += ["--data-path", token_file_run["path"]]
    off_log, resumed_log = (tmp_path / f"{n}.jsonl" for n in ("off", "res"))
    plain, plain_losses = token_file_run["proc"], token_file_run["losses"]
    assert "optimizer CPU offload" not in plain.stdout
    offload = ["--optimizer-cpu-offload", "--optimizer-offload-fraction", "0.5"]
    ckpt = tmp_path / "ckpt"
    off = run_cli(
        *base, *offload, "--train-iters", "2", "--save", str(ckpt), "--log-json", str(off_log)
    )
    assert off.returncode == 0, off.stdout + off.stderr
    assert "optimizer CPU offload: fraction 0.5" in off.stdout
    # On the CPU the offloaded AdamW is the same fp32 AdamW: bit-identical losses.
    assert _losses(off_log) == plain_losses[:2]
    # Its checkpoint (the offloaded state included) resumes a run without offload exactly.
    res = run_cli(*base, "--train-iters", "4", "--load", str(ckpt), "--log-json", str(resumed_log))
    assert res.returncode == 0, res.stdout + res.stderr
    assert _losses(resumed_log) == plain_losses[2:]
