"""lit_dist.ckpt.sharded and Snapshot's DTensor copies, on a one-process gloo group: what the background
sharded save writes is the state at the save, whatever training does next, and every file DCP writes is
in the manifest with the sha256 of its bytes on disk."""

import hashlib

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from lit_dist.ckpt import sharded
from lit_dist.ckpt.snapshot import Snapshot

pytestmark = pytest.mark.unit


@pytest.fixture
def mesh(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def test_a_snapshot_of_a_dtensor_is_a_copy_and_reuses_its_buffer(mesh):
    weight = distribute_tensor(torch.arange(12.0).reshape(4, 3), mesh, [Shard(0)])
    snapshot = Snapshot()
    first = snapshot.take({"w": weight})["w"]
    assert first.placements == weight.placements and first.shape == weight.shape
    weight.to_local().add_(100)  # the next optimizer step, while the copy is being written
    assert torch.equal(first.to_local(), torch.arange(12.0).reshape(4, 3))
    second = snapshot.take({"w": weight})["w"]
    assert second is first, "the buffer is reused from one save to the next"
    assert torch.equal(second.to_local(), torch.arange(12.0).reshape(4, 3) + 100)


def test_the_shard_writer_hashes_every_file_as_it_is_written_and_dcp_reads_it_back(mesh, tmp_path):
    state = {"state_dict": {"w": distribute_tensor(torch.randn(64, 32), mesh, [Shard(0)]), "step": 3},
             "optimizer_0": {"lr": 0.1, "m": torch.randn(5)}}
    folder = tmp_path / "step" / "state.ckpt"
    files = sharded.write(state, str(folder))
    on_disk = {f"state.ckpt/{p.name}" for p in folder.iterdir()}
    assert set(files) == on_disk == {"state.ckpt/.metadata", "state.ckpt/__0_0.distcp"}
    for rel, entry in files.items():
        data = (tmp_path / "step" / rel).read_bytes()
        assert (entry.size, entry.sha256) == (len(data), hashlib.sha256(data).hexdigest()), rel
    loaded = {"state_dict": {"w": distribute_tensor(torch.zeros(64, 32), mesh, [Shard(0)]), "step": 0},
              "optimizer_0": {"lr": 0.0, "m": torch.zeros(5)}}
    dcp.load(loaded, checkpoint_id=str(folder))
    assert torch.equal(loaded["state_dict"]["w"].to_local(), state["state_dict"]["w"].to_local())
    assert torch.equal(loaded["optimizer_0"]["m"], state["optimizer_0"]["m"])
