"""The training loop every model family runs (train.py: graph_fsdp's GPT and the unsharded
reference; integrations/megatron/train.py: Megatron-Core GPTs)::

    result = run_loop(GPTAdapter(cfg), rank, world_size)

One step: the graph runner's ``before_step`` (a capture is not timed), every microbatch's
forward+backward (gradient sync on the last only), its repeat when a dropless expert-parallel
exchange overflowed (overflow.py; parallel/dropless_ep.py [Note: dropless overflow reports]),
the gradients to the main weights, clipping
by the global norm, the optimizer step, then the mean loss and the stop votes in one
all-reduce (interrupt.py [Note: stopping at a step boundary]), an eval pass every
``eval_interval`` steps, the step's log record, the NaN/Inf check (nonfinite.py [Note:
non-finite steps]) and a scheduled (or interrupted) checkpoint (checkpoints.py [Note: the
latest complete checkpoint]).

What differs between families lives in two small objects:

- the **adapter** (:class:`ModelAdapter`) - how the model is built and sharded, its batches,
  its graph runner (the config's ``GraphPolicy`` plus the family's own checks), and what the
  run sets up and releases around the loop;
- the **trainer** (:class:`Trainer`) - where the weights live and how they are stepped:
  graph_fsdp's ``fully_shard`` (:class:`ShardedTrainer`), or a placement without it (the
  unsharded mixed-precision reference in train.py, Megatron-FSDP in megatron/train.py).
"""

from __future__ import annotations

import json
import os
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, fields, replace
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from graph_fsdp.capture.policy import GraphPolicy
from graph_fsdp.capture.step import HostClock, eager_forward_backward, timed_forward_backward
from graph_fsdp.cuda_streams import step_range
from graph_fsdp.fsdp import checkpoint as ckpt
from graph_fsdp.fsdp.api import BufferPolicy, MixedPrecisionPolicy
from graph_fsdp.fsdp.grad_norm import clip_grad_norm_
from graph_fsdp.fsdp.state import discard_gradients
from graph_fsdp.models.packed import PackedBatch
from graph_fsdp.training.checkpoints import (
    CheckpointPolicy,
    optimizer_settings,
    resolve_checkpoint,
    resume_optimizer_settings,
    save_iteration,
)
from graph_fsdp.training.interrupt import mean_loss_and_stop
from graph_fsdp.training.nonfinite import NonFiniteGuard, check_finite_model, json_number
from graph_fsdp.training.overflow import OverflowRepeats, overflow_record

Batch = tuple[torch.Tensor, ...]
"""``(input_ids, labels)``, or packed ``(input_ids, labels, position_ids, cu_seqlens)``."""


class _TakesFlatFields(type):
    """Config classes whose constructor (and so ``dataclasses.replace``) still takes the flat
    spellings of their section fields (:func:`fold_flat_fields`)."""

    def __call__(cls, *args, **kwargs):
        return super().__call__(*args, **fold_flat_fields(cls, kwargs))


@dataclass(kw_only=True)
class LoopConfig(metaclass=_TakesFlatFields):
    """The fields every family's training config has (``TrainConfig``, ``MCoreTrainConfig``),
    the CUDA graphs, the buffers, the mixed precision and the checkpoints as sections (frozen
    policies)."""

    strategy: str = "optim_grads_params"
    """Data-parallel sharding strategy."""
    separate_all_gather_group: bool = False
    """The units' all-gathers on a process group of their own, beside the reduce-scatters'
    (``fully_shard(separate_all_gather_group=True)``; comm.py [Note: a communicator for the
    all-gathers])."""
    micro_batch_size: int = 1
    """Sequences per rank per microbatch."""
    grad_accum: int = 1
    """Microbatches per step (no_sync on all but the last)."""
    steps: int = 10
    """Optimizer steps."""
    lr: float = 1e-3
    """AdamW learning rate."""
    weight_decay: float = 0.01
    """AdamW weight decay."""
    clip_grad: float = 0.0
    """Global gradient-norm clipping before each optimizer step (0: off)."""
    eval_interval: int = 0
    """Run a forward-only eval pass every N steps (0: never)."""
    check_for_nan_in_loss_and_grad: bool = True
    """Stop at a NaN/Inf loss or gradient norm (nonfinite.py [Note: non-finite steps])."""
    max_consecutive_skipped_steps: int = 10
    """The one-graph step skips non-finite updates; stop after more than this many in a row
    (0: never)."""
    start_step: int = 0
    """Data stream position of the first step (for resume)."""
    data_path: str | None = None
    """Training data: a flat numpy uint16 token file, read through np.memmap
    (``np.array(ids, dtype=np.uint16).tofile(path)``); None = synthetic tokens."""
    fused_optimizer: bool = False
    """AdamW(fused=True)."""
    optimizer_offload_fraction: float = 0.0
    """Share of the local shards (by elements) whose AdamW state lives and steps on the CPU
    (graph_fsdp.fsdp.optim_offload); 0 keeps it on the device. Needs recompute off."""
    deterministic: bool = False
    """torch.use_deterministic_algorithms(True) for the whole process (plus cuBLAS and
    TransformerEngine settings): bit-reproducible eager runs, e.g. flash-attention backward."""
    log_path: str | None = None
    """JSON lines: one record per step (rank 0)."""
    return_params: bool = True
    """Gather full parameters at the end (for parity tests)."""
    graphs: GraphPolicy = field(default_factory=GraphPolicy)
    """The run's CUDA graphs (capture/policy.py): backend, scopes, eager steps before capture,
    verification, communication graphs, the whole step in one graph."""
    buffers: BufferPolicy = field(default_factory=BufferPolicy)
    """Where the units' unsharded weights and gradients live (fsdp/api.py)."""
    mp: MixedPrecisionPolicy = field(default_factory=MixedPrecisionPolicy)
    """Mixed precision (fsdp/api.py): ``param_dtype`` None (fp32 compute) or torch.bfloat16
    (bf16 compute weights; the main weights and gradients stay in ``main_params_dtype`` /
    ``main_grads_dtype``), and how gradients are reduced (``grad_comm_dtype``,
    ``reduce_scatter_fp32_accumulation``)."""
    checkpoint: CheckpointPolicy = field(default_factory=CheckpointPolicy)
    """Where and when the run saves, what it resumes from (training/checkpoints.py)."""

    def __post_init__(self) -> None:
        for name, kind in _SECTIONS.items():
            value = getattr(self, name)
            if not isinstance(value, kind):
                raise TypeError(
                    f"{type(self).__name__}.{name}={value!r} must be a {kind.__name__} "
                    f"({name}={kind.__name__}(...))"
                )
        if self.mp.param_dtype not in (None, torch.float32, torch.bfloat16):
            raise ValueError(
                f"{type(self).__name__}.mp.param_dtype={self.mp.param_dtype} is not a compute "
                "dtype the loop trains in (it has no loss scaling for fp16): use "
                "torch.bfloat16, or None for fp32"
            )

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype the gathered weights compute in (``mp.param_dtype``; fp32 when None)."""
        return self.mp.param_dtype or torch.float32

    def with_graphs(self, **changes) -> LoopConfig:
        """This config with ``changes`` to its :attr:`graphs` (e.g. ``impl="none",
        scopes=()`` for the eager run of a graphed one)."""
        return replace(self, graphs=replace(self.graphs, **changes))

    @property
    def graph_policy(self) -> GraphPolicy:
        """Deprecated spelling of :attr:`graphs`."""
        _warn_flat("graph_policy", "graphs", stacklevel=2)
        return self.graphs

    def __getattr__(self, name: str):
        # Only reached for names the instance does not have: the flat spellings of
        # section fields (_FLAT_FIELDS), read from their section.
        where = _FLAT_FIELDS.get(name)
        if where is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        _warn_flat(name, where.spelling, stacklevel=2)
        return where.read(getattr(object.__getattribute__(self, where.section), where.name))


_SECTIONS: dict[str, type] = {
    "graphs": GraphPolicy,
    "buffers": BufferPolicy,
    "mp": MixedPrecisionPolicy,
    "checkpoint": CheckpointPolicy,
}
"""LoopConfig's sections, by field name."""


def _same(value):
    return value


class _Flat(NamedTuple):
    """Where a flat field lives in its section (``section.name``), and how its value is
    written there (``write``) and read back (``read``) where the spellings differ."""

    section: str
    name: str
    write: Callable = _same
    read: Callable = _same

    @property
    def spelling(self) -> str:
        return f"{self.section}.{self.name}"


def _grad_comm_dtype(name: str | None) -> torch.dtype | None:
    if name in (None, "fp32"):
        return None
    if name == "bf16":
        return torch.bfloat16
    raise ValueError(
        f"LoopConfig.grad_comm_dtype={name!r} must be None, 'fp32' or 'bf16' (better: "
        "mp=MixedPrecisionPolicy(grad_comm_dtype=torch.bfloat16))"
    )


_FLAT_FIELDS: dict[str, _Flat] = {
    "cuda_graph_impl": _Flat("graphs", "impl"),
    "cuda_graph_scope": _Flat("graphs", "scopes"),
    "cuda_graph_warmup_steps": _Flat("graphs", "warmup_steps"),
    "cuda_graph_scope_modules": _Flat("graphs", "scope_modules"),
    "cuda_graph_comm": _Flat("graphs", "comm_graphs"),
    "cuda_graph_verify": _Flat("graphs", "verify"),
    "cuda_graph_optimizer": _Flat("graphs", "optimizer"),
    "allocator": _Flat("buffers", "allocator"),
    "persist_on_alloc_fail": _Flat("buffers", "persist_on_alloc_fail"),
    "num_slots": _Flat("buffers", "num_slots"),
    "bf16": _Flat(
        "mp",
        "param_dtype",
        write=lambda on: torch.bfloat16 if on else None,
        read=lambda dtype: dtype == torch.bfloat16,
    ),
    "grad_comm_dtype": _Flat(
        "mp",
        "grad_comm_dtype",
        write=_grad_comm_dtype,
        read=lambda dtype: "bf16" if dtype == torch.bfloat16 else None,
    ),
    "reduce_scatter_fp32_accumulation": _Flat("mp", "reduce_scatter_fp32_accumulation"),
    "save_path": _Flat("checkpoint", "save_path"),
    "save_at": _Flat("checkpoint", "save_at"),
    "save_interval": _Flat("checkpoint", "save_interval"),
    "save_keep_last": _Flat("checkpoint", "keep_last"),
    "save_on_interrupt": _Flat("checkpoint", "save_on_interrupt"),
    "load_path": _Flat("checkpoint", "load_path"),
    "resume_optimizer_settings": _Flat("checkpoint", "resume_optimizer_settings"),
}
"""The flat fields a config had before its sections (old name -> where it lives now): still
taken by the constructor and ``dataclasses.replace`` (folded into the section) and read as
attributes, each with a DeprecationWarning. ``bf16=True`` is ``mp.param_dtype=
torch.bfloat16``; ``grad_comm_dtype="bf16"`` is ``mp.grad_comm_dtype=torch.bfloat16``."""


def _warn_flat(old: str, new: str, *, stacklevel: int) -> None:
    warnings.warn(
        f"LoopConfig.{old} is deprecated: use LoopConfig.{new}",
        DeprecationWarning,
        stacklevel=stacklevel + 1,
    )


def fold_flat_fields(cls: type, kwargs: dict) -> dict:
    """``kwargs`` of a config class with the flat section fields of :data:`_FLAT_FIELDS`
    folded into their sections (on top of a section ``kwargs`` also gives)."""
    flat = {k: kwargs.pop(k) for k in list(kwargs) if k in _FLAT_FIELDS}
    if not flat:
        return kwargs
    changes: dict[str, dict] = {}
    for old, value in flat.items():
        where = _FLAT_FIELDS[old]
        _warn_flat(old, where.spelling, stacklevel=3)  # the caller of the class
        changes.setdefault(where.section, {})[where.name] = where.write(value)
    defaults = {f.name: f for f in fields(cls)}
    for section, values in changes.items():
        base = kwargs.get(section) or defaults[section].default_factory()
        kwargs[section] = replace(base, **values)
    return kwargs


def use_deterministic_kernels(*, warn_only: bool = False) -> None:
    """``LoopConfig.deterministic``: ``torch.use_deterministic_algorithms(True)`` for the whole
    process, with the cuBLAS workspace and TransformerEngine settings it needs
    (``warn_only``: ops without a deterministic kernel warn instead of failing)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    os.environ.setdefault("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")
    torch.use_deterministic_algorithms(True, warn_only=warn_only)


class Trainer:
    """Where the weights live and how a step updates them; this base is graph_fsdp's
    placement (:class:`ShardedTrainer`) without its gradient-sync switch."""

    batches_per_microbatch = 1
    """Batches each microbatch runs (the reference runs every rank's)."""
    checkpoints = True
    """Writes ``save_path`` checkpoints (the reference does not)."""

    def __init__(self, model: nn.Module, optimizer, *, loss_world: int, device: torch.device):
        self.model, self.optimizer = model, optimizer
        self.loss_world = loss_world
        """Ranks the step's loss is averaged over (1: no collective)."""
        self.device = device
        """Where the step's loss accumulates."""

    def set_requires_gradient_sync(self, last: bool) -> None:
        """Gradient reduction on the step's last microbatch only (no_sync accumulation)."""

    def grads_to_main(self) -> None:
        """Make the gradients the optimizer reads (GradScaler's ``unscale_`` point)."""

    def drop_grads(self) -> None:
        """Throw away every gradient the step accumulated (before :meth:`grads_to_main`): an
        overflowed step is repeated (overflow.py)."""
        self.optimizer.zero_grad(set_to_none=True)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip; the global gradient norm before clipping."""
        return torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)

    def optimizer_step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def save(self, path: str, meta: dict | None) -> None:
        ckpt.save(path, self.model, self.optimizer, meta=meta)

    def full_params(self) -> dict[str, torch.Tensor]:
        return {k: v.cpu() for k, v in ckpt.full_state_dict(self.model).items()}


class ShardedTrainer(Trainer):
    """graph_fsdp's ``fully_shard``: no_sync accumulation, clipping by the global norm over
    every rank's shards (grad_norm.py [Note: global gradient norm])."""

    def set_requires_gradient_sync(self, last: bool) -> None:
        self.model.set_requires_gradient_sync(last)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        return clip_grad_norm_(self.model.parameters(), max_norm)

    def drop_grads(self) -> None:
        """The sharded ``.grad`` views go (the next reduction then overwrites the main
        gradients instead of adding to them) and so does any pending ``no_sync``
        accumulation (fsdp/state.py ``discard_gradients``)."""
        super().drop_grads()
        discard_gradients(self.model)


class ModelAdapter:
    """One model family under the loop: subclasses fill in every method that raises."""

    cfg: LoopConfig

    def setup(self, rank: int, world_size: int) -> torch.device:
        """Process settings and checks before anything is built; the training device."""
        raise NotImplementedError

    def build(self, device: torch.device, world_size: int) -> Trainer:
        """The model (sharded, or as the trainer places it), its optimizer, a loaded
        checkpoint."""
        raise NotImplementedError

    def make_graphs(self, trainer: Trainer):
        """The graph runner (None: eager): the config's GraphPolicy after the family's
        checks."""
        raise NotImplementedError

    def microbatches(self, step: int, device: torch.device) -> Iterable[Iterable[Batch]]:
        """Per microbatch of ``step``, the batches it runs (one, or every rank's for the
        reference); an iterator may build them as they are used."""
        raise NotImplementedError

    def eval_batch(self, step: int, device: torch.device) -> Batch:
        raise NotImplementedError

    def schedule(self, trainer: Trainer):
        """A callable ``(batches) -> loss`` that runs the step's microbatches in place of the
        loop's own (Megatron's schedule), or None."""
        return None

    def checkpoint_meta(self, step: int) -> dict | None:
        return None

    def finish(self, trainer: Trainer, graphs, result: dict) -> None:
        """After the last step: what the result adds, what the run releases."""


def run_loop(adapter: ModelAdapter, rank: int, world_size: int) -> dict:
    """Train ``adapter.cfg.steps`` steps; returns per-step losses, times, eval losses, graph
    reports, peak memory (and the full parameters with ``return_params``)."""
    cfg = adapter.cfg
    device = adapter.setup(rank, world_size)
    if device.type == "cuda":  # the peaks reported are this run's (runs share a process)
        torch.cuda.reset_peak_memory_stats(device)
    trainer = adapter.build(device, world_size)
    graphs = adapter.make_graphs(trainer)
    schedule = adapter.schedule(trainer)
    denom = cfg.grad_accum * trainer.batches_per_microbatch
    microbatch = MicrobatchStep(trainer.model, denom)
    # One protocol for every runner: capture(step_fn) (capture/teardown.py RunnerLifecycle).
    run = microbatch if graphs is None else graphs.capture(microbatch)
    owns_step = graphs is not None and graphs.owns_optimizer_step
    repeats = OverflowRepeats(trainer.model, device, rank)  # overflow.py
    losses, times, eval_losses = [], [], []
    host = {"step": [], "forward": [], "backward": []}
    log = open(cfg.log_path, "a") if cfg.log_path and rank == 0 else None
    saved_at = stopped_at = None
    guard = NonFiniteGuard(
        check=cfg.check_for_nan_in_loss_and_grad,
        max_consecutive_skips=cfg.max_consecutive_skipped_steps,
    )
    for step in range(cfg.start_step, cfg.start_step + cfg.steps):
        if graphs is not None and not owns_step:
            graphs.before_step()  # capture (after the warmup steps) is not timed
        if device.type == "cuda":
            torch.cuda.synchronize()
        with step_range(step):  # the step's window in a profile: cuda_streams.py
            t0 = time.perf_counter()
            norm = skipped = None  # the global gradient norm where computed; a skipped update
            microbatch.clock = clock = HostClock()
            batches = with_token_scale(adapter.microbatches(step, device), trainer.loss_world)
            rng, overflow = repeats.rng_state(), None
            if owns_step:
                # Microbatches, reductions, clipping, optimizer and zeroing: one call (one replay
                # once captured, the capture step included in its time). An overflow skipped
                # the update on the device; the eager step redoes it with every copy's buffer.
                flat = [b for micro in batches for b in micro]
                out = run(flat)
                if repeats.buffers and bool(out.overflowed):
                    overflow = repeats.take()
                    with repeats.repeating(None, rng):
                        out = run.eagerly(flat)
                    overflow = repeats.measured(overflow, step)
                step_loss, norm, skipped = out.loss, out.grad_norm, out.skipped
            else:
                step_loss = _forward_backward(
                    trainer, batches, micros=cfg.grad_accum, run=run, schedule=schedule
                )
                overflow = repeats.take()
                if overflow is not None:  # before the gradients reach the main weights
                    trainer.drop_grads()
                    with repeats.repeating(graphs, rng):
                        step_loss = _forward_backward(
                            trainer, batches, micros=cfg.grad_accum, run=microbatch,
                            schedule=schedule,
                        )  # fmt: skip
                    overflow = repeats.measured(overflow, step)
                trainer.grads_to_main()
                if cfg.clip_grad > 0:
                    norm = trainer.clip_grad_norm_(cfg.clip_grad)
                trainer.optimizer_step()
            # The mean loss over the ranks and their stop requests: interrupt.py [Note: stopping at
            # a step boundary].
            step_loss, stop_votes = mean_loss_and_stop(
                step_loss.detach().float(), trainer.loss_world
            )
            host["step"].append(time.perf_counter() - t0)  # all of the step issued
            host["forward"].append(clock.forward)
            host["backward"].append(clock.backward)
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        losses.append(step_loss.item())
        stopping = stop_votes.item() > 0
        grad_norm = None if norm is None else float(norm)
        skipped = skipped is not None and bool(skipped)
        if cfg.eval_interval and (step + 1) % cfg.eval_interval == 0:
            with torch.no_grad(), repeats.evaluating():
                eval_losses.append(eval_loss(trainer.model, adapter.eval_batch(step, device)))
        if log is not None:
            record = {"step": step, "loss": json_number(losses[-1]), "step_time_s": times[-1]}
            if grad_norm is not None:
                record["grad_norm"] = json_number(grad_norm)
            if skipped:
                record["skipped"] = True
            record.update(overflow_record(overflow))
            log.write(json.dumps(record, allow_nan=False) + "\n")
            log.flush()
        guard.after_step(step + 1, losses[-1], grad_norm, skipped)  # raises: nonfinite.py
        if trainer.checkpoints and _saves_at(cfg, step + 1, stopping):
            _save(adapter, trainer, step + 1)
            saved_at = step + 1
        if stopping:
            stopped_at = step + 1
            break
    if log is not None:
        log.close()
    result = {
        "losses": losses,
        "times": times,
        "host_times": host,
        "eval_losses": eval_losses,
        "config": asdict(cfg),
        "saved_at": saved_at,
        "stopped_at": stopped_at,
        "skipped_steps": guard.skipped,
        "overflow_steps": repeats.steps,
    }
    if cfg.return_params:
        result["params"] = trainer.full_params()
    if graphs is not None:
        result["cuda_graphs"] = graphs.report()
    if device.type == "cuda":
        # Allocated misses what graph replays use in their pools; reserved holds the pools.
        result["peak_memory_bytes"] = torch.cuda.max_memory_allocated(device)
        result["peak_reserved_bytes"] = torch.cuda.max_memory_reserved(device)
    adapter.finish(trainer, graphs, result)
    return result


def _saves_at(cfg: LoopConfig, iteration: int, stopping: bool) -> bool:
    """A checkpoint after ``iteration`` (CheckpointPolicy.saves_after)."""
    return cfg.checkpoint.saves_after(iteration, start_step=cfg.start_step, stopping=stopping)


def _save(adapter: ModelAdapter, trainer: Trainer, iteration: int) -> None:
    """``save_path/iter_NNNNNNN`` and the tracker (checkpoints.py), never a non-finite model;
    the checkpoint records the iteration and the optimizer settings (for a resume's check)."""
    policy = adapter.cfg.checkpoint
    check_finite_model(trainer.model, iteration, policy.save_path)
    meta = {
        "iteration": iteration,
        **(adapter.checkpoint_meta(iteration) or {}),
        "optimizer": optimizer_settings(trainer.optimizer),
    }
    save_iteration(
        lambda path: trainer.save(path, meta),
        policy.save_path,
        iteration,
        keep_last=policy.keep_last,
    )


def load_checkpoint(cfg: LoopConfig, model: nn.Module, optimizer) -> str:
    """Resume ``model`` and ``optimizer`` from ``cfg.checkpoint.load_path`` (a run's directory:
    its latest complete checkpoint) with its ``resume_optimizer_settings``; the directory
    read."""
    policy = cfg.checkpoint
    path = resolve_checkpoint(policy.load_path)
    ckpt.load(path, model, optimizer)
    wanted = {"lr": cfg.lr, "weight_decay": cfg.weight_decay}
    resume_optimizer_settings(optimizer, wanted, mode=policy.resume_optimizer_settings, path=path)
    return path


def _forward_backward(
    trainer: Trainer, batches: list[list[Batch]], *, micros: int, run, schedule
) -> torch.Tensor:
    """Every microbatch's forward+backward through ``run`` (the runner's captured step, or
    the eager :class:`MicrobatchStep`), gradient sync on the last only; the summed loss."""
    if schedule is not None:
        return schedule(batches)
    step_loss = torch.zeros((), device=trainer.device)
    for micro, micro_batches in enumerate(batches):
        trainer.set_requires_gradient_sync(micro == micros - 1)
        for batch in micro_batches:
            step_loss += run(*batch)
    return step_loss


class MicrobatchStep:
    """The loop's forward+backward of one microbatch, the step function every runner captures
    (``graphs.capture(step)``) or the loop calls eagerly: ``loss = model(x, y) / denom``, or
    for packed documents (``x, y, position_ids, cu_seqlens, scale``) the loss summed over the
    real tokens times the step's ``scale`` (:func:`with_token_scale`); its backward; returns
    the loss, detached. ``clock``: the host times of the eager forward and backward (a replay
    runs no Python), set by the loop each step - not an argument, so the graphs' constants
    stay the same."""

    def __init__(self, model: nn.Module, denom: int) -> None:
        self.model, self.denom = model, denom
        self.clock: HostClock | None = None

    def __call__(self, x: torch.Tensor, y: torch.Tensor, *packed: torch.Tensor) -> torch.Tensor:
        if not packed:
            return eager_forward_backward(self.model, x, y, self.denom, self.clock)
        position_ids, cu_seqlens, scale = packed
        return timed_forward_backward(
            lambda: self.model(x, y, position_ids=position_ids, cu_seqlens=cu_seqlens) * scale,
            self.clock,
        )


def with_token_scale(batches: Iterable[Iterable[Batch]], loss_world: int) -> list[list[Batch]]:
    """The step's microbatches as lists; packed batches ``(x, y, position_ids, cu_seqlens)``
    gain the per-token loss scale ``loss_world / (real tokens of the step)``, the tokens counted
    over every microbatch and, when ``loss_world > 1``, every rank (one all-reduce of a
    device scalar: no host sync) - Megatron's ``calculate_per_token_loss``: gradients averaged
    over ``loss_world`` ranks then sum each token's loss over the whole step's tokens once
    (models/packed.py [Note: packed sequences under CUDA graphs])."""
    batches = [list(micro) for micro in batches]
    packed = [b for micro in batches for b in micro if isinstance(b, PackedBatch)]
    if not packed:
        return batches
    tokens = sum(b.real_tokens() for b in packed)
    if loss_world > 1:
        dist.all_reduce(tokens)
    scale = loss_world / tokens.clamp_min(1).to(torch.float32)
    return [[(*b, scale) if isinstance(b, PackedBatch) else b for b in micro] for micro in batches]


def eval_loss(model: nn.Module, batch: Batch) -> float:
    """The eval loss of one batch: the mean over its tokens (real tokens when packed)."""
    if not isinstance(batch, PackedBatch):
        x, y = batch
        return model(x, y).float().item()
    x, y, position_ids, cu_seqlens = batch
    total = model(x, y, position_ids=position_ids, cu_seqlens=cu_seqlens)
    return (total / batch.real_tokens().clamp_min(1)).float().item()
