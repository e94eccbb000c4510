"""Integrations with model libraries (import-guarded: ``import graph_fsdp`` never needs them).

- :mod:`graph_fsdp.integrations.megatron`: Megatron-Core ``GPTModel`` (dense and MoE, TE or
  local layer specs) under graph_fsdp, with Megatron's schedule hooks and
  ``--cuda-graph-scope``. Needs ``pip install -e ".[megatron]"``.
"""
