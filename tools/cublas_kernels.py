"""Which kernels XLA's dot (and torch.matmul) run on the suite's stage and ideal shapes.

CUPTI, through torch.profiler, records every kernel of the process, XLA's included: for each
problem, three calls of a jitted bf16 `jnp.dot` and three of `torch.matmul` on GPU 0, printed as
kernel name and mean GPU time.  cuBLAS names its kernels in its column-major view (its M is our
N), so "nvjet_sm90_tst_320x128_64x3_1x2" is a 128 (M) x 320 (N) tile of ours with a cluster of
two along our M.  GPU only; needs torch (the device image has it; not a package dependency).

  python tools/cublas_kernels.py [--shapes 4096,8192,14336 8192,8192,14336]   # M,K,N

docs/performance.md J1 ran this as a throwaway script with the default shapes below; --shapes
and argparse were added when it was committed.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave memory for torch

DEFAULT_SHAPES = [  # (label, m, k, n): the suite's stage problems and one ideal
    ("AG 8192,8192,28672 stage", 4096, 8192, 14336),
    ("AG 8192,8192,28672 ideal", 8192, 8192, 14336),
    ("RS 8192,8192,28672 stage", 4096, 4096, 28672),
    ("AG seed stage", 8192, 16384, 53248),
    ("RS seed stage", 8192, 8192, 106496),
    ("AG 8192,4096,4096 stage", 4096, 4096, 2048),
    ("AG 2048,8192,8192 stage", 1024, 8192, 4096),
    ("RS 8192,4096,4096 stage", 4096, 2048, 4096),
]


def _shape(text: str) -> tuple[str, int, int, int]:
  try:
    m, k, n = (int(v) for v in text.split(","))
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected M,K,N integers, got {text!r}")
  if min(m, k, n) <= 0:
    raise argparse.ArgumentTypeError(f"M, K and N must be positive, got {text!r}")
  return (f"{m},{k},{n}", m, k, n)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--shapes", nargs="+", type=_shape, metavar="M,K,N",
                  help="problems to profile (default: the suite's stage shapes)")
  ap.add_argument("--calls", type=int, default=3, help="profiled calls per problem")
  args = ap.parse_args(argv)
  if args.calls <= 0:
    ap.error("--calls must be positive")

  import jax  # noqa: PLC0415 - after the allocator setting above
  import jax.numpy as jnp  # noqa: PLC0415
  try:
    import torch  # noqa: PLC0415
  except ImportError:
    sys.exit("tools/cublas_kernels.py needs torch (for CUPTI through torch.profiler)")

  if jax.devices()[0].platform != "gpu" or not torch.cuda.is_available():
    sys.exit("tools/cublas_kernels.py needs a CUDA GPU (for JAX and torch)")
  dev = jax.devices()[0]
  for name, m, k, n in args.shapes or DEFAULT_SHAPES:
    ka, kb = jax.random.split(jax.random.key(m + n))
    a = jax.device_put(jax.random.normal(ka, (m, k), jnp.bfloat16), dev)
    b = jax.device_put(jax.random.normal(kb, (k, n), jnp.bfloat16), dev)
    f = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.bfloat16))
    f(a, b).block_until_ready()
    ta = torch.randn(m, k, device="cuda:0", dtype=torch.bfloat16)
    tb = torch.randn(k, n, device="cuda:0", dtype=torch.bfloat16)
    torch.matmul(ta, tb)
    torch.cuda.synchronize()
    for who, fn in (("xla", lambda a=a, b=b: f(a, b).block_until_ready()),
                    ("torch", lambda ta=ta, tb=tb: (torch.matmul(ta, tb),
                                                    torch.cuda.synchronize()))):
      with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as p:
        for _ in range(args.calls):
          fn()
      names: dict[str, list[float]] = {}
      for e in p.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
          t = e.device_time if hasattr(e, "device_time") else e.cuda_time
          names.setdefault(e.name, []).append(t)
      print(f"{name} m={m} k={k} n={n} {who}:")
      for nm, ts in names.items():
        print(f"   {len(ts)}x {sum(ts) / len(ts) / 1e3:.3f} ms  {nm[:200]}")
    sys.stdout.flush()
    del a, b, ta, tb
    torch.cuda.empty_cache()


if __name__ == "__main__":
  main()
