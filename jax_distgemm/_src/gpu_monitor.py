"""SM clock and power while the benchmark times its rows: NVML, sampled on a background thread.

Under sustained load these GPUs run at their power cap, so two kernels that do the same work per
cycle can differ in speed by the clock the cap leaves each: at the seed AllGather shape our
grid and XLA's dot drew the same ~692 W, XLA's at 1402-1410 MHz and ours at 1290-1298 MHz
(docs/performance.md M3, sampled with nvidia-smi).  `GpuMonitor` samples every GPU's SM clock,
power and temperature through NVML (the driver's libnvidia-ml, by ctypes: no extra package, no
child process whose output could sit in a pipe buffer) and reports, per benchmark row, the
medians over the samples inside that row's timed repeats.  GPUs are NVML's indices (PCI order,
as nvidia-smi numbers them).
"""

from __future__ import annotations

import ctypes
import statistics
import threading
import time

_NVML_CLOCK_SM = 1  # nvmlClockType_t
_NVML_TEMPERATURE_GPU = 0  # nvmlTemperatureSensors_t


class NvmlReader:
  """(GPU index, SM MHz, W, degC) of every GPU, read through libnvidia-ml.so.1."""

  def __init__(self):
    self._lib = ctypes.CDLL("libnvidia-ml.so.1")
    self._check(self._lib.nvmlInit_v2(), "nvmlInit_v2")
    count = ctypes.c_uint()
    self._check(self._lib.nvmlDeviceGetCount_v2(ctypes.byref(count)), "nvmlDeviceGetCount_v2")
    self._handles = []
    for i in range(count.value):
      h = ctypes.c_void_p()
      self._check(self._lib.nvmlDeviceGetHandleByIndex_v2(i, ctypes.byref(h)),
                  "nvmlDeviceGetHandleByIndex_v2")
      self._handles.append(h)

  @staticmethod
  def _check(rc: int, what: str):
    if rc != 0:
      raise OSError(f"{what} returned NVML error {rc}")

  def read(self) -> list[tuple[int, float, float, float]]:
    out = []
    for i, h in enumerate(self._handles):
      mhz, mw, temp = ctypes.c_uint(), ctypes.c_uint(), ctypes.c_uint()
      if (self._lib.nvmlDeviceGetClockInfo(h, _NVML_CLOCK_SM, ctypes.byref(mhz)) == 0 and
          self._lib.nvmlDeviceGetPowerUsage(h, ctypes.byref(mw)) == 0 and
          self._lib.nvmlDeviceGetTemperature(h, _NVML_TEMPERATURE_GPU, ctypes.byref(temp)) == 0):
        out.append((i, float(mhz.value), mw.value / 1e3, float(temp.value)))
    return out

  def close(self):
    self._lib.nvmlShutdown()


def format_stats(stats: dict[str, dict] | None) -> str:
  """'GPU0 1290 MHz 692 W GPU1 ...' of window_stats' result ("" for None)."""
  return " ".join(f"GPU{i} {v['sm_mhz']:.0f} MHz {v['power_w']:.0f} W"
                  for i, v in (stats or {}).items())


def window_stats(samples, windows) -> dict[str, dict] | None:
  """Per GPU index (as a string), medians of SM MHz, W and degC over the samples
  (t, gpu, MHz, W, degC) whose time falls inside any of `windows` ([(t0, t1), ...]), and their
  count; None without any."""
  per_gpu: dict[int, list] = {}
  for t, gpu, mhz, watts, temp in samples:
    if any(t0 <= t <= t1 for t0, t1 in windows):
      per_gpu.setdefault(gpu, []).append((mhz, watts, temp))
  if not per_gpu:
    return None
  return {str(g): {"sm_mhz": statistics.median(v[0] for v in vals),
                   "power_w": statistics.median(v[1] for v in vals),
                   "temp_c": statistics.median(v[2] for v in vals),
                   "samples": len(vals)}
          for g, vals in sorted(per_gpu.items())}


class GpuMonitor:
  """Samples `reader_factory()`'s read() every `interval_ms` on a daemon thread (`start`)."""

  def __init__(self, interval_ms: int = 50, reader_factory=NvmlReader):
    self.interval_ms = interval_ms
    self.samples: list[tuple[float, int, float, float, float]] = []
    self.status, self.reason = "off", "not started"
    self._reader_factory = reader_factory
    self._reader = None
    self._thread = None
    self._stop = threading.Event()
    self._lock = threading.Lock()

  def off(self, reason: str) -> GpuMonitor:
    """Not sampling, and why (describe() reports it)."""
    self.status, self.reason = "off", reason
    return self

  def start(self) -> GpuMonitor:
    try:
      self._reader = self._reader_factory()
    except OSError as e:  # no driver library (CPU machines), or NVML refused
      self.status, self.reason = "unavailable", f"NVML: {e}"
      return self
    self._thread = threading.Thread(target=self._run, daemon=True, name="gpu_monitor")
    self._thread.start()
    self.status, self.reason = "ok", None
    return self

  def _run(self):
    while not self._stop.is_set():
      t = time.time()
      try:
        got = self._reader.read()
      except OSError:
        got = []
      with self._lock:
        self.samples.extend((t, *s) for s in got)
      self._stop.wait(self.interval_ms / 1e3)

  def stats(self, windows) -> dict[str, dict] | None:
    """window_stats over the samples so far (None when off or without samples)."""
    if not windows:
      return None
    with self._lock:
      samples = list(self.samples)
    return window_stats(samples, windows)

  def stop(self):
    if self._thread is not None:
      self._stop.set()
      self._thread.join(timeout=5)
      self._thread = None
    if self._reader is not None:
      self._reader.close()
      self._reader = None

  def describe(self) -> dict:
    return {"status": self.status, "reason": self.reason, "interval_ms": self.interval_ms,
            "source": "NVML (libnvidia-ml.so.1)", "samples": len(self.samples)}
