"""The objective a pipeline folder's ``scheduler/`` fills in: every setting of its noise schedule that training must
share with the folder's sampler, or one line where lit-dist cannot train with it."""

import json

import pytest

pytest.importorskip("diffusers")
pytest.importorskip("transformers")

from lit_dist.cache.pipelines import read_folder  # noqa: E402
from lit_dist.cli.pipeline import _objective  # noqa: E402
from lit_dist.errors import ConfigError  # noqa: E402
from tests.helpers.pipelines import save_pipeline  # noqa: E402


def _with_scheduler(folder, **changes):
    where = folder / "scheduler" / "scheduler_config.json"
    where.write_text(json.dumps({**json.loads(where.read_text()), **changes}))
    return read_folder(str(folder), "pipeline.path")


def test_a_zero_terminal_snr_schedule_is_trained_as_its_sampler_draws_and_listed_betas_are_one_line(tmp_path):
    folder = save_pipeline("sd15", tmp_path / "sd15")
    filled = _objective(_with_scheduler(folder, prediction_type="v_prediction", rescale_betas_zero_snr=True,
                                        timestep_spacing="trailing"), None).init_args
    assert (filled.prediction, filled.rescale_betas_zero_snr) == ("v_prediction", True)
    assert _objective(_with_scheduler(folder, rescale_betas_zero_snr=False), None).init_args.rescale_betas_zero_snr is False

    with pytest.raises(ConfigError, match=r"lists its own betas \(trained_betas\); lit-dist trains with a named "
                                          "beta_schedule"):
        _objective(_with_scheduler(folder, trained_betas=[0.001] * 1000), None)
