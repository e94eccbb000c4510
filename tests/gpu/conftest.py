"""GPU tests: NVLink multicast off (the GPU hosts' rule), set before any process group."""

import os

for var, value in (
    ("NCCL_NVLS_ENABLE", "0"),
    ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
    ("NVSHMEM_DISABLE_NVLS", "1"),
):
    os.environ.setdefault(var, value)
