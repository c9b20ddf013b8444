"""cc/sources.bzl, cc/BUILD and CMakeLists.txt agree on the C++/CUDA sources.

cc/sources.bzl is the single list of sources (valid Starlark and valid Python); cc/BUILD load()s
it and CMakeLists.txt exec()s it.  This fails when a file under cc/ is not listed, is listed
twice, is listed but missing, or when a list is not wired into one of the two builds.  The
checks are functions of a directory, so the tests below also run them on broken copies.
"""

import ast
import os
import re
import shutil
import subprocess
import sys
import tempfile

from absl.testing import absltest

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))
SOURCE_SUFFIXES = (".h", ".cc", ".cu", ".cuh", ".hpp", ".cpp")


def read(path: str) -> str:
  with open(path) as f:
    return f.read()


def source_lists(repo: str) -> dict[str, list[str]]:
  """The lists of cc/sources.bzl, exec'd as Python (as CMakeLists.txt does)."""
  scope: dict = {}
  exec(read(os.path.join(repo, "cc", "sources.bzl")), scope)  # pylint: disable=exec-used
  return {k: v for k, v in scope.items() if k.isupper()}


def starlark_problems(repo: str) -> list[str]:
  """sources.bzl must be plain `NAME = ["...", ...]` statements (valid in both languages)."""
  problems = []
  tree = ast.parse(read(os.path.join(repo, "cc", "sources.bzl")))
  for node in tree.body:
    ok = (isinstance(node, ast.Assign) and len(node.targets) == 1
          and isinstance(node.targets[0], ast.Name) and node.targets[0].id.isupper()
          and isinstance(node.value, ast.List)
          and all(isinstance(e, ast.Constant) and isinstance(e.value, str)
                  for e in node.value.elts))
    if not ok:
      problems.append(f"sources.bzl line {node.lineno}: not an UPPER_CASE list of strings")
  return problems


def files_under_cc(repo: str) -> list[str]:
  cc = os.path.join(repo, "cc")
  found = []
  for root, _, names in os.walk(cc):
    for name in names:
      if name.endswith(SOURCE_SUFFIXES):
        found.append(os.path.relpath(os.path.join(root, name), cc).replace(os.sep, "/"))
  return sorted(found)


def listing_problems(repo: str) -> list[str]:
  """Every source file under cc/ is in exactly one list; every listed file exists."""
  lists = source_lists(repo)
  problems = []
  owners: dict[str, list[str]] = {}
  for name, files in lists.items():
    for f in files:
      owners.setdefault(f, []).append(name)
      if not os.path.isfile(os.path.join(repo, "cc", f)):
        problems.append(f"{name} lists {f}, which does not exist under cc/")
  for f in files_under_cc(repo):
    if f not in owners:
      problems.append(f"cc/{f} is in no list of cc/sources.bzl")
    elif len(owners[f]) > 1:
      problems.append(f"cc/{f} is in several lists of cc/sources.bzl: {owners[f]}")
  return problems


def bazel_problems(repo: str) -> list[str]:
  """cc/BUILD loads every list of sources.bzl (and only those) and uses each one."""
  build = read(os.path.join(repo, "cc", "BUILD"))
  m = re.search(r'load\(\s*":sources\.bzl"\s*,(.*?)\)', build, re.S)
  if not m:
    return ['cc/BUILD does not load(":sources.bzl", ...)']
  loaded = re.findall(r'"(\w+)"', m.group(1))
  body = build[:m.start()] + build[m.end():]
  defined = set(source_lists(repo))
  problems = [f"cc/BUILD does not load {n} from sources.bzl" for n in sorted(defined - set(loaded))]
  problems += [f"cc/BUILD loads {n}, which sources.bzl does not define"
               for n in sorted(set(loaded) - defined)]
  problems += [f"cc/BUILD loads {n} but no target uses it" for n in sorted(set(loaded))
               if not re.search(rf"\b{n}\b", body)]
  return problems


def cmake_problems(repo: str) -> list[str]:
  """CMakeLists.txt reads sources.bzl (with its own snippet) and compiles every *_SRCS list."""
  cmake = read(os.path.join(repo, "CMakeLists.txt"))
  m = re.search(r'-c\s*"([^"]*)"\s*"\$\{CMAKE_CURRENT_SOURCE_DIR\}/cc/sources\.bzl"', cmake)
  if not m:
    return ["CMakeLists.txt does not read cc/sources.bzl with `python -c ... cc/sources.bzl`"]
  # Run the very snippet CMake runs, and check it sees the lists that Python sees.
  out = subprocess.run([sys.executable, "-c", m.group(1),
                        os.path.join(repo, "cc", "sources.bzl")],
                       capture_output=True, text=True, check=False)
  if out.returncode:
    return [f"CMakeLists.txt's sources.bzl reader failed: {out.stderr.strip()}"]
  seen = {}
  for entry in out.stdout.strip().split(";"):
    name, _, files = entry.partition("=")
    seen[name] = [f for f in files.split(",") if f]
  problems = []
  if seen != source_lists(repo):
    problems.append(f"CMake reads {seen}, Python reads {source_lists(repo)}")
  for name in sorted(source_lists(repo)):
    if name.endswith("_SRCS") and "${" + name + "}" not in cmake:
      problems.append(f"CMakeLists.txt never compiles ${{{name}}}")
  return problems


def all_problems(repo: str) -> list[str]:
  return (starlark_problems(repo) + listing_problems(repo) + bazel_problems(repo)
          + cmake_problems(repo))


class BuildSourcesTest(absltest.TestCase):

  def test_sources_bzl_is_plain_lists(self):
    self.assertEqual(starlark_problems(REPO), [])

  def test_every_file_listed_once_and_every_listed_file_exists(self):
    self.assertNotEmpty(files_under_cc(REPO))
    self.assertEqual(listing_problems(REPO), [])

  def test_bazel_loads_every_list(self):
    self.assertEqual(bazel_problems(REPO), [])

  def test_cmake_reads_sources_bzl(self):
    self.assertEqual(cmake_problems(REPO), [])


class CheckerCatchesDisagreementTest(absltest.TestCase):
  """The checks above on broken copies of the build files: each breakage is reported."""

  def setUp(self):
    super().setUp()
    self.repo = tempfile.mkdtemp()
    self.addCleanup(shutil.rmtree, self.repo)
    shutil.copytree(os.path.join(REPO, "cc"), os.path.join(self.repo, "cc"))
    shutil.copy(os.path.join(REPO, "CMakeLists.txt"), self.repo)
    self.assertEqual(all_problems(self.repo), [])  # the copy starts consistent

  def edit(self, rel, old, new, count=1):
    path = os.path.join(self.repo, rel)
    text = read(path)
    self.assertIn(old, text)
    with open(path, "w") as f:
      f.write(text.replace(old, new, count))

  def test_unlisted_file(self):
    with open(os.path.join(self.repo, "cc", "cpu", "extra.cu"), "w") as f:
      f.write("// new kernel\n")
    self.assertEqual(all_problems(self.repo), ["cc/cpu/extra.cu is in no list of cc/sources.bzl"])

  def test_file_in_two_lists(self):
    self.edit("cc/sources.bzl", 'CPU_HDRS = [\n', 'CPU_HDRS = [\n    "cpu/gemm_cpu.cc",\n')
    self.assertLen(all_problems(self.repo), 1)
    self.assertIn("in several lists", all_problems(self.repo)[0])

  def test_listed_file_missing(self):
    os.remove(os.path.join(self.repo, "cc", "cpu", "gemm_cpu.cc"))
    self.assertEqual(all_problems(self.repo),
                     ["CPU_SRCS lists cpu/gemm_cpu.cc, which does not exist under cc/"])

  def test_list_not_loaded_by_bazel(self):
    with open(os.path.join(self.repo, "cc", "sources.bzl"), "a") as f:
      f.write('NEW_SRCS = []\n')
    self.edit("CMakeLists.txt", "${CPU_SRCS}", "${CPU_SRCS} ${NEW_SRCS}")
    self.assertEqual(all_problems(self.repo), ["cc/BUILD does not load NEW_SRCS from sources.bzl"])

  def test_list_not_compiled_by_cmake(self):
    self.edit("CMakeLists.txt", "${CPU_SRCS}", "", count=-1)
    self.assertEqual(all_problems(self.repo), ["CMakeLists.txt never compiles ${CPU_SRCS}"])

  def test_cmake_not_reading_sources_bzl(self):
    self.edit("CMakeLists.txt", "/cc/sources.bzl", "/cc/other.bzl", count=-1)
    self.assertLen(all_problems(self.repo), 1)
    self.assertIn("does not read cc/sources.bzl", all_problems(self.repo)[0])

  def test_sources_bzl_not_plain_lists(self):
    with open(os.path.join(self.repo, "cc", "sources.bzl"), "a") as f:
      f.write('EXTRA = CPU_SRCS + ["cpu/gemm_cpu.cc"]\n')
    self.assertIn("sources.bzl line", " ".join(all_problems(self.repo)))


if __name__ == "__main__":
  absltest.main()
