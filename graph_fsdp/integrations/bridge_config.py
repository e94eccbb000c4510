"""Configuration checks that users of Megatron-Bridge meet, made before any process starts.

Megatron-Bridge validates its FSDP settings at start (``use_megatron_fsdp`` and
``use_torch_fsdp2`` exclude each other, ``use_tp_pp_dp_mapping`` is unsupported, the
checkpoint format must be the sharded one, CPU offload needs one pipeline stage and no
activation recompute). :func:`validate_fsdp_config` applies the same rules to graph_fsdp,
with Bridge's field names, so a recipe that sets graph_fsdp gets every mistake reported at
once, at start - not after hours of training when the first checkpoint is written::

    validate_fsdp_config(use_graph_fsdp=True, ckpt_format="torch_dist")
    # FSDPConfigError: ckpt_format='torch_dist' ...: use ckpt_format='fsdp_dtensor'

Pure logic: no torch.distributed, no CUDA, no Megatron import.
"""

from __future__ import annotations

from graph_fsdp.capture.scopes import GraphConfigError, check_scopes, check_static_buffers
from graph_fsdp.fsdp.api import BufferPolicy

DCP_CKPT_FORMATS = ("fsdp_dtensor", "torch_dcp")
"""Checkpoint formats graph_fsdp writes: sharded torch.distributed.checkpoint (DCP)
directories. ``fsdp_dtensor`` is Megatron-Bridge's name for the FSDP DCP format."""

REJECTED_CKPT_FORMATS = {
    "torch_dist": "Megatron's distributed format (megatron.core.dist_checkpointing)",
    "torch": "one unsharded torch.save file per rank",
    "zarr": "Megatron's zarr sharded format",
}


class FSDPConfigError(ValueError):
    """An invalid FSDP configuration; the message names every field to change."""


def validate_fsdp_config(
    *,
    use_graph_fsdp: bool = True,
    use_torch_fsdp2: bool = False,
    use_megatron_fsdp: bool = False,
    use_tp_pp_dp_mapping: bool = False,
    ckpt_format: str | None = None,
    save: str | None = None,
    load: str | None = None,
    cpu_offload: bool = False,
    pipeline_model_parallel_size: int = 1,
    recompute_granularity: str | None = None,
    cuda_graph_impl: str = "none",
    cuda_graph_scope: list[str] | tuple[str, ...] = (),
    buffer_policy: BufferPolicy | None = None,
) -> None:
    """Reject FSDP settings graph_fsdp cannot honour; all problems in one error.

    Field names are Megatron-Bridge's (``cfg.dist.*``, ``cfg.ddp.*``, ``cfg.checkpoint.*``,
    ``cfg.model.*``). ``ckpt_format=None`` means no checkpointing is configured;
    ``recompute_granularity`` is ``None``, ``"full"`` or ``"selective"``; ``cpu_offload`` is
    Bridge's activation CPU offloading (``model.cpu_offloading``), whose rules these are
    (optimizer-state offload, graph_fsdp.fsdp.optim_offload, has its own check).
    """
    problems: list[str] = []
    if not use_graph_fsdp:
        return
    if use_torch_fsdp2:
        problems.append(
            "use_graph_fsdp and use_torch_fsdp2 are both set: they are two FSDP engines for the "
            "same model and exclude each other; set use_torch_fsdp2=False"
        )
    if use_megatron_fsdp:
        problems.append(
            "use_graph_fsdp and use_megatron_fsdp are both set: they are two FSDP engines for "
            "the same model and exclude each other; set use_megatron_fsdp=False"
        )
    if use_tp_pp_dp_mapping:
        problems.append(
            "use_tp_pp_dp_mapping=True is not supported with graph_fsdp (its data-parallel "
            "group is the default tp-cp-ep-dp-pp rank order); set use_tp_pp_dp_mapping=False"
        )
    problems += _checkpoint_problems(ckpt_format, save, load)
    if cpu_offload:
        if pipeline_model_parallel_size != 1:
            problems.append(
                f"CPU offload needs pipeline_model_parallel_size=1, got "
                f"{pipeline_model_parallel_size}: set it to 1 or turn cpu_offload off"
            )
        if recompute_granularity is not None:
            problems.append(
                f"CPU offload cannot be combined with activation recompute "
                f"(recompute_granularity={recompute_granularity!r}): set "
                "recompute_granularity=None or turn cpu_offload off"
            )
    if cuda_graph_impl != "none":
        try:
            check_scopes(list(cuda_graph_scope), flag="cuda_graph_scope")
            check_static_buffers(
                buffer_policy or BufferPolicy(), list(cuda_graph_scope), flag="cuda_graph_scope"
            )
        except GraphConfigError as err:
            problems.append(str(err))
    if problems:
        raise FSDPConfigError(
            "invalid graph_fsdp configuration:\n" + "\n".join(f"  - {p}" for p in problems)
        )


def _checkpoint_problems(ckpt_format: str | None, save: str | None, load: str | None) -> list[str]:
    if ckpt_format is None:
        if save or load:
            return [
                f"checkpointing is configured (save={save!r}, load={load!r}) without "
                f"ckpt_format; set ckpt_format='fsdp_dtensor' (graph_fsdp writes DCP)"
            ]
        return []
    if ckpt_format in DCP_CKPT_FORMATS:
        return []
    what = REJECTED_CKPT_FORMATS.get(ckpt_format, "not a format graph_fsdp knows")
    return [
        f"ckpt_format={ckpt_format!r} ({what}) is not supported: graph_fsdp saves and loads "
        "sharded torch.distributed.checkpoint (DCP) directories; set "
        f"ckpt_format='fsdp_dtensor' (--ckpt-format fsdp_dtensor; accepted: "
        f"{', '.join(DCP_CKPT_FORMATS)})"
    ]
