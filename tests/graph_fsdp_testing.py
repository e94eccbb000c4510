"""Test helpers: many checks in one spawned process group, GPU skip markers and the CLI's
refusal message.

Processes are started by :func:`graph_fsdp.training.processes.spawn`; HuggingFace decoders are built by
:mod:`graph_fsdp.models.hf`. Nothing in the package imports this module.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable, Iterator, Mapping

import pytest
import torch

from graph_fsdp.cli.main import main
from graph_fsdp.training.processes import spawn

GPU_TEST_WORLD = int(os.environ.get("GRAPH_FSDP_GPU_TEST_WORLD", "2"))
"""Ranks (one GPU each) the multi-GPU tests spawn: 2, or 1 for a single-GPU smoke run
(``GRAPH_FSDP_GPU_TEST_WORLD=1``, tools/gpu_tests.sh ``WORLD=1``); the tests that need
several ranks by construction skip below 2."""


def needs_gpus(world: int | None = None):
    """``skipif`` marker: fewer CUDA GPUs than ``world`` (default ``GPU_TEST_WORLD``)."""
    world = GPU_TEST_WORLD if world is None else world
    return pytest.mark.skipif(
        torch.cuda.device_count() < world, reason=f"needs {world} CUDA GPU(s)"
    )


def megatron_stack_missing() -> str | None:
    """Why the Megatron-Core GPU tests cannot run here (TransformerEngine or megatron-core does
    not import), or None."""
    try:
        import transformer_engine.pytorch  # noqa: F401 (optional dependency)
    except Exception as err:  # noqa: BLE001 - any import failure means no TE
        return f"TransformerEngine does not import ({err})"
    try:
        import megatron.core  # noqa: F401 (optional dependency)
    except Exception as err:  # noqa: BLE001 - any import failure means no megatron-core
        return f"megatron-core does not import ({err})"
    return None


def cli_error(capsys, *argv: str) -> str:
    """The message ``graph-fsdp argv`` stops with (a CLIError: exit code 2), on one line.

    ``capsys`` is pytest's fixture; the command runs in this process, so nothing is launched
    when the arguments are refused before that.
    """
    try:
        main(list(argv))
    except SystemExit as exc:
        assert exc.code == 2, f"graph-fsdp {' '.join(argv)} exited with {exc.code}, not 2"
    else:
        raise AssertionError(f"graph-fsdp {' '.join(argv)} was not refused")
    err = capsys.readouterr().err
    assert "error:" in err, err
    return err.split("error:", 1)[1].replace("\n", " ")


def error_of(fn: Callable[[], object]) -> str:
    """The message ``fn()`` is refused with (ValueError, RuntimeError or TypeError), or "no
    error": for tests that collect refusals in a worker and assert on them after."""
    try:
        fn()
    except (ValueError, RuntimeError, TypeError) as err:
        return str(err)
    return "no error"


def saved_tensor_bytes(fn: Callable[[], object], exclude=()) -> tuple[object, int]:
    """``(fn(), bytes)``: the bytes of the tensors autograd keeps for backward while ``fn``
    runs (``torch.autograd.graph.saved_tensors_hooks``), each storage counted once (views and
    chunks of one tensor share it) and the storages of ``exclude`` (parameters) left out."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            kept[storage.data_ptr()] = storage.nbytes()  # alive until backward: no reuse
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(kept.values())


def spawn_cases(cases: Mapping[str, tuple], world_size: int = 2, **spawn_kwargs) -> CaseResults:
    """Run every case in one spawned group of ``world_size`` ranks; each case's results by label.

    ``cases`` maps a label to ``(fn, *args)``; every rank runs ``fn(rank, world_size, *args)``
    for each case in turn (FSDP2's ``run_subtests``: starting a group costs each rank an
    import of torch, seconds of CPU, while a tiny model's case costs a fraction of that).
    Each case starts from a fresh process's RNG state. A case that raises stops its rank:
    its traceback, and the cases left unrun, are reported by :class:`CaseResults` to the
    tests that read them, so every other case's test still passes or fails on its own.
    ``spawn_kwargs`` go to :func:`graph_fsdp.training.processes.spawn`.
    """
    return CaseResults(cases, spawn(_run_cases, world_size, dict(cases), **spawn_kwargs))


def _run_cases(rank: int, world_size: int, cases: dict[str, tuple]) -> dict[str, tuple]:
    seed = torch.initial_seed()
    out: dict[str, tuple] = {}
    for label, (fn, *args) in cases.items():
        torch.manual_seed(seed)
        try:
            out[label] = ("ok", fn(rank, world_size, *args))
        except Exception:  # noqa: BLE001 (reported to the case's test; the rank stops)
            out[label] = ("error", traceback.format_exc())
            break
    return out


class CaseResults(Mapping):
    """Per-case results of :func:`spawn_cases`: ``results[label]`` is the list of every rank's
    return value, or raises an ``AssertionError`` with the case's tracebacks (or names the
    case that failed before it) when a rank did not finish it. ``a | b`` holds the cases of
    both (groups of different world sizes, say)."""

    def __init__(self, cases: Mapping[str, tuple], per_rank: list[dict[str, tuple]]) -> None:
        self._groups = {label: per_rank for label in cases}  # the group each case ran in

    def __getitem__(self, label: str) -> list:
        if label not in self._groups:
            raise KeyError(f"no case {label!r}; the cases are {list(self._groups)}")
        problems = []
        for rank, outcomes in enumerate(self._groups[label]):
            if label not in outcomes:
                failed = [k for k, (status, _) in outcomes.items() if status == "error"]
                why = f"case {failed[0]!r} failed before it" if failed else "no failure reported"
                problems.append(f"rank {rank} did not run it: {why}")
            elif outcomes[label][0] == "error":
                problems.append(f"rank {rank} failed:\n{outcomes[label][1]}")
        if problems:
            raise AssertionError(f"case {label!r}: " + "\n".join(problems))
        return [outcomes[label][1] for outcomes in self._groups[label]]

    def __or__(self, other: CaseResults) -> CaseResults:
        both = CaseResults({}, [])
        both._groups = {**self._groups, **other._groups}
        return both

    def __iter__(self) -> Iterator[str]:
        return iter(self._groups)

    def __len__(self) -> int:
        return len(self._groups)
