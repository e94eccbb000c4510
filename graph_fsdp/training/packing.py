"""Packed-sequence data: documents packed first-fit into fixed token budgets, and the static
tensors of a pack (models/packed.py [Note: packed sequences under CUDA graphs]).

Documents come from a token file (Megatron's convention: an end-of-document token closes each
document; the token stays the document's last token) or, without one, from a seeded synthetic
stream of lognormal lengths. They are packed in stream order, first-fit over a window of open
packs: each document goes into the first open pack with room for it and fewer than
``max_documents`` documents; when no open pack has room a new one opens, and the oldest is
closed once more than :data:`OPEN_PACKS` are open. A document longer than the budget is split
into budget-sized pieces, each its own document (``split_documents=False`` refuses it instead,
naming the document). The stream of packs depends only on the documents and the settings, so
pack ``i`` is the same in every run and on every rank; a microbatch row of ``(step_index,
rank)`` is pack ``(step_index * world + rank) * micro_batch_size + row``, like the unpacked
data (data.py).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from graph_fsdp.models.packed import IGNORE_INDEX, PackedBatch
from graph_fsdp.training.data import EVAL_STEP_OFFSET, TOKEN_DTYPE, check_token_file

OPEN_PACKS = 16
"""Packs open for first-fit at once: more fill the budgets better (a pack closes when it is the
oldest of more than this many) and cost nothing but host memory for their lists."""


@dataclass(frozen=True, kw_only=True)
class PackingPolicy:
    """How documents become packs."""

    budget: int
    """T: tokens per pack (a microbatch row), the model's ``seq_length``."""
    max_documents: int = 16
    """D: documents per pack at most; the graphs' ``cu_seqlens`` has ``D + 1`` slots per row
    (the last is the padding tail)."""
    split_documents: bool = True
    """A document longer than ``budget`` is split into budget-sized documents; False refuses it."""
    mean_document_length: int = 600
    """Synthetic documents (no token file): the mean of their lognormal lengths."""
    seed: int = 1234
    """Synthetic documents: the stream's seed."""
    padded: bool = False
    """The fixed-shape alternative, for comparison: each document of a pack in a row of its
    own, padded to the budget - ``max_documents`` plain causal rows per pack (``(input_ids,
    labels)``, -100 past each document), the same documents and real tokens as the pack."""

    def __post_init__(self) -> None:
        for name in ("budget", "max_documents", "mean_document_length"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"PackingPolicy.{name}={value!r}: expected an int >= 1")
        if self.budget < 2:
            raise ValueError(
                f"PackingPolicy.budget={self.budget}: a pack needs at least 2 tokens (one "
                "input and the label it predicts)"
            )

    def check_budget(self, seq_length: int, field: str) -> None:
        """A pack is one sequence of the model's length: ``budget`` must equal ``seq_length``
        (the config's ``field``, named in the error)."""
        if self.budget != seq_length:
            raise ValueError(
                f"PackingPolicy.budget={self.budget} != {field}={seq_length}: a pack is one "
                "sequence of the model's length"
            )


def first_fit(
    lengths: Iterator[int],
    policy: PackingPolicy,
    *,
    name: Callable[[int], str] = "document {}".format,
) -> Iterator[list]:
    """Packs of ``(document, start, length)`` pieces from a stream of document lengths, in
    order (module docstring). ``name(i)`` names document ``i`` in a refusal."""
    open_packs: list[tuple[int, list]] = []  # (tokens used, pieces)
    for doc, length in enumerate(lengths):
        if length > policy.budget and not policy.split_documents:
            raise ValueError(
                f"{name(doc)} has {length} tokens, more than the budget of {policy.budget} "
                "(--seq-length): split documents (the default) or raise the budget"
            )
        for start in range(0, length, policy.budget):
            piece = min(policy.budget, length - start)
            for i, (used, pieces) in enumerate(open_packs):
                if used + piece <= policy.budget and len(pieces) < policy.max_documents:
                    open_packs[i] = (used + piece, [*pieces, (doc, start, piece)])
                    break
            else:
                open_packs.append((piece, [(doc, start, piece)]))
                if len(open_packs) > OPEN_PACKS:
                    yield open_packs.pop(0)[1]
    for _, pieces in open_packs:
        yield pieces


class PackStream:
    """Pack ``i`` of a document source, computed once in stream order and kept (a pack is a
    short list of offsets)."""

    def __init__(
        self,
        lengths: Iterator[int],
        policy: PackingPolicy,
        *,
        name: Callable[[int], str] = "document {}".format,
    ) -> None:
        self._packs = first_fit(lengths, policy, name=name)
        self._done: list[list] = []
        self.exhausted = False

    @property
    def packs_made(self) -> int:
        """Packs computed so far (all of them once :attr:`exhausted`)."""
        return len(self._done)

    def pack(self, index: int) -> list | None:
        """The pieces of pack ``index``, or None past the last pack."""
        while len(self._done) <= index and not self.exhausted:
            nxt = next(self._packs, None)
            if nxt is None:
                self.exhausted = True
            else:
                self._done.append(nxt)
        return self._done[index] if index < len(self._done) else None


def synthetic_lengths(policy: PackingPolicy, stream: int) -> Iterator[int]:
    """Lognormal document lengths (sigma 1, mean ``policy.mean_document_length``, at least 2),
    seeded by ``(policy.seed, stream)``: an endless stream."""
    rng = np.random.default_rng([policy.seed, stream])
    sigma = 1.0
    mu = np.log(policy.mean_document_length) - sigma**2 / 2
    while True:
        for length in rng.lognormal(mu, sigma, size=256):
            yield max(2, int(round(length)))


def synthetic_tokens(policy: PackingPolicy, stream: int, doc: int, length: int, vocab: int):
    """The tokens of synthetic document ``doc`` (seeded by the stream and the document)."""
    rng = np.random.default_rng([policy.seed, stream, doc])
    return torch.from_numpy(rng.integers(0, vocab, size=length, dtype=np.int64))


class DocumentFile:
    """The documents of a flat uint16 token file (data.py's format), split after every
    ``eod_token_id``; a last document without one ends at the end of the file."""

    def __init__(self, path: str | os.PathLike, eod_token_id: int, vocab_size: int) -> None:
        self.path = os.fspath(path)
        check_token_file(self.path, 1, vocab_size)
        self.tokens = np.memmap(self.path, dtype=TOKEN_DTYPE, mode="r")
        largest = int(self.tokens.max())
        if largest >= vocab_size:
            raise ValueError(
                f"{self.path} holds token id {largest}, not below --vocab-size {vocab_size}: "
                "raise --vocab-size or use the tokenizer's file"
            )
        ends = np.flatnonzero(self.tokens == eod_token_id) + 1
        if ends.size == 0 or ends[-1] != self.tokens.size:
            ends = np.append(ends, self.tokens.size)
        self.starts = np.concatenate([[0], ends[:-1]]).astype(np.int64)
        self.lengths = (ends - self.starts).astype(np.int64)

    def __len__(self) -> int:
        return int(self.lengths.size)

    def name(self, doc: int) -> str:
        return f"document {doc} of {self.path} (tokens {self.starts[doc]}..)"

    def tokens_of(self, doc: int, start: int, length: int) -> torch.Tensor:
        begin = int(self.starts[doc]) + start
        return torch.from_numpy(self.tokens[begin : begin + length].astype(np.int64))


def pack_tensors(
    rows: Sequence[Sequence[torch.Tensor]],
    policy: PackingPolicy,
    device: torch.device | str | None = None,
) -> PackedBatch:
    """The :class:`~graph_fsdp.models.packed.PackedBatch` of ``b`` rows of documents (each row
    at most ``max_documents`` token tensors of at most ``budget`` tokens in all); see
    models/packed.py [Note: packed sequences under CUDA graphs] for the layout."""
    budget, slots = policy.budget, policy.max_documents
    b = len(rows)
    input_ids = torch.zeros(b, budget, dtype=torch.int64)
    labels = torch.full((b, budget), IGNORE_INDEX, dtype=torch.int64)
    position_ids = torch.zeros(b, budget, dtype=torch.int64)
    cu = torch.empty(b * (slots + 1) + 1, dtype=torch.int32)
    for r, docs in enumerate(rows):
        if len(docs) > slots:
            raise ValueError(f"row {r} holds {len(docs)} documents, more than {slots}")
        used, base = 0, r * budget
        offsets = []
        for tokens in docs:
            n = int(tokens.numel())
            if used + n > budget:
                raise ValueError(f"row {r}'s documents hold more than the budget of {budget}")
            offsets.append(base + used)
            input_ids[r, used : used + n] = tokens
            labels[r, used : used + n - 1] = tokens[1:]
            position_ids[r, used : used + n] = torch.arange(n)
            used += n
        # Unused slots are zero-length (they start where the tail starts); the tail is the
        # rest of the row, positions from 0 (it attends only to itself and carries no loss).
        offsets += [base + used] * (slots - len(docs))
        offsets.append(base + used)
        position_ids[r, used:] = torch.arange(budget - used)
        cu[r * (slots + 1) : (r + 1) * (slots + 1)] = torch.tensor(offsets, dtype=torch.int32)
    cu[-1] = b * budget
    return PackedBatch(*(t.to(device) for t in (input_ids, labels, position_ids, cu)))


def padded_tensors(
    rows: Sequence[Sequence[torch.Tensor]],
    policy: PackingPolicy,
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, labels)`` ``[len(rows) * max_documents, budget]``: every document in a
    row of its own from position 0, labels -100 past its last token and in unused rows."""
    budget, slots = policy.budget, policy.max_documents
    input_ids = torch.zeros(len(rows) * slots, budget, dtype=torch.int64)
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    for r, docs in enumerate(rows):
        for d, tokens in enumerate(docs):
            n = int(tokens.numel())
            input_ids[r * slots + d, :n] = tokens
            labels[r * slots + d, : n - 1] = tokens[1:]
    return input_ids.to(device), labels.to(device)


class PackedData:
    """The packed microbatches of a run: pack stream, token source and the row addressing."""

    def __init__(
        self,
        policy: PackingPolicy,
        *,
        vocab_size: int,
        data_path: str | os.PathLike | None = None,
        eod_token_id: int | None = None,
        eval: bool = False,
    ) -> None:
        self.policy, self.vocab_size = policy, vocab_size
        self.stream_id = EVAL_STEP_OFFSET if eval else 0
        if data_path is None:
            self.file = None
            lengths = synthetic_lengths(policy, self.stream_id)
            name = "synthetic document {}".format
        else:
            if eod_token_id is None:
                raise ValueError(
                    f"--data-path {os.fspath(data_path)} with packed sequences needs the end-"
                    "of-document token id (--eod-token-id) to find the documents"
                )
            self.file = DocumentFile(data_path, eod_token_id, vocab_size)
            half = len(self.file) // 2  # eval documents: the second half, as data.py's eval
            order = range(half, len(self.file)) if eval else range(len(self.file))
            self._doc_index = list(order)
            lengths = (int(self.file.lengths[d]) for d in order)
            name = self._file_doc_name
        self.stream = PackStream(lengths, policy, name=name)

    def _file_doc_name(self, doc: int) -> str:
        return self.file.name(self._doc_index[doc])  # type: ignore[union-attr]

    def _tokens(self, doc: int, start: int, length: int) -> torch.Tensor:
        if self.file is None:
            full = synthetic_tokens(
                self.policy, self.stream_id, doc, start + length, self.vocab_size
            )
            return full[start : start + length]
        return self.file.tokens_of(self._doc_index[doc], start, length)

    def rows(self, first: int, count: int) -> list[list[torch.Tensor]]:
        """The documents of packs ``first .. first + count - 1``."""
        out = []
        for index in range(first, first + count):
            pieces = self.stream.pack(index)
            if pieces is None:
                n = self.stream.packs_made
                raise ValueError(
                    f"the documents make {n} packs of {self.policy.budget} tokens, and this "
                    f"run needs pack {index}: use more data, fewer steps or a smaller budget"
                )
            out.append([self._tokens(*piece) for piece in pieces])
        return out

    def batch(self, micro_batch_size: int, step_index: int, rank: int, world_size: int, device):
        """The microbatch of ``(step_index, rank)``: a PackedBatch of ``micro_batch_size``
        packs, or with ``policy.padded`` their documents as padded rows."""
        rows = self.rows(
            self.first_pack(micro_batch_size, step_index, rank, world_size), micro_batch_size
        )
        if self.policy.padded:
            return padded_tensors(rows, self.policy, device)
        return pack_tensors(rows, self.policy, device)

    @staticmethod
    def first_pack(micro_batch_size: int, step_index: int, rank: int, world_size: int) -> int:
        return (step_index * world_size + rank) * micro_batch_size

    def document_tokens(self, first: int, count: int) -> int:
        """The document (non-padding) tokens of packs ``first .. first + count - 1``."""
        return sum(piece[2] for i in range(first, first + count) for piece in self.stream.pack(i))


class RunDocuments:
    """A run's packed documents: its training stream and its eval stream (another region of
    the data), each made on first use."""

    def __init__(self, policy: PackingPolicy, **settings: Any) -> None:
        """``settings``: :class:`PackedData`'s keywords but ``eval`` (``vocab_size``, and
        ``data_path`` with ``eod_token_id`` for documents from a token file)."""
        self._settings = settings
        self.policy = policy
        self._streams: dict[bool, PackedData] = {}

    def __call__(self, eval: bool = False) -> PackedData:
        if eval not in self._streams:
            self._streams[eval] = PackedData(self.policy, eval=eval, **self._settings)
        return self._streams[eval]


def padding_fraction(packs: Sequence[Sequence[tuple[int, int, int]]], budget: int) -> float:
    """The fraction of the packs' tokens that are padding (the tails)."""
    used = sum(piece[2] for pieces in packs for piece in pieces)
    return 1.0 - used / (budget * max(1, len(packs)))


__all__ = [
    "OPEN_PACKS",
    "DocumentFile",
    "PackStream",
    "PackedData",
    "PackingPolicy",
    "RunDocuments",
    "first_fit",
    "pack_tensors",
    "padded_tensors",
    "padding_fraction",
    "synthetic_lengths",
]
