#!/usr/bin/env python3
"""all_gather_matmul with one TP group spanning N processes of this host (one jax.distributed job).

  python examples/launch_multiprocess.py                  # 2 processes x 2 fake CPU devices
  python examples/launch_multiprocess.py --platform gpu   # 2 processes x 1 GPU
"""
import argparse
import os
import socket
import subprocess
import sys

p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
p.add_argument("-n", "--num-processes", type=int, default=2)
p.add_argument("--devices-per-process", type=int, default=2, help="fake CPU devices (CPU only)")
p.add_argument("--platform", choices=("cpu", "gpu"), default="cpu")
p.add_argument("--implementation", choices=("auto", "ffi"), default="auto")
args = p.parse_args()

pid = os.environ.get("JDG_PROCESS_ID")
if pid is None:  # the launcher: this script again in each process
  with socket.socket() as s:  # a free port for the coordinator
    s.bind(("127.0.0.1", 0))
    coordinator = f"127.0.0.1:{s.getsockname()[1]}"
  gpu = args.platform == "gpu"
  procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), *sys.argv[1:]], env={
      **os.environ, "JDG_COORDINATOR": coordinator, "JDG_PROCESS_ID": str(i),
      "JAX_PLATFORMS": "cuda" if gpu else "cpu", **({"CUDA_VISIBLE_DEVICES": str(i)} if gpu else {})
  }) for i in range(args.num_processes)]
  sys.exit(1 if any([proc.wait() for proc in procs]) else 0)

import jax  # noqa: E402  (the launcher above never starts JAX)
jax.config.update("jax_num_cpu_devices", args.devices_per_process)  # unused on GPUs
jax.distributed.initialize(os.environ["JDG_COORDINATOR"], args.num_processes, int(pid))
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402
import jax_distgemm  # noqa: E402
jax_distgemm.initialize_multiprocess()  # before the first call: lets a TP group span processes

mesh = jax.sharding.Mesh(np.array(jax.devices()), ("tp",))  # every device of every process
tp, impl = mesh.size, None if args.implementation == "auto" else args.implementation
rows, cols = P("tp", None), P(None, "tp")  # x rows-sharded, w and the output columns-sharded
rng = np.random.default_rng(0)  # the same global arrays in every process
x = jax.device_put(rng.standard_normal((64 * tp, 32), np.float32), NamedSharding(mesh, rows))
w = jax.device_put(rng.standard_normal((32, 48 * tp), np.float32), NamedSharding(mesh, cols))


def body(x, w):
  out = jax_distgemm.all_gather_matmul(x, w, axis_name="tp", implementation=impl)
  return out, jax.lax.all_gather(x, "tp", tiled=True) @ w  # the reference


f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(rows, cols), out_specs=(cols, cols)))
out, ref = f(x, w)
err = max(float(np.abs(np.asarray(a.data) - np.asarray(b.data)).max() / np.abs(b.data).max())
          for a, b in zip(out.addressable_shards, ref.addressable_shards))
ok = err <= 1e-3  # fp32 (TF32 on GPUs); a wrong block is off by O(1)
print(f"process {pid} of {args.num_processes}: all_gather_matmul, TP={tp}, implementation="
      f"{args.implementation}: max relative error {err:.2e} {'OK' if ok else 'WRONG'}")
sys.exit(0 if ok else 1)
