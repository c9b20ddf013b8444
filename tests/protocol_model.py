"""Explicit-state model of the CUDA executor's flag protocol, checked over all interleavings.

The protocol (cc/cuda/peer_state.h, executor.cc, docs/design.md "Epochs"): every device takes
one epoch per call (the same sequence on every device).  A peer that feeds this device copies
its data into a symmetric-workspace slot (double-buffered by epoch parity) and then writes the
call's epoch into one of this device's flag words; the stage that consumes it spins, bounded,
until the word reaches the epoch (>=, 64-bit), then reads the slot.  Each flag word has one
writer, whose epochs rise in its stream order:

    device d's flag words          written by                        read by
    ---------------------------    --------------------------------  --------------------------
    D(i, c)  data row              d+i: AllGather / gather pushes     d's stage i (AG, gather)
                                   (copy engine, after the slot copy)
    R(i, c)  RingFlags row         d-1: remote-C stage-i signal       d's ring stage i
                                   (kernel) / copy-ring push (copy)
    S(i, c)  SeenMark              d's own AG grid, once stage i's    d's copy stream, before
                                   wait ended (arrived or timed out)  it copies slot i-1 into
                                                                      the gathered result
    PD       kPushDoneFlag         d's own copy stream, after its     d's AG grid join (bounded)
                                   pushes (AG without gathered)

    slots[parity e%2]:  AG / gather: slot i-1 <- pushed by d+i;  remote C: slot i <- d's own
    stage i, read remotely by d+1;  copy ring: send slot i (own stage i), recv slot i <- d-1.

What the model is: per device a host thread that walks its call sequence (PendingError check,
epoch, then each launch in the C++ enqueue order) onto a main and a copy stream, each a FIFO of
at most `queue_depth` launches (an enqueue blocks on a full queue; at most `max_in_flight`
calls begun and not returned); a launch is a short list of steps run in order (a stage kernel:
signal, wait, GEMM).  Devices, streams and host threads interleave arbitrarily.  Data is a tag
(source device, epoch, reset generation), so "the slot holds call e's data from the right
source" is a comparison.  The kept paths only: AllGather as the fused grid (stage 0 left out:
it reads only the caller's shard), joined by its in-kernel wait on PD, or with a gathered
result by an event; ReduceScatter remote C, copy ring (2 chunks) and gather, stage launches.

Timeouts.  "stuck": a bounded wait times out only when nothing but timeouts and hosts' next
calls can move (the timeout outlasts every latency; a host's next call may come before or after
it).  "always" / "before_reset": whenever its word is short (a live peer may be arbitrarily
late); the AG grid's join on our own copy stream only while that stream is blocked on a wait of
its own (or its host stopped).  A failed device stops its host (mid-call too), freezes (host
and streams), or never pushes (CallOptions::skip_signals).

Not modeled: shapes and bytes (one shape per path; slots of different paths in one parity half
are taken to overlap); CTAs and the stage overlap inside one call (a call's stages run in
order; only the AG grid's join runs beside its stages); AllGather stage launches and chunked
shards (same words, one chunk); the fused ReduceScatter grids, push and copy-add (being
removed); workspace growth and EnsureReady; groups across processes (IPC) and their
per-process reset; streams that share a hardware queue; memory ordering (a copy and the flag
write after it are one step).

Invariants (Violation.invariant):
  1 a wait that passes by arrival finds call e's data from the right source in its slot
    (and the copy stream's reads of slots find it too);
  2 no slot is overwritten while a reader of another call still needs it (checked when the
    stage's GEMM, which read it, ends);
  3 fault-free, no timeouts: no reachable state is stuck before every call completed;
  4 with a failed peer, timeouts allowed: no reachable state is stuck before every live
    stream drained (each step makes progress, so the graph is acyclic and every run ends),
    and no step reads or writes a caller's buffer after its call returned on the main stream;
  5 after reset(), no wait passes on a flag write made before the reset;
  6 every flag word has one writer (statically, over every enqueued write), and its value
    never goes back within a reset generation.
After a timeout, until reset(), 1 and 2 are checked only with strict_after_timeout: they hold
where timeouts come from a failed peer ("stuck"), not where a live peer lags by more than the
timeout ("always"): its call still waiting can then pass on a later call's epoch and read that
call's data, once the peer that timed out has moved on; the error record is what reports it.

Search: breadth-first over states with a visited set, with partial-order reduction: a host's
enqueue is explored alone (it commutes with every step), and so is a stream step that commutes
with every step any other stream may still take, judged from what each step touches and a
static happens-before order (program order, one-writer flag waits, events, reset());
protocol_model_test checks on small graphs that the reduction reaches every final state and
every violation the full search does.
"""

import argparse
import collections
import dataclasses
import sys
import time

# -- What each model step stands for ------------------------------------------------------------

# step name -> (file, C++ function).  protocol_model_test checks that each function still occurs
# in its file (or, after a move, somewhere under cc/), as a name or a name's start: the stream
# value calls are named without their width, which the 64-bit epochs change.
MODEL_SOURCES = {
    "host_begin_call": ("cc/cuda/distgemm_cuda.cc", "RunCall"),  # PendingError check
    "host_take_epoch": ("cc/cuda/executor.cc", "EnqueueDistGemm"),
    "host_enqueue": ("cc/cuda/executor.cc", "Launch"),
    "pending_error": ("cc/cuda/peer_state.cc", "PendingError"),
    "stage_wait_timeout": ("cc/cuda/stage_sync_device.cuh", "WaitFlagUntil"),
    "error_record": ("cc/cuda/stage_sync.h", "ErrorRecord"),
    "parity_slot": ("cc/cuda/executor_internal.h", "ParityBase"),
    "flag_words": ("cc/cuda/peer_state.h", "FlagIndex"),
    "ring_flags": ("cc/cuda/peer_state.h", "RingFlags"),
    "seen_mark": ("cc/cuda/peer_state.h", "SeenMark"),
    "push_done_flag": ("cc/cuda/peer_state.h", "kPushDoneFlag"),
    "stream_write_value": ("cc/cuda/peer_state.cc", "StreamWriteValue"),
    "stream_wait_value": ("cc/cuda/peer_state.cc", "StreamWaitValue"),
    "ag_source": ("cc/schedules/ring_1d.h", "AllGather1D_TilingCD_RotatingA"),
    "rs_ring_source": ("cc/schedules/ring_1d.h", "ReduceScatter1D_TilingA_RotatingC"),
    "rs_gather_source": ("cc/schedules/ring_1d.h", "ReduceScatter1D_TilingA_Gather"),
    # AllGather
    "ag_push": ("cc/cuda/all_gather.cc", "EnqueueAllGatherOf"),
    "ag_stage_wait": ("cc/cuda/sm90_fused_gemm.cuh", "WaitForStage"),
    "ag_stage_gemm": ("cc/cuda/sm90_fused_gemm.cuh", "FusedStageKernel"),
    "ag_copy_own": ("cc/cuda/all_gather.cc", "CopyIntoGathered"),
    "ag_copy_slot": ("cc/cuda/all_gather.cc", "CopyGathered"),
    "ag_push_done": ("cc/cuda/all_gather.cc", "EnqueueAllGatherOf"),
    "ag_kernel_join": ("cc/cuda/sm90_fused_gemm.cuh", "WaitForOwnPushes"),
    "ag_join_timeout": ("cc/cuda/stage_sync_device.cuh", "WaitFlagUntil"),
    "ag_event_join": ("cc/cuda/all_gather.cc", "EnqueueAllGatherOf"),
    # ReduceScatter, remote C
    "rc_signal": ("cc/cuda/sm90_gemm.cuh", "StageKernel"),
    "rc_stage_wait": ("cc/cuda/stage_sync_device.cuh", "WaitFlag"),
    "rc_stage_gemm": ("cc/cuda/reduce_scatter.cc", "EnqueueReduceScatter"),
    # ReduceScatter, copy ring
    "cr_stage_wait": ("cc/cuda/stage_sync_device.cuh", "WaitFlag"),
    "cr_stage_gemm": ("cc/cuda/reduce_scatter.cc", "EnqueueRsCopyRing"),
    "cr_push": ("cc/cuda/reduce_scatter.cc", "PushCopyRingChunk"),
    "cr_join": ("cc/cuda/reduce_scatter.cc", "EnqueueRsCopyRing"),
    # ReduceScatter, gather
    "rg_push": ("cc/cuda/reduce_scatter.cc", "EnqueueRsGather"),
    "rg_stage_wait": ("cc/cuda/stage_sync_device.cuh", "WaitFlag"),
    "rg_stage_gemm": ("cc/cuda/reduce_scatter.cc", "EnqueueRsGather"),
    "rg_join": ("cc/cuda/reduce_scatter.cc", "EnqueueRsGather"),
    # reset()
    "reset": ("cc/cuda/peer_state.cc", "PeerGroup::Reset"),
    "reset_all": ("cc/cuda/distgemm_cuda.cc", "ResetAll"),
}

# -- Configuration ------------------------------------------------------------------------------

# Call kinds: AllGather RotatingA / RotatingB (same flags, different slot layout), with "+g" a
# gathered result; ReduceScatter remote C ("rc"), copy ring ("cr"), gather ("rg").
CALL_KINDS = ("agA", "agB", "agA+g", "agB+g", "rc", "cr", "rg")

MUTATIONS = {
    "shared_flag_row": "the rings signal and wait on the AllGather data row (two writers a word)",
    "single_buffer": "every call uses slot parity 0 (no double buffering)",
    "reset_one_at_a_time": "reset() drains, zeroes and restarts one device at a time",
    "cyclic_epoch": "uint32 epochs compared as (int32)(flag - epoch) >= 0, here mod 8",
    "kernel_join_gathered": "a gathered AllGather ends on the grid's bounded join, not an event",
    "no_seen_wait": "the copy stream copies slot i-1 into the gathered result without the mark",
    "no_fork": "the copy stream pushes a call's data without waiting for the previous call",
}
EPOCH_MODULUS = 8  # cyclic_epoch: 2^32 scaled down; a word stale for M/2 calls passes at once


@dataclasses.dataclass(frozen=True)
class Config:
  tp: int
  calls: tuple  # each device's call sequence (CALL_KINDS)
  after_reset: tuple = None  # not None: every host then calls reset(), then these calls
  queue_depth: int = 2  # launches a stream holds before its host blocks
  max_in_flight: int = 3  # calls a host may have begun and not yet seen return
  failure: tuple = None  # (device, "stop" | "mute" | "freeze")
  timeouts: str = "none"  # "none" | "before_reset" | "always"
  initial_epoch: int = 0  # calls already run before (they wrote the data row only)
  mutations: frozenset = frozenset()
  rs_chunks: int = 2
  strict_after_timeout: bool = False  # also check 1 and 2 after a timeout
  check_writers: bool = True  # the static half of invariant 6

  def label(self):
    parts = [f"tp={self.tp}", "calls=" + ",".join(self.calls)]
    if self.after_reset is not None:
      parts.append("reset;" + ",".join(self.after_reset))
    if self.failure:
      parts.append(f"fail=d{self.failure[0]}:{self.failure[1]}")
    if self.timeouts != "none":
      parts.append(f"timeouts={self.timeouts}")
    if self.initial_epoch:
      parts.append(f"from_epoch={self.initial_epoch}")
    parts.append(f"q={self.queue_depth}")
    if self.mutations:
      parts.append("mut=" + "+".join(sorted(self.mutations)))
    return " ".join(parts)


INVARIANTS = {
    1: "a wait passed (or a copy read) before its data",
    2: "a slot was overwritten while a reader of another call needed it",
    3: "deadlock without a failed peer",
    4: "with a failed peer: a stream cannot finish, or a caller's buffer is used after return",
    5: "after reset, a wait passed on a write from before the reset",
    6: "a flag word has two writers, or went back",
}


@dataclasses.dataclass
class Violation:
  invariant: int
  message: str
  trace: list

  def __str__(self):
    return self.format()

  def format(self, enqueues=False):
    """The verdict and the counterexample; host enqueue steps are left out unless asked for
    (they only fill queues: the streams' steps say what ran)."""
    lines = [f"invariant {self.invariant} ({INVARIANTS[self.invariant]}): {self.message}"]
    if self.trace:
      shown = [t for t in self.trace if enqueues or ": enqueue " not in t]
      left = len(self.trace) - len(shown)
      lines.append(f"counterexample ({len(self.trace)} steps" +
                   (f", {left} host enqueues not shown" if left else "") + "):")
      lines += [f"  {i + 1:3d}. {t}" for i, t in enumerate(shown)]
    return "\n".join(lines)


@dataclasses.dataclass
class Result:
  config: Config
  states: int = 0
  transitions: int = 0
  terminal: int = 0
  depth: int = 0
  seconds: float = 0.0
  violation: Violation = None
  others: dict = dataclasses.field(default_factory=dict)  # invariant -> first Violation

  @property
  def ok(self):
    return self.violation is None

  def summary(self):
    verdict = "OK" if self.ok else f"VIOLATION of invariant {self.violation.invariant}"
    return (f"{verdict}: {self.states} states, {self.transitions} transitions, "
            f"{self.terminal} final, depth {self.depth}, {self.seconds:.2f}s  "
            f"[{self.config.label()}]")


# -- Static structure: launches and host actions -------------------------------------------------

Launch = collections.namedtuple("Launch", "stream call guard steps ends_call kernel_join")
# stream: "main" | "copy".  guard: None; "main" (copy entry after the main stream completed
# every launch enqueued before it: the fork / stage_done events); "copy" (main entry after the
# copy stream completed every entry enqueued before it: the join event).

# Labels' step names of timeouts (the "stuck" mode enables them only where nothing else moves).
TIMEOUT_STEPS = ("stage_wait_timeout", "ag_join_timeout")
CALL_STEPS = ("host_take_epoch", "host_begin_call")

# Device state, one tuple per device (indices):
PC, FAIL, EPOCH, CSTAT, CEP, CGEN, MQ, MSUB, CQ, CSUB, MDONE, CDONE, FLAGS, SLOTS, TMO, JTMO = \
    range(16)
# CSTAT per call: 0 not begun, 1 in flight, 2 returned (its last main launch completed),
# 3 refused (PendingError).  FAIL: 0 live, 1 host stopped, 2 frozen (host and streams).
NOT_BEGUN, IN_FLIGHT, RETURNED, REFUSED = range(4)


class Model:
  """The state graph of one Config: initial state, successors, invariant checks."""

  def __init__(self, config):
    c = self.config = config
    if c.tp < 2:
      raise ValueError("tp >= 2")
    for k in tuple(c.calls) + tuple(c.after_reset or ()):
      if k not in CALL_KINDS:
        raise ValueError(f"unknown call kind {k!r}")
    for m in c.mutations:
      if m not in MUTATIONS:
        raise ValueError(f"unknown mutation {m!r}")
    self.n = c.tp
    self.mut = frozenset(c.mutations)
    self.ring_row = "D" if "shared_flag_row" in self.mut else "R"
    self.cyclic = "cyclic_epoch" in self.mut
    n = self.n
    self.words = ([("D", i, ch) for i in range(1, n) for ch in range(2)] +
                  [("R", i, ch) for i in range(1, n) for ch in range(2)] +
                  [("S", i, 0) for i in range(1, n)] + [("PD",)])
    self.widx = {w: j for j, w in enumerate(self.words)}
    self.fail_dev, self.fail_kind = c.failure if c.failure else (-1, None)
    if c.timeouts not in ("none", "stuck", "always", "before_reset"):
      raise ValueError(f"timeouts={c.timeouts!r}")
    self.stuck_only = c.timeouts == "stuck"
    self.tmo_anytime = c.timeouts in ("always", "before_reset")
    self.launches = []
    self.actions = []
    self.segments = []  # per device: [(first call, last call + 1, end pc)]
    for d in range(n):
      self._build_device(d)
    # Stream steps are taken alone (_stream_ample) only where its independence argument holds:
    # monotone >= waits (not cyclic_epoch), and no reset() that runs beside the streams (the
    # old one-at-a-time reset).
    # (With strict checks and timeouts at any moment, a timeout's mark in TMO is what a
    # later check of the copy stream reads: left out rather than tracked.)
    self.stream_por = (not (c.strict_after_timeout and self.tmo_anytime) and
                       not self.mut & {"cyclic_epoch", "reset_one_at_a_time"})
    if self.stream_por:
      self._build_accesses()

  # Host order of one call's launches, as its Enqueue* function issues them.  Steps:
  #   ("wait", word, peer, read, seen, stage, name)   bounded wait for own word >= epoch; then
  #        check the slot `read` = (device, key, source) it guards; set own mark `seen`
  #   ("gemm", write, read, stage, name)   the stage GEMM: ends the read of `read`, writes own
  #        slot `write` (its running sum), or out
  #   ("signal", target, word, name)       kernel stores epoch into target's word
  #   ("push", target, key, word, reads_caller, own_read, name)   copy into target's slot,
  #        then epoch into target's word (one step: the write is fenced after the copy)
  #   ("gcopy_own", name), ("gcopy_slot", guard, key, source, stage, name)   into the caller's
  #        gathered result, the latter after own mark `guard` (cuStreamWaitValue32, unbounded)
  #   ("write_own", word, name)            copy stream stores epoch into own PD
  #   ("grid_end", word, name)             the AG grid's bounded join on own PD
  #   ("join", name)                       main stream waits the join event of the copy stream
  def _build_call(self, d, k, kind):
    n, mut = self.n, self.mut
    mute = self.fail_kind == "mute" and self.fail_dev == d  # CallOptions::skip_signals
    left, right = (d - 1) % n, (d + 1) % n
    row = self.ring_row
    out = []  # (stream, guard, steps, ends_call, kernel_join)
    # AllGather and gather record the fork event on the main stream and make the copy stream
    # wait for it: the call's pushes start after what precedes the call (set below).
    forked = kind.startswith("ag") or kind == "rg"
    if kind.startswith("ag"):
      layout, gathered = kind[:3], kind.endswith("+g")
      kernel_join = not gathered or "kernel_join_gathered" in mut
      # EnqueueAllGather: fork, then one push per stage into PushTarget(d, i) = d-i.
      if not mute:
        for i in range(1, n):
          step = ("push", (d - i) % n, (layout, i - 1, 0), ("D", i, 0), True, None, "ag_push")
          out.append(("copy", None, (step,), False, False))
      steps = []
      for i in range(1, n):
        src = (d + i) % n  # AllGather1D_*::Source(d, i)
        seen = ("S", i, 0) if gathered else None
        steps.append(("wait", ("D", i, 0), src, (d, (layout, i - 1, 0), src), seen, i,
                      "ag_stage_wait"))
        steps.append(("gemm", None, (d, (layout, i - 1, 0), src), i, "ag_stage_gemm"))
      if kernel_join:
        steps.append(("grid_end", ("PD",), "ag_kernel_join"))
      out.append(("main", None, tuple(steps), kernel_join, kernel_join))
      if gathered:  # CopyGathered
        out.append(("copy", None, (("gcopy_own", "ag_copy_own"),), False, False))
        for i in range(1, n):
          guard = None if "no_seen_wait" in mut else ("S", i, 0)
          step = ("gcopy_slot", guard, (layout, i - 1, 0), (d + i) % n, i, "ag_copy_slot")
          out.append(("copy", None, (step,), False, False))
      if kernel_join:
        out.append(("copy", None, (("write_own", ("PD",), "ag_push_done"),), False, False))
      else:
        out.append(("main", "copy", (("join", "ag_event_join"),), True, False))
    elif kind == "rc":
      # EnqueueReduceScatter, kRemoteC: stage i signals right's R(i) (my stage i-1 is done),
      # waits its own R(i), reads left's slot i-1 as C, writes its slot i (out at the last).
      out.append(("main", None, (("gemm", ("rc", 0, 0), None, 0, "rc_stage_gemm"),), False,
                  False))
      for i in range(1, n):
        steps = []
        if not mute:
          steps.append(("signal", right, (row, i, 0), "rc_signal"))
        steps.append(("wait", (row, i, 0), left, (left, ("rc", i - 1, 0), left), None, i,
                      "rc_stage_wait"))
        steps.append(("gemm", ("rc", i, 0) if i < n - 1 else None,
                      (left, ("rc", i - 1, 0), left), i, "rc_stage_gemm"))
        out.append(("main", None, tuple(steps), i == n - 1, False))
    elif kind == "cr":
      # EnqueueRsCopyRing: chunk (i, c) waits R(i, c), reads recv slot i, writes send slot i;
      # the copy stream (after the chunk's stage_done event) pushes it into right's recv slot
      # i+1 and sets right's R(i+1, c).  Send slot i = i, recv slot i = TP-1 + (i-1).
      for i in range(n):
        for ch in range(self.config.rs_chunks):
          steps = []
          if i > 0:
            steps.append(("wait", (row, i, ch), left, (d, ("cr", n - 1 + i - 1, ch), left),
                          None, i, "cr_stage_wait"))
          read = (d, ("cr", n - 1 + i - 1, ch), left) if i > 0 else None
          steps.append(("gemm", ("cr", i, ch) if i < n - 1 else None, read, i, "cr_stage_gemm"))
          out.append(("main", None, tuple(steps), False, False))
          if i < n - 1 and not mute:
            step = ("push", right, ("cr", n - 1 + i, ch), (row, i + 1, ch), False,
                    (("cr", i, ch), d), "cr_push")
            out.append(("copy", "main", (step,), False, False))
      out.append(("main", "copy", (("join", "cr_join"),), True, False))
    elif kind == "rg":
      # EnqueueRsGather: pushes at the call's start into PushTarget(d, i) = d-i (x rows, w),
      # then stage i waits D(i, 0) and reads slot i-1; the running sums are local.
      if not mute:
        for i in range(1, n):
          step = ("push", (d - i) % n, ("rg", i - 1, 0), ("D", i, 0), True, None, "rg_push")
          out.append(("copy", None, (step,), False, False))
      for i in range(1, n):
        src = (d + i) % n
        out.append(("main", None, (
            ("wait", ("D", i, 0), src, (d, ("rg", i - 1, 0), src), None, i, "rg_stage_wait"),
            ("gemm", None, (d, ("rg", i - 1, 0), src), i, "rg_stage_gemm")), False, False))
      out.append(("main", "copy", (("join", "rg_join"),), True, False))
    if forked and "no_fork" not in mut:
      j = next((j for j, o in enumerate(out) if o[0] == "copy"), None)
      if j is not None:
        out[j] = ("copy", "main") + out[j][2:]
    return out

  def _build_device(self, d):
    c = self.config
    launches, actions, segments = [], [], []
    seg_calls = [tuple(c.calls)]
    if c.after_reset is not None:
      seg_calls.append(tuple(c.after_reset))
    k = 0
    for s, calls in enumerate(seg_calls):
      first = k
      for kind in calls:
        actions.append(("begin", k, s))
        for stream, guard, steps, ends, kj in self._build_call(d, k, kind):
          launches.append(Launch(stream, k, guard, steps, ends, kj))
          actions.append(("enq", len(launches) - 1))
        k += 1
      # A refused call sends its host here: the reset() barrier, or the end.
      segments.append((first, k, len(actions)))
      if s + 1 < len(seg_calls):
        actions.append(("reset",))
    self.launches.append(launches)
    self.actions.append(actions)
    self.segments.append(segments)
    self.ncalls = k

  # -- Partial-order reduction: what each stream step touches ------------------------------------

  def _build_accesses(self):
    """Per process (device, stream): its steps in program order, and for each step the shared
    objects it touches, so that _stream_ample can tell whether a step commutes with every step
    any other process may still take.

    Objects and modes:  ("F", dev, word) flag word: "W" write, "R" wait or guard (>=), "T" a
    wait that may time out, "J" the AG grid's join timeout;  ("SL", dev, parity) a slot half,
    with the slot key: "R" read (a check), "W" write;  ("CS", dev, call) whether the call
    returned: "W" its last main launch, "R" a copy step that uses the caller's buffers;
    ("CQH", dev) the copy stream's head: "W" any copy step, "J" the join timeout.
    A guard (process, position) on an access says it cannot happen before that process has
    taken that step (a wait on a word only that step writes, an event on that launch)."""
    n, c = self.n, self.config
    self.procs = [(d, st) for d in range(n) for st in ("main", "copy")]
    self.prog = {P: [] for P in self.procs}
    self.pos = {}
    for d in range(n):
      for li, lau in enumerate(self.launches[d]):
        for sub in range(len(lau.steps)):
          P = (d, lau.stream)
          self.pos[(d, li, sub)] = len(self.prog[P])
          self.prog[P].append((li, sub))
    # The next launch of each stream a host will enqueue, from each host position.
    self.next_launch = []
    for d in range(n):
      acts = self.actions[d]
      nl = {"main": [None] * (len(acts) + 1), "copy": [None] * (len(acts) + 1)}
      for pc in range(len(acts) - 1, -1, -1):
        for st in ("main", "copy"):
          nl[st][pc] = nl[st][pc + 1]
        if acts[pc][0] == "enq":
          li = acts[pc][1]
          nl[self.launches[d][li].stream][pc] = li
      self.next_launch.append(nl)
    # Where each flag word of each call is written, and a few steps guards point at.
    flag_write, gemm_at, pd_at, last_copy, seen_at = {}, {}, {}, {}, {}
    for d in range(n):
      for li, lau in enumerate(self.launches[d]):
        for sub, st in enumerate(lau.steps):
          where = ((d, lau.stream), self.pos[(d, li, sub)])
          if st[0] == "push":
            flag_write[(st[1], st[3], lau.call)] = where
          elif st[0] == "signal":
            flag_write[(st[1], st[2], lau.call)] = where
          elif st[0] == "gemm" and st[1] is not None:
            gemm_at[(d, lau.call, st[1])] = where
          elif st[0] == "write_own":
            pd_at[(d, lau.call)] = where
          elif st[0] == "wait" and st[4] is not None:
            seen_at[(d, st[4], lau.call)] = where
          if lau.stream == "copy":
            last_copy[(d, lau.call)] = where
    never = ("never",)
    # Words with two writers (shared_flag_row) can go down: a wait on them does not commute
    # with their writes, and no single write guards it.
    self.multi = {(x, w) for (x, w), by in self.flag_writers().items() if len(by) > 1}

    def wait_guard(x, word, k):
      if (x, word) in self.multi:
        return None
      return flag_write.get((x, word, k), never)

    self.acc = {P: [] for P in self.procs}
    for d in range(n):
      for li, lau in enumerate(self.launches[d]):
        k = lau.call
        par, seg = self._static_parity(k)
        may_time_out = self.timeouts_allowed(seg)
        tmo = self.tmo_anytime and may_time_out  # ... at any moment, not only when stuck
        for sub, st in enumerate(lau.steps):
          a = []
          kind = st[0]
          if kind == "wait":
            _, word, peer, read, seen, stage, src = st
            a.append((("F", d, word), "T" if tmo else "R", None, None))
            if seen is not None:
              a.append((("F", d, seen), "W", None, None))
            if read is not None:
              g = wait_guard(d, word, k)
              if g is not never:
                a.append((("SL", read[0], par), "R", read[1], g))
          elif kind == "gemm":
            _, wkey, read, stage, src = st
            if read is not None:
              word = lau.steps[sub - 1][1]  # the wait before it in the same launch
              g = wait_guard(d, word, k)
              if g is not never:
                a.append((("SL", read[0], par), "R", read[1], g))
            if wkey is not None:
              a.append((("SL", d, par), "W", wkey, None))
          elif kind == "signal":
            a.append((("F", st[1], st[2]), "W", None, None))
          elif kind == "push":
            _, target, key, word, reads_caller, own_read, src = st
            a.append((("F", target, word), "W", None, None))
            a.append((("SL", target, par), "W", key, None))
            if reads_caller:
              a.append((("CS", d, k), "R", None, None))
            if own_read is not None:
              a.append((("SL", d, par), "R", own_read[0], gemm_at.get((d, k, own_read[0]))))
          elif kind == "gcopy_own":
            a.append((("CS", d, k), "R", None, None))
          elif kind == "gcopy_slot":
            _, guard, key, want_src, stage, src = st
            a.append((("CS", d, k), "R", None, None))
            g = wait_guard(d, ("D", stage, 0), k) if guard is not None else None
            if g is not never:
              a.append((("SL", d, par), "R", key, g))
          elif kind == "write_own":
            a.append((("F", d, st[1]), "W", None, None))
          elif kind == "grid_end":
            a.append((("CS", d, k), "W", None, None if may_time_out else pd_at.get((d, k))))
            if tmo:
              # The join's timeout runs beside the grid's stages (CTA 0): what it reads is
              # what decides whether our copy stream is blocked.
              a.append((("F", d, st[1]), "J", None, None))
              a.append((("CQH", d), "J", None, None))
              for other in lau.steps:
                if other[0] == "wait" and other[4] is not None:
                  a.append((("F", d, other[4]), "J", None, None))
          elif kind == "join":
            a.append((("CS", d, k), "W", None, last_copy.get((d, k))))
          if kind == "gemm" and lau.ends_call and sub == len(lau.steps) - 1:
            a.append((("CS", d, k), "W", None, None))
          if lau.stream == "copy":
            a.append((("CQH", d), "W", None, None))
          self.acc[(d, lau.stream)].append(tuple(a))
    self._build_happens_before(flag_write, seen_at, pd_at)
    # The last step of each process that may time out (and so set the error record).
    self.last_timeout = {P: max([p_ for p_, a in enumerate(self.acc[P])
                                 if any(m_ in ("T", "J") for _, m_, _, _ in a)], default=-1)
                         for P in self.procs}
    # Per process and object, the accesses in program order: [(position, mode, key, guard)].
    self.acc_index = {}
    for P in self.procs:
      idx = collections.defaultdict(list)
      for p, a in enumerate(self.acc[P]):
        for obj, mode, key, guard in a:
          idx[obj].append((p, mode, key, guard))
      self.acc_index[P] = dict(idx)

  def _build_happens_before(self, flag_write, seen_at, pd_at):
    """A vector clock per step of the static happens-before order: vc[P][pos][Q] is the last
    position of process Q that must have run before step pos of P can run (-1: none).  Edges:
    program order; a flag write before the wait that needs it (one writer, a wait that cannot
    time out); a seen mark before the copy that waits for it; PD before the grid's join (no
    join timeout); the fork, stage_done and join events between a device's two streams."""
    n = self.n
    pidx = {P: j for j, P in enumerate(self.procs)}
    preds = {}
    for d in range(n):
      last = {"main": None, "copy": None}  # last launch of each stream in host order
      for li, lau in enumerate(self.launches[d]):
        P = (d, lau.stream)
        tmo = self.timeouts_allowed(self._static_parity(lau.call)[1])
        for sub, st in enumerate(lau.steps):
          node = (P, self.pos[(d, li, sub)])
          ps = []
          if node[1] > 0:
            ps.append((P, node[1] - 1))
          if sub == 0 and lau.guard is not None and last[lau.guard] is not None:
            gl = last[lau.guard]
            ps.append(((d, lau.guard), self.pos[(d, gl, len(self.launches[d][gl].steps) - 1)]))
          if st[0] == "wait" and not tmo and (d, st[1]) not in self.multi:
            w = flag_write.get((d, st[1], lau.call))
            if w is not None:
              ps.append(w)
          elif st[0] == "gcopy_slot" and st[1] is not None:
            w = seen_at.get((d, st[1], lau.call))
            if w is not None:
              ps.append(w)
          elif st[0] == "grid_end" and not tmo:
            w = pd_at.get((d, lau.call))
            if w is not None:
              ps.append(w)
          preds[node] = ps
        last[lau.stream] = li
    # reset() drains every stream: each process's first step after it follows every
    # process's last step before it.
    npre = len(self.config.calls)
    last_pre, first_post = {}, {}
    for P in self.procs:
      d = P[0]
      for p_, (li, _) in enumerate(self.prog[P]):
        if self.launches[d][li].call < npre:
          last_pre[P] = p_
        elif P not in first_post:
          first_post[P] = p_
    for P, p_ in first_post.items():
      preds[(P, p_)] = preds[(P, p_)] + [(Q, q_) for Q, q_ in last_pre.items() if Q != P]
    # Kahn's order; a step on a cycle (a deadlock by construction) keeps no clock.
    succs = collections.defaultdict(list)
    indeg = {}
    for node, ps in preds.items():
      indeg[node] = len(ps)
      for p_ in ps:
        succs[p_].append(node)
    ready = [v for v, k in indeg.items() if k == 0]
    vc = {}
    while ready:
      v = ready.pop()
      clock = [-1] * len(self.procs)
      for p_ in preds[v]:
        pc_ = vc[p_]
        for j in range(len(clock)):
          if pc_[j] > clock[j]:
            clock[j] = pc_[j]
        j = pidx[p_[0]]
        if p_[1] > clock[j]:
          clock[j] = p_[1]
      vc[v] = tuple(clock)
      for w in succs[v]:
        indeg[w] -= 1
        if indeg[w] == 0:
          ready.append(w)
    self.pidx = pidx
    self.vc = {P: [vc.get((P, p_)) for p_ in range(len(self.prog[P]))] for P in self.procs}

  def _static_parity(self, k):
    """(parity of call k, its reset generation).  Before a reset every call takes the epoch
    initial_epoch + k + 1 (a refused call is the segment's last); after reset() the group
    continues from a common epoch, so only parities relative to each other are known."""
    npre = len(self.config.calls)
    if k < npre:
      return self.parity(self.config.initial_epoch + k + 1), 0
    return ("post", self.parity(k - npre)), 1

  def _cursor(self, dv, d, stream):
    """Position of the next step process (d, stream) takes (or would, once enqueued)."""
    q = dv[MQ] if stream == "main" else dv[CQ]
    if q:
      return self.pos[(d, q[0][0], dv[MSUB] if stream == "main" else dv[CSUB])]
    if dv[FAIL] != 0:
      return len(self.prog[(d, stream)])
    li = self.next_launch[d][stream][dv[PC]]
    return len(self.prog[(d, stream)]) if li is None else self.pos[(d, li, 0)]

  def _independent(self, s, P, pos_t):
    """Whether the step at pos_t of process P commutes with every step another process may
    still take (from its cursor on)."""
    devs, error = s[0], s[1]
    pj = self.pidx[P]
    acc = self.acc[P][pos_t]
    if not error and self.tmo_anytime and self.timeouts_allowed(s[2]) and any(
        obj[0] == "SL" and mode == "R" for obj, mode, _, _ in acc):
      # The slot checks are off once the error record is set: they do not commute with a
      # timeout anywhere (it sets the record).
      for Q in self.procs:
        if Q != P and devs[Q[0]][FAIL] != 2 and \
            self._cursor(devs[Q[0]], Q[0], Q[1]) <= self.last_timeout[Q]:
          return False
    for obj, mode, key, _ in acc:
      if mode == "T":
        mode = "R"  # P's wait passes now (a timeout is never taken alone)
      for Q in self.procs:
        if devs[Q[0]][FAIL] == 2:
          continue
        lst = self.acc_index[Q].get(obj)
        if not lst:
          continue
        cq = self._cursor(devs[Q[0]], Q[0], Q[1])
        for pos_u, mode_u, key_u, guard_u in lst:
          if pos_u < cq or (Q == P and mode_u != "J"):
            continue  # P's own later steps follow t; its join timeout does not
          kind = obj[0]
          if kind == "SL":
            clash = (key == key_u or key[0] != key_u[0]) and "W" in (mode, mode_u)
          elif kind == "F":
            # >= waits on a word whose one writer only raises it commute with its writes,
            # unless the wait may time out instead.
            clash = mode == "W" and mode_u in ("W", "T", "J")
            if (obj[1], obj[2]) in self.multi:
              clash = clash or (mode == "R" and mode_u == "W") or (mode == "W" and mode_u == "R")
          elif kind == "CS":
            clash = mode != mode_u
          else:  # CQH
            clash = mode == "W" and mode_u == "J"
          if not clash:
            continue
          if mode_u == "J":
            return False  # the join timeout may fire anywhere in its grid
          if guard_u is not None and guard_u[0] == P and pos_t <= guard_u[1]:
            continue  # u waits for P's step at or after t
          vc_u = self.vc[Q][pos_u]
          if vc_u is not None and vc_u[pj] >= pos_t:
            continue  # u happens after some step of P at or after t
          return False
    return True

  def _stream_ample(self, s):
    devs = s[0]
    for d, stream in self.procs:
      dv = devs[d]
      # A device that may still freeze: its streams' steps do not commute with the freeze.
      # (Stopping only stops its host, which commutes with them.)
      if dv[FAIL] == 2 or (d == self.fail_dev and self.fail_kind == "freeze" and dv[FAIL] == 0):
        continue
      q = dv[MQ] if stream == "main" else dv[CQ]
      if not q:
        continue
      steps = self._stream_steps(s, d, stream)
      if len(steps) != 1 or steps[0][0][3] in TIMEOUT_STEPS:
        continue
      # (With timeouts only when stuck, an enabled step means no timeout is enabled.)
      if stream == "main" and not self.stuck_only and self._join_timeout(s, d) is not None:
        continue
      if self._independent(s, (d, stream), self._cursor(dv, d, stream)):
        return list(steps)
    return None

  # -- Epochs ------------------------------------------------------------------------------------

  def arrived(self, value, epoch):
    if self.cyclic:  # (int32)(flag - epoch) >= 0 with 2^32 scaled to EPOCH_MODULUS
      return (value - epoch) % EPOCH_MODULUS < EPOCH_MODULUS // 2
    return value >= epoch

  def parity(self, epoch):
    return 0 if "single_buffer" in self.mut else epoch % 2

  def timeouts_allowed(self, gen):
    t = self.config.timeouts
    return t in ("always", "stuck") or (t == "before_reset" and gen == 0)

  # -- State -------------------------------------------------------------------------------------

  def initial_state(self):
    c = self.config
    e0 = c.initial_epoch
    # Calls before this window ran AllGathers only: the data row and own marks hold e0, the
    # ring row was never written (0).
    flags = tuple((e0 if w[0] != "R" else 0, 0) for w in self.words)
    empty = ((), ())
    devs = []
    for _ in range(self.n):
      nc = self.ncalls
      devs.append((0, 0, e0, (NOT_BEGUN,) * nc, (0,) * nc, (0,) * nc, (), 0, (), 0, 0, 0, flags,
                   empty, frozenset(), -1))
    return (tuple(devs), False, 0, 0)  # devices, error record set, reset generation, reset phase

  def checking(self, error):
    return self.config.strict_after_timeout or not error

  def stale(self, nx, slot_dev, key, want_src, e, cgen):
    """(what the slot holds, what call e expects there) where they differ, else None."""
    have, want = nx.slot(slot_dev, self.parity(e), key), (want_src, e, cgen)
    return None if have == want else (have, want)

  # -- Successors --------------------------------------------------------------------------------

  def successors(self, s, por=True):
    """[(label, next state, (invariant, message) or None)] of every step enabled in `s`, or
    with `por` of an ample subset (see _ample)."""
    if por:
      ample = self._ample(s)
      if ample is None and self.stream_por:
        ample = self._stream_ample(s)
      if ample is not None:
        return ample
    devs = s[0]
    out = []
    for d in range(self.n):
      dv = devs[d]
      if dv[FAIL] == 2:
        continue
      if dv[FAIL] == 0:
        t = self._host_step(s, d)
        if t is not None:
          out.append(t)
        if d == self.fail_dev and self.fail_kind in ("stop", "freeze") and (
            dv[PC] < len(self.actions[d]) or
            (self.fail_kind == "freeze" and (dv[MQ] or dv[CQ]))):
          out.append(self._fail_step(s, d))
      out.extend(self._stream_steps(s, d, "main"))
      out.extend(self._stream_steps(s, d, "copy"))
      t = self._join_timeout(s, d)
      if t is not None:
        out.append(t)
    out.extend(self._reset_steps(s))
    if self.stuck_only:
      # Stuck: nothing but a timeout or a host's next call can move.  (The program decides
      # when a host calls next, so that may come before or after a timeout.)
      if any(t[0][3] not in TIMEOUT_STEPS + CALL_STEPS for t in out):
        return [t for t in out if t[0][3] not in TIMEOUT_STEPS]
    return out

  def _ample(self, s):
    """Partial-order reduction: a host's enqueue commutes with every other step (it appends
    at a queue's tail; streams read the head) and changes nothing an invariant reads, so when
    one is enabled it alone is explored.  A call's begin reads the error record, which a
    timeout writes: it is taken alone only when no timeout can fire any more, or the record is
    already set (then only reset clears it, and reset waits for this host)."""
    devs, error, gen, _ = s
    for d in range(self.n):
      dv = devs[d]
      if dv[FAIL] != 0:
        continue
      acts = self.actions[d]
      if dv[PC] >= len(acts):
        continue
      act = acts[dv[PC]]
      if act[0] == "reset":
        continue
      if act[0] == "begin" and not error and self.timeouts_allowed(gen):
        continue
      if d == self.fail_dev and self.fail_kind == "freeze":
        continue  # freezing also stops its streams: not independent of them
      t = self._host_step(s, d)
      if t is None:
        continue
      out = [t]
      if d == self.fail_dev and self.fail_kind == "stop":
        out.append(self._fail_step(s, d))
      return out
    return None

  def _fail_step(self, s, d):
    devs = list(s[0])
    dv = list(devs[d])
    dv[FAIL] = 1 if self.fail_kind == "stop" else 2
    devs[d] = tuple(dv)
    return ((d, "host", f"device fails ({self.fail_kind})", None), (tuple(devs),) + s[1:], None)

  def _host_step(self, s, d):
    devs, error, gen, rphase = s
    dv = devs[d]
    acts = self.actions[d]
    pc = dv[PC]
    if pc >= len(acts):
      return None
    act = acts[pc]
    if act[0] == "reset":
      return None
    q = self.config.queue_depth
    if act[0] == "begin":
      k, seg = act[1], act[2]
      if sum(1 for st in dv[CSTAT] if st == IN_FLIGHT) >= self.config.max_in_flight:
        return None
      dl = list(dv)
      cstat = list(dv[CSTAT])
      if error:
        # RunCall: PendingError() fails the call before it takes an epoch; the record
        # stays set until reset(), so the segment's later calls are refused too.
        _, last, end_pc = self.segments[d][seg]
        for j in range(k, last):
          cstat[j] = REFUSED
        dl[CSTAT] = tuple(cstat)
        dl[PC] = end_pc
        label = (d, "host", f"call {k} refused (PendingError)", "host_begin_call")
      else:
        e = dv[EPOCH] + 1  # EnqueueDistGemm: ++epoch
        cstat[k] = IN_FLIGHT
        dl[EPOCH] = e
        dl[CSTAT] = tuple(cstat)
        dl[CEP] = _set(dv[CEP], k, e)
        dl[CGEN] = _set(dv[CGEN], k, gen)
        dl[PC] = pc + 1
        kind = self._kind(k)
        label = (d, "host", f"call {k} ({kind}) begins, epoch {e}", "host_take_epoch")
      devs = list(devs)
      devs[d] = tuple(dl)
      return (label, (tuple(devs), error, gen, rphase), None)
    # enqueue one launch
    li = act[1]
    lau = self.launches[d][li]
    qi = MQ if lau.stream == "main" else CQ
    if len(dv[qi]) >= q:
      return None
    # cudaStreamWaitEvent waits for the event's latest record when it is called: everything
    # the other stream holds now (fork, stage_done: the main stream; join: the copy stream).
    if lau.guard == "main":
      thr = dv[MDONE] + len(dv[MQ])
    elif lau.guard == "copy":
      thr = dv[CDONE] + len(dv[CQ])
    else:
      thr = 0
    dl = list(dv)
    dl[qi] = dv[qi] + ((li, thr),)
    dl[PC] = pc + 1
    devs = list(devs)
    devs[d] = tuple(dl)
    label = (d, "host", f"enqueue {lau.stream}: {self._launch_text(d, li)}", "host_enqueue")
    return (label, (tuple(devs), error, gen, rphase), None)

  def _kind(self, k):
    calls = tuple(self.config.calls) + tuple(self.config.after_reset or ())
    return calls[k]

  def _launch_text(self, d, li):
    lau = self.launches[d][li]
    return f"call {lau.call} [" + ", ".join(st[-1] for st in lau.steps) + "]"

  # A stream's head step: (label, state, violation) or nothing.
  def _stream_steps(self, s, d, stream):
    devs, error, gen, rphase = s
    dv = devs[d]
    qi, si = (MQ, MSUB) if stream == "main" else (CQ, CSUB)
    q = dv[qi]
    if not q:
      return ()
    li, thr = q[0]
    lau = self.launches[d][li]
    k = lau.call
    e = dv[CEP][k]
    cgen = dv[CGEN][k]
    sub = dv[si]
    step = lau.steps[sub]
    kind = step[0]
    flags = dv[FLAGS]
    out = []
    # Launch guards: events (fork, stage_done, join) are unbounded waits on our own streams.
    if sub == 0 and lau.guard == "main" and dv[MDONE] < thr:
      return ()
    if sub == 0 and lau.guard == "copy" and dv[CDONE] < thr:
      return ()
    nx = _Next(self, s)
    tag = (d, e, cgen)
    if kind == "wait":
      _, word, peer, read, seen, stage, src = step
      value, wgen = flags[self.widx[word]]
      if self.arrived(value, e):
        label = (d, stream, f"call {k} e{e} stage {stage}: wait {_w(word)}>={e} passes "
                 f"(holds {value})", src)
        if seen is not None:
          nx.write_flag(d, d, seen, e, cgen)
        if wgen < cgen:
          nx.violate(5, f"device {d} call {k} (epoch {e}, after reset) passed its wait on "
                     f"{_w(word)} = {value}, written before the reset")
        elif read is not None and self.checking(error):
          slot_dev, key, want_src = read
          if stale := self.stale(nx, slot_dev, key, want_src, e, cgen):
            have, want = stale
            nx.violate(1, f"device {d} call {k} (epoch {e}) stage {stage} passed its wait on "
                       f"{_w(word)} = {value}, but slot {_k(key)}[parity {self.parity(e)}] of "
                       f"device {slot_dev} holds {_tag(have)}, not {_tag(want)}")
        nx.advance(d, stream)
        out.append((label, nx.pack(), nx.viol))
      elif self.timeouts_allowed(cgen):
        nx.error = True
        label = (d, stream, f"call {k} e{e} stage {stage}: wait {_w(word)}>={e} TIMES OUT "
                 f"(holds {value}; error record set)", "stage_wait_timeout")
        if seen is not None:  # WaitForStage marks even after a timeout
          nx.write_flag(d, d, seen, e, cgen)
        nx.add_tmo(d, (k, stage))
        nx.advance(d, stream)
        out.append((label, nx.pack(), nx.viol))
      return out
    if kind == "gemm":
      # The stage's GEMM has read the slot its wait guarded: invariant 2 asks that nothing
      # overwrote it in between (the slot still holds what the wait found).
      _, wkey, read, stage, src = step
      if read is not None and (k, stage) not in dv[TMO] and self.checking(error):
        slot_dev, key, want_src = read
        if stale := self.stale(nx, slot_dev, key, want_src, e, cgen):
          have, want = stale
          nx.violate(2, f"device {d} call {k} (epoch {e}) stage {stage}: slot {_k(key)}"
                     f"[parity {self.parity(e)}] of device {slot_dev} was overwritten with "
                     f"{_tag(have)} between the wait and the GEMM that reads {_tag(want)}")
      if wkey is not None:
        nx.write_slot(d, d, self.parity(e), wkey, tag, k)
      label = (d, stream, f"call {k} e{e}: GEMM" +
               (f" writes own slot {_k(wkey)}" if wkey else ""), src)
      nx.advance(d, stream)
      return [(label, nx.pack(), nx.viol)]
    if kind == "signal":
      _, target, word, src = step
      nx.write_flag(d, target, word, e, cgen)
      nx.advance(d, stream)
      return [((d, stream, f"call {k} e{e}: signal device {target} {_w(word)} := {e}", src),
               nx.pack(), nx.viol)]
    if kind == "push":
      _, target, key, word, reads_caller, own_read, src = step
      if reads_caller and dv[CSTAT][k] == RETURNED:
        nx.violate(4, f"device {d} pushes from call {k}'s input after the call returned")
      if own_read is not None and self.checking(error):
        okey, want_src = own_read
        if stale := self.stale(nx, d, okey, want_src, e, cgen):
          nx.violate(1, f"device {d} call {k} pushes its slot {_k(okey)}, which holds "
                     f"{_tag(stale[0])}, not {_tag(stale[1])}")
      nx.write_slot(d, target, self.parity(e), key, tag, k)
      nx.write_flag(d, target, word, e, cgen)
      nx.advance(d, stream)
      return [((d, stream, f"call {k} e{e}: copy into device {target} slot {_k(key)}"
                f"[parity {self.parity(e)}], then {_w(word)} := {e}", src), nx.pack(), nx.viol)]
    if kind == "gcopy_own":
      if dv[CSTAT][k] == RETURNED:
        nx.violate(4, f"device {d} writes call {k}'s gathered result after the call returned")
      nx.advance(d, stream)
      return [((d, stream, f"call {k} e{e}: copy own shard into gathered", step[-1]),
               nx.pack(), nx.viol)]
    if kind == "gcopy_slot":
      _, guard, key, want_src, stage, src = step
      if guard is not None and not self.arrived(flags[self.widx[guard]][0], e):
        return ()
      if dv[CSTAT][k] == RETURNED:
        nx.violate(4, f"device {d} copies slot {_k(key)} into call {k}'s gathered result "
                   f"after the call returned")
      elif (k, stage) not in dv[TMO] and self.checking(error):
        if stale := self.stale(nx, d, key, want_src, e, cgen):
          nx.violate(1, f"device {d} call {k} copies slot {_k(key)} into the gathered result "
                     f"holding {_tag(stale[0])}, not {_tag(stale[1])}")
      nx.advance(d, stream)
      return [((d, stream, f"call {k} e{e}: " + (f"mark {_w(guard)}>={e} seen, " if guard
                else "") + f"copy slot {_k(key)} into gathered", src), nx.pack(), nx.viol)]
    if kind == "write_own":
      _, word, src = step
      nx.write_flag(d, d, word, e, cgen)
      nx.advance(d, stream)
      return [((d, stream, f"call {k} e{e}: {_w(word)} := {e}", src), nx.pack(), nx.viol)]
    if kind == "grid_end":
      _, word, src = step
      if self.arrived(flags[self.widx[word]][0], e) or dv[JTMO] == k:
        nx.advance(d, stream)
        return [((d, stream, f"call {k} e{e}: grid join on {_w(word)} ends, call returns",
                  src), nx.pack(), nx.viol)]
      return ()
    if kind == "join":
      nx.advance(d, stream)
      return [((d, stream, f"call {k} e{e}: join event passes, call returns", step[-1]),
               nx.pack(), nx.viol)]
    raise AssertionError(kind)

  def _join_timeout(self, s, d):
    """The AllGather grid's bounded join on PD, concurrent with its stages (CTA 0 can reach
    it while other CTAs still wait for a peer): it times out only while our own copy stream
    cannot get there by itself (its head is blocked on a wait, or its host stopped)."""
    devs, error, gen, rphase = s
    dv = devs[d]
    if not dv[MQ]:
      return None
    lau = self.launches[d][dv[MQ][0][0]]
    if not lau.kernel_join:
      return None
    k = lau.call
    e = dv[CEP][k]
    if dv[JTMO] == k or not self.timeouts_allowed(dv[CGEN][k]):
      return None
    if self.arrived(dv[FLAGS][self.widx[("PD",)]][0], e):
      return None
    if dv[CQ]:
      cli, cthr = dv[CQ][0]
      clau = self.launches[d][cli]
      cstep = clau.steps[dv[CSUB]]
      blocked = ((dv[CSUB] == 0 and clau.guard == "main" and dv[MDONE] < cthr) or
                 (cstep[0] == "gcopy_slot" and cstep[1] is not None and
                  not self.arrived(dv[FLAGS][self.widx[cstep[1]]][0], dv[CEP][clau.call])))
    else:
      blocked = dv[FAIL] == 1
    if not blocked:
      return None
    nx = _Next(self, s)
    nx.error = True
    nx.dev(d)[JTMO] = k
    return ((d, "main", f"call {k} e{e}: grid join on PD TIMES OUT (copy stream blocked; "
             "error record set)", "ag_join_timeout"), nx.pack(), nx.viol)

  def _reset_steps(self, s):
    devs, error, gen, rphase = s
    n = self.n
    for d in range(n):
      dv = devs[d]
      acts = self.actions[d]
      if dv[FAIL] == 2 or dv[PC] >= len(acts) or acts[dv[PC]][0] != "reset":
        return []
    if "reset_one_at_a_time" in self.mut:
      # Before the fix: for each device in turn, drain it, zero its flags, epoch 0.
      d = rphase
      dv = devs[d]
      if dv[MQ] or dv[CQ]:
        return []
      nx = _Next(self, s)
      dl = nx.dev(d)
      dl[FLAGS] = tuple((0, -1) for _ in self.words)
      dl[EPOCH] = 0
      label = (-1, "host", f"drain device {d}, zero its flags, epoch 0", "reset")
      if d + 1 < n:
        nx.rphase = d + 1
      else:
        nx.rphase = 0
        self._finish_reset(nx)
      return [(label, nx.pack(), nx.viol)]
    # PeerGroup::Reset: drain every device, then continue every epoch from the group's max;
    # flags keep their values (a late write of an old epoch is below every later epoch).
    if any(dv[MQ] or dv[CQ] for dv in devs):
      return []
    nx = _Next(self, s)
    top = max(dv[EPOCH] for dv in devs)
    for d in range(n):
      nx.dev(d)[EPOCH] = top
    self._finish_reset(nx)
    return [((-1, "host", f"all devices drained, epochs continue from {top}",
              "reset"), nx.pack(), nx.viol)]

  def _finish_reset(self, nx):
    nx.error = False
    nx.gen += 1
    for d in range(self.n):
      dl = nx.dev(d)
      dl[PC] += 1
      dl[TMO] = frozenset()
      dl[JTMO] = -1

  def finished(self, s):
    """None if `s` is a correct end state, else what is stuck."""
    devs = s[0]
    stuck = []
    for d, dv in enumerate(devs):
      if dv[FAIL] == 2:
        continue
      if dv[MQ] or dv[CQ]:
        what = []
        for stream, qi, si in (("main", MQ, MSUB), ("copy", CQ, CSUB)):
          if dv[qi]:
            lau = self.launches[d][dv[qi][0][0]]
            what.append(f"{stream} at call {lau.call} {lau.steps[dv[si]][-1]}")
        stuck.append(f"device {d}: " + "; ".join(what))
      elif dv[FAIL] == 0 and dv[PC] < len(self.actions[d]):
        act = self.actions[d][dv[PC]]
        stuck.append(f"device {d}: host at {act[0]}")
    return "; ".join(stuck) if stuck else None

  # -- Invariant 6, statically ---------------------------------------------------------------------

  def flag_writers(self):
    """{(device, word): {writer device: [step names]}} over every launch of every device."""
    writers = collections.defaultdict(lambda: collections.defaultdict(list))
    for d in range(self.n):
      for lau in self.launches[d]:
        for st in lau.steps:
          if st[0] == "push":
            writers[(st[1], st[3])][d].append(f"call {lau.call} {st[-1]}")
          elif st[0] == "signal":
            writers[(st[1], st[2])][d].append(f"call {lau.call} {st[-1]}")
          elif st[0] == "wait" and st[4] is not None:
            writers[(d, st[4])][d].append(f"call {lau.call} {st[-1]} (mark)")
          elif st[0] == "write_own":
            writers[(d, st[1])][d].append(f"call {lau.call} {st[-1]}")
    return writers

  def static_violation(self):
    for (dev, word), by in sorted(self.flag_writers().items()):
      if len(by) > 1:
        trace = [f"device {w} writes device {dev} {_w(word)}: {', '.join(steps)}"
                 for w, steps in sorted(by.items())]
        return Violation(6, f"device {dev}'s flag word {_w(word)} has {len(by)} writers "
                         f"(devices {sorted(by)})", trace)
    return None


# Mutable view of a state under construction.
class _Next:
  __slots__ = ("model", "devs", "error", "gen", "rphase", "viol", "_copied")

  def __init__(self, model, s):
    self.model = model
    self.devs = list(s[0])
    self.error, self.gen, self.rphase = s[1], s[2], s[3]
    self.viol = None
    self._copied = set()

  def dev(self, d):
    if d not in self._copied:
      self.devs[d] = list(self.devs[d])
      self._copied.add(d)
    return self.devs[d]

  def violate(self, inv, msg):
    if self.viol is None:
      self.viol = (inv, msg)

  def pack(self):
    return (tuple(tuple(x) if isinstance(x, list) else x for x in self.devs), self.error,
            self.gen, self.rphase)

  def advance(self, d, stream):
    dl = self.dev(d)
    qi, si, di = (MQ, MSUB, MDONE) if stream == "main" else (CQ, CSUB, CDONE)
    li = dl[qi][0][0]
    lau = self.model.launches[d][li]
    if dl[si] + 1 < len(lau.steps):
      dl[si] += 1
      return
    dl[qi] = dl[qi][1:]
    dl[si] = 0
    dl[di] += 1
    if lau.ends_call:
      dl[CSTAT] = _set(dl[CSTAT], lau.call, RETURNED)

  def write_flag(self, writer, d, word, value, gen):
    m = self.model
    dl = self.dev(d)
    j = m.widx[word]
    old, ogen = dl[FLAGS][j]
    if not m.cyclic and value < old and ogen == gen:
      self.violate(6, f"device {writer} sets device {d} {_w(word)} back from {old} to {value}")
    dl[FLAGS] = _set(dl[FLAGS], j, (value, gen))

  def slot(self, d, parity, key):
    dv = self.devs[d]
    for k2, tag in dv[SLOTS][parity]:
      if k2 == key:
        return tag
    return None

  def write_slot(self, writer, d, parity, key, tag, call):
    # Slots of one path are disjoint by index; slots of different paths in one parity half may
    # overlap (shapes differ), so a write forgets what the other paths' slots held.
    dl = self.dev(d)
    entries = tuple((k2, t) for k2, t in dl[SLOTS][parity] if k2[0] == key[0] and k2 != key)
    slots = list(dl[SLOTS])
    slots[parity] = tuple(sorted(entries + ((key, tag),)))
    dl[SLOTS] = tuple(slots)

  def add_tmo(self, d, item):
    dl = self.dev(d)
    dl[TMO] = dl[TMO] | {item}


def _set(t, i, v):
  return t[:i] + (v,) + t[i + 1:]


def _w(word):
  return word[0] if len(word) == 1 else f"{word[0]}({word[1]},{word[2]})"


def _k(key):
  return f"{key[0]}#{key[1]}" + (f".{key[2]}" if key[2] else "")


def _tag(tag):
  if tag is None:
    return "nothing of this path"
  src, e, g = tag
  return f"<src {src}, epoch {e}" + (f", reset {g}>" if g else ">")


# -- The checker ---------------------------------------------------------------------------------


def check(config, por=True, stop_on=None, max_states=None):
  """Breadth-first search of every reachable state.  Stops at the first violation of an
  invariant in `stop_on` (default: any), a shortest counterexample; a violation of another
  invariant is recorded in Result.others and its step not followed.  Returns a Result."""
  t0 = time.perf_counter()
  model = Model(config)
  res = Result(config)
  wanted = set(INVARIANTS) if stop_on is None else set(stop_on)

  def found(v):
    if v.invariant in wanted:
      res.violation = v
      return True
    res.others.setdefault(v.invariant, v)
    return False

  if config.check_writers:
    v = model.static_violation()
    if v is not None and found(v):
      res.seconds = time.perf_counter() - t0
      return res
  init = model.initial_state()
  parent = {init: None}
  frontier = [init]
  depth = 0
  no_failure = config.failure is None and config.timeouts == "none"
  while frontier and res.violation is None:
    nxt = []
    for s in frontier:
      succ = model.successors(s, por)
      if not succ:
        res.terminal += 1
        stuck = model.finished(s)
        if stuck is not None and found(Violation(3 if no_failure else 4,
                                                 f"no step is enabled: {stuck}",
                                                 _trace(parent, s))):
          break
        continue
      for label, t, viol in succ:
        res.transitions += 1
        if viol is not None:
          if found(Violation(viol[0], viol[1], _trace(parent, s) + [_label_text(label)])):
            break
          continue
        if t not in parent:
          parent[t] = (s, label)
          nxt.append(t)
      if res.violation is not None:
        break
    if nxt:
      depth += 1
    frontier = nxt
    if max_states is not None and len(parent) > max_states:
      raise RuntimeError(f"more than {max_states} states: {config.label()}")
  res.states = len(parent)
  res.depth = depth
  res.seconds = time.perf_counter() - t0
  return res


def _label_text(label):
  d, actor, text, src = label
  who = "reset()" if d < 0 else f"d{d} {actor}"
  where = ""
  if src in MODEL_SOURCES:
    where = f"  [{MODEL_SOURCES[src][1]}]"
  return f"{who}: {text}{where}"


def _trace(parent, s):
  out = []
  while parent[s] is not None:
    s, label = parent[s]
    out.append(_label_text(label))
  return out[::-1]


# -- Scenarios -----------------------------------------------------------------------------------


def mutation_scenario(mutation, tp):
  """A configuration in which `mutation` shows (used by the test and the command line)."""
  if mutation == "shared_flag_row":
    return Config(tp, ("rc", "agA"), mutations=frozenset({mutation}))
  if mutation == "single_buffer":
    return Config(tp, ("agA", "agA", "agA"), mutations=frozenset({mutation}))
  if mutation == "reset_one_at_a_time":
    # Device 0 never pushes, so its peers time out; device 1's host had begun its next call
    # before it saw the error, and that call's push is still queued when reset() zeroes
    # device 0: the late peer.
    return Config(tp, ("agA", "agA"), after_reset=("agA",), failure=(0, "mute"),
                  timeouts="stuck", mutations=frozenset({mutation}))
  if mutation == "cyclic_epoch":
    return Config(tp, ("rc",), initial_epoch=EPOCH_MODULUS // 2,
                  mutations=frozenset({mutation}))
  if mutation == "kernel_join_gathered":
    return Config(tp, ("agA+g",), failure=(tp - 1, "mute"), timeouts="stuck",
                  mutations=frozenset({mutation}))
  if mutation == "no_seen_wait":
    return Config(tp, ("agA+g",), mutations=frozenset({mutation}))
  if mutation == "no_fork":
    return Config(tp, ("agA", "agA", "agA"), mutations=frozenset({mutation}))
  raise ValueError(mutation)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--tp", type=int, default=3)
  p.add_argument("--mutation", choices=sorted(MUTATIONS), default=None,
                 help="reintroduce a defect; without --calls, its default scenario")
  p.add_argument("--calls", default=None, help="comma-separated call kinds: " +
                 ", ".join(CALL_KINDS))
  p.add_argument("--after-reset", default=None, help="calls after a reset()")
  p.add_argument("--queue-depth", type=int, default=2)
  p.add_argument("--failure", default=None, help="DEVICE:stop|mute|freeze")
  p.add_argument("--timeouts", choices=("none", "stuck", "always", "before_reset"), default=None)
  p.add_argument("--initial-epoch", type=int, default=0)
  p.add_argument("--no-por", action="store_true", help="explore without partial-order reduction")
  p.add_argument("--no-static", action="store_true",
                 help="skip the static writer check (show the dynamic race instead)")
  a = p.parse_args(argv)
  if a.mutation and a.calls is None:
    cfg = mutation_scenario(a.mutation, a.tp)
  else:
    calls = tuple((a.calls or "agA,rc,cr").split(","))
    failure = None
    if a.failure:
      dev, kind = a.failure.split(":")
      failure = (int(dev), kind)
    cfg = Config(a.tp, calls,
                 after_reset=tuple(a.after_reset.split(",")) if a.after_reset else None,
                 failure=failure, initial_epoch=a.initial_epoch,
                 mutations=frozenset([a.mutation] if a.mutation else []))
  overrides = {"queue_depth": a.queue_depth}
  if a.timeouts:
    overrides["timeouts"] = a.timeouts
  elif a.failure and cfg.timeouts == "none":
    overrides["timeouts"] = "stuck"
  if a.no_static:
    overrides["check_writers"] = False
  cfg = dataclasses.replace(cfg, **overrides)
  res = check(cfg, por=not a.no_por)
  print(res.summary())
  if res.violation is not None:
    print(res.violation)
    if res.states == 0 and cfg.check_writers:
      # Two writers on a word is the defect; whether they race is for the search to say.
      dyn = check(dataclasses.replace(cfg, check_writers=False), por=not a.no_por)
      print("\nthe same calls, searched without the static writer check:")
      print(dyn.summary())
      if dyn.violation is not None:
        print(dyn.violation)
  return 0 if res.ok else 1


if __name__ == "__main__":
  sys.exit(main())
