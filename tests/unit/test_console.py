"""Lines printed at the same moment by the processes of a run stay whole in the console they share."""

import os
import re
import subprocess
import sys
import time

import pytest

# Two writers as two ranks: each prints many long lines into one pipe, both starting at the same instant.
WRITER = """
import sys, time
from lit_dist.watch.console import whole_lines
whole_lines()
time.sleep(max(0.0, float(sys.argv[2]) - time.time()))
for i in range(400):
    print(f"lit-dist: error: rank {sys.argv[1]} line {i} " + "x" * 300, file=sys.stderr)
"""


def _console_of_two() -> list[str]:
    read, write = os.pipe()
    start = str(time.time() + 2.0)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(rank), start], stderr=write, env=env)
             for rank in (0, 1)]
    os.close(write)
    with os.fdopen(read) as console:
        lines = console.read().splitlines()
    assert [p.wait(timeout=60) for p in procs] == [0, 0]
    return lines


@pytest.mark.process
def test_lines_of_two_ranks_printing_at_once_under_pythonunbuffered_stay_whole():
    whole = re.compile(r"lit-dist: error: rank [01] line \d+ x{300}")
    lines = _console_of_two()  # without whole_lines: glued lines and empty ones
    broken = [line[:80] for line in lines if not whole.fullmatch(line)]
    assert not broken and len(lines) == 800, (len(lines), broken[:3])
