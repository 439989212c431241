"""What a run imports with the optional extras: diffusers and peft come without bitsandbytes (it is for quantized
bases lit-dist does not load, and its import cost each process of a pipeline run about 0.9 s of CPU and printed a
line about its kernels), unless the run's optimizer is bitsandbytes' own. Each case is a new interpreter: the test
process has imported them already."""

import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.process
pytest.importorskip("diffusers")
pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")

# What a pipeline run with an adapter imports, in its order: the net's require, a model class, the adapter's peft,
# which looks for bitsandbytes again as it makes the adapter's layers.
PIPELINE_RUN = """
from lit_dist.runtime.extras import require
require("diffusers", "model.net PipelineDenoiser")
from diffusers import AutoencoderKL, UNet2DConditionModel
from lit_dist.model.adapters import import_peft
peft = import_peft()
import sys, torch
peft.inject_adapter_in_model(peft.LoraConfig(r=2, target_modules=["0"]), torch.nn.Sequential(torch.nn.Linear(4, 4)))
print("bitsandbytes" in sys.modules, peft.import_utils.is_bnb_available())
"""


def _run(code: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.split()


def test_a_pipeline_run_imports_diffusers_and_peft_without_bitsandbytes():
    assert _run(PIPELINE_RUN) == ["False", "False"]


def test_a_run_whose_optimizer_is_bitsandbytes_keeps_it_for_peft_too():
    assert _run("import bitsandbytes.optim\n" + PIPELINE_RUN) == ["True", "True"]
