"""Messages a new user meets first: no abbreviated flags, a bad value's error before one usage
line, --load of a file, a token file shorter than the run, a configuration that cannot fit in
memory, and the two entry points beside ``graph-fsdp`` (run_demo --help, the RL example on a
CPU-only machine).

Everything here is refused before any rank starts, so ``main()`` runs in this process; so does
the example, as ``__main__`` through runpy (the environment variables its module sets at
import are put back after it).
"""

from __future__ import annotations

import os
import runpy
import sys
import time

import numpy as np
import pytest
import torch
from _cli_helpers import REPO, TINY

from graph_fsdp import run_demo
from graph_fsdp.cli.main import build_parser, main
from graph_fsdp.cli.train_options import check_data_path


def _stderr_of(capsys: pytest.CaptureFixture, *argv: str) -> list[str]:
    """The lines ``graph-fsdp argv`` writes to stderr when refused with exit code 2."""
    with pytest.raises(SystemExit) as exc:
        main(list(argv))
    assert exc.value.code == 2, f"graph-fsdp {' '.join(argv)} exited with {exc.value.code}"
    captured = capsys.readouterr()
    assert not captured.out, captured.out
    return [ln for ln in captured.err.splitlines() if ln.strip()]


@pytest.mark.parametrize("command", ["train", "compare", "bench", "profile"])
def test_abbreviated_flags_are_refused_naming_the_flag(capsys, command: str) -> None:
    """``--num-layer 2`` is not taken as --num-layers: the error names it and the flag meant,
    then one usage line."""
    lines = _stderr_of(capsys, command, "--num-layer", "2")
    assert lines[0] == (
        f"graph-fsdp {command}: error: unrecognized arguments: --num-layer 2 "
        "(did you mean --num-layers?)"
    ), lines
    assert lines[1:] == [
        f"usage: graph-fsdp {command} [flags] (graph-fsdp {command} --help lists them)"
    ]


def test_a_bad_value_comes_first_with_one_usage_line(capsys) -> None:
    lines = _stderr_of(capsys, "train", *TINY, "--lr", "abc")
    assert lines == [
        "graph-fsdp train: error: argument --lr: invalid float value: 'abc'",
        "usage: graph-fsdp train [flags] (graph-fsdp train --help lists them)",
    ]
    lines = _stderr_of(capsys, "trian")  # the top level's usage is short: it stays whole
    assert lines[0].startswith("graph-fsdp: error: argument COMMAND: invalid choice: 'trian'")
    assert lines[1].startswith("usage: graph-fsdp ") and len(lines) == 2


def test_one_line_refusals(capsys, tmp_path) -> None:
    """--load of a file, --distributed-timeout-minutes <= 0, and a model that cannot fit in
    the host's memory (counted, never built: the refusal takes no longer than the others)."""
    afile = tmp_path / "ckpt.pt"
    afile.write_bytes(b"not a checkpoint directory")
    train = ["train", *TINY, "--train-iters", "2"]
    cases = [
        (["--load", str(afile)], [f"--load {afile} is a file, not a checkpoint directory"]),
        (["--distributed-timeout-minutes", "0"], ["--distributed-timeout-minutes 0 must be"]),
        (
            ["--num-layers", "100000", "--hidden-size", "256"],
            [
                "100000 layers of hidden 256 (78.7B parameters) on 2 rank(s) need at least ",
                "optimizer state 293 GiB",
                " per rank, but a rank has ",
                "the host's available ",
                "--recompute-activations",
            ],
        ),  # fmt: skip
    ]
    for argv, expected in cases:
        start = time.monotonic()
        lines = _stderr_of(capsys, *train, *argv)
        assert time.monotonic() - start < 5, f"{argv} took {time.monotonic() - start:.1f} s"
        assert len(lines) == 1 and lines[0].startswith("graph-fsdp train: error: "), lines
        for text in expected:
            assert text in lines[0], f"{text!r} not in {lines[0]!r}"


def test_a_token_file_shorter_than_the_run_is_refused_or_reused_on_request(
    capsys, tmp_path
) -> None:
    """20 tokens hold one sample of 16: ten iterations of two ranks read 40 (global batch 4),
    (micro batches of 2), so the run is refused naming both numbers; --allow-data-reuse accepts it with a note."""
    path = tmp_path / "tokens.bin"
    np.arange(20, dtype=np.uint16).tofile(path)
    argv = ["train", *TINY, "--train-iters", "10", "--data-path", str(path)]
    lines = _stderr_of(capsys, *argv)
    assert len(lines) == 1, lines
    assert (
        f"--data-path {path} holds 1 sample of --seq-length 16 (20 tokens), but the run reads "
        "40 (4 per iteration up to --train-iters 10), so it would train on the same samples "
        "again; pass a file of at least 641 tokens" in lines[0]
    ), lines[0]
    assert "--allow-data-reuse" in lines[0]
    args = build_parser().parse_args([*argv, "--allow-data-reuse"])
    kwargs = dict(seq_length=16, vocab_size=128, world_size=2, grad_accum=1, start=0, steps=10)
    assert check_data_path(args, **kwargs) == str(path)
    note = capsys.readouterr().err
    assert note.startswith(f"note: --data-path {path} holds 1 sample") and "read 40 times" in note
    (np.arange(40 * 16 + 1) % 128).astype(np.uint16).tofile(path)
    args = build_parser().parse_args(argv)  # exactly long enough: no note
    assert check_data_path(args, **kwargs) == str(path) and not capsys.readouterr().err


def test_run_demo_help_prints_help_and_runs_nothing(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        run_demo.main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m graph_fsdp.run_demo") and "graph-fsdp train" in out
    with pytest.raises(SystemExit) as exc:
        run_demo.main(["--steps", "3"])
    assert exc.value.code == 2 and "unrecognized arguments: --steps 3" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_rl_example_on_a_cpu_machine_says_how_to_run_it_there(capsys, monkeypatch) -> None:
    """``python examples/rl_loop.py`` run as ``__main__`` in this process (runpy, with its
    argv; the environment variables it sets at import are put back): it stops with that one
    line as its exit message (exit status 1) before anything else is printed."""
    script = str(REPO / "examples" / "rl_loop.py")
    monkeypatch.setattr(sys, "argv", [script])
    environ = dict(os.environ)
    try:
        with pytest.raises(SystemExit) as exc:
            runpy.run_path(script, run_name="__main__")
    finally:
        os.environ.clear()
        os.environ.update(environ)
    assert exc.value.code == (
        f"rl_loop.py: error: --device cuda (the default) needs a GPU, and this torch "
        f"{torch.__version__} sees none; on this machine run: python examples/rl_loop.py "
        "--device cpu --preset tiny"
    ), exc.value.code
    captured = capsys.readouterr()
    assert not captured.out.strip() and not captured.err.strip(), captured
