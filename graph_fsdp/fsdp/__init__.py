"""The FSDP core: ``fully_shard``, unit state and hooks, flat parameter groups, reductions,
collectives, policies, gradient norms, checkpoints and offload.

It knows no model library and never imports :mod:`graph_fsdp.capture`: capture reads the core
through :class:`~graph_fsdp.fsdp.capture_context.CaptureContext` and the hook markers of
:mod:`graph_fsdp.fsdp.hook_markers`. Expert and tensor-parallel *layouts* live here because the
core shards, reduces, checkpoints and takes norms by them; the modules that set up those
layouts for a model are in :mod:`graph_fsdp.parallel`.
"""
