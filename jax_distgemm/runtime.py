"""Runtime controls of the CUDA executor: recovery after a timed-out wait and saved tuning.

Each is a no-op (or returns nothing) in a build without the CUDA executor.
"""

from jax_distgemm._src.runtime import clear_tuning as clear_tuning
from jax_distgemm._src.runtime import describe_tuning as describe_tuning
from jax_distgemm._src.runtime import load_tuning as load_tuning
from jax_distgemm._src.runtime import pending_error as pending_error
from jax_distgemm._src.runtime import reset as reset
from jax_distgemm._src.runtime import save_tuning as save_tuning
