"""graph_fsdp: a CUDA-graph-compatible FSDP engine (ZeRO-1/2/3) for PyTorch."""

from graph_fsdp.api import STRATEGIES, BufferPolicy, MixedPrecisionPolicy, placements_for
from graph_fsdp.distributed import init_distributed
from graph_fsdp.experts import expert_mesh_from_groups, init_expert_mesh, mark_expert_params
from graph_fsdp.fully_shard import FSDPModule, fully_shard, synchronize_param_gather
from graph_fsdp.grad_norm import clip_grad_norm_
from graph_fsdp.offload import iter_full_params
from graph_fsdp.state import TrainingState
from graph_fsdp.vocab_parallel import VocabParallelEmbedding, shard_embedding_by_vocab

__all__ = [
    "STRATEGIES",
    "BufferPolicy",
    "FSDPModule",
    "MixedPrecisionPolicy",
    "TrainingState",
    "VocabParallelEmbedding",
    "clip_grad_norm_",
    "expert_mesh_from_groups",
    "fully_shard",
    "init_distributed",
    "init_expert_mesh",
    "iter_full_params",
    "mark_expert_params",
    "placements_for",
    "shard_embedding_by_vocab",
    "synchronize_param_gather",
]
__version__ = "0.1.0"
