"""The console the run's processes share: every line reaches it in one write.

Under ``PYTHONUNBUFFERED=1`` (common in cluster job scripts, and set on CI machines) Python writes stdout and
stderr through (``write_through``): ``print(line)`` is two writes, the line and then its newline. Ranks
printing at the same moment into one terminal, pipe or Slurm log then glue their lines together ("...step 4lit-dist:
error: ...", then an empty line), so a rank's "lit-dist: error:" line is no longer a line of its own. Measured on
CI: a full disk's two identical lines came out as one. Line buffering without write-through keeps the output
unbuffered in effect (each line is written as it ends) while making each line one write.
"""

import sys


def whole_lines() -> None:
    """Make this process write each line of stdout and stderr in one write (see the module's docstring). Leaves
    alone a stream that is not the process's own (a test's capture, a wrapper around it)."""
    for stream, own in ((sys.stdout, sys.__stdout__), (sys.stderr, sys.__stderr__)):
        if stream is not None and stream is own and getattr(stream, "write_through", False):
            stream.reconfigure(write_through=False, line_buffering=True)
