"""graph_fsdp's GPT/MoE model under the training loop (loop.py), for the CLI, the tests and
the benchmarks.

``run(rank, world_size, cfg)`` trains the reference model under graph_fsdp (or, with
``cfg.mode == "reference"``, an unsharded single-process mixed-precision reference on the
global batch: a placement of the same loop) and returns per-step losses, step times and final
full parameters.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.checkpoint import checkpoint

from graph_fsdp.capture import te_backend
from graph_fsdp.fsdp.experts import init_expert_mesh
from graph_fsdp.fsdp.fully_shard import fully_shard
from graph_fsdp.models import (
    GPTConfig,
    build_model,
    parallelize_gpt,
    partition_experts,
    sharding_units,
    transformer_layers,
)
from graph_fsdp.parallel.vocab_parallel import shard_embedding_by_vocab
from graph_fsdp.training.adapters import (
    DataParallelAdapter,
    make_optimizer,
    packed_documents,
    sharded_trainer,
)
from graph_fsdp.training.data import batch_for
from graph_fsdp.training.loop import LoopConfig, Trainer, run_loop, use_deterministic_kernels
from graph_fsdp.training.packing import PackingPolicy


@dataclass(kw_only=True)
class TrainConfig(LoopConfig):
    """graph_fsdp's GPT/MoE model (or the unsharded reference) under the training loop
    (loop.py); the loop's fields are :class:`~graph_fsdp.training.loop.LoopConfig`'s."""

    model: GPTConfig = field(default_factory=GPTConfig)
    """Model shape."""
    mode: str = "fsdp"
    """fsdp: graph_fsdp; reference: unsharded single-process model on the global batch."""
    mesh_shape: tuple[int, int] | None = None
    """HSDP: (replicate, shard) sizes of a 2-D device mesh over every rank (their product is
    the world size; e.g. (nodes, GPUs per node)). None: 1-D FSDP over every rank."""
    optim_over_replicas: bool = False
    """HSDP: shard the optimizer (main weights and grads) across the replicas as well."""
    expert_parallel: int | None = None
    """MoE models: partition the experts over expert-parallel groups of this many ranks and
    shard them over the expert-data-parallel group (world / this), the other parameters over
    the data-parallel group (graph_fsdp.fsdp.experts). None: experts are sharded like the rest."""
    vocab_parallel_embedding: bool = False
    """The input embedding sharded by vocabulary rows over the data-parallel group and never
    gathered: token ids and activations cross the group instead of the table
    (vocab_parallel.py [Note: vocab-parallel embedding]). The vocabulary must be a multiple
    of the world size; not with HSDP or tensor parallelism."""
    tensor_parallel: int | None = None
    """Dense models: torch DTensor tensor parallelism over groups of this many consecutive
    ranks (models/tp_plans.py ``parallelize_gpt``), then ``fully_shard`` of each TP rank's
    pieces over the data-parallel group (world / this): torchtitan's apply_tp -> apply_fsdp
    (tensor_parallel.py). The TP ranks of a data-parallel rank read the same batches. None: no
    TP."""
    sequence_parallel: bool = False
    """With tensor_parallel: the activations between the TP blocks (residual stream, norms)
    split over the sequence."""
    recompute: bool = False
    """Activation checkpointing of every transformer layer."""
    device: str = "cpu"
    """cpu or cuda."""
    packing: PackingPolicy | None = None
    """Packed variable-length documents (training/packing.py; models/packed.py [Note: packed
    sequences under CUDA graphs]): each microbatch row is a pack of ``packing.budget`` tokens
    (= ``model.seq_length``) holding up to ``packing.max_documents`` documents that attend
    only within themselves, with the per-token loss over the step. None: fixed rows."""
    eod_token_id: int | None = None
    """Packed documents from ``data_path``: the token that ends each document."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.packing is None:
            return
        self.packing.check_budget(self.model.seq_length, "GPTConfig.seq_length")
        refused = _given(self, "tensor_parallel") or (
            {"transformer_impl": self.model.transformer_impl}
            if self.model.transformer_impl != "local"
            else {}
        )
        if refused:
            raise ValueError(
                f"packed sequences are not supported with {refused}: the local layers without "
                "tensor parallelism take the document boundaries"
            )


def shard_model(model: nn.Module, cfg: TrainConfig) -> nn.Module:
    mp, bp = cfg.mp, cfg.buffers
    mesh = data_parallel_mesh(cfg)
    vocab_mesh = None
    if cfg.vocab_parallel_embedding:
        given = _given(cfg, "mesh_shape", "tensor_parallel")
        if given:
            raise ValueError(
                f"TrainConfig.vocab_parallel_embedding=True with {given}: the embedding's rows "
                "are split over every rank, which HSDP and tensor parallelism split otherwise; "
                "drop one of them"
            )
        vocab_mesh = vocab_parallel_mesh(cfg.device)
    if cfg.tensor_parallel is not None:  # apply_tp, then fully_shard over the other dimension
        tp_mesh = tensor_parallel_mesh(cfg)
        parallelize_gpt(model, tp_mesh["tp"], sequence_parallel=cfg.sequence_parallel)
        mesh = tp_mesh["dp"]
    placement = {
        "mesh": mesh,
        "strategy": cfg.strategy,
        "optim_over_replicas": cfg.optim_over_replicas,
        "separate_all_gather_group": cfg.separate_all_gather_group,
    }
    if cfg.expert_parallel is not None:
        if cfg.model.num_experts is None:
            raise ValueError(
                f"TrainConfig.expert_parallel={cfg.expert_parallel} needs an MoE model: set "
                "GPTConfig.num_experts (or leave expert_parallel None)"
            )
        expert_mesh = _cached_mesh(
            cfg.device,
            (dist.get_world_size() // cfg.expert_parallel, cfg.expert_parallel),
            ("edp", "ep"),
            lambda: init_expert_mesh(cfg.device, cfg.expert_parallel),
        )
        partition_experts(model, expert_mesh["ep"].get_group())
        placement["expert_mesh"] = expert_mesh  # units without experts ignore it
    for unit, reshard in sharding_units(model):
        fully_shard(
            unit, **placement, mp_policy=mp, buffer_policy=bp, reshard_after_forward=reshard
        )
    if vocab_mesh is not None:  # the root unit holds the embedding
        shard_embedding_by_vocab(model, "embedding", vocab_mesh["ep"].get_group())
        placement["expert_mesh"] = vocab_mesh
    return fully_shard(model, **placement, mp_policy=mp, buffer_policy=bp)


def _given(cfg: TrainConfig, *fields: str) -> dict:
    """Those of ``fields`` that ``cfg`` sets (not None), by name: for refusals."""
    return {f: getattr(cfg, f) for f in fields if getattr(cfg, f) is not None}


def vocab_parallel_mesh(device: str):
    """The ``(edp 1, ep world)`` expert mesh a vocab-parallel embedding's rows live on
    (vocab_parallel.py [Note: vocab-parallel embedding])."""
    world = dist.get_world_size()
    return _cached_mesh(device, (1, world), ("edp", "ep"), lambda: init_expert_mesh(device, world))


def tensor_parallel_size(cfg: TrainConfig) -> int:
    return cfg.tensor_parallel or 1


def check_tensor_parallel(cfg: TrainConfig, world_size: int) -> None:
    """TrainConfig.tensor_parallel / sequence_parallel against the rest of the run (the plan
    checks the model's shape: models/tp_plans.py)."""
    tp = cfg.tensor_parallel
    if cfg.sequence_parallel and tp is None:
        raise ValueError(
            "TrainConfig.sequence_parallel=True splits the sequence over the TP group, but "
            "tensor_parallel is None: set tensor_parallel (> 1) or sequence_parallel=False"
        )
    if tp is None:
        return
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1 or world_size % tp:
        raise ValueError(
            f"TrainConfig.tensor_parallel={tp!r} must be a positive divisor of the world size "
            f"{world_size} (the data-parallel size is world / tensor_parallel)"
        )
    given = _given(cfg, "mesh_shape", "expert_parallel")
    if given:
        raise ValueError(
            f"TrainConfig.tensor_parallel={tp} with {given}: a 3-D mesh (HSDP or expert "
            "parallelism with TP) is not wired in TrainConfig; drop one of them (HSDP + TP: "
            "fully_shard over a 3-D mesh, docs/tensor_parallel.md)"
        )


def tensor_parallel_mesh(cfg: TrainConfig):
    """The 2-D ``(dp, tp)`` DeviceMesh of ``cfg.tensor_parallel`` (consecutive ranks form a TP
    group)."""
    world = dist.get_world_size()
    check_tensor_parallel(cfg, world)
    shape, names = (world // cfg.tensor_parallel, cfg.tensor_parallel), ("dp", "tp")
    return _cached_mesh(
        cfg.device, shape, names, lambda: init_device_mesh(cfg.device, shape, mesh_dim_names=names)
    )


def placement_label(cfg: TrainConfig) -> str:
    """The strategy and, for HSDP, the mesh (and the EP and TP sizes, the vocab-parallel
    embedding): for summaries and reports."""
    ep = "" if cfg.expert_parallel is None else f", expert parallel {cfg.expert_parallel}"
    if cfg.vocab_parallel_embedding:
        ep += ", vocab-parallel embedding"
    if cfg.tensor_parallel is not None:
        sp = " with sequence parallel" if cfg.sequence_parallel else ""
        ep += f", tensor parallel {cfg.tensor_parallel}{sp}"
    if cfg.mesh_shape is None:
        return cfg.strategy + ep
    r, s = cfg.mesh_shape
    over = ", optimizer over replicas" if cfg.optim_over_replicas else ""
    return f"{cfg.strategy} HSDP replicate {r} x shard {s}{over}{ep}"


_MESHES: dict[tuple, tuple] = {}
"""(device type, shape, dimension names) -> (the default group it was built under, mesh):
runs in one process (compare, bench, tests) reuse one mesh instead of creating new process
groups each time."""


def data_parallel_mesh(cfg: TrainConfig):
    """The 2-D (replicate, shard) DeviceMesh of ``cfg.mesh_shape`` (None: 1-D, no mesh)."""
    if cfg.mesh_shape is None:
        return None
    shape = tuple(cfg.mesh_shape)
    world = dist.get_world_size()
    if len(shape) != 2 or min(shape) < 1 or shape[0] * shape[1] != world:
        raise ValueError(
            f"TrainConfig.mesh_shape={cfg.mesh_shape} must be (replicate, shard) sizes >= 1 "
            f"whose product is the world size {world}, e.g. (2, {world // 2}) or (1, {world})"
        )
    names = ("replicate", "shard")
    return _cached_mesh(
        cfg.device, shape, names, lambda: init_device_mesh(cfg.device, shape, mesh_dim_names=names)
    )


def _cached_mesh(device: str, shape: tuple, names: tuple, build):
    key = (device, shape, names)
    cached = _MESHES.get(key)
    if cached is None or cached[0] is not dist.group.WORLD:
        cached = _MESHES[key] = (dist.group.WORLD, build())
    return cached[1]


class MixedPrecisionReference(Trainer):
    """The unsharded reference as a placement of the loop: the compute-dtype model, fp32
    master weights and AdamW over them; each microbatch runs every rank's batch in turn."""

    checkpoints = False

    def __init__(self, model: nn.Module, cfg: TrainConfig, world_size: int = 1) -> None:
        self.params = [p for p in model.parameters()]
        self.master = [p.detach().float().clone().requires_grad_(True) for p in self.params]
        device = next(model.parameters()).device
        super().__init__(model, make_optimizer(self.master, cfg), loss_world=1, device=device)
        # MoE capacity is per microbatch, so concatenating the ranks' batches would route
        # tokens differently: each microbatch runs them one after another.
        self.batches_per_microbatch = world_size
        if cfg.mp.param_dtype is not None:
            model.to(cfg.mp.param_dtype)

    def grads_to_main(self) -> None:
        for m, p in zip(self.master, self.params):
            m.grad = p.grad.float() if p.grad is not None else None

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(self.master, max_norm)

    def optimizer_step(self) -> None:
        super().optimizer_step()
        with torch.no_grad():
            torch._foreach_copy_(self.params, self.master)
        for p in self.params:
            p.grad = None

    def full_params(self) -> dict[str, torch.Tensor]:
        names = [n for n, _ in self.model.named_parameters()]
        return {n: p.detach().float().cpu() for n, p in zip(names, self.master)}


def device_of(cfg: TrainConfig) -> torch.device:
    """The device this process trains on: the current CUDA device (launchers set it from
    LOCAL_RANK, so this is right on every node) or the CPU."""
    if cfg.device == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def checkpoint_layers(model: nn.Module) -> None:
    """Activation checkpointing (non-reentrant) around every transformer layer."""
    for layer in transformer_layers(model):
        forward = layer.forward

        def wrapped(*args, _f=forward, **kwargs):
            return checkpoint(_f, *args, use_reentrant=False, **kwargs)

        layer.forward = wrapped


def build_for(cfg: TrainConfig, device: torch.device, *, meta: bool = False) -> nn.Module:
    """The (unsharded) model ``cfg`` describes: seeded, with recompute when asked.

    ``meta``: on the meta device (no memory), for :func:`shard_model` to materialise one unit
    at a time ([Note: meta build]); only where :func:`builds_on_meta` says the weights come
    out the same."""
    torch.manual_seed(cfg.model.seed)
    if meta and not builds_on_meta(cfg):
        raise ValueError(
            f"build_for(meta=True) with {_meta_refusal(cfg)}: build it on {device} instead"
        )
    model = build_model(cfg.model, device="meta" if meta else device)
    if cfg.recompute:
        checkpoint_layers(model)
    return model


def builds_on_meta(cfg: TrainConfig) -> bool:
    """Whether :class:`GPTAdapter` builds ``cfg``'s model on the meta device.

    [Note: meta build] The reference GPT's weights depend only on the config's seed and each
    parameter's name (models/seeded.py), so a model built on the meta device and materialised
    by ``fully_shard`` unit by unit (``to_empty`` + ``reset_parameters``, then the unit is
    sharded and its full weights dropped) holds the same bits as one built whole: a rank's
    host or device memory holds one unsharded unit at a time, never the whole model. Not
    for TransformerEngine layers (initialised from the global RNG in construction order),
    tensor parallelism (the plan distributes materialised weights) or the vocab-parallel
    embedding (its rows are cut from a materialised table), nor for the unsharded reference.
    """
    return not _meta_refusal(cfg)


def _meta_refusal(cfg: TrainConfig) -> dict:
    """The settings of ``cfg`` that need a materialised build (see :func:`builds_on_meta`)."""
    out = _given(cfg, "tensor_parallel")
    if cfg.mode != "fsdp":
        out["mode"] = cfg.mode
    if cfg.model.transformer_impl != "local":
        out["transformer_impl"] = cfg.model.transformer_impl
    if cfg.vocab_parallel_embedding:
        out["vocab_parallel_embedding"] = True
    return out


def make_graphs(model: nn.Module, cfg: TrainConfig, optimizer: torch.optim.Optimizer | None = None):
    """The CUDA graph runner ``cfg`` asks for (None for eager runs): its GraphPolicy, after the
    TransformerEngine attention check of TE-layer models. The whole-step runner
    (``cfg.graphs.optimizer``) takes the ``optimizer``."""
    policy = cfg.graphs
    if policy.enabled and cfg.model.transformer_impl == "transformer_engine":
        # Before any step; the capture checks every TE attention call again (any model).
        te_backend.check_attention_capture(
            seq_length=cfg.model.seq_length,
            impl=policy.impl,
            scopes=list(policy.scopes),
            backend=te_backend.te_attention_backend_from_env(),
        )
    return policy.build(
        model, recompute=cfg.recompute, optimizer=optimizer, clip_grad=cfg.clip_grad
    )


class GPTAdapter(DataParallelAdapter):
    """graph_fsdp's GPT/MoE model under the loop: ``fully_shard`` on every rank, or the
    unsharded reference (``cfg.mode == "reference"``) on the global batch."""

    model_name = "gpt"

    def __init__(self, cfg: TrainConfig) -> None:
        super().__init__(cfg, packed_documents(cfg, cfg.model.vocab_size))
        self.reference = cfg.mode == "reference"
        self.document_tokens: list[int] = []
        """Packed runs: each step's document (non-padding) tokens on this rank, from the host."""

    def setup(self, rank: int, world_size: int) -> torch.device:
        cfg = self.cfg
        check_tensor_parallel(cfg, world_size)
        # The TP ranks of a data-parallel rank read the same batches ((dp, tp) mesh order).
        tp = tensor_parallel_size(cfg)
        self.data_rank, self.data_world = rank // tp, world_size // tp
        if cfg.deterministic:
            use_deterministic_kernels()
        return device_of(cfg)

    def build(self, device: torch.device, world_size: int) -> Trainer:
        cfg = self.cfg
        if self.reference:
            return MixedPrecisionReference(build_for(cfg, device), cfg, self.data_world)
        model = build_for(cfg, device, meta=builds_on_meta(cfg))  # [Note: meta build]
        shard_model(model, cfg)
        return sharded_trainer(model, cfg, device, world_size)

    def make_graphs(self, trainer: Trainer):
        return None if self.reference else make_graphs(trainer.model, self.cfg, trainer.optimizer)

    def microbatches(self, step: int, device: torch.device):
        # The reference sees every rank's microbatches as one global batch.
        ranks = range(self.data_world) if self.reference else [self.data_rank]
        accum = self.cfg.grad_accum
        if self.cfg.packing is not None:  # host-side count of the step's document tokens
            data, mbs = self._documents(), self.cfg.micro_batch_size
            self.document_tokens.append(
                sum(
                    data.document_tokens(
                        data.first_pack(mbs, step * accum + m, r, self.data_world), mbs
                    )
                    for m in range(accum)
                    for r in ranks
                )
            )
        for micro in range(accum):
            yield self._batches(step * accum + micro, ranks, device)

    def _batches(self, index: int, ranks, device: torch.device):
        for r in ranks:
            yield self._batch(index, r, device)

    def fixed_batch(self, index: int, rank: int, device: torch.device, *, eval: bool):
        return batch_for(self.cfg, index, rank, device, eval=eval, world_size=self.data_world)

    def finish(self, trainer: Trainer, graphs, result: dict) -> None:
        if self.cfg.packing is not None:
            result["document_tokens"] = list(self.document_tokens)


def run(rank: int, world_size: int, cfg: TrainConfig) -> dict:
    """Train ``cfg`` on this rank (graph_fsdp.training.loop.run_loop over :class:`GPTAdapter`)."""
    return run_loop(GPTAdapter(cfg), rank, world_size)
