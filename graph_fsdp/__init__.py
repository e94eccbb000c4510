"""graph_fsdp: a CUDA-graph-compatible FSDP engine (ZeRO-1/2/3) for PyTorch.

Folders by layer, each importing only those below it: ``cli``/``bench`` -> ``integrations`` ->
``training`` -> ``models`` -> ``capture``/``parallel`` -> ``fsdp`` -> ``buffers``.
"""

from graph_fsdp import _moved
from graph_fsdp.distributed import init_distributed
from graph_fsdp.fsdp.api import STRATEGIES, BufferPolicy, MixedPrecisionPolicy, placements_for
from graph_fsdp.fsdp.experts import expert_mesh_from_groups, init_expert_mesh, mark_expert_params
from graph_fsdp.fsdp.fully_shard import FSDPModule, fully_shard, synchronize_param_gather
from graph_fsdp.fsdp.grad_norm import clip_grad_norm_
from graph_fsdp.fsdp.offload import iter_full_params
from graph_fsdp.fsdp.state import TrainingState
from graph_fsdp.parallel.vocab_parallel import VocabParallelEmbedding, shard_embedding_by_vocab

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

# Old module paths (graph_fsdp.train, graph_fsdp.state, ...) still import, with a warning.
_moved.install()
