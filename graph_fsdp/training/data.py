"""Training data: flat uint16 token files (``--data-path``) or synthetic tokens.

A token file is a raw array of uint16 token ids (what Megatron's and nanoGPT's preprocessing
write: ``np.array(tokens, dtype=np.uint16).tofile(path)``), read through ``np.memmap`` so
it is never loaded whole. Sample ``i`` is the window ``tokens[i * seq : i * seq + seq + 1]``
(input = the first ``seq`` ids, labels = the last ``seq``); a batch is addressed by
``(step, rank)`` exactly like :func:`graph_fsdp.models.synthetic_batch`, so every run and
every rank sees the same data for the same step, and ranks of one step never share samples.

:func:`batch_for` is the one data source of :func:`graph_fsdp.training.train.run`: the token file of
``TrainConfig.data_path`` when it is set, else synthetic tokens.
"""

from __future__ import annotations

import functools
import os
from typing import Protocol

import numpy as np
import torch

from graph_fsdp.models import synthetic_batch

TOKEN_DTYPE = np.uint16
TOKEN_BYTES = np.dtype(TOKEN_DTYPE).itemsize


def check_token_file(
    path: str | os.PathLike,
    seq_length: int,
    vocab_size: int | None = None,
    *,
    flag: str = "--data-path",
) -> int:
    """Validate size and shape of a token file without reading it; return its token count."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ValueError(f"{flag} {path}: no such file (expected a flat uint16 token file)")
    size = os.path.getsize(path)
    if size % TOKEN_BYTES != 0:
        raise ValueError(
            f"{flag} {path}: size {size} bytes is not a multiple of {TOKEN_BYTES}, so it is not a "
            "flat uint16 token file (write one with np.array(ids, dtype=np.uint16).tofile(path))"
        )
    num_tokens = size // TOKEN_BYTES
    if num_tokens < seq_length + 1:
        raise ValueError(
            f"{flag} {path}: {num_tokens} tokens is shorter than one sample of --seq-length "
            f"{seq_length} + 1 label token; use a longer file or a shorter --seq-length"
        )
    if vocab_size is not None and vocab_size > np.iinfo(TOKEN_DTYPE).max + 1:
        raise ValueError(
            f"--vocab-size {vocab_size} does not fit uint16 token ids (max 65536); {flag} needs "
            "a vocabulary of at most 65536 tokens"
        )
    return num_tokens


def training_samples(
    start_step: int, steps: int, *, grad_accum: int, world_size: int, micro_batch_size: int
) -> tuple[int, int]:
    """``(first, count)``: the samples (before wrapping) steps ``[start_step, start_step +
    steps)`` read from a token file, over every rank (:meth:`TokenFileDataset.batch`)."""
    per_step = grad_accum * world_size * micro_batch_size
    return start_step * per_step, steps * per_step


def check_token_ids(
    path: str | os.PathLike,
    seq_length: int,
    vocab_size: int,
    samples: list[tuple[int, int]],
    *,
    flag: str = "--data-path",
) -> None:
    """Every token id of the given samples is < ``vocab_size``: raise a ValueError naming the
    first sample that holds a larger one. ``samples``: ``(first, count)`` runs of sample
    indices, wrapped modulo the file's sample count like :class:`TokenFileDataset`; only
    their windows are read (a run as long as the file reads the whole file once)."""
    path = os.fspath(path)
    tokens = np.memmap(path, dtype=TOKEN_DTYPE, mode="r")
    num_samples = (len(tokens) - 1) // seq_length
    spans: list[tuple[int, int]] = []  # sample ranges [a, b) inside the file
    for first, count in samples:
        if count >= num_samples:
            spans = [(0, num_samples)]
            break
        a = first % num_samples
        b = a + count
        spans += [(a, min(b, num_samples))] + ([(0, b - num_samples)] if b > num_samples else [])
    chunk = max(1, (1 << 22) // seq_length)  # samples per read: ~4M tokens
    for a, b in sorted(spans):
        for lo in range(a, b, chunk):
            hi = min(b, lo + chunk)
            window = tokens[lo * seq_length : hi * seq_length + 1]
            if window.size and int(window.max()) >= vocab_size:
                at = lo * seq_length + int(np.argmax(window >= vocab_size))
                sample = min(at // seq_length, num_samples - 1)
                raise ValueError(
                    f"{flag} {path}: token {at} (sample {sample}) has id {int(tokens[at])}, "
                    f"which is >= --vocab-size {vocab_size}; set --vocab-size to the "
                    f"tokenizer's vocabulary size (> {int(window.max())}), or re-tokenize the "
                    "file with a tokenizer of this vocabulary"
                )


def check_run_data(
    path: str | os.PathLike,
    *,
    seq_length: int,
    vocab_size: int,
    start_step: int,
    steps: int,
    grad_accum: int,
    world_size: int,
    micro_batch_size: int,
    eval_interval: int = 0,
    allow_reuse: bool = False,
    flag: str = "--data-path",
) -> str | None:
    """The token file a run of steps ``[start_step, start_step + steps)`` reads, checked before
    any rank starts: its shape (:func:`check_token_file`), the token ids of every training and
    eval sample the run reads (:func:`check_token_ids`; eval batches read the second half of
    the file: :func:`batch_for`), and that it holds every training sample up to the last step.
    A shorter file is refused (the stream would wrap around and train on the same samples
    again) or, with ``allow_reuse``, the note to show is returned; None: nothing to say."""
    num_tokens = check_token_file(path, seq_length, vocab_size, flag=flag)
    first, count = training_samples(
        start_step,
        steps,
        grad_accum=grad_accum,
        world_size=world_size,
        micro_batch_size=micro_batch_size,
    )
    runs = [(first, count)]
    if eval_interval:
        per_eval = world_size * micro_batch_size
        offset = (num_tokens - 1) // seq_length // 2  # batch_for's eval region
        for step in range(start_step, start_step + steps):
            if (step + 1) % eval_interval == 0:
                runs.append((offset + step * per_eval, per_eval))
    check_token_ids(path, seq_length, vocab_size, runs, flag=flag)
    num_samples = (num_tokens - 1) // seq_length
    needed = first + count
    if needed <= num_samples:
        return None
    held = (
        f"{flag} {os.fspath(path)} holds {num_samples} sample{'s' * (num_samples != 1)} "
        f"of --seq-length {seq_length} ({num_tokens} tokens), but the run reads {needed} "
        f"({count // max(steps, 1)} per iteration up to --train-iters {start_step + steps})"
    )
    if allow_reuse:
        return f"{held}: each sample is read {needed / num_samples:.3g} times on average"
    raise ValueError(
        f"{held}, so it would train on the same samples again; pass a file of at least "
        f"{needed * seq_length + 1} tokens, fewer --train-iters, or --allow-data-reuse to "
        "read it again on purpose"
    )


class TokenFileDataset:
    """Deterministic ``(input_ids, labels)`` batches from a flat uint16 token file.

    Row ``j`` of the batch for ``(step, rank)`` is sample
    ``((step * world_size + rank) * micro_batch_size + j) % len(self)``: consecutive steps walk
    the file in order, the ranks of one step read disjoint samples, and the stream wraps
    around (a new epoch) at the end of the file.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        seq_length: int,
        *,
        world_size: int = 1,
        vocab_size: int | None = None,
    ) -> None:
        if seq_length < 1 or world_size < 1:
            raise ValueError(f"seq_length={seq_length} and world_size={world_size} must be >= 1")
        self.path = os.fspath(path)
        self.seq_length = seq_length
        self.world_size = world_size
        self.vocab_size = vocab_size
        self.num_tokens = check_token_file(self.path, seq_length, vocab_size)
        self.tokens = np.memmap(self.path, dtype=TOKEN_DTYPE, mode="r")
        # Windows overlap by one token: the last label of sample i is the first input of i + 1.
        self.num_samples = (self.num_tokens - 1) // seq_length

    def __len__(self) -> int:
        return self.num_samples

    def sample(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample ``index`` (modulo the sample count) as int64 ``(input_ids, labels)``, [seq]."""
        start = (index % self.num_samples) * self.seq_length
        window = torch.from_numpy(self.tokens[start : start + self.seq_length + 1].astype(np.int64))
        if self.vocab_size is not None and int(window.max()) >= self.vocab_size:
            raise ValueError(
                f"{self.path}: sample {index % self.num_samples} holds token id "
                f"{int(window.max())} >= --vocab-size {self.vocab_size}; raise --vocab-size to "
                "the tokenizer's vocabulary size"
            )
        return window[:-1], window[1:]

    def batch(
        self,
        micro_batch_size: int,
        step: int,
        rank: int = 0,
        device: torch.device | str | None = None,
        *,
        sample_offset: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(input_ids, labels)``, each [micro_batch_size, seq_length] int64, for (step, rank).

        Same signature (after the config) as :func:`graph_fsdp.models.synthetic_batch`.
        ``sample_offset`` shifts the whole stream by that many samples (another region of the
        file, e.g. for eval batches).
        """
        if micro_batch_size < 1 or step < 0 or not 0 <= rank < self.world_size:
            raise ValueError(
                f"micro_batch_size={micro_batch_size} must be >= 1, step={step} >= 0 and "
                f"0 <= rank={rank} < world_size={self.world_size}"
            )
        first = sample_offset + (step * self.world_size + rank) * micro_batch_size
        rows = [self.sample(first + j) for j in range(micro_batch_size)]
        input_ids = torch.stack([r[0] for r in rows])
        labels = torch.stack([r[1] for r in rows])
        if device is not None:
            input_ids, labels = input_ids.to(device), labels.to(device)
        return input_ids, labels


EVAL_STEP_OFFSET = 10**6
"""Synthetic eval batches use step index ``EVAL_STEP_OFFSET + step`` (a stream training never
reaches); a token file's eval batches start half the file away from the training stream."""


@functools.lru_cache(maxsize=4)
def _token_dataset(
    path: str, seq_length: int, world_size: int, vocab_size: int
) -> TokenFileDataset:
    return TokenFileDataset(path, seq_length, world_size=world_size, vocab_size=vocab_size)


class BatchConfig(Protocol):
    """What :func:`batch_for` reads of a training config (``train.TrainConfig``, the
    Megatron-Core loop's ``MCoreTrainConfig``)."""

    model: object
    """The model's config: ``seq_length``, ``vocab_size`` (and what ``synthetic_batch``
    reads of it)."""
    micro_batch_size: int
    data_path: str | os.PathLike | None


def batch_for(
    cfg: BatchConfig,
    step_index: int,
    rank: int,
    device: torch.device | str | None,
    eval: bool = False,
    *,
    world_size: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``(input_ids, labels)`` microbatch of ``(step_index, rank)``, each
    ``[cfg.micro_batch_size, cfg.model.seq_length]`` int64 on ``device``.

    ``step_index``: training microbatch ``step * grad_accum + micro``, or the step for an eval
    batch (``eval=True``, another region of the data). The position depends only on
    ``(step_index, rank, world_size)``, so a run resumed at ``start_step`` reads the batches
    the uninterrupted run would have read. ``cfg.data_path`` None: synthetic tokens
    (:func:`graph_fsdp.models.synthetic_batch`); else the token file, ranks of a step reading
    disjoint samples (``world_size`` must be the data-parallel size).
    """
    if cfg.data_path is None:
        step = EVAL_STEP_OFFSET + step_index if eval else step_index
        return synthetic_batch(cfg.model, cfg.micro_batch_size, step, rank=rank, device=device)
    ds = _token_dataset(
        os.fspath(cfg.data_path), cfg.model.seq_length, world_size, cfg.model.vocab_size
    )
    offset = len(ds) // 2 if eval else 0
    return ds.batch(cfg.micro_batch_size, step_index, rank, device, sample_offset=offset)
