"""Parallelism with no global state: each role builds its own ParallelMesh and passes it around.

- `mesh.py`: ParallelMesh (dp × pp × tp over explicit ranks; tp fastest) and ProcessGroupCache.
- `collectives.py`: group-taking collectives, plain and differentiable (TP and sequence axis).
- `tensor_parallel.py`: column/row-parallel linears, vocab-parallel embedding, LM head.
- `vocab_parallel.py`: log-probs and entropy over vocab-sharded logits.
- `stages.py`: pipeline stage layout (even or uneven layers, virtual stages for interleaving).
- `p2p.py`: activation and gradient transfer between stages, shapes from the micro-batch assignment.
- `launch.py`: run a function on N local processes (tests, `rlhf verify-model`).
- `memory_probes.py`: a process's device and host memory, and what an NCCL communicator took.
"""

from rlhf.parallel.collectives import (
                                       copy_to_tp,
                                       gather_from_sequence,
                                       gather_from_tp,
                                       reduce_from_tp,
                                       reduce_scatter_to_sequence,
                                       scatter_to_sequence,
                                       scatter_to_tp,
)
from rlhf.parallel.launch import DistributedRunError, DistributedTimeoutError, run_distributed
from rlhf.parallel.mesh import ParallelMesh, ProcessGroupCache
from rlhf.parallel.tensor_parallel import (
                                       ColumnParallelLinear,
                                       ParallelLMHead,
                                       RowParallelLinear,
                                       VocabParallelEmbedding,
                                       shard_for_rank,
)
from rlhf.parallel.vocab_parallel import (
                                       padded_vocab_size,
                                       vocab_parallel_entropy,
                                       vocab_parallel_log_probs,
                                       vocab_shard_range,
)

__all__ = [
    "ColumnParallelLinear", "DistributedRunError", "DistributedTimeoutError", "ParallelLMHead",
    "ParallelMesh", "ProcessGroupCache", "RowParallelLinear", "VocabParallelEmbedding",
    "copy_to_tp", "gather_from_sequence", "gather_from_tp",
    "padded_vocab_size", "reduce_from_tp",
    "reduce_scatter_to_sequence", "run_distributed", "scatter_to_sequence", "scatter_to_tp",
    "shard_for_rank", "vocab_parallel_entropy", "vocab_parallel_log_probs", "vocab_shard_range",
]
