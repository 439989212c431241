"""Long work before training in the console: a bar in a terminal, lines with rate and time left in a log file."""

import re
import sys

from lit_dist.runtime.counter import counter


def test_counter_in_a_log_file_writes_lines_with_rate_and_time_left_then_one_at_the_end(capsys, monkeypatch):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    with counter(4096, "lit-dist cache (rank 0)", "img", every_s=0.0) as count:
        count.update(1024)
        count.update(3072)
    lines = capsys.readouterr().out.splitlines()
    assert re.fullmatch(r"lit-dist cache \(rank 0\): 1,024 of 4,096 img \(25%\), [\d,]+ img/s, 0:\d\d:\d\d left",
                        lines[0]), lines
    assert lines[1].startswith("lit-dist cache (rank 0): 4,096 of 4,096 img (100%), ")
    assert re.fullmatch(r".*: 4,096 of 4,096 img \(100%\), done in 0:00:0\d", lines[2]) and len(lines) == 3, lines


def test_counter_in_a_log_file_says_when_short_work_is_done_and_nothing_unless_shown_and_a_bar_in_a_terminal(
        capsys, monkeypatch):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    for show in (True, False):  # done before its first line; not shown
        with counter(10, "scan", "img", show=show, every_s=60.0) as count:
            count.update(10)
    assert capsys.readouterr() == ("scan: 10 of 10 img (100%), done in 0:00:00\n", "")
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    with counter(10, "scan", "img") as count:
        count.update(10)
    assert "scan: 100%|" in capsys.readouterr().err
