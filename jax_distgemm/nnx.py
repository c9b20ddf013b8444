"""Flax NNX tensor-parallel linear layers backed by the collective matmuls.

Megatron-style sequence parallelism on a mesh with a tensor-parallel axis ("tp") and,
optionally, a data-parallel one ("data"); activations are [batch, seq, features] (any number of
leading dims; the first is data-sharded when the mesh has the batch axis):

  layer                  input                     kernel            output
  ColumnParallelLinear   [B, S/tp, in]  (seq-par)  [in, out/tp]      [B, S, out/tp]
                         AllGather1D_TilingCD_RotatingA: out = AG_seq(x) @ kernel (+ bias/tp)
  RowParallelLinear      [B, S, in/tp]             [in/tp, out]      [B, S/tp, out]  (seq-par)
                         ReduceScatter1D_TilingA_RotatingC: out = RS_seq(x @ kernel) (+ bias)

so Column -> activation -> Row is the Megatron MLP block (`ParallelMLP`) with no other
collective: its output has its input's layout.  Gradients go through the custom VJP of the ops
(the backward of each layer runs the other layer's fused collective).  Parameters carry their
sharding as metadata (nnx.with_partitioning), so they are created sharded under a mesh.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.nnx.nn import dtypes as nnx_dtypes
from jax.sharding import PartitionSpec as P

from jax_distgemm._src import api, config, partitioning
from jax_distgemm._src.schedules import Schedule

default_kernel_init = nnx.initializers.lecun_normal()
default_bias_init = nnx.initializers.zeros_init()


class _ByIdentity:
  """A callable that hashes and compares by the function it wraps: the layout cache
  (_sharded_linear) hashes the op, and a callable may have no hash (a dataclass with
  __call__)."""

  def __init__(self, fn: Callable):
    self.fn = fn

  def __call__(self, *args, **kwargs):
    return self.fn(*args, **kwargs)

  def __hash__(self):
    return id(self.fn)

  def __eq__(self, other):
    return isinstance(other, _ByIdentity) and other.fn is self.fn


def _per_shard_op(implementation) -> Callable:
  """The injected implementation as fn(x, w, *, axis_name, schedule, out_dtype) per shard."""
  if callable(implementation):
    return implementation if _hashable(implementation) else _ByIdentity(implementation)
  if not (implementation is None or isinstance(implementation, str)):
    raise TypeError(f"implementation: expected a name, None or a callable, got "
                    f"{implementation!r}")
  if implementation is not None and implementation not in api.IMPLEMENTATIONS:
    raise ValueError(f"implementation: expected one of {api.IMPLEMENTATIONS}, None or a "
                     f"callable, got {implementation!r}")
  return _named_op(implementation)


def _hashable(fn) -> bool:
  try:
    hash(fn)
  except TypeError:
    return False
  return True


@functools.lru_cache(maxsize=None)
def _named_op(implementation: str | None) -> Callable:
  return functools.partial(api.distributed_matmul, implementation=implementation)


@functools.lru_cache(maxsize=256)
def _sharded_linear(mesh, op, schedule: Schedule, axis: str, x_spec: P, w_spec: P,
                    b_spec: P | None, out_spec: P, out_dtype):
  """jit(shard_map(op + bias)) for one layout (jit even when called eagerly: primitives.py's
  FFI op cannot be compiled on its own by an eager shard_map)."""

  def body(x, w, b):
    y = op(x, w, axis_name=axis, schedule=schedule, out_dtype=out_dtype)
    return y if b is None else y + b.astype(y.dtype)

  specs = (x_spec, w_spec, b_spec)
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=out_spec))


_DEFAULT_BATCH_AXIS = "data"


def _names(batch_axis) -> tuple[str, ...]:
  return () if batch_axis is None else (batch_axis,) if isinstance(batch_axis, str) else (
      tuple(batch_axis))


class _ParallelLinear(nnx.Module):
  """Shared code of the two layers; see their docstrings."""

  schedule: Schedule
  # NOTE: private (leading _): nnx.tabulate wraps every public function of the class, and a
  # wrapped staticmethod then gets self too (its failure left the classes broken).
  _kernel_sharding: Callable[[str], tuple]
  _bias_sharding: Callable[[str], tuple]

  def __init__(self, in_features: int, out_features: int, *, use_bias: bool = True,
               dtype: Any = None, param_dtype: Any = jnp.float32,
               kernel_init=default_kernel_init, bias_init=default_bias_init,
               implementation: str | None | Callable = None, axis: str = "tp",
               batch_axis: str | tuple[str, ...] | None = _DEFAULT_BATCH_AXIS,
               mesh: jax.sharding.Mesh | None = None,
               rngs: nnx.Rngs):
    for name, v in (("in_features", in_features), ("out_features", out_features)):
      if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
        raise ValueError(f"{type(self).__name__}: {name} must be a positive integer, got {v!r}")
    if isinstance(batch_axis, list):
      batch_axis = tuple(batch_axis)
    if batch_axis is not None and not (isinstance(batch_axis, str) or (
        isinstance(batch_axis, tuple) and batch_axis
        and all(isinstance(a, str) for a in batch_axis))):
      raise TypeError(f"{type(self).__name__}: batch_axis must be a mesh axis name, a tuple of "
                      f"them or None, got {batch_axis!r}")
    names = _names(batch_axis)
    if len(set(names)) != len(names):
      raise ValueError(f"{type(self).__name__}: batch_axis {batch_axis!r} names an axis twice")
    if axis in names:
      raise ValueError(f"{type(self).__name__}: batch_axis and axis must be different mesh "
                       f"axes (the batch dim and the sequence dim cannot both be sharded over "
                       f"{axis!r}); pass batch_axis=None for no data-parallel axis")
    self.in_features, self.out_features = int(in_features), int(out_features)
    self.use_bias, self.dtype, self.param_dtype = use_bias, dtype, param_dtype
    self.axis, self.batch_axis, self.mesh = axis, batch_axis, mesh
    self.implementation = implementation
    _per_shard_op(implementation)  # fail early on a bad value
    if mesh is not None:
      self._mesh()  # the axis must be one of the mesh's
    kinit = nnx.with_partitioning(kernel_init, self._kernel_sharding(axis), mesh=mesh)
    self.kernel = nnx.Param(kinit(rngs.params(), (self.in_features, self.out_features),
                                  param_dtype))
    if use_bias:
      binit = nnx.with_partitioning(bias_init, self._bias_sharding(axis), mesh=mesh)
      self.bias = nnx.Param(binit(rngs.params(), (self.out_features,), param_dtype))
    else:
      self.bias = None

  def _mesh(self):
    mesh = self.mesh if self.mesh is not None else jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty:
      raise ValueError(f"{type(self).__name__}: no mesh; pass mesh= or call it under "
                       "jax.set_mesh(mesh)")
    if self.axis not in mesh.axis_names:
      raise ValueError(f"{type(self).__name__}: axis {self.axis!r} is not an axis of the "
                       f"mesh {tuple(mesh.axis_names)}")
    return mesh

  def _x_spec(self, ndim: int, mesh) -> P:
    if ndim < 2:
      raise ValueError(f"{type(self).__name__}: input must have rank >= 2 ([..., seq, "
                       f"features]), got rank {ndim}")
    batch = [None] * (ndim - 2)
    names = _names(self.batch_axis)
    if missing := [a for a in names if a not in mesh.axis_names]:
      if self.batch_axis != _DEFAULT_BATCH_AXIS:  # the default is "data" where the mesh has it
        raise ValueError(f"{type(self).__name__}: batch_axis {self.batch_axis!r}: {missing} "
                         f"not an axis of the mesh {tuple(mesh.axis_names)}")
      names = ()
    if batch and names:
      batch[0] = self.batch_axis
    if idle := [a for a, n in zip(mesh.axis_names, mesh.axis_sizes)
                if n > 1 and a != self.axis and a not in (names if batch else ())]:
      how = (f"add them to batch_axis, e.g. batch_axis={tuple(names) + tuple(idle)!r}" if batch
             else "the input has no batch dim to shard over them")
      config.warn_once(("nnx idle axes", type(self).__name__, tuple(idle), bool(batch)),
                       "jax_distgemm.nnx.%s: the mesh axes %s shard neither the batch nor %r, "
                       "so every replica along them computes the same layer (%s)",
                       type(self).__name__, idle, self.axis, how)
    return self._input_spec(batch)

  def __call__(self, x):
    """Applies the layer to x (global array); see the class docstring for the layouts."""
    mesh = self._mesh()
    if x.shape[-1] != self.in_features:
      raise ValueError(f"{type(self).__name__}: input has {x.shape[-1]} features, the layer "
                       f"expects {self.in_features}")
    kernel = self.kernel[...]
    bias = self.bias[...] if self.bias is not None else None
    x, kernel, bias = nnx_dtypes.promote_dtype((x, kernel, bias), dtype=self.dtype)
    x_spec = self._x_spec(x.ndim, mesh)
    w_spec = P(*self._kernel_sharding(self.axis))
    # The rule table of collective_matmul confirms the layer's layout and gives out's spec.
    p = partitioning.plan(x_spec, w_spec, None, x_ndim=x.ndim, w_ndim=2, axis=self.axis)
    if p.schedule != self.schedule:
      raise AssertionError(f"layout {x_spec}, {w_spec} planned as {p.schedule}: {p.reason}")
    b_spec = P(*self._bias_sharding(self.axis)) if bias is not None else None
    f = _sharded_linear(mesh, _per_shard_op(self.implementation), self.schedule, self.axis,
                        x_spec, w_spec, b_spec, p.out_spec, jnp.dtype(x.dtype))
    if partitioning.all_explicit(mesh):
      # NOTE: shard_map refuses an input whose Explicit sharding differs from in_specs (under
      # Auto axes XLA reshards it), so the layer lays out its operands itself, as a matmul
      # would; a no-op when they already have the layout.
      x, kernel = (partitioning.reshard(x, x_spec, mesh),
                   partitioning.reshard(kernel, w_spec, mesh))
      bias = None if bias is None else partitioning.reshard(bias, b_spec, mesh)
    return f(x, kernel, bias)


class ColumnParallelLinear(_ParallelLinear):
  """Column-parallel linear layer with a sequence-parallel input (AllGather + GEMM).

  y [..., S, out/tp] = all_gather_seq(x [..., S/tp, in]) @ kernel [in, out/tp] + bias [out/tp]
  (AllGather1D_TilingCD_RotatingA); the backward runs GEMM + ReduceScatter for dx.

  Args:
    in_features, out_features: kernel shape [in_features, out_features] (out_features
      divisible by the tp size; the sequence length by it too).
    use_bias: add a bias [out_features], sharded like the kernel's columns.
    dtype: computation (and output) dtype; None promotes the input's and the params' dtypes.
    param_dtype: dtype of the parameters.
    kernel_init, bias_init: initializers; the layer adds the sharding metadata
      (kernel (None, axis), bias (axis,)) with nnx.with_partitioning.
    implementation: "ffi", "xla", "reference", None (auto), or a callable used per shard as
      fn(x, w, *, axis_name, schedule, out_dtype), e.g. a functools.partial of
      jax_distgemm.distributed_matmul.
    axis: the tensor-parallel mesh axis.
    batch_axis: the mesh axis (or tuple of axes, e.g. ("data", "fsdp")) the first (batch)
      dim of the input is sharded over, when the input has a batch dim; None: replicated
      batch.  The default "data" is used where the mesh has it; other names must be mesh
      axes.  Mesh axes of size > 1 that shard neither the batch nor `axis` replicate the
      layer's work along them (a warning says so).
    mesh: the mesh (default: the one set with jax.set_mesh, which must then be set when the
      layer is built too: its parameters are created sharded).
    rngs: nnx.Rngs for the initializers.
  """

  schedule = Schedule.AllGather1D_TilingCD_RotatingA
  _kernel_sharding = staticmethod(lambda axis: (None, axis))
  _bias_sharding = staticmethod(lambda axis: (axis,))

  def _input_spec(self, batch):
    return P(*batch, self.axis, None)


class RowParallelLinear(_ParallelLinear):
  """Row-parallel linear layer with a sequence-parallel output (GEMM + ReduceScatter).

  y [..., S/tp, out] = reduce_scatter_seq(x [..., S, in/tp] @ kernel [in/tp, out]) + bias
  (ReduceScatter1D_TilingA_RotatingC); the backward runs AllGather + GEMM for dx.  The bias
  [out] is replicated and added after the reduction.  Arguments as ColumnParallelLinear
  (in_features is divisible by the tp size, the kernel is sharded (axis, None)).
  """

  schedule = Schedule.ReduceScatter1D_TilingA_RotatingC
  _kernel_sharding = staticmethod(lambda axis: (axis, None))
  _bias_sharding = staticmethod(lambda axis: (None,))

  def _input_spec(self, batch):
    return P(*batch, None, self.axis)


class ParallelMLP(nnx.Module):
  """Megatron MLP block: ColumnParallelLinear -> activation -> RowParallelLinear.

  x [..., S/tp, d_model] -> [..., S/tp, d_model]: the input and output are sequence-parallel,
  the hidden activation [..., S, d_ff/tp] is column-sharded; the only collectives are the two
  fused ones.  Keyword arguments other than `activation` go to both layers.
  """

  def __init__(self, d_model: int, d_ff: int, *, activation: Callable = jax.nn.gelu,
               rngs: nnx.Rngs, **layer_kwargs):
    self.activation = activation
    self.up = ColumnParallelLinear(d_model, d_ff, rngs=rngs, **layer_kwargs)
    self.down = RowParallelLinear(d_ff, d_model, rngs=rngs, **layer_kwargs)

  def __call__(self, x):
    return self.down(self.activation(self.up(x)))
