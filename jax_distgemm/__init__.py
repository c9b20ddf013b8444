"""jax_distgemm: tensor-parallel collective matmuls for JAX (AllGather+GEMM, GEMM+ReduceScatter).

The ops run inside `jax.shard_map` on local shards; `collective_matmul` takes globally sharded
arrays and picks the schedule from their shardings.  The Flax NNX layers are in
`jax_distgemm.nnx` (needs Flax), the runtime controls in `jax_distgemm.runtime`.
"""

from jax_distgemm import runtime as runtime
from jax_distgemm._src.api import all_gather_matmul as all_gather_matmul
from jax_distgemm._src.api import distributed_matmul as distributed_matmul
from jax_distgemm._src.api import matmul_reduce_scatter as matmul_reduce_scatter
from jax_distgemm._src.collective import collective_matmul as collective_matmul
from jax_distgemm._src.fp8 import dequantize as dequantize
from jax_distgemm._src.fp8 import quantize as quantize
from jax_distgemm._src.multiprocess import initialize_multiprocess as initialize_multiprocess
from jax_distgemm._src.schedules import Schedule as Schedule

__version__ = "0.2.0"

_IN_RUNTIME = ("reset", "pending_error", "save_tuning", "load_tuning", "clear_tuning",
               "describe_tuning")


def __getattr__(name: str):
  if name == "nnx":  # imports Flax: only when asked for
    import importlib  # pylint: disable=g-import-not-at-top
    return importlib.import_module("jax_distgemm.nnx")
  if name in _IN_RUNTIME:
    raise AttributeError(f"jax_distgemm.{name} is jax_distgemm.runtime.{name}")
  raise AttributeError(f"module 'jax_distgemm' has no attribute {name!r}")
