"""``--packed-sequences`` on the command line: a packed run of documents from a token file
(split at the end-of-document token) on 2 gloo ranks, Megatron's three spellings, and the
refusals, each naming the flag."""

from __future__ import annotations

import json

import numpy as np
import pytest
from _cli_helpers import TINY, run_cli
from graph_fsdp_testing import cli_error

EOD = 0


@pytest.fixture
def document_file(tmp_path):
    """120 documents of 3..14 tokens, each ended by the end-of-document token 0."""
    rng = np.random.default_rng(0)
    docs = [np.append(rng.integers(1, 128, size=rng.integers(2, 14)), EOD) for _ in range(120)]
    path = tmp_path / "docs.bin"
    np.concatenate(docs).astype(np.uint16).tofile(path)
    return str(path)


@pytest.mark.slow
def test_train_packed_documents_from_a_token_file(tmp_path, document_file):
    log = tmp_path / "log.jsonl"
    out = run_cli(
        "train", *TINY, "--packed-sequences", "--data-path", document_file,
        "--eod-token-id", str(EOD), "--packed-max-documents", "4", "--train-iters", "4",
        "--global-batch-size", "8", "--micro-batch-size", "2", "--log-json", str(log),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(records) == 4 and all(0 < r["loss"] < 10 for r in records), records


def test_megatron_spellings_mean_packed_sequences(capsys):
    """The three flags together are accepted (the run is then refused for TP, proving the
    packed path was taken); one alone is refused naming the other two."""
    err = cli_error(
        capsys, "train", *TINY, "--reset-position-ids", "--reset-attention-mask",
        "--eod-mask-loss", "--tensor-model-parallel-size", "2",
    )  # fmt: skip
    assert "--packed-sequences with --tensor-model-parallel-size 2 and --model gpt" in err
    assert "use --model mcore-gpt" in err
    err = cli_error(capsys, "train", *TINY, "--reset-position-ids")
    assert "--reset-position-ids alone" in err and "--reset-attention-mask --eod-mask-loss" in err


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        (["--transformer-impl", "transformer_engine"], "needs --transformer-impl local"),
        (["--data-path", "x.bin"], "needs --eod-token-id"),
        (["--packed-max-documents", "0"], "max_documents=0"),
        (["--model", "mcore-gpt"], "--model mcore-gpt needs --transformer-impl transformer_engine"),
    ],
)
def test_refusals_name_the_flag(capsys, extra, match):
    assert match in cli_error(capsys, "train", *TINY, "--packed-sequences", *extra)


def test_eod_token_without_packing_is_refused(capsys):
    err = cli_error(capsys, "train", *TINY, "--eod-token-id", "0")
    assert "--eod-token-id 0 is given without --packed-sequences" in err


def test_too_few_documents_for_the_run(capsys, document_file):
    err = cli_error(
        capsys, "train", *TINY, "--packed-sequences", "--data-path", document_file,
        "--eod-token-id", str(EOD), "--train-iters", "500",
    )  # fmt: skip
    assert "packs of 16 tokens, and this run needs pack" in err
