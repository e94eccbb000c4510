"""Benchmarks and profiling behind ``graph-fsdp bench`` and ``graph-fsdp profile``.

``peers`` runs torch FSDP2 (eager and CUDA-graphed), Megatron-FSDP and the unsharded
reference on the reference model; ``runner`` runs every row in one launch; ``verdicts``
measures each row's own peak memory and fails graphed rows that did not replay; ``report``
writes markdown/JSON/PNG; ``provenance`` stamps results and GPU logs with the git commit;
``trace`` summarises torch profiler traces; ``profiling`` is the profiled loop.
"""
