"""Pretrained diffusers pipelines as a user has them on disk, made here without a download: each family's own
pipeline class and components with tiny configs and seeded random weights, written with ``save_pretrained`` into a
folder (``model_index.json``, ``unet/`` or ``transformer/``, ``vae/``, ``text_encoder*/``, ``tokenizer*/``,
``scheduler/``), which code under test then loads by path, exactly as it loads a downloaded one.

The tokenizers are real ones with small vocabularies written here: CLIP's byte-level BPE (every byte, each also as
a word's end, and merges that make each word of the shapes demo's captions one token) and T5's SentencePiece-style
Unigram (every printable ASCII character, and those words), saved as a fast tokenizer's ``tokenizer.json``: no
sentencepiece model is needed.

    save_pipeline("sdxl", tmp_path / "sdxl")    # then DiffusionPipeline.from_pretrained(tmp_path / "sdxl")

The configs follow diffusers' own tests of each pipeline; sizes are kept to what a CPU runs in a second or two.
"""

import json
import tempfile
from pathlib import Path

import torch

from lit_dist.data.demo.shapes import CLASSES, COLOURS

FAMILIES = ("sd15", "sdxl", "sd3", "flux", "pixart")
# The words of the shapes demo's captions ("a red circle on a white background"): one token each in both tokenizers.
_WORDS = ("a", "on", "background", *CLASSES, *COLOURS)


def save_pipeline(family: str, folder: Path, seed: int = 0, variant: str | None = None) -> Path:
    """Write a tiny pipeline of ``family`` (one of FAMILIES) to ``folder``; with ``variant="fp16"``, as a download
    with ``--variant fp16`` holds it: half-precision weights in ``*.fp16.safetensors`` files only. Returns ``folder``."""
    if family not in FAMILIES:
        raise ValueError(f"family {family!r}: one of {', '.join(FAMILIES)}")
    torch.manual_seed(seed)
    with tempfile.TemporaryDirectory() as scratch:  # the tokenizers' source files: save_pretrained writes their own
        pipeline = globals()[f"_{family}"](Path(scratch))
        if variant == "fp16":
            pipeline.to(torch.float16)
        pipeline.save_pretrained(folder, safe_serialization=True, variant=variant)
    return Path(folder)


def _sd15(scratch: Path):
    from diffusers import DDPMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextModel

    unet = UNet2DConditionModel(block_out_channels=(8, 16), layers_per_block=1, sample_size=8, in_channels=4,
                                out_channels=4, down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
                                up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), cross_attention_dim=32,
                                attention_head_dim=4, norm_num_groups=4)
    text_encoder = CLIPTextModel(_clip_config(hidden_size=32))
    return StableDiffusionPipeline(vae=_vae(), text_encoder=text_encoder,
                                   tokenizer=_clip_tokenizer(scratch / "clip"), unet=unet,
                                   scheduler=DDPMScheduler(beta_schedule="scaled_linear", beta_start=0.00085,
                                                           beta_end=0.012, num_train_timesteps=1000, steps_offset=1,
                                                           clip_sample=False),
                                   safety_checker=None, feature_extractor=None, requires_safety_checker=False)


def _sdxl(scratch: Path):
    from diffusers import (
        EulerDiscreteScheduler,
        StableDiffusionXLPipeline,
        UNet2DConditionModel,
    )
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    # cross_attention_dim = 16 + 32 (the two encoders' penultimate states, concatenated); the added embedding
    # takes the second encoder's pooled projection (32) and six time ids of 8 each: 32 + 48 = 80.
    unet = UNet2DConditionModel(block_out_channels=(8, 16), layers_per_block=1, sample_size=8, in_channels=4,
                                out_channels=4, down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
                                up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), attention_head_dim=(2, 4),
                                use_linear_projection=True, addition_embed_type="text_time",
                                addition_time_embed_dim=8, transformer_layers_per_block=(1, 1),
                                projection_class_embeddings_input_dim=80, cross_attention_dim=48,
                                norm_num_groups=4)
    tokenizer = _clip_tokenizer(scratch / "clip")
    return StableDiffusionXLPipeline(
        vae=_vae(), text_encoder=CLIPTextModel(_clip_config(hidden_size=16)),
        text_encoder_2=CLIPTextModelWithProjection(_clip_config(hidden_size=32, projection_dim=32)),
        tokenizer=tokenizer, tokenizer_2=tokenizer, unet=unet,
        scheduler=EulerDiscreteScheduler(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012,
                                         timestep_spacing="leading", steps_offset=1))


def _sd3(scratch: Path):
    from diffusers import (
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    from transformers import CLIPTextModelWithProjection

    # joint_attention_dim: the CLIP states (16 + 16, padded to the T5's width) and the T5's (32) share it;
    # pooled_projection_dim: the two CLIP pooled projections, concatenated (16 + 16).
    transformer = SD3Transformer2DModel(sample_size=8, patch_size=1, in_channels=4, num_layers=1,
                                        attention_head_dim=8, num_attention_heads=2, caption_projection_dim=16,
                                        joint_attention_dim=32, pooled_projection_dim=32, out_channels=4)
    clip = _clip_tokenizer(scratch / "clip")
    return StableDiffusion3Pipeline(
        transformer=transformer, vae=_vae(shift_factor=0.0609),
        text_encoder=CLIPTextModelWithProjection(_clip_config(hidden_size=16, projection_dim=16)),
        text_encoder_2=CLIPTextModelWithProjection(_clip_config(hidden_size=16, projection_dim=16)),
        text_encoder_3=_t5_encoder(), tokenizer=clip, tokenizer_2=clip,
        tokenizer_3=_t5_tokenizer(scratch / "t5"), scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0))


def _flux(scratch: Path):
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextModel

    # Flux packs 2 x 2 latent patches: in_channels = 4 x the VAE's latent channels. The guidance embedding marks a
    # guidance-distilled model (Flux.1-dev); axes_dims_rope sums to attention_head_dim.
    transformer = FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1,
                                         attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                         pooled_projection_dim=32, guidance_embeds=True, axes_dims_rope=(4, 6, 6))
    return FluxPipeline(
        transformer=transformer, vae=_vae(shift_factor=0.1159, scaling_factor=0.3611),
        text_encoder=CLIPTextModel(_clip_config(hidden_size=32)),
        text_encoder_2=_t5_encoder(), tokenizer=_clip_tokenizer(scratch / "clip"),
        tokenizer_2=_t5_tokenizer(scratch / "t5"),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5,
                                                  max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096))


def _pixart(scratch: Path):
    from diffusers import (
        DPMSolverMultistepScheduler,
        PixArtSigmaPipeline,
        PixArtTransformer2DModel,
    )

    transformer = PixArtTransformer2DModel(sample_size=8, num_layers=1, patch_size=2, attention_head_dim=8,
                                           num_attention_heads=2, caption_channels=32, in_channels=4,
                                           cross_attention_dim=16, out_channels=8, attention_bias=True,
                                           activation_fn="gelu-approximate", num_embeds_ada_norm=1000,
                                           norm_type="ada_norm_single", norm_elementwise_affine=False,
                                           norm_eps=1e-6, use_additional_conditions=False)
    return PixArtSigmaPipeline(transformer=transformer, vae=_vae(),
                               text_encoder=_t5_encoder(),
                               tokenizer=_t5_tokenizer(scratch / "t5"), scheduler=DPMSolverMultistepScheduler())


def _vae(**config):
    """Four latent channels at 1/2 the image's side (one downsampling)."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(block_out_channels=(8, 8), in_channels=3, out_channels=3, latent_channels=4,
                         down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
                         up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"), norm_num_groups=4,
                         sample_size=16, **config)


def _clip_config(hidden_size: int, projection_dim: int | None = None):
    from transformers import CLIPTextConfig

    return CLIPTextConfig(bos_token_id=0, eos_token_id=1, pad_token_id=1, hidden_size=hidden_size,
                          intermediate_size=2 * hidden_size, num_attention_heads=2, num_hidden_layers=2,
                          vocab_size=len(_clip_vocab()), max_position_embeddings=77, hidden_act="gelu",
                          projection_dim=projection_dim or hidden_size, layer_norm_eps=1e-5)


def _t5_encoder():
    from transformers import T5Config, T5EncoderModel

    return T5EncoderModel(T5Config(vocab_size=len(_t5_pieces()) + 100, d_model=32, d_kv=8, d_ff=37, num_layers=2,
                                   num_heads=4, relative_attention_num_buckets=8, decoder_start_token_id=0,
                                   pad_token_id=0, eos_token_id=1))


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's (and CLIP's) map of bytes to printable characters."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars, extra = printable[:], 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars), strict=True))


def _clip_merges() -> list[tuple[str, str]]:
    """Merges that make each of _WORDS one token: each word is split as BPE splits it with the merges so far,
    and where none applies the next pair becomes a new merge (later merges rank lower, so they never change how an
    earlier word splits)."""
    merges: list[tuple[str, str]] = []
    for word in _WORDS:
        pieces = list(word[:-1]) + [word[-1] + "</w>"]
        while len(pieces) > 1:
            pairs = list(zip(pieces, pieces[1:], strict=False))
            known = [pair for pair in pairs if pair in merges]
            pair = min(known, key=merges.index) if known else pairs[0]
            if not known:
                merges.append(pair)
            merged, i = [], 0
            while i < len(pieces):
                if tuple(pieces[i:i + 2]) == pair:
                    merged.append(pieces[i] + pieces[i + 1])
                    i += 2
                else:
                    merged.append(pieces[i])
                    i += 1
            pieces = merged
    return merges


def _clip_vocab() -> dict[str, int]:
    # The ids of the start and end tokens first: the text config's bos (0) and eos/pad (1).
    tokens = ["<|startoftext|>", "<|endoftext|>"]
    for char in _bytes_to_unicode().values():
        tokens += [char, char + "</w>"]
    tokens += ["".join(pair) for pair in _clip_merges()]
    return {token: i for i, token in enumerate(dict.fromkeys(tokens))}


def _clip_tokenizer(scratch: Path):
    from transformers import CLIPTokenizer

    scratch.mkdir(parents=True, exist_ok=True)
    (scratch / "vocab.json").write_text(json.dumps(_clip_vocab()))
    (scratch / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in _clip_merges()))
    return CLIPTokenizer(str(scratch / "vocab.json"), str(scratch / "merges.txt"), model_max_length=77)


def _t5_pieces() -> list[tuple[str, float]]:
    """SentencePiece-style pieces (▁ marks a word's start) with log-probabilities: the special tokens at T5's ids
    (pad 0, eos 1, unk 2), every printable ASCII character alone and after ▁, and a few whole words."""
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    pieces += [(chr(c), -5.0) for c in range(33, 127)] + [("▁" + chr(c), -6.0) for c in range(33, 127)]
    pieces += [("▁" + word, -3.0) for word in _WORDS]
    return pieces


def _t5_tokenizer(scratch: Path):
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import T5TokenizerFast

    tokenizer = Tokenizer(models.Unigram(_t5_pieces(), unk_id=2, byte_fallback=False))
    tokenizer.normalizer = normalizers.Sequence([normalizers.Replace(" {2,}", " ")])
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tokenizer.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    tokenizer.post_processor = processors.TemplateProcessing(single="$A </s>", pair="$A </s> $B </s>",
                                                             special_tokens=[("</s>", 1)])
    scratch.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(scratch / "tokenizer.json"))
    return T5TokenizerFast(tokenizer_file=str(scratch / "tokenizer.json"), eos_token="</s>", unk_token="<unk>",
                           pad_token="<pad>", extra_ids=100, model_max_length=512)
