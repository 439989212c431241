"""DeepSpeed's CPU operators are built once per machine under torch's lock file: a run waits for another
process's build with a line now and then (torch waits without a word); a killed build's lock is one line and exit 2
(tests/distributed/test_deepspeed.py, through the command line)."""

import threading
import time

import pytest

pytest.importorskip("deepspeed")


def test_a_build_in_progress_is_waited_for_with_a_line_and_the_run_goes_on_when_it_ends(tmp_path, monkeypatch, capsys):
    from lit_dist.strategies import deepspeed

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = tmp_path / "cpu_adam" / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    threading.Timer(1.0, lock.unlink).start()  # the other process's build ends
    began = time.monotonic()
    deepspeed._wait_for_another_build("cpu_adam", say=True, every_s=0.3)
    assert 1.0 <= time.monotonic() - began < 5
    out = capsys.readouterr().out
    assert f"lit-dist: waiting for another process to build DeepSpeed's CPU operator cpu_adam ({lock}, " in out


def test_a_lock_older_than_any_build_is_named_with_the_fix(tmp_path, monkeypatch):
    from lit_dist.errors import ConfigError
    from lit_dist.strategies import deepspeed

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(deepspeed, "STALE_LOCK_S", 0.5)
    lock = tmp_path / "cpu_adam" / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    with pytest.raises(ConfigError, match=rf"cpu_adam has been locked for 0 minutes by {lock}, which a build leaves "
                                          "when it is killed: .* delete that file"):
        deepspeed._wait_for_another_build("cpu_adam", say=False)
