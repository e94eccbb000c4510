"""Test helpers: many checks in one spawned process group, GPU skip markers, the CLI's
refusal message and the model and training configurations several test files share.

Processes are started by :func:`graph_fsdp.training.processes.spawn`; HuggingFace decoders are built by
:mod:`graph_fsdp.models.hf`. Nothing in the package imports this module.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import traceback
from collections.abc import Callable, Iterator, Mapping

import pytest
import torch
import torch.distributed as dist

from graph_fsdp.cli.main import main
from graph_fsdp.fsdp import checkpoint as ckpt
from graph_fsdp.fsdp.api import BufferPolicy, MixedPrecisionPolicy
from graph_fsdp.fsdp.fully_shard import fully_shard
from graph_fsdp.integrations import megatron as gm
from graph_fsdp.models import GPTConfig, transformer_layers
from graph_fsdp.training.processes import spawn
from graph_fsdp.training.train import TrainConfig

# ---------------------------------------------------------------------- shared configurations
TINY_SHAPE = dict(
    vocab_size=128, num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16
)
"""The CPU tests' reference GPT: 2 layers, hidden 32, 4 heads, sequence 16, vocabulary 128."""


def tiny_gpt(**overrides) -> GPTConfig:
    """:data:`TINY_SHAPE` with ``overrides`` (built anew: derived sizes follow them)."""
    return GPTConfig(**{**TINY_SHAPE, **overrides})


TINY_GPT = tiny_gpt()
SMALLEST_GPT = GPTConfig(
    vocab_size=64, num_layers=2, hidden_size=16, num_attention_heads=2, seq_length=8
)
"""The capture tests' smallest GPT: 2 layers, hidden 16, 2 heads, sequence 8."""

TINY_MCORE_SHAPE = {**TINY_SHAPE, "vocab_size": 64, "ffn_hidden_size": 64}
"""The CPU tests' Megatron-Core GPT (``MCoreGPTConfig`` keywords; this module imports no
Megatron)."""

GPU_SHAPE = dict(
    vocab_size=1024, num_layers=4, hidden_size=256, num_attention_heads=4, seq_length=128
)
"""The GPU tests' GPT: 4 layers, hidden 256, sequence 128, vocabulary 1024."""
MOE_LAYERS = dict(num_experts=4, moe_layer_freq=2, moe_router_topk=2)
"""Every second layer a mixture of 4 experts, top-2 routing."""


def gpu_gpt(**overrides) -> GPTConfig:
    """:data:`GPU_SHAPE` with ``overrides`` (built anew: derived sizes follow them)."""
    return GPTConfig(**{**GPU_SHAPE, **overrides})


BF16_MP = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
"""bf16 compute weights, fp32 main weights and gradients: a loop config's ``mp``."""

GPU_RUN = dict(
    mp=BF16_MP,
    device="cuda",
    deterministic=True,
    buffers=BufferPolicy(allocator="double_buffer", persist_on_alloc_fail=True),
)
"""The GPU bit-exactness tests' run settings (any family's loop config): bf16 on CUDA, static
buffers (double buffer, persistent on a failed allocation) and deterministic kernels - eager
must be reproducible before graphs can equal it."""


MCORE_GPU_RUN = dict(
    {k: v for k, v in GPU_RUN.items() if k != "device"},
    grad_accum=2,
    clip_grad=1.0,
    fused_optimizer=True,
    return_params=True,
)
"""The Megatron-Core GPU parity tests' run settings (``MCoreTrainConfig``, always on CUDA):
:data:`GPU_RUN`, 2 microbatches a step, clipping and the fused AdamW of the graphed step."""


def bit_exact_gpu_run(model: GPTConfig, **overrides) -> TrainConfig:
    """The GPU bit-exactness tests' training run: :data:`GPU_RUN`, 2 microbatches of 2."""
    return TrainConfig(
        model=model, **{**GPU_RUN, "micro_batch_size": 2, "grad_accum": 2, **overrides}
    )


GRAPH_MODES = {
    "layerwise": {"cuda_graph_impl": "torch"},
    "full_iteration": {"cuda_graph_impl": "torch", "cuda_graph_scope": ["full_iteration"]},
    "one_graph": {
        "cuda_graph_impl": "torch",
        "cuda_graph_scope": ["full_iteration"],
        "cuda_graph_optimizer": True,
    },
}
"""TrainConfig fields of the graphed modes the bit-exactness tests run beside eager: whole
layers, full_iteration, and the whole step in one graph."""


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


def megatron_imports() -> bool:
    """Whether megatron-core imports here (graph_fsdp.integrations.megatron.require_megatron)."""
    try:
        gm.require_megatron()
    except ImportError:
        return False
    return True


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


def megatron_gpu_marks(gpus: int = 1) -> list:
    """The marks of a Megatron-Core GPU test module: ``gpu``, at least ``gpus`` CUDA devices,
    and a skip naming what does not import (TransformerEngine, megatron-core) where CUDA is
    there; TE's deterministic attention for the ranks it spawns
    (``NVTE_ALLOW_NONDETERMINISTIC_ALGO=0``, read when TE's attention is built)."""
    os.environ.setdefault("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")
    marks = [pytest.mark.gpu, needs_gpus(gpus)]
    missing = megatron_stack_missing() if torch.cuda.is_available() else None
    if missing:
        marks.append(pytest.mark.skip(reason=missing))
    return marks


def shard_layers(model: torch.nn.Module, **placement) -> torch.nn.Module:
    """``fully_shard`` every transformer layer, then the root, with the same ``placement``."""
    for layer in transformer_layers(model):
        fully_shard(layer, **placement)
    return fully_shard(model, **placement)


def profile_steps(model, opt, x, y, *, warmup: int = 2, steps: int = 4):
    """``warmup`` unprofiled training steps on the batch ``(x, y)``, then ``steps`` under the
    CUDA profiler: the profile."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            model(x, y).backward()
            opt.step()
            opt.zero_grad()
        torch.cuda.synchronize()
    return prof


def run_modes(run: Callable, rank: int, world_size: int, base, modes: Mapping[str, dict]) -> dict:
    """``run(rank, world_size, cfg)`` on ``base`` (as ``"eager"``) and on ``base`` with each
    mode's changes, by the mode's name; a mode that raises gives ``{"error": traceback}``, so
    that one failing mode does not hide the others' results."""
    out = {"eager": run(rank, world_size, base)}
    for name, change in modes.items():
        try:
            out[name] = run(rank, world_size, dataclasses.replace(base, **change))
        except Exception:  # noqa: BLE001 - reported by the test
            out[name] = {"error": traceback.format_exc()}
    return out


class _NoStream:
    """Stands in for the alltoall dispatcher's CUDA stream of dropless host copies."""

    def __getattr__(self, name: str):
        raise AssertionError(f"the dispatcher used its dtoh stream ({name}) on CPU")


def megatron_on_cpu() -> None:
    """Megatron-Core's CUDA-only details bridged for CPU (gloo) tests - call it in spawned
    workers only, none of it is in the code under test: its allocations with
    ``device=torch.cuda.current_device()`` (communication outputs, the attention's buffer, the
    router's weight) go to the CPU; megatron-core 0.16's router linear finds its TE-less
    branch; and the alltoall dispatcher's CUDA stream for dropless host copies, which
    drop-padding never touches, is a placeholder that fails if it is ever used. (The
    attention's dropout RNG fork, dropout 0, is Megatron's no-op inference tracker: the tests
    set it after building.)"""
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    torch.cuda.current_device = lambda: "cpu"
    MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = _NoStream()
    # megatron-core 0.16 reads te_general_gemm in the router's linear whether or not
    # TransformerEngine imported (0.19 defines it as None without TE).
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


MOE_EXPERTS, MOE_TOPK, MOE_HIDDEN, MOE_FFN = 4, 2, 32, 64
"""The shape of :func:`megatron_moe_config`'s MoE block."""


def megatron_moe_config(**kw):
    """A one-layer Megatron ``TransformerConfig`` of a small MoE block for CPU tests (CPU
    initialisation, no dropout, no biases; a shared expert; the allgather dispatcher, as the
    alltoall one makes a CUDA stream at construction): ``kw`` overrides any field."""
    from megatron.core.transformer import TransformerConfig

    base = dict(
        num_layers=1,
        hidden_size=MOE_HIDDEN,
        num_attention_heads=4,
        ffn_hidden_size=MOE_FFN,
        moe_ffn_hidden_size=MOE_FFN,
        num_moe_experts=MOE_EXPERTS,
        moe_router_topk=MOE_TOPK,
        moe_token_dispatcher_type="allgather",
        moe_shared_expert_intermediate_size=MOE_FFN,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
    )
    return TransformerConfig(**{**base, **kw})


def graphed_modes_failures(
    label: dict, results: dict, modes, *, steps: int, warmup: int
) -> list[str]:
    """:func:`graphed_run_failures` of each of ``modes``' runs in ``results`` (by mode name)
    against ``results["eager"]``, all of them."""
    failures = []
    for name in modes:
        failures += graphed_run_failures(
            label, name, results[name], results["eager"], steps=steps, warmup=warmup
        )
    return failures


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


def full_optimizer_state(model, optimizer) -> dict[str, torch.Tensor]:
    """Every optimizer state tensor at full size (``"<fqn>.<name>"``), gathered on every rank.

    Independent of the checkpoint code: each rank contributes its pieces; elements no rank
    holds stay NaN, so a gap fails any equality check.
    """
    pieces = []
    for ref in ckpt._refs(model):
        for name, value in optimizer.state.get(ref.sharded, {}).items():
            per_element = value.dim() == 1 and value.shape == ref.sharded.shape
            offset = ref.global_offset if per_element else None
            pieces.append((f"{ref.fqn}.{name}", offset, ref.shape.numel(), value.detach().clone()))
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, pieces)
    out: dict[str, torch.Tensor] = {}
    for rank_pieces in gathered:
        for key, offset, numel, value in rank_pieces:
            if offset is None:  # e.g. AdamW's scalar step: the same on every holder
                out[key] = value
            else:
                full = out.setdefault(key, torch.full((numel,), math.nan, dtype=value.dtype))
                full[offset : offset + value.numel()] = value
    return out


def first_difference(a: list, b: list) -> str:
    """The first step where two loss lists differ, or "none"."""
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        if x != y:
            return f"step {i}: {x!r} vs {y!r} (delta {y - x:.3e})"
    return "none"


def differing_params(got: dict, reference: dict) -> list[str]:
    """The names of ``got["params"]`` (final weights) that are not ``reference``'s bit for bit."""
    return [n for n, v in reference["params"].items() if not torch.equal(got["params"][n], v)]


def graphed_run_failures(
    label: dict, mode: str, got: dict, eager: dict, *, steps: int, warmup: int, what: str = ""
) -> list[str]:
    """One graphed run of a GPU parity test against its eager twin: prints its JSON row
    (``label``, the graph counts, both median step times, both runs' peak allocated and
    reserved CUDA memory) and returns what failed - not exactly
    one capture, an eager fallback, fewer replays than one per graphed step (``mode``
    "full_iteration": two graphs a step; "one_graph": one; else every captured callable), or
    losses, eval losses or final weights that are not eager's bit for bit. ``got`` and ``eager``
    hold ``losses``, ``eval_losses``, ``params`` and ``times`` (``got`` also ``cuda_graphs``, or
    ``error``); ``what`` names the run in the failures (default: ``mode``)."""
    what = what or mode
    if "error" in got:
        return [f"{what}: {got['error']}"]
    report = got["cuda_graphs"]
    print(
        json.dumps(
            {
                **label,
                "mode": mode,
                "captures": report["captures"],
                "replays": report["replays"],
                "eager_fallbacks": report["eager_fallbacks"],
                "median_step_s": sorted(got["times"])[len(got["times"]) // 2],
                "eager_median_step_s": sorted(eager["times"])[len(eager["times"]) // 2],
                "peak_allocated_bytes": got.get("peak_memory_bytes"),
                "peak_reserved_bytes": got.get("peak_reserved_bytes"),
                "eager_peak_allocated_bytes": eager.get("peak_memory_bytes"),
                "eager_peak_reserved_bytes": eager.get("peak_reserved_bytes"),
            }
        )
    )
    per_step = {"full_iteration": 2, "one_graph": 1}.get(mode, len(report["callables"]))
    checks = {
        "one capture": report["captures"] == 1,
        "no eager fallback": report["eager_fallbacks"] == 0,
        "a replay every graphed step": report["replays"] >= (steps - warmup - 1) * per_step,
        "losses": got["losses"] == eager["losses"],
        "eval losses": got["eval_losses"] == eager["eval_losses"],
    }
    failures = []
    bad = [k for k, ok in checks.items() if not ok]
    if bad:
        failures.append(
            f"{what}: {bad}; report {report}; losses "
            f"{first_difference(eager['losses'], got['losses'])}"
        )
    differing = differing_params(got, eager)
    if differing:
        failures.append(f"{what}: final weights differ from eager's: {differing[:4]}")
    return failures


OVERFLOW_MODES = {
    "eager": {},
    "layer": {"cuda_graph_impl": "torch"},
    "moe": {"cuda_graph_impl": "torch", "cuda_graph_scope": ["moe"]},
    "full_iteration": GRAPH_MODES["full_iteration"],
    "one_graph": GRAPH_MODES["one_graph"],
}
"""Loop config fields of the modes the dropless overflow GPU tests run with a receive buffer
that overflows: eager, whole layers, ``moe``, ``full_iteration`` and the one graph."""


def overflow_probe(rank: int, world: int, run, cfg) -> list[float]:
    """Run ``cfg`` (a receive-buffer factor that overflows every step) through ``run(rank,
    world, cfg)``; rank 0: the factor each step's warning named (the factor that would have
    held that step; the repeats make the run's trajectory that of a buffer of every copy)."""
    import re
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run(rank, world, cfg)
    said = [str(w.message) for w in caught if "overflowed its receive buffer" in str(w.message)]
    return [float(re.search(r"factor >= ([0-9.]+)", m).group(1)) for m in said]


def overflow_problems(label: str, reference: dict, got: dict, *, steps: int, warmup: int) -> list:
    """A run with an overflowing factor against ``reference`` (no factor, eager): overflow
    steps counted, not all; bit-identical losses, eval losses and weights; graphed runs
    captured once, replayed every graphed step, no eager fallback."""
    problems = []
    overflows = got.get("overflow_steps", 0)
    if not 0 < overflows < steps:
        problems.append(f"{label}: {overflows} overflow steps of {steps}")
    if got.get("skipped_steps"):
        problems.append(f"{label}: {got['skipped_steps']} non-finite skipped steps")
    for what in ("losses", "eval_losses"):
        if got[what] != reference[what]:
            problems.append(f"{label}: {what} differ from the run without a factor")
    differ = differing_params(got, reference)
    if differ:
        problems.append(f"{label}: final weights differ: {differ[:4]}")
    report = got.get("cuda_graphs")
    if report is not None and report["impl"] != "eager":
        if report["captures"] != 1 or report["eager_fallbacks"]:
            problems.append(f"{label}: captures/fallbacks {report}")
        if report["replays"] < steps - warmup:
            problems.append(f"{label}: {report['replays']} replays in {steps - warmup} steps")
    return problems
