"""TokenFileDataset: deterministic (step, rank) batches from a flat uint16 token file."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from graph_fsdp.cli.data import TokenFileDataset, check_token_file


@pytest.fixture
def token_file(tmp_path):
    path = tmp_path / "tokens.bin"
    np.arange(101, dtype=np.uint16).tofile(path)  # 10 samples of 10 tokens + 1 label
    return path


def test_samples_are_shifted_windows(token_file) -> None:
    ds = TokenFileDataset(token_file, seq_length=10)
    assert len(ds) == 10
    x, y = ds.sample(3)
    assert torch.equal(x, torch.arange(30, 40)) and torch.equal(y, torch.arange(31, 41))
    assert x.dtype == torch.int64


def test_batches_are_deterministic_disjoint_across_ranks_and_wrap(token_file) -> None:
    ds = TokenFileDataset(token_file, seq_length=10, world_size=2)
    x0, y0 = ds.batch(2, step=0, rank=0)
    x1, _ = ds.batch(2, step=0, rank=1)
    assert x0.shape == y0.shape == (2, 10)
    assert torch.equal(x0[:, 0], torch.tensor([0, 10])) and torch.equal(
        x1[:, 0], torch.tensor([20, 30])
    )
    again = TokenFileDataset(token_file, seq_length=10, world_size=2).batch(2, step=0, rank=1)
    assert torch.equal(again[0], x1)
    # Step 2: rank 0 reads samples (2 * 2 + 0) * 2 = 8 and 9, rank 1 wraps around to 0 and 1.
    assert torch.equal(ds.batch(2, step=2, rank=0)[0][:, 0], torch.tensor([80, 90]))
    assert torch.equal(ds.batch(2, step=2, rank=1)[0][:, 0], torch.tensor([0, 10]))


def test_token_ids_beyond_vocab_are_reported(token_file) -> None:
    ds = TokenFileDataset(token_file, seq_length=10, vocab_size=50)
    ds.sample(0)
    with pytest.raises(ValueError, match="token id 60 >= --vocab-size 50"):
        ds.sample(5)


def test_bad_files_and_arguments(tmp_path, token_file) -> None:
    with pytest.raises(ValueError, match="no such file"):
        check_token_file(tmp_path / "missing.bin", 10)
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x00" * 5)
    with pytest.raises(ValueError, match="not a multiple of 2"):
        check_token_file(odd, 1)
    with pytest.raises(ValueError, match="shorter than one sample"):
        check_token_file(token_file, 101)
    with pytest.raises(ValueError, match="at most 65536"):
        check_token_file(token_file, 10, vocab_size=70000)
    ds = TokenFileDataset(token_file, seq_length=10, world_size=2)
    with pytest.raises(ValueError, match="rank=2"):
        ds.batch(1, 0, rank=2)
