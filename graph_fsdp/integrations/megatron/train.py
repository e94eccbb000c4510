"""Megatron-Core GPTs under the training loop (graph_fsdp.training.loop; CLI ``--model mcore-gpt``,
tests).

``run(rank, world_size, cfg)`` builds the model (:mod:`graph_fsdp.integrations.megatron`),
shards it, and trains ``cfg.steps`` AdamW steps on synthetic tokens or a ``data_path`` token
file (resuming from / saving a DCP checkpoint, graph_fsdp.fsdp.checkpoint) through the loop every
model family runs (:class:`MCoreAdapter`): the loop's own microbatches (which drive layerwise /
full-iteration graphs) or Megatron's ``get_forward_backward_func()`` schedule
(``use_megatron_schedule``; eager or layerwise graphs, which replay inside the model's
forward). ``engine="megatron_fsdp"`` trains the same model with megatron_fsdp instead (the
comparison the GPU tests make). Returns per-step losses, eval losses, step times and peak
memory (with what was allocated when the run started: tests and benchmarks run several models
in one process, and a model a run leaves behind would count in every later run's peak).
"""

from __future__ import annotations

import dataclasses
import gc
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from graph_fsdp.fsdp.api import MixedPrecisionPolicy
from graph_fsdp.integrations import megatron as gm
from graph_fsdp.integrations.megatron import tp as megatron_tp
from graph_fsdp.integrations.megatron.megatron_fsdp import megatron_fsdp_shard
from graph_fsdp.training.adapters import DataParallelAdapter, make_optimizer, packed_documents
from graph_fsdp.training.data import batch_for
from graph_fsdp.training.loop import (
    LoopConfig,
    ShardedTrainer,
    Trainer,
    load_checkpoint,
    run_loop,
    use_deterministic_kernels,
)
from graph_fsdp.training.packing import PackingPolicy


@dataclass(kw_only=True)
class MCoreTrainConfig(LoopConfig):
    """A Megatron-Core GPT under the training loop (loop.py); the loop's fields are
    :class:`~graph_fsdp.training.loop.LoopConfig`'s (defaults here: micro batch 2, bf16, no full
    parameters returned)."""

    model: gm.MCoreGPTConfig = field(default_factory=gm.MCoreGPTConfig)
    """Model shape."""
    engine: str = "graph_fsdp"
    """graph_fsdp, or megatron_fsdp (comparison runs; eager only)."""
    micro_batch_size: int = 2
    """Sequences per rank per microbatch."""
    mp: MixedPrecisionPolicy = field(
        default_factory=lambda: MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    )
    """Mixed precision: bf16 compute weights, fp32 main weights and grads by default."""
    return_params: bool = False
    """Gather full parameters at the end (for parity tests)."""
    use_megatron_schedule: bool = False
    """Run each step through megatron.core's get_forward_backward_func()."""
    model_name: str = "mcore-gpt"
    """The CLI's ``--model`` every checkpoint records (a ``--load`` of another is refused)."""
    packing: PackingPolicy | None = None
    """Packed variable-length documents (training/packing.py): each row a pack of
    ``packing.budget`` (= ``model.seq_length``) tokens through TransformerEngine's THD
    attention, the per-token loss (megatron/packed.py [Note: Megatron-Core packed
    sequences]). Needs the TE layer spec and TP = 1. None: fixed rows."""
    eod_token_id: int | None = None
    """Packed documents from ``data_path``: the token that ends each document."""
    router_skew: float = 0.0
    """Added to expert 0's gating logit in every MoE layer (:func:`skew_router`): a skewed
    routing load for benchmarks (``graph-fsdp bench --moe-router-skew``); 0: the model's own."""

    def __post_init__(self) -> None:
        if self.router_skew and not self.model.is_moe:
            raise ValueError(
                f"router_skew={self.router_skew} skews MoE routers, but the model has no "
                "experts: set num_moe_experts (--num-experts N) or drop it"
            )
        if self.packing is None:
            return
        self.packing.check_budget(self.model.seq_length, "MCoreGPTConfig.seq_length")
        gm.check_packed_config(self.model)
        if self.engine != "graph_fsdp" or self.use_megatron_schedule:
            raise ValueError(
                "packed sequences run in graph_fsdp's loop (its per-token loss scale over the "
                f"step); engine={self.engine!r}, use_megatron_schedule="
                f"{self.use_megatron_schedule}: use engine='graph_fsdp' without "
                "use_megatron_schedule (drop --use-megatron-schedule)"
            )

    @property
    def recompute(self) -> bool:
        """Activation recompute: not wired for Megatron-Core models (graph_fsdp.training.adapters'
        make_optimizer reads it to refuse optimizer offload with recompute)."""
        return False


def batch(
    cfg: MCoreTrainConfig, step: int, rank: int, device, *, eval: bool = False, world_size: int = 1
):
    """``(tokens, labels)`` of microbatch ``step`` (``step * grad_accum + micro``; the step for
    eval) of ``rank``: from ``cfg.data_path`` (graph_fsdp.training.data.batch_for: ranks read disjoint
    samples), else synthetic tokens addressed by (seed, step, rank). Same data every run."""
    if cfg.data_path is not None:
        # MCoreTrainConfig has the fields batch_for reads (model.seq_length / vocab_size,
        # micro_batch_size, data_path).
        return batch_for(cfg, step, rank, device, eval=eval, world_size=world_size)
    m = cfg.model
    g = torch.Generator().manual_seed(
        (m.seed * 1_000_003 + step * 7919 + rank * 104729 + (1 << 20 if eval else 0)) % 2**63
    )
    seq = torch.randint(0, m.vocab_size, (cfg.micro_batch_size, m.seq_length + 1), generator=g)
    return seq[:, :-1].to(device), seq[:, 1:].contiguous().to(device)


def _setup(cfg: MCoreTrainConfig) -> torch.device:
    if cfg.deterministic:
        # warn_only: Megatron's unfused MoE permutation has ops without a deterministic CUDA
        # kernel; they warn instead of failing (eager and graphed runs use the same kernels).
        use_deterministic_kernels(warn_only=True)
    gm.init_parallel_state(
        expert_model_parallel_size=cfg.model.expert_model_parallel_size,
        tensor_model_parallel_size=cfg.model.tensor_model_parallel_size,
    )
    if torch.cuda.is_available() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def build_sharded(cfg: MCoreTrainConfig, device: torch.device):
    """The sharded model, its optimizer and step function (``step(i, rank) -> loss``)."""
    # TransformerConfig.bf16 follows the compute dtype graph_fsdp's policy gives the weights.
    model = dataclasses.replace(cfg.model, bf16=cfg.compute_dtype == torch.bfloat16)
    lm = gm.build_gpt(model if cfg.packing is None else gm.packed_model_config(model), device)
    if cfg.router_skew:
        gm.skew_router(lm, cfg.router_skew)
    if cfg.engine == "megatron_fsdp":
        if cfg.model.tensor_model_parallel_size != 1:
            raise ValueError(
                "engine='megatron_fsdp' compares data-parallel runs; tensor_model_parallel_size="
                f"{cfg.model.tensor_model_parallel_size} is wired for graph_fsdp's engine only"
            )
        if cfg.clip_grad > 0:
            raise ValueError(
                f"clip_grad={cfg.clip_grad} is wired for graph_fsdp's engine only (the global "
                "norm over its shards); the megatron_fsdp row trains unclipped: set clip_grad=0"
            )
        return _build_megatron_fsdp(cfg, lm, device)
    gm.shard_gpt(
        lm,
        strategy=cfg.strategy,
        mp_policy=cfg.mp,
        buffer_policy=cfg.buffers,
        separate_all_gather_group=cfg.separate_all_gather_group,
    )
    # graph_fsdp.training.adapters' optimizer: AdamW, or CPUOffloadOptimizer(AdamW) with an offload fraction.
    opt = make_optimizer(lm.parameters(), cfg)
    if cfg.checkpoint.load_path:
        load_checkpoint(cfg, lm, opt)
    return lm, opt


def _build_megatron_fsdp(cfg: MCoreTrainConfig, lm, device):
    from megatron.core.transformer.transformer_layer import TransformerLayer  # noqa: PLC0415 (optional dependency)
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415 (optional dependency)

    mesh = init_device_mesh(device.type, (dist.get_world_size(), 1), mesh_dim_names=("dp", "tp"))
    if cfg.mp.param_dtype is not None:
        lm = lm.to(cfg.mp.param_dtype)
    # Expert params (EP = 1) are sharded over the data-parallel mesh too; megatron_fsdp needs
    # it named as the expert mesh or it has no group for them.
    return megatron_fsdp_shard(lm, mesh, "dp", TransformerLayer, cfg, expt_device_mesh=mesh)


def _schedule_step(cfg: MCoreTrainConfig, lm, batches) -> torch.Tensor:
    from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: PLC0415 (optional dependency)

    out = get_forward_backward_func()(
        forward_step_func=gm.forward_step,
        data_iterator=iter(batches),
        model=[lm],
        num_microbatches=len(batches),
        seq_length=cfg.model.seq_length,
        micro_batch_size=cfg.micro_batch_size,
        forward_only=False,
    )
    return torch.stack([r["lm loss"] for r in out]).sum() / len(batches)


def _set_moe_aux_loss_scale(cfg: MCoreTrainConfig, device: torch.device) -> None:
    """Megatron's schedule scales the gradient of the MoE auxiliary losses by 1 / microbatches
    (``MoEAuxLossAutoScaler.set_loss_scale``), as it divides each microbatch's loss; graph_fsdp's
    loop divides its losses the same way, so it sets the same scale. One tensor, filled in
    place: captured graphs read it at a fixed address."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler  # noqa: PLC0415 (optional dependency)

    scale = 1.0 / cfg.grad_accum
    current = MoEAuxLossAutoScaler.main_loss_backward_scale
    if current is None or current.device != device:
        MoEAuxLossAutoScaler.main_loss_backward_scale = torch.full((1,), scale, device=device)
    else:
        current.fill_(scale)


def release_moe_dispatch_state(model: nn.Module) -> int:
    """Drop the tensors with an autograd graph that Megatron-Core's MoE token dispatchers keep
    from the last forward (``MoEAlltoAllTokenDispatcher.probs``,
    ``MoEAllGatherTokenDispatcher.local_probs``); returns how many were dropped. A dispatcher
    sets them again in its next forward, so this is safe between steps.

    [Note: MoE dispatchers keep the last routing] Those tensors keep the last forward's
    autograd graph alive. Its nodes are C++ objects, invisible to Python's garbage collector,
    and they reach the model: graph_fsdp's replay nodes hold their captured callable (which
    holds the module), TransformerEngine's graphed callables hold the parameters. So a model
    dropped after training was never collected - the cycle model -> dispatcher -> tensor ->
    graph node -> model runs through C++ - and its main weights and gradients stayed on the
    device: each later run in the process counted them in its peak memory (graph_fsdp's own
    backward handlers hold their state weakly for the same reason, state.py [Note: autograd
    holds FSDP states weakly]). graph_fsdp.integrations.megatron.moe's dispatcher keeps
    nothing past its combine.
    """
    dropped = 0
    for module in model.modules():
        disp = getattr(module, "token_dispatcher", None)
        if disp is None:
            continue
        for holder in (disp, getattr(disp, "_comm_manager", None)):
            for name, value in list(vars(holder).items()) if holder is not None else ():
                if isinstance(value, torch.Tensor) and value.grad_fn is not None:
                    setattr(holder, name, None)
                    dropped += 1
    return dropped


class MegatronFSDPTrainer(Trainer):
    """Megatron-FSDP's placement (``engine="megatron_fsdp"``, the comparison rows): its
    wrapper reduces every microbatch's gradients; clipping is refused (build_sharded)."""


class MCoreAdapter(DataParallelAdapter):
    """A Megatron-Core GPT under the loop: Megatron's parallel state, its model sharded by
    graph_fsdp (or megatron_fsdp), batches per data-parallel rank (the TP ranks of one read
    the same), graphs through :func:`graph_fsdp.integrations.megatron.build_graphs`, and
    optionally Megatron's forward/backward schedule for the microbatches."""

    def __init__(self, cfg: MCoreTrainConfig) -> None:
        super().__init__(cfg, packed_documents(cfg, cfg.model.vocab_size))
        self.start_bytes = None

    @property
    def model_name(self) -> str:
        return self.cfg.model_name

    def setup(self, rank: int, world_size: int) -> torch.device:
        cfg = self.cfg
        # Config-only rules of graph_fsdp's graphs first: nothing is built for a run that
        # cannot go.
        schedule = cfg.engine == "graph_fsdp" and cfg.use_megatron_schedule
        if schedule and cfg.graphs.verify:
            raise ValueError(
                "cuda_graph_verify checks a step of graph_fsdp's loop (graphs.forward_backward); "
                "use it without use_megatron_schedule"
            )
        if schedule and cfg.graphs.full_iteration:
            raise ValueError(
                "full_iteration replaces the forward/backward schedule with one graph per "
                "microbatch; use it without use_megatron_schedule"
            )
        device = _setup(cfg)
        if device.type == "cuda":
            # A previous run in this process (tests run several) leaves a model and graphs in
            # reference cycles: collect them so this run's peak memory is its own.
            gc.collect()
            torch.cuda.empty_cache()  # run_loop resets the peaks next
            self.start_bytes = torch.cuda.memory_allocated(device)
        # The TP ranks of a data-parallel rank read the same batches (megatron/tp.py).
        self.data_rank, self.data_world = megatron_tp.data_parallel_rank(rank, world_size)
        return device

    def build(self, device: torch.device, world_size: int) -> Trainer:
        cfg = self.cfg
        lm, opt = build_sharded(cfg, device)
        if cfg.model.is_moe and not cfg.use_megatron_schedule:  # the schedule sets it itself
            _set_moe_aux_loss_scale(cfg, device)
        if cfg.engine == "megatron_fsdp":
            return MegatronFSDPTrainer(lm, opt, loss_world=world_size, device=device)
        return ShardedTrainer(lm, opt, loss_world=world_size, device=device)

    def make_graphs(self, trainer: Trainer):
        if self.cfg.engine != "graph_fsdp":
            return None
        return gm.build_graphs(
            trainer.model,
            self.cfg.model,
            self.cfg.graphs,
            optimizer=trainer.optimizer,
            clip_grad=self.cfg.clip_grad,
        )

    def microbatches(self, step: int, device: torch.device):
        cfg = self.cfg
        return [
            [self._batch(step * cfg.grad_accum + m, self.data_rank, device)]
            for m in range(cfg.grad_accum)
        ]

    def fixed_batch(self, index: int, rank: int, device: torch.device, *, eval: bool):
        return batch(self.cfg, index, rank, device, eval=eval, world_size=self.data_world)

    def schedule(self, trainer: Trainer):
        if not self.cfg.use_megatron_schedule:
            return None
        return lambda batches: _schedule_step(
            self.cfg, trainer.model, [b for micro in batches for b in micro]
        )

    def finish(self, trainer: Trainer, graphs, result: dict) -> None:
        if self.start_bytes is not None:
            result["start_memory_bytes"] = self.start_bytes
        # Nothing of this run may outlive it: the graphs and their memory pool go now, and the
        # dispatchers' last routing with its autograd graph ([Note: MoE dispatchers keep the
        # last routing]), so the model is freed on return.
        if graphs is not None:
            graphs.close()
        release_moe_dispatch_state(trainer.model)
        # parallel_state stays initialised: the next run in this process reuses its groups
        # (re-creating them would build new NCCL communicators every run).


def run(rank: int, world_size: int, cfg: MCoreTrainConfig) -> dict:
    """Train ``cfg`` on this rank (graph_fsdp.training.loop.run_loop over :class:`MCoreAdapter`)."""
    return run_loop(MCoreAdapter(cfg), rank, world_size)
