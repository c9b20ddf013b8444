"""Command-line checks shared by the benchmark and the examples (standard library only)."""

from __future__ import annotations

import argparse
import os


def check_output_path(p: argparse.ArgumentParser, flag: str, path: str) -> None:
  """Usage error unless `path` can be written (also atomically: a temporary file beside it,
  then a rename): its directory exists and is writable, and it is not a directory itself."""
  if not path:
    p.error(f"{flag}: empty path")
  if os.path.isdir(path):
    p.error(f"{flag}: {path} is a directory")
  parent = os.path.dirname(os.path.abspath(path))
  if not os.path.isdir(parent):
    p.error(f"{flag}: {path}: directory {parent} does not exist")
  if not os.access(parent, os.W_OK | os.X_OK):
    p.error(f"{flag}: {path}: directory {parent} is not writable")
