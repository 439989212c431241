"""Preflight: its settings, how outliers are named, and a one-process run from the command line and from fit
(the three-node run with a starved rank is tests/slurm/test_preflight.py)."""

import json

import pytest

from lit_dist.callbacks.preflight import Preflight, RankFigures, outliers
from lit_dist.errors import ConfigError
from tests.conftest import lit_dist, quickstart_args


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"min_fraction": 1.0}, r"preflight.min_fraction = 1.0: must be between 0 and 1"),
    ({"min_fraction": 0}, r"preflight.min_fraction = 0: must be between 0 and 1"),
    ({"seconds": 0}, r"preflight.seconds = 0: must be positive"),
    ({"io_mb": 0}, r"preflight.io_mb = 0: must be at least 1"),
])
def test_bars_that_always_or_never_trip_are_refused(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        Preflight(**kwargs)


def _rank(rank, node, matmul=1.0, read=500.0, write=300.0, loader=1000.0):
    return RankFigures(rank, node, node, matmul, read, write, loader)


def test_each_figure_below_the_fraction_of_its_median_is_named_with_rank_node_and_values():
    ranks = [_rank(0, "a"), _rank(1, "a", matmul=0.98), _rank(2, "b", matmul=0.3, write=100.0), _rank(3, "b")]
    found = outliers(ranks, {"a": 10.0, "b": 3.0, "c": 9.5}, min_fraction=0.5)
    assert found == ["rank 2 (b) matmul 0.3 vs median 0.99 TFLOP/s", "rank 2 (b) write 100 vs median 300 MB/s",
                     "node b all-reduce 3.00 vs median 9.50 GB/s"]
    assert outliers(ranks, {"a": 10.0}, min_fraction=0.2) == [], "one node: nothing to compare its all-reduce with"
    missing = [_rank(0, "a", read=None), _rank(1, "a", read=10.0)]  # a rank without files to read: not compared
    assert not [o for o in outliers(missing, {}, 0.5) if "read" in o]


@pytest.mark.process
def test_the_command_prints_the_table_and_writes_preflight_json_then_fit_runs_it_before_training(tmp_path, demo_data):
    args = quickstart_args(tmp_path, demo_data, data__num_workers=0, data__batch_size_per_device=8, run__run_id="p")
    flags = ["--preflight.seconds", "0.3", "--preflight.io_mb", "2"]
    out = lit_dist("preflight", *args, *flags, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "lit-dist preflight: 1 rank on 1 node" in out.stdout and "matmul TFLOP/s" in out.stdout, out.stdout
    report = json.loads((tmp_path / "quickstart" / "p" / "preflight.json").read_text())
    figures = report["ranks"][0]
    assert all(figures[k] > 0 for k in ("matmul_tflops", "read_mb_s", "write_mb_s", "loader_images_s")), figures
    assert not list((tmp_path / "quickstart" / "p" / "checkpoints").glob(".preflight-*")), "its file is removed"

    out = lit_dist("fit", *quickstart_args(tmp_path, demo_data, data__num_workers=0, data__batch_size_per_device=8, run__run_id="f",
                                           trainer__max_steps=3, trainer__enable_progress_bar=False),
                   *flags, "--preflight.enabled", "true", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.index("lit-dist preflight: 1 rank") < out.stdout.index("lit-dist: fit finished"), out.stdout
