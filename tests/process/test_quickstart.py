"""The quickstart exactly as README.md gives it, from a folder without the demo data."""

import re

import pytest

from tests.conftest import CONFIGS, lit_dist
from tests.helpers.quickstart import check_quickstart_output

pytestmark = pytest.mark.process


@pytest.mark.slow
def test_quickstart_trains_to_90_percent_on_cpu(tmp_path):
    out = lit_dist("fit", "--config", str(CONFIGS / "quickstart.yaml"), cwd=tmp_path, timeout=300)
    check_quickstart_output(out, tmp_path)
    assert (tmp_path / "data" / "shapes" / "metadata.parquet").is_file(), "demo data generated on first use"
    # Its output goes to a pipe, as under Slurm to a file: plain lines, no progress bar redraws.
    log = out.stdout + out.stderr
    steps = int(re.findall(r"lit-dist: step (\d+)/", log)[-1])
    assert steps == 1245 and "samples/s" in log and "data wait" in log
    assert len(log.encode()) <= 5000 * steps / 1000, f"{len(log.encode())} bytes of log for {steps} steps"
    assert log.count("\r") <= steps / 100, f"{log.count(chr(13))} carriage returns for {steps} steps"

    # The quickstart's classifier is the shapes judge of generated samples (lit_dist.model.judge): on the real
    # validation images it must accept their own captions and refuse another image's.
    from lit_dist.data.datamodule import BucketDataModule
    from lit_dist.data.demo.judge import ShapesJudge

    run_dir = tmp_path / re.search(r"run directory: (\S+)", out.stdout).group(1)
    judge = ShapesJudge(str(run_dir / "model.pt"))
    data = BucketDataModule(metadata=str(tmp_path / "data" / "shapes" / "metadata.parquet"), resolution=32,
                            batch_size_per_device=64, num_workers=0)
    data.setup("fit")
    right = wrong = total = 0
    for batch in data.val_dataloader():
        pixels = batch["image"].permute(0, 3, 1, 2)  # the loader's uint8 (B, H, W, 3)
        captions = list(batch["caption"])
        right += int(judge(pixels, captions).sum())
        wrong += int(judge(pixels, captions[1:] + captions[:1]).sum())  # each image with its neighbour's caption
        total += len(captions)
    assert right / total >= 0.95 and wrong / total <= 0.05, (right, wrong, total)  # 0.98 and 0.004 here
