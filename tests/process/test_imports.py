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


def _avx512_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return "avx512_bf16" in f.read()
    except OSError:
        return False


@pytest.mark.skipif(not _avx512_bf16(), reason="bitsandbytes asks for a Hub kernel only on CPUs with AVX-512 BF16")
def test_a_run_with_bitsandbytes_8bit_adamw_asks_the_hub_nothing_at_its_import(tmp_path, demo_data):
    # A network that accepts and never answers, as the Hub's endpoint: bitsandbytes' import used to wait on it (its
    # `kernels` asking whether a 4-bit CPU kernel's publisher is trusted), minutes before the run's first line.
    pytest.importorskip("kernels")
    from tests.conftest import lit_dist, quickstart_args
    from tests.helpers.tcp_proxy import TcpProxy

    hub = TcpProxy(("127.0.0.1", 9))
    hub.silence()
    try:
        out = lit_dist("fit", *quickstart_args(tmp_path, demo_data, trainer__max_steps=2, trainer__limit_val_batches=0,
                                               data__num_workers=0, data__allow_oversubscription=True),
                       "--model.optimizer", "bitsandbytes.optim.AdamW8bit", env={"HF_ENDPOINT": hub.url}, timeout=120)
    finally:
        hub.cut()
    assert out.returncode == 0, out.stderr[-3000:]
    assert "kernels-community" not in out.stdout + out.stderr, out.stderr[-3000:]
