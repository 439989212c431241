"""The count of long work before training (a cache build, a folder scan's header reads) for the console: a bar in a
terminal, lines in a log file, where a bar's redraws would make one line of megabytes.

    with counter(total, "lit-dist cache (rank 0)", "img", show=rank == 0) as count:
        count.update(len(batch))
"""

import sys
import time

LOG_EVERY_S = 30.0  # as progress.log_every_s's default: a log file's lines come at one pace


def counter(total: int, title: str, unit: str, show: bool = True, every_s: float = LOG_EVERY_S):
    """A count of ``total`` pieces of work for the console, used as ``with counter(...) as c: c.update(n)``: tqdm's
    bar where stderr is a terminal; elsewhere (a Slurm output, a pipe) a line every ``every_s`` seconds and one at
    the end, which says how long the work took; nothing if not ``show``."""
    if show and sys.stderr.isatty():
        from tqdm import tqdm

        return tqdm(total=total, desc=title, unit=unit, mininterval=1)
    return _Lines(total, title, unit, every_s, show)


class _Lines:
    """``counter``'s lines: "{title}: 1,024 of 4,096 img (25%), 310 img/s, 0:00:10 left"."""

    def __init__(self, total: int, title: str, unit: str, every_s: float, show: bool):
        self.total, self.title, self.unit, self.every_s, self.show = total, title, unit, every_s, show
        self.done = 0
        self.start = self.last = time.monotonic()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        if self.show and exc[0] is None:
            self._line(time.monotonic(), f"done in {hms(time.monotonic() - self.start)}")

    def update(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if self.show and now - self.last >= self.every_s:
            rate = self.done / max(now - self.start, 1e-6)
            left = f", {hms((self.total - self.done) / rate)} left" if rate > 0 and self.total >= self.done else ""
            self._line(now, f"{rate:,.0f} {self.unit}/s{left}")

    def _line(self, now: float, tail: str) -> None:
        share = f" ({100 * self.done / self.total:.0f}%)" if self.total else ""
        print(f"{self.title}: {self.done:,} of {self.total:,} {self.unit}{share}, {tail}", flush=True)
        self.last = now


def hms(seconds: float) -> str:
    """H:MM:SS."""
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"
