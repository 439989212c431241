"""transformers' and diffusers' loading bars and torchvision notice are left out of lit-dist's loads; their
warnings are not (the process test of a pipeline run checks its whole output: tests/process/test_pipeline_fit.py)."""

import logging

import pytest


def test_quiet_loading_turns_the_hub_libraries_bars_off_and_back_and_drops_only_the_torchvision_notice():
    pytest.importorskip("transformers")
    pytest.importorskip("diffusers")
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    from lit_dist.runtime.extras import quiet_loading

    libraries = (transformers_logging, diffusers_logging)
    were = [library.is_progress_bar_enabled() for library in libraries]
    notices = logging.getLogger("transformers.utils.import_utils")
    said = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    notices.addHandler(handler)
    try:
        for library in libraries:
            library.enable_progress_bar()
        with quiet_loading():
            assert [library.is_progress_bar_enabled() for library in libraries] == [False, False]
            notices.warning("`CLIPImageProcessor` requires torchvision (not installed); falling back to ...")
            notices.warning("a weight the folder lacks")
        assert [library.is_progress_bar_enabled() for library in libraries] == [True, True]
        notices.warning("`X` requires torchvision (not installed); after the load")
    finally:
        notices.removeHandler(handler)
        for library, on in zip(libraries, were, strict=True):
            (library.enable_progress_bar if on else library.disable_progress_bar)()
    assert said == ["a weight the folder lacks", "`X` requires torchvision (not installed); after the load"]
