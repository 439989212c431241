"""How the command line reports what went wrong: a user error in one line, a bug with its traceback, and the
commands' own flags parsed as their signatures say."""

from pathlib import Path

import pytest
from lightning.pytorch import Callback

from tests.conftest import lit_dist, quickstart_args

pytestmark = pytest.mark.process


class BrokenOnException(Callback):
    """A callback whose ``on_exception`` has a bug: it runs while Lightning handles the run's error."""

    def on_exception(self, trainer, pl_module, exception):
        raise RuntimeError("bug in BrokenOnException.on_exception")


def test_a_user_error_names_its_field_without_a_traceback(tmp_path, demo_data):
    # Raised in LitModel.__init__ and wrapped by jsonargparse (raise ... from): still the user's error.
    out = lit_dist("fit", *quickstart_args(tmp_path, demo_data, model__base_batch_size=0))
    assert out.returncode == 2, out.stderr[-3000:]
    assert "model.base_batch_size = 0" in out.stderr and "Traceback" not in out.stderr, out.stderr[-3000:]


def test_a_bug_raised_while_a_user_error_is_handled_shows_its_traceback(tmp_path, demo_data):
    # The demo's buckets are too small for a global batch of 32: a data error inside trainer.fit, during whose
    # handling the callback's bug is raised. Exiting 3 with the data error's line alone would hide the bug.
    out = lit_dist("fit", *quickstart_args(tmp_path, demo_data, data__num_workers=0),
                   "--trainer.callbacks+=tests.process.test_cli_errors.BrokenOnException")
    assert out.returncode == 1, out.stderr[-3000:]
    assert "Traceback" in out.stderr and "RuntimeError: bug in BrokenOnException.on_exception" in out.stderr
    assert "fewer than one global batch" in out.stderr, "the user error stays visible as the bug's context"


def cache_command(tmp_path, demo_data, *flags):
    return lit_dist("cache", *quickstart_args(tmp_path, demo_data, data__num_workers=0), "--data.cache.dir",
                    str(tmp_path / "cache"), "--data.cache.pixels", "true", *flags)


@pytest.mark.parametrize("flags, builds", [(["--check=false"], True), (["--check", "false"], True),
                                           (["--check"], False), (["--check=true"], False), (["--check", "yes"], False)])
def test_a_bool_flag_of_a_command_takes_its_value(tmp_path, demo_data, flags, builds):
    out = cache_command(tmp_path, demo_data, *flags)
    if builds:
        assert out.returncode == 0 and "lit-dist cache: built" in out.stdout, out.stdout + out.stderr[-3000:]
    else:  # the report on a cache not built yet
        assert out.returncode == 3 and "no cache at" in out.stdout, out.stdout + out.stderr[-3000:]
    assert (tmp_path / "cache").exists() == builds


@pytest.mark.parametrize("command, flags, named", [
    ("cache", ["--check=maybe"], "check"), ("cache", ["--check", "maybe"], "check"),
    ("scale", ["--steps", "many"], "steps"), ("scale", ["--steps"], "--steps: expected one argument")])
def test_a_bad_value_of_a_command_s_own_flag_is_a_configuration_error(tmp_path, demo_data, command, flags, named):
    out = lit_dist(command, *quickstart_args(tmp_path, demo_data), *flags)
    assert out.returncode == 2, out.stderr[-3000:]
    first = out.stderr.splitlines()[0]
    assert first.startswith("lit-dist: error:") and named in first and "Traceback" not in out.stderr, out.stderr[-3000:]


def test_a_command_s_help_lists_its_own_flags_from_its_signature():
    out = lit_dist("scale", "--help")
    assert out.returncode == 0, out.stderr
    assert "its own options:" in out.stdout and "--trainer.devices" in out.stdout
    assert "--steps STEPS" in out.stdout and "(type: int, default: 60)" in " ".join(out.stdout.split())
    assert "--check {true,false}" in lit_dist("cache", "--help").stdout


NO_DIFFUSERS = Path(__file__).parent / "without_diffusers"  # its sitecustomize makes `import diffusers` fail


@pytest.mark.parametrize("objective", ["FlowMatching", "Diffusion"])
def test_a_generative_run_without_diffusers_is_refused_before_its_first_step(objective, tmp_path, demo_data):
    # diffusers is an extra: flow matching on pixels trains without it, but its sample grids need its samplers, which
    # were first imported at the first validation, after the training up to it.
    args = quickstart_args(tmp_path, demo_data, data__num_workers=0, trainer__max_steps=4,
                           trainer__enable_progress_bar=False)
    out = lit_dist("fit", *args, "--model.net", "lit_dist.model.nets.TinyUNet", "--model.net.channels", "[8, 16]",
                   "--model.objective", f"lit_dist.model.objectives.{objective}", "--model.objective.condition", "none",
                   env={"PYTHONPATH": str(NO_DIFFUSERS)})
    errors = [line for line in out.stderr.splitlines() if line.startswith("lit-dist: error:")]
    assert out.returncode == 2 and len(errors) == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert "needs diffusers, which is not installed here" in errors[0], errors
    assert "pip install 'lit-dist[latent]'" in errors[0], errors
    assert "Epoch 0" not in out.stdout + out.stderr and "train/loss" not in out.stdout + out.stderr
