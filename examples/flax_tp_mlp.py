#!/usr/bin/env python3
"""Train a transformer MLP block with tensor-parallel Flax NNX layers on a ("data", "tp") mesh.

The block is pre-LayerNorm -> ColumnParallelLinear -> GELU -> RowParallelLinear -> residual
(jax_distgemm.nnx.ParallelMLP: a sequence-parallel input all-gathered inside the first GEMM,
the second GEMM's output reduce-scattered back to sequence-parallel).  The batch is sharded
over "data", the sequence and the weights over "tp".  It takes a few Adam steps (optax) on a
fixed regression task, prints the loss curve next to that of the same model built from plain
nnx.Linear layers on ONE device (same initial weights, same data), and checks that the two
curves agree to --rtol (relative); it prints "Disposition: Passed" or "Disposition: Failed"
(exit code 1).

Devices: data*tp GPUs when there are that many; otherwise data*tp fake CPU devices of this
process (the CPU executor runs the same schedules).

  python examples/flax_tp_mlp.py
  python examples/flax_tp_mlp.py --data=1 --tp=2 --implementation=ffi   # e.g. 2 H200s
  python examples/flax_tp_mlp.py --fp8=block --d-model=128 --d-ff=512     # fp8 GEMMs
"""

from __future__ import annotations

import argparse
import math
import re
import sys
import time


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--data", type=int, default=2, help="size of the data axis (default: 2)")
  p.add_argument("--tp", type=int, default=4, help="size of the tp axis (default: 4)")
  p.add_argument("--batch", type=int, default=4, help="global batch (default: 4)")
  p.add_argument("--seq", type=int, default=32, help="sequence length (default: 32)")
  p.add_argument("--d-model", type=int, default=32, help="model width (default: 32)")
  p.add_argument("--d-ff", type=int, default=128, help="MLP hidden width (default: 128)")
  p.add_argument("--steps", type=int, default=8, help="optimizer steps, >= 2 (default: 8)")
  p.add_argument("--lr", type=float, default=1e-2, help="Adam learning rate (default: 1e-2)")
  p.add_argument("--implementation", default="auto", choices=("auto", "ffi", "xla", "reference"),
                 help="jax_distgemm implementation (default: auto)")
  p.add_argument("--fp8", default="none", choices=("none", "tensor", "block"),
                 help="quantize the tensor-parallel layers' GEMMs to fp8 (default: none; block "
                 "needs --d-model and --d-ff/--tp to be multiples of 128)")
  p.add_argument("--rtol", type=float, default=None,
                 help="max relative loss difference vs the one-device model (default: 1e-3, "
                 "5e-2 with --fp8: the one-device model does not quantize)")
  p.add_argument("--seed", type=int, default=0)
  args = p.parse_args(argv)
  for name in ("data", "tp", "batch", "seq", "d_model", "d_ff"):
    if getattr(args, name) < 1:
      p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
  if args.steps < 2:  # the check compares the last loss with the first
    p.error(f"--steps must be >= 2 (the loss must decrease over the steps), got {args.steps}")
  if args.seq % args.tp or args.d_ff % args.tp or args.batch % args.data:
    p.error("--seq and --d-ff must be divisible by --tp, --batch by --data")
  if args.rtol is None:
    args.rtol = 1e-3 if args.fp8 == "none" else 5e-2
  return args


def max_difference(rels: list[float]) -> float:
  """The largest of `rels`, nan if any is (Python's max drops a nan after the first item)."""
  return float("nan") if any(math.isnan(r) for r in rels) else max(rels, default=0.0)


def pick_devices(n: int):
  """n GPUs if there are that many, else n fake CPU devices (requested before JAX starts)."""
  import jax
  try:
    jax.config.update("jax_num_cpu_devices", max(n, 1))
  except RuntimeError:
    pass  # backends already initialized (e.g. imported by a test): take what is there
  try:
    gpus = jax.devices("gpu")
  except RuntimeError:
    gpus = []
  if len(gpus) >= n:
    return gpus[:n], "GPU"
  cpus = jax.devices("cpu")
  if len(cpus) < n:
    raise SystemExit(f"need {n} devices, have {len(cpus)} CPU devices and {len(gpus)} GPUs")
  return cpus[:n], "fake CPU"


def main(argv=None) -> int:
  args = parse_args(argv)
  devices, kind = pick_devices(args.data * args.tp)

  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax
  from flax import nnx
  from jax.sharding import AxisType, NamedSharding
  from jax.sharding import PartitionSpec as P

  from jax_distgemm import nnx as tp_nnx

  implementation = None if args.implementation == "auto" else args.implementation
  mesh = jax.make_mesh((args.data, args.tp), ("data", "tp"), devices=devices,
                       axis_types=(AxisType.Auto, AxisType.Auto))
  print(f"running on {len(devices)} {kind} devices: mesh data={args.data} x tp={args.tp}, "
        f"implementation={args.implementation}, fp8={args.fp8}")

  class Block(nnx.Module):
    """x + MLP(LayerNorm(x)); MLP tensor-parallel or plain."""

    def __init__(self, parallel: bool, rngs: nnx.Rngs):
      self.norm = nnx.LayerNorm(args.d_model, rngs=rngs)
      if parallel:
        self.mlp = tp_nnx.ParallelMLP(args.d_model, args.d_ff, mesh=mesh,
                                      implementation=implementation,
                                      fp8=None if args.fp8 == "none" else args.fp8, rngs=rngs)
      else:
        self.up = nnx.Linear(args.d_model, args.d_ff, rngs=rngs)
        self.down = nnx.Linear(args.d_ff, args.d_model, rngs=rngs)
      self.parallel = parallel

    def __call__(self, x):
      h = self.norm(x)
      h = self.mlp(h) if self.parallel else self.down(jax.nn.gelu(self.up(h)))
      return x + h

  def loss_fn(model, x, y):
    return jnp.mean((model(x) - y) ** 2)

  def train_step(model, optimizer, x, y):
    loss, grads = nnx.value_and_grad(loss_fn)(model, x, y)
    optimizer.update(model, grads)
    return loss

  # A fixed regression task: targets from a random "teacher" map of the inputs.
  rng = np.random.default_rng(args.seed)
  x = rng.standard_normal((args.batch, args.seq, args.d_model)).astype(np.float32)
  teacher = rng.standard_normal((args.d_model, args.d_model)).astype(np.float32)
  y = np.tanh(x @ teacher / np.sqrt(args.d_model)).astype(np.float32)

  # -- The tensor-parallel model (params created sharded) and a one-device dense copy --------
  seq_parallel = NamedSharding(mesh, P("data", "tp", None))
  with jax.set_mesh(mesh):
    model = Block(parallel=True, rngs=nnx.Rngs(args.seed))
  one = devices[0]
  with jax.default_device(one):
    dense = Block(parallel=False, rngs=nnx.Rngs(args.seed))
  host = lambda v: jax.device_put(np.asarray(v[...]), one)  # gathered, then on one device
  for dst, src in ((dense.norm.scale, model.norm.scale), (dense.norm.bias, model.norm.bias),
                   (dense.up.kernel, model.mlp.up.kernel), (dense.up.bias, model.mlp.up.bias),
                   (dense.down.kernel, model.mlp.down.kernel),
                   (dense.down.bias, model.mlp.down.bias)):
    dst[...] = host(src)

  # -- Train both on the same data --------------------------------------------------------------
  with jax.set_mesh(mesh):
    optimizer = nnx.Optimizer(model, optax.adam(args.lr), wrt=nnx.Param)
    step = nnx.jit(train_step)
    xs, ys = jax.device_put(x, seq_parallel), jax.device_put(y, seq_parallel)
    t0 = time.perf_counter()
    tp_losses = [float(step(model, optimizer, xs, ys))]
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    tp_losses += [float(step(model, optimizer, xs, ys)) for _ in range(args.steps - 1)]
    steps_s = time.perf_counter() - t0
    # What one step runs: the fused ops (FFI custom calls) and the collectives XLA adds.
    graphdef, state = nnx.split(model)
    grad_fn = jax.jit(jax.grad(lambda st, a, b: loss_fn(nnx.merge(graphdef, st), a, b)))
    hlo = grad_fn.lower(state, xs, ys).compile().as_text()
  counts = {name: len(re.findall(rf"= [^=\n]*\b{name}(-start)?\(", hlo))
            for name in ("all-gather", "reduce-scatter", "all-reduce", "collective-permute")}
  fused = len(re.findall(r'custom_call_target="jax_distgemm_(gathered_|fp8_)?v1"', hlo))
  print(f"forward+backward HLO: {fused} fused collective matmuls (FFI custom calls), "
        + ", ".join(f"{v} {k}" for k, v in counts.items()))
  with jax.default_device(one):
    dense_opt = nnx.Optimizer(dense, optax.adam(args.lr), wrt=nnx.Param)
    dense_step = nnx.jit(train_step)
    xd, yd = jax.device_put(x, one), jax.device_put(y, one)
    dense_losses = [float(dense_step(dense, dense_opt, xd, yd)) for _ in range(args.steps)]

  # -- Report --------------------------------------------------------------------------------------
  print(f"{'step':>4}  {'tensor-parallel':>16}  {'one device':>16}  {'rel diff':>9}")
  rels = [abs(a - b) / max(abs(b), 1e-30) for a, b in zip(tp_losses, dense_losses)]
  for i, (a, b, rel) in enumerate(zip(tp_losses, dense_losses, rels)):
    print(f"{i:>4}  {a:>16.8f}  {b:>16.8f}  {rel:>9.2e}")
  worst = max_difference(rels)
  decreased = tp_losses[-1] < tp_losses[0]
  print(f"max relative difference: {worst:.2e} (rtol {args.rtol:g}); loss "
        f"{'decreased' if decreased else 'did NOT decrease'}: {tp_losses[0]:.6f} -> "
        f"{tp_losses[-1]:.6f}")
  print(f"first step (compile + run): {compile_s:.2f} s; {args.steps - 1} more steps: "
        f"{steps_s:.3f} s")
  ok = worst <= args.rtol and decreased
  print(f"Disposition: {'Passed' if ok else 'Failed'}")
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
