"""`lit-dist report RUN_DIR` on real run directories: a finished run and a killed one."""

import re

import pytest
from PIL import Image

from lit_dist.ckpt.store import CheckpointStore
from lit_dist.errors import ExitCode
from tests.conftest import lit_dist, quickstart_args


@pytest.mark.process
def test_report_of_a_finished_run_names_its_changes_metrics_goodput_and_checkpoints_and_plots_them(tmp_path, demo_data):
    args = quickstart_args(tmp_path, demo_data, data__num_workers=0, data__batch_size_per_device=8,
                           trainer__max_epochs=2, trainer__log_every_n_steps=5, run__run_id="r",
                           trainer__enable_progress_bar=False)
    fit = lit_dist("fit", *args)
    assert fit.returncode == 0, fit.stderr[-3000:]
    run = tmp_path / "quickstart" / "r"
    assert f"summary:       lit-dist report {run}" in fit.stdout
    final = dict(re.findall(r"(val/\w+) (\d\.\d{4})", fit.stdout.split("fit finished:")[1].splitlines()[0]))

    out = lit_dist("report", str(run), "--plot", str(tmp_path / "report.png"))
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    steps = re.search(r"state: finished at step (\d+)/(\d+) \(100%\)", text)
    assert steps and steps[1] == steps[2], text
    assert "trainer.max_epochs: 2   (default: null)" in text and "data.init_args.batch_size_per_device: 8" in text
    assert "trainer.logger" not in text and "run.run_id" not in text  # lit-dist's own fill-ins are no news
    assert "data.init_args.mean" not in text  # equal to its default (a tuple read back as a list)
    for name, value in final.items():  # the last validation, as fit printed it
        # (Lightning logs a validation at the step before global_step's)
        assert re.search(rf"{name}: last {float(value):.4g} \(step {int(steps[1]) - 1}\), best ", text), (name, text)
    assert re.search(r"goodput \d+\.\d% of \d:\d\d:\d\d: train ", text)
    complete = CheckpointStore(str(run / "checkpoints")).complete()
    assert f"checkpoints: {len(complete)} complete, newest {complete[0]} " in text
    with Image.open(tmp_path / "report.png") as image:
        assert image.format == "PNG" and image.size == (1100, 700)


@pytest.mark.process
def test_report_of_a_killed_run_says_it_stopped_without_a_word_and_a_wrong_folder_is_a_config_error(tmp_path,
                                                                                                      demo_data):
    args = quickstart_args(tmp_path, demo_data, data__num_workers=0, data__batch_size_per_device=8,
                           trainer__max_steps=30, run__run_id="r", trainer__enable_progress_bar=False)
    lit_dist("fit", *args, "--trainer.callbacks+=tests.helpers.recorder.KillAtStep", "--trainer.callbacks.step", "8")
    out = lit_dist("report", str(tmp_path / "quickstart" / "r"))
    assert "state: stopped at step 8/30 (27%) without a word (killed, or its node was lost)" in out.stdout, out.stdout
    wrong = lit_dist("report", str(tmp_path / "quickstart"))
    assert wrong.returncode == ExitCode.CONFIG_ERROR and "not a lit-dist run directory" in wrong.stderr


def test_checkpoints_with_a_damaged_marker_are_left_out_of_the_report_and_the_others_listed(tmp_path):
    import json

    from lit_dist.watch.report import checkpoints

    folder = tmp_path / "checkpoints"
    markers = {"step-000000010": json.dumps({"step": 10, "reason": "every_n_steps",
                                             "files": {"state.ckpt": {"size": 2_000_000}}}),
               "step-000000020": '{"step": 20, "files": {"state.ck',  # cut short by a full disk
               "step-000000030": "\udcff".encode("utf-8", "surrogateescape").decode("latin-1"),  # not UTF-8
               "step-000000040": json.dumps(["not", "a", "manifest"])}
    for name, text in markers.items():
        (folder / name).mkdir(parents=True)
        (folder / name / "COMPLETE.json").write_bytes(text.encode("latin-1"))
    (folder / "step-000000050").mkdir()
    (folder / "step-000000050" / "COMPLETE.json").mkdir()  # a folder where the marker should be: unreadable
    found = checkpoints(str(tmp_path))
    assert [(c["name"], c["step"], c["bytes"], c["reason"]) for c in found] == \
        [("step-000000010", 10, 2_000_000, "every_n_steps")]


def test_the_newest_sample_grid_is_named_and_drawn_beside_the_curves(tmp_path):
    from lit_dist.watch.report import read

    run = tmp_path / "run"
    (run / "goodput").mkdir(parents=True)
    (run / "samples").mkdir()
    for step, colour in ((20, "red"), (100, "blue")):
        Image.new("RGB", (64, 32), colour).save(run / "samples" / f"step-{step:09d}.png")
    (run / "samples" / "notes.txt").write_text("not a grid")
    found = read(str(run))
    assert found.samples == ["samples/step-000000020.png", "samples/step-000000100.png"]
    assert f"samples: 2 grids, newest {run / 'samples' / 'step-000000100.png'}" in found.text()
    found.plot(str(tmp_path / "plot.png"))
    assert Image.open(tmp_path / "plot.png").size == (1600, 700)  # the grid's column added (1100 x 700 without)
