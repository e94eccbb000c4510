"""Benchmarks and profiling behind ``graph-fsdp bench`` and ``graph-fsdp profile``.

``peers`` runs torch FSDP2 (eager and CUDA-graphed), Megatron-FSDP and the unsharded
reference on the reference model; ``runner`` runs every row in one launch; ``report`` writes
markdown/JSON/PNG; ``trace`` summarises torch profiler traces; ``profiling`` is the
profiled loop.
"""
