"""jax_distgemm: tensor-parallel collective matmuls for JAX (AllGather+GEMM, GEMM+ReduceScatter).

The fused path is an XLA FFI custom call (CUTLASS SM90 kernels on Hopper; a CPU executor that
runs the same rotation between fake CPU devices); a pure-XLA ppermute ring is the fallback.
"""

from jax_distgemm._src.api import all_gather_matmul as all_gather_matmul
from jax_distgemm._src.api import distributed_matmul as distributed_matmul
from jax_distgemm._src.api import IMPLEMENTATIONS as IMPLEMENTATIONS
from jax_distgemm._src.api import matmul_reduce_scatter as matmul_reduce_scatter
from jax_distgemm._src.multiprocess import initialize_multiprocess as initialize_multiprocess
from jax_distgemm._src.partitioning import collective_matmul as collective_matmul
from jax_distgemm._src.schedules import Schedule as Schedule

from jax_distgemm._src.runtime import clear_tuning as clear_tuning
from jax_distgemm._src.runtime import describe_tuning as describe_tuning
from jax_distgemm._src.runtime import load_tuning as load_tuning
from jax_distgemm._src.runtime import pending_error as pending_error
from jax_distgemm._src.runtime import reset as reset
from jax_distgemm._src.runtime import save_tuning as save_tuning

__version__ = "0.1.0"
