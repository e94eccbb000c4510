"""What a training run captures, and the rules every graph runner's configuration obeys.

:class:`GraphPolicy` is the one frozen value a training config holds for its graphs
(``LoopConfig.graphs``: ``TrainConfig``, ``MCoreTrainConfig``): the backend, the scopes,
the eager steps before capture, verification and communication graphs. Its rules are checked
in a fixed order, each by one function, so the command line (before any process starts) and
the library (before a runner is built) refuse the same settings with the same words:

1. ``__post_init__``: the values on their own - backend, scope names and combinations
   (scopes.py ``check_scopes``), the verify option, full_iteration's backend;
2. :meth:`GraphPolicy.check_config`: against the rest of the run - FSDP's buffers
   (scopes.py ``check_static_buffers``), activation recompute, steps past the warmup;
3. :meth:`GraphPolicy.build`: the runner (``LayerwiseGraphs`` / ``FullIterationGraphs`` /
   the whole-step ``WholeStepGraph``), whose ``check_capturable`` (step.py) checks the
   sharded model and its device.

Family rules (a TransformerEngine attention check, Megatron-Core's MoE scopes) run before
:meth:`build`, in the model adapter that knows the family (train.py, megatron/train.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from graph_fsdp.capture.full_iteration import FullIterationGraphs
from graph_fsdp.capture.layerwise import LayerwiseGraphs
from graph_fsdp.capture.scopes import (
    GRAPH_IMPLS,
    GraphConfigError,
    check_scopes,
    check_static_buffers,
    scope_label,
)
from graph_fsdp.capture.step import check_verify_option
from graph_fsdp.capture.whole_step import StepPolicy, WholeStepGraph
from graph_fsdp.fsdp.api import BufferPolicy


def capture_impl(impl: str, scopes) -> str:
    """The backend a run with ``impl`` and ``scopes`` captures with: full_iteration is always
    captured with torch.cuda graphs (FSDP's collectives inside), the rest with ``impl``
    (bench rows, compare runs and the train command map a layerwise backend this way)."""
    return "torch" if impl != "none" and "full_iteration" in scopes else impl


@dataclass(frozen=True, kw_only=True)
class GraphPolicy:
    """CUDA graphs of a training run (``impl="none"``: eager, the other fields unused)."""

    impl: str = "none"
    """none | torch | te: the capture backend (full_iteration is captured with torch)."""
    scopes: tuple[str, ...] = ()
    """Megatron's scopes: () whole layer, attn, mlp, moe, moe_router, moe_preprocess,
    full_iteration."""
    warmup_steps: int = 2
    """Eager training steps before the capture."""
    verify: bool | str = False
    """Check the first graphed step against an eager run of it (verify.py): False, True
    (record, warn on a difference) or "raise"."""
    comm_graphs: bool = True
    """Layerwise graphs: each unit's gather and reduction kernels replay as CUDA graphs of
    their own (comm_graphs.py)."""
    scope_modules: dict[str, list[str]] = field(default_factory=dict)
    """Scope -> submodule paths relative to each FSDP unit (replacing a scope's presets or
    defining a new scope)."""
    optimizer: bool = False
    """The whole training step as one graph (whole_step.py ``WholeStepGraph``): every
    microbatch, the reductions, clipping by the global norm, the optimizer step with an
    Inf/NaN skip on the device and the zeroing - one replay per step. Needs full_iteration;
    with ``impl="none"`` the same step runs eagerly (its bit-exact twin)."""
    overlap_next_gather: bool = False
    """With ``optimizer``: the step updates the next forward's first units first and queues
    their next-step gathers under the rest of the optimizer step (``StepPolicy.
    overlap_next_gather``, next_gather.py [Note: the next step's gathers in the step graph])."""
    norm_beside_last_reduction: bool = False
    """With ``optimizer``: the global norm over the gradients reduced before the step's last
    reduction runs beside it (``StepPolicy.norm_beside_last_reduction``, grad_norm.py [Note:
    the norm beside the last reduction])."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "scopes", tuple(self.scopes))
        if self.impl not in GRAPH_IMPLS:
            raise GraphConfigError(
                f"cuda_graph_impl={self.impl!r}: choose one of {', '.join(GRAPH_IMPLS)} "
                "(--cuda-graph-impl)"
            )
        if self.optimizer:
            self._check_whole_step()
        elif self.overlap_next_gather:
            raise GraphConfigError(
                "--cuda-graph-overlap-next-gather (overlap_next_gather=True) queues the next "
                "step's gathers inside the whole-step graph's optimizer step: add "
                "--cuda-graph-optimizer (optimizer=True), or drop it"
            )
        elif self.norm_beside_last_reduction:
            raise GraphConfigError(
                "--cuda-graph-norm-beside-last-reduction (norm_beside_last_reduction=True) "
                "moves the whole-step graph's gradient norm: add --cuda-graph-optimizer "
                "(optimizer=True), or drop it"
            )
        if not self.enabled:
            return
        check_scopes(self.scopes, scope_modules=self.scope_modules)
        check_verify_option(self.verify)
        if self.full_iteration and self.impl != "torch":
            raise GraphConfigError(
                f"cuda_graph_scope full_iteration is captured with torch.cuda graphs, not "
                f"cuda_graph_impl={self.impl!r}: use --cuda-graph-impl torch"
            )

    def _check_whole_step(self) -> None:
        if self.scopes not in ((), ("full_iteration",)) or self.enabled and not self.scopes:
            raise GraphConfigError(
                f"--cuda-graph-optimizer (cuda_graph_optimizer=True) puts the optimizer step "
                f"inside the full_iteration graph, but the scopes are "
                f"{scope_label(self.scopes)}: use --cuda-graph-scope full_iteration (layerwise "
                "graphs keep the optimizer eager), or drop --cuda-graph-optimizer"
            )
        if self.verify:
            raise GraphConfigError(
                "--cuda-graph-verify checks a forward+backward graph against its eager run; "
                "the whole-step graph (--cuda-graph-optimizer) has no such check: drop one of them"
            )

    def check_optimizer(self, *, fused: bool, offload_fraction: float = 0.0) -> None:
        """The optimizer the command line builds (AdamW) against the whole-step graph: its
        update and Inf/NaN skip need ``AdamW(fused=True)`` on the device (step_optimizer.py
        [Note: optimizers in the step graph])."""
        if not self.optimizer:
            return
        if offload_fraction > 0:
            raise GraphConfigError(
                "--cuda-graph-optimizer captures the optimizer step on the device, but "
                "--optimizer-cpu-offload steps part of it on the CPU, which no CUDA graph can "
                "hold: drop one of them"
            )
        if not fused:
            raise GraphConfigError(
                "--cuda-graph-optimizer needs AdamW(fused=True): the fused kernel reads the "
                "learning rate from the device and takes the Inf/NaN skip (found_inf); drop "
                "--no-fused-adamw (or --cuda-graph-optimizer)"
            )

    @property
    def enabled(self) -> bool:
        return self.impl != "none"

    @property
    def full_iteration(self) -> bool:
        return "full_iteration" in self.scopes

    def check_config(
        self,
        buffers: BufferPolicy,
        *,
        recompute: bool = False,
        steps: int | None = None,
        flag: str = "--cuda-graph-scope",
    ) -> None:
        """The rules against the rest of the run (no model needed): FSDP's buffers keep
        static addresses, no activation recompute inside layerwise graphs, and more training
        ``steps`` than eager warmup steps. (The command line calls the three in its own
        order: environment errors come before advice on buffer flags.)"""
        self.check_recompute(recompute, flag=flag)
        if steps is not None:
            self.check_steps(steps)
        self.check_buffers(buffers, flag=flag)

    def check_buffers(self, buffers: BufferPolicy, *, flag: str = "--cuda-graph-scope") -> None:
        if self.enabled:
            check_static_buffers(buffers, self.scopes, flag=flag)

    def check_recompute(self, recompute: bool, *, flag: str = "--cuda-graph-scope") -> None:
        if self.enabled and recompute and not self.full_iteration:
            raise GraphConfigError(
                f"--recompute-activations re-runs layer forwards inside backward, which "
                f"layerwise CUDA graphs ({flag} {scope_label(self.scopes)}) do not capture "
                "(recompute=True): drop --recompute-activations, use --cuda-graph-scope "
                "full_iteration, or --cuda-graph-impl none"
            )

    def check_steps(self, steps: int, *, given: str | None = None) -> None:
        """``steps`` training steps (``given``: how the message names them, e.g.
        ``"--train-iters 10"``) must reach a graphed step."""
        if self.enabled and steps <= self.warmup_steps:
            raise GraphConfigError(
                f"{given or f'steps={steps}'} must exceed --cuda-graph-warmup-steps "
                f"{self.warmup_steps}, or no step ever runs graphed"
            )

    def build(
        self,
        model: nn.Module,
        *,
        recompute: bool = False,
        optimizer: torch.optim.Optimizer | None = None,
        clip_grad: float = 0.0,
    ):
        """The runner this policy asks for over the ``fully_shard``-ed ``model`` (None when
        eager); the runner checks the model (step.py ``check_capturable``). The whole-step
        runner (``optimizer=True``) takes the ``optimizer`` and clips to ``clip_grad`` (0:
        off); it checks that the optimizer can run there (step_optimizer.py)."""
        if self.optimizer:
            if optimizer is None:
                raise GraphConfigError(
                    "GraphPolicy(optimizer=True) steps the optimizer inside its graph: pass "
                    "build(..., optimizer=the model's optimizer)"
                )
            return WholeStepGraph(
                model,
                optimizer,
                policy=StepPolicy(
                    clip_grad=clip_grad if clip_grad > 0 else None,
                    overlap_next_gather=self.overlap_next_gather,
                    norm_beside_last_reduction=self.norm_beside_last_reduction,
                ),
                warmup_steps=self.warmup_steps,
                eager=not self.enabled,
            )
        if not self.enabled:
            return None
        if self.full_iteration:
            return FullIterationGraphs(model, warmup_steps=self.warmup_steps, verify=self.verify)
        self.check_recompute(recompute)
        return LayerwiseGraphs(
            model,
            impl=self.impl,
            scopes=list(self.scopes),
            warmup_steps=self.warmup_steps,
            scope_modules=self.scope_modules or None,
            verify=self.verify,
            comm_graphs=self.comm_graphs,
        )
