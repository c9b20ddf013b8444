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

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.nnx.nn import dtypes as nnx_dtypes
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_distgemm._src import config
from jax_distgemm._src import fp8 as fp8_lib
from jax_distgemm._src import implementation as impl
from jax_distgemm._src import sharding_rules as rules
from jax_distgemm._src.collective import collective_matmul
from jax_distgemm._src.schedules import Schedule

default_kernel_init = nnx.initializers.lecun_normal()
default_bias_init = nnx.initializers.zeros_init()

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
  _sharded_features: str  # the argument the TP size must divide

  def __init__(self, in_features: int, out_features: int, *, use_bias: bool = True,
               dtype: Any = None, param_dtype: Any = jnp.float32,
               kernel_init=default_kernel_init, bias_init=default_bias_init,
               implementation: str | None | Callable = None, axis: str = "tp",
               batch_axis: str | tuple[str, ...] | None = _DEFAULT_BATCH_AXIS,
               mesh: jax.sharding.Mesh | None = None, fp8: str | None = None,
               rngs: nnx.Rngs):
    name = type(self).__name__
    for arg, v in (("in_features", in_features), ("out_features", out_features)):
      if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
        raise ValueError(f"{name}: {arg} must be a positive integer, got {v!r}")
    if isinstance(batch_axis, list):
      batch_axis = tuple(batch_axis)
    if batch_axis is not None and not (isinstance(batch_axis, str) or (
        isinstance(batch_axis, tuple) and batch_axis
        and all(isinstance(a, str) for a in batch_axis))):
      raise TypeError(f"{name}: batch_axis must be a mesh axis name, a tuple of them or None, "
                      f"got {batch_axis!r}")
    names = _names(batch_axis)
    if len(set(names)) != len(names):
      raise ValueError(f"{name}: batch_axis {batch_axis!r} names an axis twice")
    if axis in names:
      raise ValueError(f"{name}: batch_axis and axis must be different mesh axes (the batch "
                       f"dim and the sequence dim cannot both be sharded over {axis!r}); pass "
                       "batch_axis=None for no data-parallel axis")
    if callable(implementation):
      pass  # a per-shard op, run in place of the fused one
    elif implementation is not None and not isinstance(implementation, str):
      raise TypeError(f"{name}: implementation: expected a name, None or a callable, got "
                      f"{implementation!r}")
    elif implementation is not None and implementation not in impl.IMPLEMENTATIONS:
      raise ValueError(f"{name}: implementation: expected one of {impl.IMPLEMENTATIONS}, None or "
                       f"a callable, got {implementation!r}")
    self.in_features, self.out_features = int(in_features), int(out_features)
    self.use_bias, self.dtype, self.param_dtype = use_bias, dtype, param_dtype
    self.axis, self.batch_axis, self.mesh = axis, batch_axis, mesh
    self.implementation = implementation
    tp = self._mesh().shape[axis]
    if getattr(self, self._sharded_features) % tp:
      raise ValueError(f"{name}: {self._sharded_features} "
                       f"({getattr(self, self._sharded_features)}) must be divisible by the "
                       f"size of mesh axis {axis!r} ({tp}): the kernel is sharded over it")
    if fp8 is not None:
      fp8_lib.check_scaling(fp8, f"{name}: fp8")
      if callable(implementation):
        raise ValueError(f"{name}: fp8: a callable implementation quantizes nothing")
      if fp8 == "block":
        k, n = self._kernel_shard(tp)
        if k % fp8_lib.BLOCK or n % fp8_lib.BLOCK:
          raise ValueError(f"{name}: fp8='block' needs each kernel shard [{k}, {n}] to be whole "
                           f"{fp8_lib.BLOCK}x{fp8_lib.BLOCK} blocks")
    self.fp8 = fp8
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
      raise ValueError(f"{type(self).__name__}: mesh: none given and none set; pass mesh= or "
                       "build and call the layer under jax.set_mesh(mesh)")
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
      config.warn(("nnx idle axes", type(self).__name__, tuple(idle), bool(batch)),
                  f"jax_distgemm.nnx.{type(self).__name__}: the mesh axes {idle} shard neither "
                  f"the batch nor {self.axis!r}, so every replica along them computes the same "
                  f"layer ({how})")
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
    p = rules.plan(x_spec, w_spec, None, x_ndim=x.ndim, w_ndim=2, axis=self.axis)
    if p.schedule != self.schedule:
      raise AssertionError(f"layout {x_spec}, {w_spec} planned as {p.schedule}: {p.reason}")
    y = collective_matmul(
        x, kernel, mesh=mesh, axis=self.axis, in_specs=(x_spec, w_spec),
        out_sharding=NamedSharding(mesh, p.out_spec) if isinstance(mesh, jax.sharding.Mesh)
        else p.out_spec,
        out_dtype=x.dtype, implementation=self.implementation, fp8=self.fp8)
    return y if bias is None else y + bias.astype(y.dtype)


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
    fp8: None, "tensor" or "block": quantize the input and the kernel shards to fp8 in every
      call (current scaling); gradients pass straight through, per tensor in fp8 (the
      cotangent in float8_e5m2), block-scaled in the layer's dtype.
    rngs: nnx.Rngs for the initializers.
  """

  schedule = Schedule.AllGather1D_TilingCD_RotatingA
  _sharded_features = "out_features"
  _kernel_sharding = staticmethod(lambda axis: (None, axis))
  _bias_sharding = staticmethod(lambda axis: (axis,))

  def _input_spec(self, batch):
    return P(*batch, self.axis, None)

  def _kernel_shard(self, tp):
    return self.in_features, self.out_features // tp


class RowParallelLinear(_ParallelLinear):
  """Row-parallel linear layer with a sequence-parallel output (GEMM + ReduceScatter).

  y [..., S/tp, out] = reduce_scatter_seq(x [..., S, in/tp] @ kernel [in/tp, out]) + bias
  (ReduceScatter1D_TilingA_RotatingC); the backward runs AllGather + GEMM for dx.  The bias
  [out] is replicated and added after the reduction.  Arguments as ColumnParallelLinear
  (in_features is divisible by the tp size, the kernel is sharded (axis, None)).
  """

  schedule = Schedule.ReduceScatter1D_TilingA_RotatingC
  _sharded_features = "in_features"
  _kernel_sharding = staticmethod(lambda axis: (axis, None))
  _bias_sharding = staticmethod(lambda axis: (None,))

  def _input_spec(self, batch):
    return P(*batch, None, self.axis)

  def _kernel_shard(self, tp):
    return self.in_features // tp, self.out_features


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
