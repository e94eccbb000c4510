"""Parallelism on top of the FSDP core: the vocabulary-parallel input embedding and the
reference model's expert dispatch. Expert meshes and tensor-parallel markings are described by
:mod:`graph_fsdp.fsdp.experts` and :mod:`graph_fsdp.fsdp.tensor_parallel`, which the core reads."""
