"""Token files (graph_fsdp.training.data): deterministic (step, rank) batches; batch_for, train.run's
data source (token file or synthetic)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from graph_fsdp.models import GPTConfig, synthetic_batch
from graph_fsdp.training.data import EVAL_STEP_OFFSET, TokenFileDataset, batch_for, check_token_file
from graph_fsdp.training.train import TrainConfig


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


def test_stream_offset_shifts_whole_batches(token_file) -> None:
    ds = TokenFileDataset(token_file, seq_length=10, world_size=2)
    x, _ = ds.batch(2, step=0, rank=1, sample_offset=5)  # samples 5 + 2, 5 + 3
    assert torch.equal(x[:, 0], torch.tensor([70, 80]))


MODEL = GPTConfig(
    vocab_size=128, num_layers=1, hidden_size=32, num_attention_heads=4, seq_length=16
)


def test_batch_for_without_data_path_is_synthetic_batch() -> None:
    cfg = TrainConfig(model=MODEL, micro_batch_size=3)
    for got, want in [
        (batch_for(cfg, 5, 1, "cpu"), synthetic_batch(MODEL, 3, 5, rank=1)),
        (batch_for(cfg, 5, 1, "cpu", eval=True), synthetic_batch(MODEL, 3, 10**6 + 5, rank=1)),
    ]:
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert EVAL_STEP_OFFSET == 10**6


def test_batch_for_reads_the_token_file_like_synthetic_batch_is_shaped(tmp_path) -> None:
    path = tmp_path / "tokens.bin"
    tokens = np.random.default_rng(0).integers(0, 128, 40 * 16 + 1).astype(np.uint16)
    tokens.tofile(path)
    cfg = TrainConfig(model=MODEL, micro_batch_size=2, data_path=str(path))
    x, y = batch_for(cfg, 3, 1, "cpu", world_size=2)
    sx, sy = synthetic_batch(MODEL, 2, 3, rank=1)
    assert (x.shape, y.shape, x.dtype, y.dtype) == (sx.shape, sy.shape, sx.dtype, sy.dtype)
    first = (3 * 2 + 1) * 2  # (step_index * world_size + rank) * micro_batch_size
    want = torch.from_numpy(tokens.astype(np.int64))
    assert torch.equal(x[0], want[first * 16 : first * 16 + 16])
    assert torch.equal(y[1], want[(first + 1) * 16 + 1 : (first + 1) * 16 + 17])
    # Same (step_index, rank): same batch (what a resumed run relies on).
    assert torch.equal(batch_for(cfg, 3, 1, "cpu", world_size=2)[0], x)
    # Eval reads another region: half the file (20 samples) further on.
    xe, _ = batch_for(cfg, 3, 1, "cpu", eval=True, world_size=2)
    assert torch.equal(xe[0], want[(first + 20) * 16 : (first + 20) * 16 + 16])
    assert not torch.equal(xe, x)
    with pytest.raises(ValueError, match="rank=1"):
        batch_for(cfg, 0, 1, "cpu")  # a file's ranks need the data-parallel size
