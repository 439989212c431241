"""The suite's layout for work-stealing workers (tests/helpers/schedule.py): equal runs, long modules first."""

import pytest

from tests.helpers import schedule


class Item:
    def __init__(self, nodeid: str, *marks: str):
        self.nodeid = nodeid
        self.marks = [pytest.Mark(name, (), {}) for name in marks]

    def iter_markers(self):
        return iter(self.marks)


def runs(items, workers):
    """The runs xdist's work stealing first hands the workers, from the laid-out list."""
    out, start = [], 0
    for length in schedule._run_lengths(len(items), workers):
        out.append(items[start:start + length])
        start += length
    return out


def test_the_runs_have_xdists_lengths_and_about_equal_times(monkeypatch):
    recorded = {f"tests/process/test_p{i}.py": s for i, s in enumerate([400, 300, 250, 200, 120, 90, 60, 30])}
    monkeypatch.setattr(schedule, "_recorded", lambda: recorded)
    items = [Item(f"{m}::test_{j}", "process") for m in recorded for j in range(3)]
    items += [Item(f"tests/unit/test_u{i}.py::test_{j}") for i in range(20) for j in range(10)]
    schedule.order(items, 3)
    assert sum(schedule._run_lengths(len(items), 3)) == len(items) == 224
    times = []
    for run in runs(items, 3):
        modules = {i.nodeid.split("::")[0] for i in run}
        times.append(sum(recorded.get(m, 0) for m in modules))
        long = [i for i in run if i.nodeid.startswith("tests/process/")]
        assert run[:len(long)] == long  # the long modules open the run: stealing takes from its end
    assert max(times) - min(times) <= 100, times  # 1,450 s in three runs: LPT leaves them within the last module
    for m in recorded:  # a long module is never cut between workers
        assert len({r for r, run in enumerate(runs(items, 3)) for i in run if i.nodeid.startswith(m)}) == 1


def test_a_module_without_a_recorded_time_is_estimated_from_its_markers(monkeypatch):
    monkeypatch.setattr(schedule, "_recorded", lambda: {})
    items = [Item("tests/process/test_a.py::t", "process", "slow"), Item("tests/process/test_b.py::t", "process"),
             Item("tests/unit/test_c.py::t")]
    schedule.order(items, 2)
    assert [i.nodeid for i in items][0] == "tests/process/test_a.py::t"  # 30 s before 5 s; the unit test fills
    assert schedule._estimate(items[1]) == schedule.ESTIMATE_S["process"]
    assert schedule._estimate(items[2]) == schedule.UNIT_ESTIMATE_S
