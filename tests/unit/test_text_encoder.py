"""lit_dist.cache.encoders.TextEncoder from a config (random weights, ByT5's byte tokenizer): one shape per caption
whatever its length, the same weights from the same seed, different embeddings for different captions, and bad
settings named as config errors."""

import pytest
import torch

from lit_dist.cache.encoders import TextEncoder, load_encoder, weights_sha256
from lit_dist.errors import ConfigError

pytestmark = pytest.mark.unit
pytest.importorskip("transformers")
T5 = {"vocab_size": 384, "d_model": 32, "d_kv": 8, "d_ff": 64, "num_layers": 1, "num_heads": 4}
CLIP = {"vocab_size": 384, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
        "max_position_embeddings": 32}


@pytest.mark.parametrize("kind,config", [("t5", T5), ("clip", CLIP)])
def test_captions_of_any_length_become_one_shape_and_the_same_seed_gives_the_same_encoder(kind, config):
    spec = {"class_path": "lit_dist.cache.encoders.TextEncoder", "init_args": {"kind": kind, "config": config,
                                                                              "max_length": 24}}
    a, b = load_encoder(spec, "caption_encoder"), load_encoder(spec, "caption_encoder")
    assert weights_sha256(a) == weights_sha256(b)  # what keys the cache entries
    texts = ["a blue circle on a red background", "a red circle on a blue background", "", "x" * 100]
    with torch.no_grad():
        out = a(texts)
        assert out.shape == (4, 24, 32)
        torch.testing.assert_close(out, b(texts))  # eval mode: no dropout
    assert (out[0] - out[1]).abs().mean() > 0.01  # the words' order matters


def test_bad_text_encoder_settings_are_config_errors():
    with pytest.raises(ConfigError, match="exactly one of pretrained or config"):
        TextEncoder()
    with pytest.raises(ConfigError, match="vocab_size = 100: the byte tokenizer needs at least"):
        TextEncoder(config={**T5, "vocab_size": 100})
    with pytest.raises(ConfigError, match="kind = 'bert': must be t5 or clip"):
        TextEncoder(config=T5, kind="bert")
