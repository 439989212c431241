"""What ``lit_dist.ckpt.pickles`` says about a file it will not unpickle (the type it refused, or why the file is no
checkpoint, in words a user can act on) and how it vets the folders torch and DeepSpeed unpickle in full."""

import argparse
import pickle

import pytest
import torch

from lit_dist.ckpt.pickles import UntrustedPickle, load
from lit_dist.errors import DataError
from tests.helpers.planted import Planted

pytestmark = pytest.mark.unit

TRUST = "run it again with --trust true"


def test_a_type_outside_the_allowlist_is_named_with_the_opt_in_and_loads_when_trusted(tmp_path):
    path = tmp_path / "sent.ckpt"
    torch.save({"weights": torch.ones(2), "args": argparse.Namespace(lr=1)}, path)
    with pytest.raises(UntrustedPickle, match=rf"{path} holds argparse.Namespace: .*: {TRUST}$"):
        load(str(path), TRUST)
    assert load(str(path), TRUST, allowed=[argparse.Namespace])["args"].lr == 1
    assert load(str(path), TRUST, trust=True)["args"].lr == 1


@pytest.mark.parametrize("content, reason", [
    (b"hello\n", "it is not a file that torch.save writes (neither a zip archive nor a pickle)"),
    (b"PK\x03\x04 truncated", "RuntimeError: PytorchStreamReader failed reading zip archive"),
], ids=["text", "truncated-zip"])
def test_a_file_that_is_no_checkpoint_says_why(tmp_path, content, reason):
    path = tmp_path / "model.ckpt"
    path.write_bytes(content)
    with pytest.raises(DataError, match=rf"^{path} cannot be read as a checkpoint: ") as raised:
        load(str(path), TRUST)
    assert str(raised.value).startswith(f"{path} cannot be read as a checkpoint: {reason}"), raised.value


def test_a_sharded_checkpoint_is_vetted_before_torch_unpickles_its_entries_in_full(tmp_path):
    import torch.distributed.checkpoint as dcp

    from lit_dist.ckpt.vetting import vet

    own, sent, marker = tmp_path / "own", tmp_path / "sent", tmp_path / "marker"
    # What an optimizer's state holds beside tensors, as torch.distributed.checkpoint stores it (pickled entries).
    dcp.save({"w": torch.ones(3), "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99)}], "step": 3},
             checkpoint_id=str(own), no_dist=True)
    vet(str(own), TRUST)
    dcp.save({"w": torch.ones(3), "extra": Planted(marker)}, checkpoint_id=str(sent), no_dist=True)
    with pytest.raises(UntrustedPickle, match=rf"^{sent}/__0_0.distcp \(entry extra\) holds builtins.exec: .*{TRUST}$"):
        vet(str(sent), TRUST)
    assert not marker.exists()
    vet(str(sent), TRUST, trust=True)  # the opt-in: torch unpickles it in full, as it would anyway

    (sent / ".metadata").write_bytes(pickle.dumps(Planted(marker)))
    with pytest.raises(UntrustedPickle, match=rf"^{sent}/.metadata holds builtins.exec: "):
        vet(str(sent), TRUST)
    assert not marker.exists(), "the planted object ran"
