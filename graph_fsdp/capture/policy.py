"""What a training run captures, and the rules every graph runner's configuration obeys.

:class:`GraphPolicy` is the one frozen value a training config holds for its graphs
(``TrainConfig.graph_policy``, ``MCoreTrainConfig.graph_policy``): the backend, the scopes,
the eager steps before capture, verification and communication graphs. Its rules are checked
in a fixed order, each by one function, so the command line (before any process starts) and
the library (before a runner is built) refuse the same settings with the same words:

1. ``__post_init__``: the values on their own - backend, scope names and combinations
   (scopes.py ``check_scopes``), the verify option, full_iteration's backend;
2. :meth:`GraphPolicy.check_config`: against the rest of the run - FSDP's buffers
   (scopes.py ``check_static_buffers``), activation recompute, steps past the warmup;
3. :meth:`GraphPolicy.build`: the runner (``LayerwiseGraphs`` / ``FullIterationGraphs``),
   whose ``check_capturable`` (step.py) checks the sharded model and its device.

Family rules (a TransformerEngine attention check, Megatron-Core's MoE scopes) run before
:meth:`build`, in the model adapter that knows the family (train.py, megatron_train.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from graph_fsdp.api import BufferPolicy
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

    def __post_init__(self) -> None:
        object.__setattr__(self, "scopes", tuple(self.scopes))
        if self.impl not in GRAPH_IMPLS:
            raise GraphConfigError(
                f"cuda_graph_impl={self.impl!r}: choose one of {', '.join(GRAPH_IMPLS)} "
                "(--cuda-graph-impl)"
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

    def build(self, model: nn.Module, *, recompute: bool = False):
        """The runner this policy asks for over the ``fully_shard``-ed ``model`` (None when
        eager); the runner checks the model (step.py ``check_capturable``)."""
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
