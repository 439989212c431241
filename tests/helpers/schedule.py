"""The order of the tests for ``pytest -n N --dist worksteal`` (.ci/test): every worker busy until the end.

pytest-xdist's work-stealing scheduler first hands worker i the i-th of N equal runs of the collected list (by
count), then lets an idle worker take the second half of the longest queue, from its end. So the list is laid out
as N runs of those lengths whose times are about equal: modules as wholes (a module's fixtures are made once),
the longest first and each into the run with the least time so far (longest-processing-time first), then the
modules of quick tests filling each run to its length, a module cut only where a run is full. Within a run the
long modules come first: what another worker steals from its end is quick.

A module's time is what it took in the last recorded full run (``DURATIONS``, seconds as three workers on CI's two
cores measure them); a module not in it is estimated from its tests' markers. The file only orders the tests: a
stale one costs minutes, never a result. Record it again after adding slow tests:

    LIT_DIST_TEST_DURATIONS=1 bash .ci/test      # rewrites tests/durations.json from this run
"""

import json
import os
from collections import defaultdict
from pathlib import Path

import pytest

DURATIONS = Path(__file__).resolve().parents[1] / "durations.json"
RECORD_ENV = "LIT_DIST_TEST_DURATIONS"  # "1": the run writes DURATIONS at its end
# Seconds per test of a module with no recorded time, by its first marker in this order (tiers: pyproject.toml).
ESTIMATE_S = {"slow": 30.0, "distributed": 10.0, "s3": 10.0, "process": 5.0}
UNIT_ESTIMATE_S = 0.3
QUICK_S = 1.0  # a module whose tests take less than this each fills the runs


class Order:
    """The plugin: after the tiers' markers and the selection (-m, -k), the layout for this run's workers."""

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items):
        workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))  # set in each of xdist's workers
        if workers > 1:
            order(items, workers)


def order(items: list, workers: int) -> None:
    """Reorder ``items`` (pytest's collected list) in place for ``workers`` work-stealing workers."""
    modules: dict[str, list] = defaultdict(list)
    for item in items:
        modules[_module(item)].append(item)
    recorded = _recorded()
    cost = {m: recorded.get(m, sum(_estimate(i) for i in tests)) for m, tests in modules.items()}
    long = sorted((m for m in modules if cost[m] >= QUICK_S * len(modules[m])), key=lambda m: -cost[m])
    quick = [m for m in modules if m not in long]
    lengths = _run_lengths(len(items), workers)
    runs: list[list] = [[] for _ in range(workers)]
    times = [0.0] * workers
    for m in long:
        i = min(range(workers), key=lambda r: times[r])
        runs[i].extend(modules[m])
        times[i] += cost[m]
    rest = [item for m in quick for item in modules[m]]
    for i in sorted(range(workers), key=lambda r: times[r]):  # the emptiest run first: the quick tests' time goes there
        take = max(0, lengths[i] - len(runs[i]))
        runs[i].extend(rest[:take])
        rest = rest[take:]
    runs[-1].extend(rest)  # only where the long modules alone overfill a run: the cut then falls elsewhere
    items[:] = [item for run in runs for item in run]


def _run_lengths(count: int, workers: int) -> list[int]:
    """How many of ``count`` tests xdist's work stealing first hands each worker (its ``check_schedule``)."""
    lengths = []
    for i in range(workers):
        lengths.append(count // (workers - i))
        count -= lengths[-1]
    return lengths


def _module(item) -> str:
    return item.nodeid.split("::")[0]


def _estimate(item) -> float:
    names = {mark.name for mark in item.iter_markers()}
    return next((s for mark, s in ESTIMATE_S.items() if mark in names), UNIT_ESTIMATE_S)


def _recorded() -> dict[str, float]:
    try:
        return json.loads(DURATIONS.read_text())
    except (OSError, ValueError):
        return {}


class Recorder:
    """Sums each module's setup, call and teardown seconds as the workers report them; writes DURATIONS at the end
    (modules this run did not run keep their recorded time)."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)

    def pytest_runtest_logreport(self, report):
        self.seconds[report.nodeid.split("::")[0]] += report.duration

    def pytest_sessionfinish(self):
        merged = {**_recorded(), **{m: round(s, 1) for m, s in self.seconds.items()}}
        DURATIONS.write_text(json.dumps(dict(sorted(merged.items())), indent=1) + "\n")
