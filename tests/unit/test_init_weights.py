"""``model.init_weights``: a new run's network starts from the weights of a file users bring (lit-dist's export, a
checkpoint of any run, a state dict of other code), all of them or all but a new head, and a file that does not
fit is one line naming the first tensor that differs, with the network left as it was."""

import argparse

import pytest
import torch

from lit_dist.ckpt.pickles import UntrustedPickle
from lit_dist.errors import ConfigError, DataError
from lit_dist.model.module import LitModel
from lit_dist.model.nets import SimpleCNN
from tests.helpers.training import run

pytestmark = pytest.mark.unit


def trained() -> SimpleCNN:
    net = SimpleCNN(num_classes=4)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(torch.randn_like(p))  # anything a fresh SimpleCNN is not
    return net


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("form", ["safetensors", "ddp", "lightning", "compiled"])
def test_a_state_dict_in_the_forms_users_bring_loads_whole(tmp_path, form, monkeypatch):
    from safetensors.torch import save_file

    from lit_dist.ckpt import init_weights

    monkeypatch.setattr(init_weights, "CHUNK_BYTES", 4096)  # copied in several parts, as a big model's file is

    source = trained().state_dict()
    path = str(tmp_path / ("w.safetensors" if form == "safetensors" else "w.pt"))
    if form == "safetensors":
        save_file(source, path)
    elif form == "ddp":  # a hand-written DDP script's torch.save(model.state_dict())
        torch.save({f"module.{k}": v for k, v in source.items()}, path)
    elif form == "lightning":  # a LightningModule's checkpoint: the net under "net.", beside other entries
        torch.save({"state_dict": {**{f"net.{k}": v for k, v in source.items()}, "loss.weight": torch.ones(4)},
                    "epoch": 3}, path)
    else:  # torch.compile's wrapper, inside DDP's
        torch.save({f"module._orig_mod.{k}": v for k, v in source.items()}, path)
    model = LitModel(SimpleCNN(num_classes=4), init_weights=path)
    assert same(model.net.state_dict(), source)


def test_a_checkpoint_of_a_run_gives_its_network_and_says_its_average_is_not_used(tmp_path, demo_data, caplog):
    model, _, _ = run(tmp_path, demo_data, max_steps=2)
    folder = str(tmp_path / "ckpt")  # the checkpoints folder: its newest usable one, as ckpt_path: auto picks
    net = type(model.net)(num_classes=4)
    LitModel(net, init_weights=folder)
    assert same(net.state_dict(), model.net.state_dict())
    assert f"model.net starts from {folder}: {len(net.state_dict())} tensors" in caplog.text

    # A checkpoint with a weight average: the network's own weights, and the line says how to start from the average.
    average = tmp_path / "with-average.pt"
    torch.save({"state_dict": {**{f"net.{k}": v for k, v in model.net.state_dict().items()},
                               **{f"ema.average.{k}": v + 1 for k, v in model.net.named_parameters()}}}, average)
    caplog.clear()
    net = type(model.net)(num_classes=4)
    LitModel(net, init_weights=str(average))
    assert same(net.state_dict(), model.net.state_dict())
    assert "its weight average is not used: `lit-dist export CHECKPOINT --ema true" in caplog.text


def test_a_new_head_stays_at_its_initialisation_and_the_rest_loads(tmp_path):
    source = trained().state_dict()
    path = tmp_path / "w.pt"
    torch.save(source, path)
    torch.manual_seed(0)
    fresh = SimpleCNN(num_classes=7).state_dict()
    torch.manual_seed(0)
    model = LitModel(SimpleCNN(num_classes=7), init_weights=str(path), init_weights_skip=("head",))
    loaded = model.net.state_dict()
    for key, value in loaded.items():
        assert torch.equal(value, fresh[key] if key.startswith("head.") else source[key]), key
    # fnmatch patterns, as the docstring says
    model = LitModel(SimpleCNN(num_classes=7), init_weights=str(path), init_weights_skip=("head.*",))
    assert torch.equal(model.net.state_dict()["features.0.0.weight"], source["features.0.0.weight"])


def test_a_file_that_does_not_fit_is_one_line_and_loads_nothing(tmp_path):
    path = tmp_path / "w.pt"
    torch.save(trained().state_dict(), path)
    net = SimpleCNN(num_classes=7)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    with pytest.raises(ConfigError, match=rf"^model.init_weights: {path} holds head.weight of shape \(4, 64\), this "
                                          r"model's is \(7, 64\) \(1 more tensor differs\)\. Name the tensors to leave "
                                          r"at their initialisation in model.init_weights_skip"):
        LitModel(net, init_weights=str(path))
    assert same(net.state_dict(), before), "a refused file changed the network"

    # A tensor the file lacks, and a file of another network altogether.
    torch.save({k: v for k, v in SimpleCNN(num_classes=4).state_dict().items() if k != "head.bias"}, path)
    with pytest.raises(ConfigError, match=rf"^model.init_weights: {path} has no head.bias\. Name"):
        LitModel(SimpleCNN(num_classes=4), init_weights=str(path))
    torch.save({"encoder.weight": torch.ones(3)}, path)
    with pytest.raises(ConfigError, match=r"none of the 1 tensors of .* is named as model.net's \(its first: "
                                          r"encoder.weight; model.net's: features.0.0.weight\): weights of another"):
        LitModel(SimpleCNN(num_classes=4), init_weights=str(path))


def test_a_pattern_that_names_nothing_and_a_skip_without_weights_are_refused(tmp_path):
    path = tmp_path / "w.pt"
    torch.save(SimpleCNN(num_classes=4).state_dict(), path)
    with pytest.raises(ConfigError, match=r"model.init_weights_skip: 'haed' names no tensor of model.net or of"):
        LitModel(SimpleCNN(num_classes=4), init_weights=str(path), init_weights_skip=("head", "haed"))
    with pytest.raises(ConfigError, match=r"model.init_weights_skip is set and model.init_weights is not"):
        LitModel(SimpleCNN(num_classes=4), init_weights_skip=("head",))
    with pytest.raises(ConfigError, match=r"model.init_weights = '.*nothing.pt': no such file or folder"):
        LitModel(SimpleCNN(num_classes=4), init_weights=str(tmp_path / "nothing.pt"))


def test_an_untrusted_pickle_or_a_damaged_file_is_refused_with_what_to_do(tmp_path):
    path = tmp_path / "sent.pt"
    torch.save({**SimpleCNN(num_classes=4).state_dict(), "args": argparse.Namespace(lr=1)}, path)
    with pytest.raises(UntrustedPickle, match=rf"holds argparse.Namespace: .*: convert it once with `lit-dist export "
                                              rf"{path} --trust_pickle true --output weights.safetensors` and name"):
        LitModel(SimpleCNN(num_classes=4), init_weights=str(path))
    damaged = tmp_path / "w.safetensors"
    damaged.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(DataError, match=rf"model.init_weights: {damaged} cannot be read as safetensors"):
        LitModel(SimpleCNN(num_classes=4), init_weights=str(damaged))


def test_a_bare_model_s_file_loads_into_the_network_that_holds_it(tmp_path):
    """A diffusers model's own file (conv_in.weight) into the pipeline's denoiser, which holds it as ``model``
    (model.conv_in.weight): the names match with the holder's prefix taken off."""

    class Holder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = SimpleCNN(num_classes=4)

    source = trained().state_dict()
    path = tmp_path / "bare.pt"
    torch.save(source, path)
    holder = Holder()
    LitModel(holder, init_weights=str(path))
    assert same(holder.model.state_dict(), source)
