"""SM clock and power while the benchmark times its rows: nvidia-smi, sampled in the background.

Under sustained load these GPUs run at their power cap, so two kernels that do the same work per
cycle can differ in speed by the clock the cap leaves each: at the seed AllGather shape our
grid and XLA's dot drew the same ~692 W, XLA's at 1402-1410 MHz and ours at 1290-1298 MHz
(docs/performance.md M3).  `GpuMonitor` samples every GPU's SM clock, power and temperature and
reports, per benchmark row, the medians over the samples inside that row's timed repeats.

nvidia-smi stamps each sample in local time; the windows are `time.time()` on the same host.
"""

from __future__ import annotations

import datetime
import shutil
import statistics
import subprocess
import threading

FIELDS = ("timestamp", "index", "clocks.sm", "power.draw", "temperature.gpu")


def parse_line(line: str) -> tuple[float, int, float, float, float] | None:
  """(unix time, GPU index, SM MHz, W, degC) of one `--format=csv,noheader,nounits` line, or
  None for anything else (a header, a '[N/A]' field, a message)."""
  parts = [p.strip() for p in line.split(",")]
  if len(parts) != len(FIELDS):
    return None
  try:
    t = datetime.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
    return t, int(parts[1]), float(parts[2]), float(parts[3]), float(parts[4])
  except ValueError:
    return None


def window_stats(samples, windows) -> dict[str, dict] | None:
  """Per GPU index (as a string), medians of SM MHz, W and degC over the samples whose time
  falls inside any of `windows` ([(t0, t1), ...]), and their count; None without any."""
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
  """nvidia-smi in the background (`start`), its samples parsed as they arrive."""

  def __init__(self, interval_ms: int = 50):
    self.interval_ms = interval_ms
    self.samples: list[tuple[float, int, float, float, float]] = []
    self.status, self.reason = "off", "not started"
    self._proc = None
    self._reader = None
    self._lock = threading.Lock()

  def start(self) -> GpuMonitor:
    exe = shutil.which("nvidia-smi")
    if exe is None:
      self.status, self.reason = "unavailable", "nvidia-smi not found"
      return self
    try:
      self._proc = subprocess.Popen(
          [exe, f"--query-gpu={','.join(FIELDS)}", "--format=csv,noheader,nounits",
           f"-lms={self.interval_ms}"],
          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    except OSError as e:
      self.status, self.reason = "unavailable", f"nvidia-smi did not start: {e}"
      return self
    self._reader = threading.Thread(target=self._read, daemon=True)
    self._reader.start()
    self.status, self.reason = "ok", None
    return self

  def _read(self):
    for line in self._proc.stdout:
      s = parse_line(line)
      if s is not None:
        with self._lock:
          self.samples.append(s)

  def stats(self, windows) -> dict[str, dict] | None:
    """window_stats over what has arrived so far (None when off or without samples)."""
    if not windows:
      return None
    with self._lock:
      samples = list(self.samples)
    return window_stats(samples, windows)

  def stop(self):
    if self._proc is not None:
      self._proc.terminate()
      try:
        self._proc.wait(timeout=5)
      except subprocess.TimeoutExpired:
        self._proc.kill()
      if self._reader is not None:
        self._reader.join(timeout=5)
      self._proc = None

  def describe(self) -> dict:
    return {"status": self.status, "reason": self.reason, "interval_ms": self.interval_ms,
            "fields": list(FIELDS), "samples": len(self.samples)}
