"""Exhaustive checks of the CUDA executor's flag protocol, on the model in protocol_model.py.

The protocol is only as good as its worst interleaving, and the GPUs show one interleaving per
run.  So every state the model can reach is visited here (breadth-first, with a visited set
and partial-order reduction), for TP = 2, 3 and 4, over call sequences that mix every kept
path: the unmodified protocol must keep all six invariants of protocol_model's docstring, and
each known defect, put back as a mutation, must be found.  The state counts are printed
(pytest -s, or run this file); the fault-free runs also assert that the search walked every
step of every call, so a model that explores nothing cannot pass.

Run one configuration by hand with `python tests/protocol_model.py --help`.
"""

import contextlib
import dataclasses
import io
import itertools
import os
import re
import sys
import time

from absl.testing import absltest
from absl.testing import parameterized

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import protocol_model as pm  # noqa: E402  (a plain module next to this file, no package)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
C = pm.Config
ALL = pm.CALL_KINDS  # agA, agB, agA+g, agB+g, rc, cr, rg
# RotatingA and RotatingB share flags and differ in slot layout only: one of each below.
FIVE = ("agA", "agB+g", "rc", "cr", "rg")


def _seqs(kinds, length):
  return list(itertools.product(kinds, repeat=length))


# -- The configurations ---------------------------------------------------------------------------

def fault_free_configs(tp):
  """Every device runs the same calls; no failure, no timeout (invariants 1, 2, 3, 6)."""
  if tp == 2:
    return ([C(2, s) for s in _seqs(ALL, 3)] +
            [C(2, s, queue_depth=1) for s in _seqs(FIVE, 3)] +
            # Four calls: the fourth begins only once the first returned (3 in flight).
            [C(2, s, max_in_flight=3) for s in _seqs(("agA+g", "rc", "cr", "rg"), 4)])
  if tp == 3:
    return ([C(3, s) for s in _seqs(ALL, 2)] + [C(3, s) for s in _seqs(FIVE, 3)] +
            [C(3, s, queue_depth=1) for s in _seqs(FIVE, 2)])
  return [C(4, s) for s in _seqs(ALL, 2)] + [C(4, s) for s in _seqs(FIVE, 3)]


def _pairs(kinds):
  """Two-call sequences in which every kind comes first and second, each after two others."""
  n = len(kinds)
  return [(kinds[i], kinds[(i + j) % n]) for j in (1, 2) for i in range(n)]


def failure_configs(tp):
  """One device stops (its host, mid-call too), freezes (host and streams) or never pushes
  (skip_signals).  Invariant 4, and 6.  A bounded wait times out once nothing else can move
  ("stuck"): then 1 and 2 hold even after the timeouts (strict), since no live peer lags.
  At TP=2 (mute also at TP=3) also at any moment ("always"): 1 and 2 up to the first
  timeout."""
  stuck = dict(timeouts="stuck", strict_after_timeout=True)
  if tp == 2:
    return ([C(2, s, failure=(1, f), **stuck)
             for f in ("stop", "mute", "freeze") for s in _seqs(ALL, 2)] +
            [C(2, s, failure=(0, f), timeouts="always")
             for f in ("stop", "mute", "freeze") for s in _seqs(FIVE, 1)] +
            [C(2, s, failure=(0, "mute"), timeouts="always") for s in _pairs(FIVE)])
  if tp == 3:
    return ([C(3, s, failure=(2, f), **stuck) for f in ("stop", "mute")
             for s in _seqs(ALL, 1) + _pairs(FIVE)] +
            [C(3, s, failure=(2, "freeze"), **stuck) for s in _seqs(ALL, 1)] +
            [C(3, (k,), failure=(1, "mute"), timeouts="always") for k in FIVE])
  return ([C(4, (k,), failure=(3, "mute"), **stuck) for k in ALL] +
          [C(4, (k,), failure=(3, "stop"), **stuck) for k in ("agA", "agB+g", "rc", "rg")] +
          [C(4, (k,), failure=(3, "freeze"), **stuck) for k in ("rc", "rg")] +
          [C(4, s, failure=(1, "mute"), **stuck) for s in (("agA+g", "rc"), ("cr", "rg"))])


def reset_configs(tp):
  """Calls, reset() on every host, calls again (invariants 5 and 3 or 4).  The late peer:
  either a timeout at any moment before the reset (a slow live peer), or device 0 never
  pushes, the others time out, and a host begins its next call before it sees the error."""
  mute = dict(failure=(0, "mute"), timeouts="stuck")
  if tp == 2:
    return ([C(2, (a,), after_reset=(b,), timeouts="before_reset") for a, b in _seqs(ALL, 2)] +
            [C(2, (a, a), after_reset=(b,), **mute) for a, b in _seqs(FIVE, 2)])
  if tp == 3:
    return ([C(3, (a,), after_reset=(b,), timeouts="before_reset")
             for a, b in (("rc", "agA+g"), ("rg", "cr"))] +
            [C(3, (a, a), after_reset=(b,), **mute) for a, b in (("agA", "rc"), ("cr", "agA+g"))])
  return [C(4, (a,), after_reset=(b,), **mute) for a, b in (("rc", "agA+g"), ("agA", "rc"))]


def stale_word_configs(tp):
  """A word left unwritten for many calls (here EPOCH_MODULUS // 2 AllGathers, which never
  write the ring row): with 64-bit epochs and >= it must still wait."""
  return [C(tp, s, initial_epoch=pm.EPOCH_MODULUS // 2) for s in (("rc",), ("cr", "agA"))]


def _steps_of_complete_run(config):
  """Transitions of a run in which every call completes with no timeout: each host action
  once (reset() once for the group) and each stream step once."""
  m = pm.Model(config)
  host = sum(len(a) for a in m.actions)
  resets = sum(a[0] == "reset" for a in m.actions[0])
  streams = sum(len(lau.steps) for launches in m.launches for lau in launches)
  return host - resets * (m.n - 1) + streams


def _steps_after_reset(config):
  """Stream steps of the calls after reset(): every run takes them all."""
  m = pm.Model(config)
  return sum(len(lau.steps) for launches in m.launches for lau in launches
             if lau.call >= len(config.calls))


class _Totals:
  """State counts per group, printed at the end of the run."""
  rows = []

  @classmethod
  def add(cls, name, results, seconds):
    cls.rows.append((name, len(results), sum(r.states for r in results),
                     sum(r.transitions for r in results), max(r.states for r in results),
                     seconds))

  @classmethod
  def report(cls):
    if not cls.rows:
      return
    print("\nprotocol model: configurations, reachable states (after reduction), "
          "transitions, largest, seconds")
    for name, n, states, trans, largest, secs in cls.rows:
      print(f"  {name:28s} {n:5d} {states:9d} {trans:9d} {largest:7d} {secs:6.1f}")


def _check_all(test, name, configs):
  t0 = time.perf_counter()
  results = []
  for config in configs:
    res = pm.check(config)
    if not res.ok:
      test.fail(f"{res.summary()}\n{res.violation.format()}")
    test.assertGreaterEqual(res.terminal, 1, config.label())
    results.append(res)
  _Totals.add(name, results, time.perf_counter() - t0)
  return results


class ProtocolTest(parameterized.TestCase):
  """The protocol after the epoch, reset and gathered-join changes keeps every invariant."""

  @classmethod
  def tearDownClass(cls):
    _Totals.report()
    super().tearDownClass()

  @parameterized.parameters(2, 3, 4)
  def test_fault_free(self, tp):
    configs = fault_free_configs(tp)
    for config, res in zip(configs, _check_all(self, f"fault-free tp={tp}", configs)):
      # Every run walks every step: a search that explored nothing would stop short.
      self.assertEqual(res.depth, _steps_of_complete_run(config), config.label())
      self.assertEqual(res.terminal, 1, config.label())  # one final state: data is tags

  @parameterized.parameters(2, 3, 4)
  def test_failed_peer(self, tp):
    configs = failure_configs(tp)
    for config, res in zip(configs, _check_all(self, f"failed peer tp={tp}", configs)):
      # The failure bites in more than one way (where it strikes, which wait times out).
      self.assertGreater(res.terminal, 1, config.label())

  @parameterized.parameters(2, 3, 4)
  def test_reset_with_late_peer(self, tp):
    configs = reset_configs(tp)
    for config, res in zip(configs, _check_all(self, f"reset tp={tp}", configs)):
      # Every final state has run the calls after the reset to their end.
      self.assertGreaterEqual(res.depth, _steps_after_reset(config), config.label())

  @parameterized.parameters(2, 3, 4)
  def test_stale_word_waits(self, tp):
    _check_all(self, f"stale word tp={tp}", stale_word_configs(tp))

  def test_a_peer_late_past_the_timeout_is_left_to_the_error_record(self):
    # The limit of the strict checks: device 0 times out waiting for a live but slow device
    # 1 and moves on; device 1's wait for an older call then passes on device 0's newer epoch
    # and reads its data.  Only the error record, set by the timeout, reports it.
    cfg = C(2, ("rc", "rc", "rc"), timeouts="always", strict_after_timeout=True)
    res = pm.check(cfg)
    self.assertIsNotNone(res.violation, res.summary())
    self.assertEqual(res.violation.invariant, 1, res.violation.format())
    self.assertIn("TIMES OUT", "\n".join(res.violation.trace))

  def test_one_writer_per_flag_word_up_to_tp8(self):
    for tp in range(2, 9):
      model = pm.Model(C(tp, ALL))
      for (dev, word), by in model.flag_writers().items():
        self.assertLen(by, 1, f"tp={tp} device {dev} {word}: {dict(by)}")


# -- Mutations: each known defect, put back, is found ---------------------------------------------

# mutation -> (the TPs its scenario runs at, the invariants its first counterexample may break)
MUTATION_EXPECT = {
    "shared_flag_row": ((3, 4), {6}),
    "single_buffer": ((2, 3, 4), {1, 2}),
    "reset_one_at_a_time": ((2, 3), {5}),  # (TP=4: found too, after 660k states)
    "cyclic_epoch": ((2, 3, 4), {1}),
    "kernel_join_gathered": ((2, 3, 4), {4}),
    "no_seen_wait": ((2, 3, 4), {1}),
    "no_fork": ((2, 3, 4), {1, 2}),
}


class MutationTest(parameterized.TestCase):

  def _expect(self, config, invariants, stop_on=None):
    """The checker finds a violation of one of `invariants`; prints its counterexample."""
    res = pm.check(config, stop_on=stop_on)
    self.assertIsNotNone(res.violation, f"not found: {res.summary()}")
    self.assertIn(res.violation.invariant, invariants, res.violation.format())
    # Shown with pytest -s or when this file runs by itself.
    print(f"\n{res.summary()}\n{res.violation.format()}")
    return res

  @parameterized.parameters(sorted(MUTATION_EXPECT))
  def test_mutation_is_found(self, mutation):
    tps, invariants = MUTATION_EXPECT[mutation]
    for tp in tps:
      self._expect(pm.mutation_scenario(mutation, tp), invariants)

  def test_shared_flag_row_races_from_tp4(self):
    # The dynamic hazard behind the static two-writer finding (docs/design.md, "Epochs"): a
    # device done with a ring call early pushes the next AllGather's epoch into the word the
    # left neighbour has not signalled yet.  TP=3 has two writers per word but no such race.
    for calls in (("rc", "agA"), ("cr", "rg"), ("rc", "agA+g")):
      cfg = C(4, calls, mutations=frozenset({"shared_flag_row"}), check_writers=False)
      res = self._expect(cfg, {1})
      self.assertIn("stage 2", res.violation.message)
      self.assertTrue(pm.check(dataclasses.replace(cfg, tp=3)).ok)

  def test_single_buffer_overwrites_a_slot_in_use(self):
    # Invariant 2 itself (the overwrite between a stage's wait and its GEMM), not only the
    # wait that passes on the later call's epoch.
    cfg = C(3, ("rc", "rc", "rc"), mutations=frozenset({"single_buffer"}))
    self._expect(cfg, {2}, stop_on={2})

  def test_reset_one_at_a_time_needs_the_late_peer(self):
    # With every device pushing, no wait times out, no call is left queued when reset() runs,
    # and the old reset is safe; so is it with a single call before the reset.
    cfg = pm.mutation_scenario("reset_one_at_a_time", 2)
    self.assertTrue(pm.check(dataclasses.replace(cfg, failure=None, timeouts="none")).ok)
    self.assertTrue(pm.check(dataclasses.replace(cfg, calls=("agA",))).ok)

  def test_cyclic_epoch_needs_the_stale_word(self):
    cfg = pm.mutation_scenario("cyclic_epoch", 2)
    self.assertTrue(pm.check(dataclasses.replace(cfg, initial_epoch=0)).ok)

  def test_kernel_join_needs_a_failed_peer(self):
    cfg = pm.mutation_scenario("kernel_join_gathered", 3)
    self.assertTrue(pm.check(dataclasses.replace(cfg, failure=None, timeouts="none")).ok)

  def test_command_line(self):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
      rc = pm.main(["--tp", "3", "--mutation", "shared_flag_row"])
    self.assertEqual(rc, 1)
    self.assertIn("VIOLATION of invariant 6", out.getvalue())
    self.assertIn("counterexample", out.getvalue())
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
      rc = pm.main(["--tp", "3", "--calls", "agA+g,rc,cr"])
    self.assertEqual(rc, 0, out.getvalue())
    self.assertTrue(out.getvalue().startswith("OK"), out.getvalue())


# -- The reduction explores enough ---------------------------------------------------------------

def _explore(config, por):
  """(final states, invariants violated) over the whole graph, depth first."""
  model = pm.Model(config)
  init = model.initial_state()
  seen, stack, finals, broken = {init}, [init], set(), set()
  while stack:
    s = stack.pop()
    succ = model.successors(s, por)
    if not succ:
      finals.add(s)
    for _, t, viol in succ:
      if viol is not None:
        broken.add(viol[0])
      elif t not in seen:
        seen.add(t)
        stack.append(t)
  return finals, broken


class ReductionTest(parameterized.TestCase):
  """Partial-order reduction must reach every final state and every violation the full
  graph reaches (it leaves out orders of steps that commute).  Small graphs only."""

  @parameterized.parameters(
      C(2, ("agA+g", "rc", "agA+g")),
      C(2, ("cr", "agA", "rc"), queue_depth=1),
      C(2, ("rg", "agA", "rg"), mutations=frozenset({"no_fork"})),
      C(2, ("rc", "agB+g", "cr"), mutations=frozenset({"single_buffer"})),
      C(2, ("agA+g", "rc", "agA+g"), mutations=frozenset({"no_seen_wait"})),
      C(2, ("cr", "agA+g"), failure=(1, "freeze"), timeouts="stuck"),
      C(2, ("agA+g",), failure=(1, "stop"), timeouts="always",
        mutations=frozenset({"kernel_join_gathered"})),
      C(2, ("rg", "cr"), failure=(0, "mute"), timeouts="always"),
      C(2, ("cr",), after_reset=("agA+g",), timeouts="before_reset"),
      C(2, ("agA", "agA"), after_reset=("agA+g",), failure=(0, "mute"), timeouts="stuck"),
      C(3, ("rc", "agA"), queue_depth=1, mutations=frozenset({"shared_flag_row"}),
        check_writers=False),
      C(3, ("rc",), failure=(2, "freeze"), timeouts="stuck"),
      C(3, ("rc",), after_reset=("rg",), failure=(0, "mute"), timeouts="stuck"),
  )
  def test_reduction_reaches_what_full_search_reaches(self, config):
    reduced = _explore(config, por=True)
    full = _explore(config, por=False)
    self.assertEqual(reduced, full, config.label())


# -- The model names real code ----------------------------------------------------------------

def _find_in_cc(name):
  """Files under cc/ that contain `name`."""
  hits = []
  for root, _, files in os.walk(os.path.join(REPO, "cc")):
    for f in files:
      path = os.path.join(root, f)
      try:
        with open(path, encoding="utf-8", errors="replace") as fh:
          if name in fh.read():
            hits.append(os.path.relpath(path, REPO))
      except OSError:
        pass
  return sorted(hits)


class SourcesTest(absltest.TestCase):

  def test_each_step_names_a_function_that_exists(self):
    if not os.path.isdir(os.path.join(REPO, "cc")):
      self.skipTest("no cc/ next to tests/: tests run outside the repository")
    missing = []
    for step, (path, func) in sorted(pm.MODEL_SOURCES.items()):
      # A name, or the start of one ("StreamWriteValue" for ...32 and ...64).
      pattern = re.compile(r"\b" + re.escape(func))
      full = os.path.join(REPO, path)
      if os.path.exists(full):
        with open(full, encoding="utf-8", errors="replace") as fh:
          if pattern.search(fh.read()):
            continue
      missing.append(f"{step}: {func} not in {path}" + (
          f" (it is in {', '.join(where)})" if (where := _find_in_cc(func)) else ""))
    self.assertEmpty(missing, "update MODEL_SOURCES, the C++ each step stands for:\n" +
                     "\n".join(missing))

  def test_every_step_kind_has_a_source(self):
    model = pm.Model(C(3, ALL + ("agA",), after_reset=("rc",), timeouts="before_reset",
                       failure=None))
    used = {st[-1] for launches in model.launches for lau in launches for st in lau.steps}
    used |= {"host_begin_call", "host_take_epoch", "host_enqueue", "stage_wait_timeout",
             "ag_join_timeout", "reset"}
    self.assertEmpty(sorted(used - set(pm.MODEL_SOURCES)))


if __name__ == "__main__":
  absltest.main()
