"""The frozen encoder of an encoder cache: built from the config, identified by its weights.

Any ``torch.nn.Module`` works: it gets the image batch (B, 3, H, W), normalised with
``data.mean`` and ``data.std`` exactly as training batches are, and returns a tensor
(B, ...). For diffusers' ``AutoencoderKL`` use ``VAEEncoder``, which returns latents::

    encoder:
      class_path: lit_dist.cache.encoders.VAEEncoder
      init_args: {pretrained: stabilityai/sd-vae-ft-mse}       # on a cluster with the weights
      # init_args: {config: {latent_channels: 4, ...}}         # random weights from a config (tests)
"""

import hashlib
import json
from pathlib import Path
from typing import Literal

import torch
from torch import nn

from lit_dist.errors import ConfigError
from lit_dist.runtime.extras import quiet_loading, require


def encoder_class(spec: dict, field: str = "encoder") -> type:
    """The class ``spec`` names, imported but not built; ConfigError naming ``data.cache.<field>`` if it does not
    import."""
    import importlib

    class_path = spec.get("class_path", "")
    module, _, name = class_path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ConfigError(f"data.cache.{field}.class_path = {class_path!r} does not import ({exc}). Install the "
                          "package that provides it (diffusers: pip install 'lit-dist[latent]') or fix the path.") from exc


TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def load_encoder(spec: dict, field: str = "encoder", dtype: str = "fp32") -> nn.Module:
    """Build ``spec`` ({class_path, init_args}) of ``data.cache.<field>`` as a frozen module in eval mode, on the CPU,
    its floating-point weights in ``dtype`` (data.cache.compute_dtype)."""
    from lightning.pytorch.cli import instantiate_class

    class_path = spec.get("class_path", "")
    try:
        module = instantiate_class((), {"class_path": class_path, "init_args": dict(spec.get("init_args") or {})})
    except (ImportError, AttributeError, ModuleNotFoundError) as exc:
        raise ConfigError(f"data.cache.{field}.class_path = {class_path!r} does not import ({exc}). Install the "
                          "package that provides it (diffusers: pip install 'lit-dist[latent]') or fix the path.") from exc
    except TypeError as exc:
        raise ConfigError(f"data.cache.{field}.init_args do not fit {class_path} ({exc})") from exc
    if not isinstance(module, nn.Module):
        raise ConfigError(f"data.cache.{field}.class_path = {class_path!r} is a {type(module).__name__}, not a "
                          "torch.nn.Module")
    module.eval().requires_grad_(False)
    # fp32 too: a half-precision folder (--variant fp16) loads its text encoders as stored (transformers' dtype auto).
    return module.to(TORCH_DTYPES[dtype])


def weights_sha256(module: nn.Module) -> str:
    """sha256 over every parameter and buffer (name, dtype, shape, bytes), in name order."""
    sha = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        t = tensor.detach().cpu().contiguous()
        sha.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        sha.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")  # 0-dim: as 1-dim
    return sha.hexdigest()


def description(spec: dict, module, dtype: str, field: str = "encoder", compute: str = "fp32", **inputs) -> dict:
    """Everything that makes an encoder entry what it is; its fingerprint keys the entries. The weights are named by
    the class's ``files_fingerprint(**init_args)`` where it has one (loaded from a folder: its files, sampled,
    without building the encoder), else by a sha256 of every parameter and buffer of ``module()`` (a function that
    gives the built encoder)."""
    cls = encoder_class(spec, field)
    arguments = dict(spec.get("init_args") or {})
    try:
        weights = cls.files_fingerprint(**arguments) if hasattr(cls, "files_fingerprint") else None
    except TypeError as exc:
        raise ConfigError(f"data.cache.{field}.init_args do not fit {spec['class_path']} ({exc})") from exc
    init_args = json.loads(json.dumps(arguments, sort_keys=True, default=str))
    if weights:  # the files stand for the folder: a copy of it elsewhere (another path) keeps the cache
        init_args = {k: v for k, v in init_args.items() if k not in getattr(cls, "FOLDER_ARGS", ())}
    else:
        module = module()
    return {
        "field": field,
        "class_path": spec["class_path"],
        "init_args": init_args,
        **({"weights_files": weights} if weights else {"weights_sha256": weights_sha256(module)}),
        "dtype": dtype,
        # Run in half precision, an encoder gives other outputs; fp32 is left out, so that caches built before the
        # knob existed keep their keys.
        **({"compute_dtype": compute} if compute != "fp32" else {}),
        "layout": "byte-shuffled",  # how the stored bytes are laid out: part of what an entry is
        "input": inputs,
    }


def _variant(pretrained: str, subfolder: str | None) -> str | None:
    """The weights variant a local folder's VAE has (cache.pipelines.weights_variant); None for a hub id."""
    from lit_dist.cache.pipelines import weights_variant

    folder = Path(pretrained).expanduser() / (subfolder or "")
    return weights_variant(folder, "data.cache.encoder.init_args.pretrained") if folder.is_dir() else None


class VAEEncoder(nn.Module):
    """Latents of diffusers' ``AutoencoderKL``: (``encode(x).latent_dist`` mean (or a sample) - shift factor) x scaling
    factor, as the pipelines that use it make them."""

    FOLDER_ARGS = ("pretrained",)  # the init argument naming the folder files_fingerprint reads

    def __init__(self, pretrained: str | None = None, subfolder: str | None = None, config: dict | None = None,
                 output: Literal["mean", "sample"] = "mean", seed: int = 0):
        """Load or build the VAE.

        Args:
            pretrained: A diffusers model id or folder to load weights from (needs them on disk or the hub).
            subfolder: Subfolder of ``pretrained`` holding the VAE (e.g. "vae" of a full pipeline).
            config: Instead of pretrained: AutoencoderKL init arguments, randomly initialised from ``seed``.
            output: mean (the distribution's mean) or sample (one draw, from ``seed``).
            seed: Seed of the random initialisation (with config) and of the draws (output: sample).
        """
        super().__init__()
        require("diffusers", "data.cache.encoder VAEEncoder")
        from diffusers import AutoencoderKL

        if (pretrained is None) == (config is None):
            raise ConfigError("data.cache.encoder.init_args: give VAEEncoder exactly one of pretrained or config")
        if pretrained is not None:
            with quiet_loading():
                self.vae = AutoencoderKL.from_pretrained(pretrained, subfolder=subfolder,
                                                         variant=_variant(pretrained, subfolder))
        else:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                self.vae = AutoencoderKL(**config)
        # Encoding needs the encoder half only; the decoder would double the memory and the weights hashed.
        self.vae.decoder, self.vae.post_quant_conv = None, None
        self.output, self.seed = output, seed

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 3, H, W) in [-1, 1]
        dist = self.vae.encode(x).latent_dist
        if self.output == "mean":
            latents = dist.mean
        else:
            latents = dist.sample(torch.Generator(x.device).manual_seed(self.seed))
        # SD3's and Flux's VAEs centre their latents first (shift_factor); SD 1.5's and SDXL's have none.
        return (latents - _shift(self.vae)) * self.vae.config.scaling_factor  # (B, C, H / f, W / f)

    @staticmethod
    def files_fingerprint(pretrained: str | None = None, subfolder: str | None = None, **_) -> str | None:
        """A VAE loaded from a local folder is named by its files (cache.pipelines.files_fingerprint); else None."""
        return _folder_fingerprint(pretrained, subfolder)


class VAEDecoder(nn.Module):
    """Images from latents that ``VAEEncoder`` with the same ``pretrained``/``subfolder``/``config``/``seed`` made:
    ``decode(latents / scaling factor + shift factor)``, normalised as the encoder's input was (data.mean, data.std)."""

    def __init__(self, pretrained: str | None = None, subfolder: str | None = None, config: dict | None = None,
                 seed: int = 0):
        super().__init__()
        require("diffusers", "decoding VAE latents (VAEDecoder)")
        from diffusers import AutoencoderKL

        if pretrained is not None:
            with quiet_loading():
                self.vae = AutoencoderKL.from_pretrained(pretrained, subfolder=subfolder,
                                                         variant=_variant(pretrained, subfolder))
        else:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)  # the same draws as VAEEncoder's: the same weights
                self.vae = AutoencoderKL(**config)
        self.vae.encoder, self.vae.quant_conv = None, None

    @property
    def latent_shape_factor(self) -> tuple[int, int]:
        """(latent channels, pixels per latent along a side)."""
        return self.vae.config.latent_channels, 2 ** (len(self.vae.config.block_out_channels) - 1)

    def forward(self, latents: torch.Tensor) -> torch.Tensor:  # (B, C, h, w) -> (B, 3, h x f, w x f)
        return self.vae.decode(latents / self.vae.config.scaling_factor + _shift(self.vae)).sample


def _shift(vae) -> float:
    """The VAE's shift_factor (SD3, Flux), 0 where it has none."""
    return getattr(vae.config, "shift_factor", None) or 0.0


def _folder_fingerprint(pretrained: str | None, subfolder: str | None) -> str | None:
    from pathlib import Path

    if pretrained is None or not Path(pretrained).expanduser().is_dir():
        return None  # random weights from a config, or a hub id: the weights themselves are hashed
    from lit_dist.cache.pipelines import files_fingerprint

    return files_fingerprint(Path(pretrained).expanduser(), [subfolder or "."])


def decoder_for(spec: dict, field: str = "encoder") -> VAEDecoder:
    """The decoder that turns ``data.cache.<field>``'s latents back into images (frozen, eval, CPU); ConfigError for
    an encoder lit-dist knows no decoder of."""
    class_path = spec.get("class_path", "")
    if class_path.rsplit(".", 1)[-1] != "VAEEncoder":
        raise ConfigError(f"data.cache.{field}.class_path = {class_path!r}: lit-dist decodes latents of "
                          "lit_dist.cache.encoders.VAEEncoder only; train on pixels, or cache with VAEEncoder")
    args = {k: v for k, v in dict(spec.get("init_args") or {}).items() if k in ("pretrained", "subfolder", "config", "seed")}
    return VAEDecoder(**args).eval().requires_grad_(False)


class TextEncoder(nn.Module):
    """Token embeddings of a frozen transformers text encoder (T5's encoder or CLIP's text model), for
    ``data.cache.caption_encoder``: captions -> (B, max_length, width), every caption padded or cut to
    ``max_length`` tokens so that all have one shape."""

    def __init__(self, pretrained: str | None = None, kind: Literal["t5", "clip"] = "t5", config: dict | None = None,
                 subfolder: str | None = None, max_length: int = 64, seed: int = 0):
        """Load or build the text encoder.

        Args:
            pretrained: A transformers model id or folder (e.g. google/t5-v1_1-base); its tokenizer comes with it.
            kind: t5 (T5EncoderModel) or clip (CLIPTextModel).
            config: Instead of pretrained: the model config's arguments, randomly initialised from ``seed``, with
                ByT5's byte tokenizer (no vocabulary file to download; vocab_size must be at least 259).
            subfolder: Subfolder of ``pretrained`` holding the text encoder (e.g. "text_encoder" of a pipeline).
            max_length: Tokens per caption, padded or cut: the cached embedding is (max_length, width).
            seed: Seed of the random initialisation (with config).
        """
        super().__init__()
        require("transformers", "data.cache.caption_encoder TextEncoder")
        import transformers

        if (pretrained is None) == (config is None):
            raise ConfigError("data.cache.caption_encoder.init_args: give TextEncoder exactly one of pretrained or config")
        if kind not in ("t5", "clip"):
            raise ConfigError(f"data.cache.caption_encoder.init_args.kind = {kind!r}: must be t5 or clip")
        if max_length < 1:
            raise ConfigError(f"data.cache.caption_encoder.init_args.max_length = {max_length}: must be at least 1")
        model_class = transformers.T5EncoderModel if kind == "t5" else transformers.CLIPTextModel
        if pretrained is not None:
            kwargs = {"subfolder": subfolder} if subfolder else {}
            with quiet_loading():
                self.model = model_class.from_pretrained(pretrained, **kwargs)
            tokenizer_folder = {"subfolder": subfolder.replace("text_encoder", "tokenizer")} if subfolder else {}
            self.tokenizer = transformers.AutoTokenizer.from_pretrained(pretrained, **tokenizer_folder)
        else:
            config_class = transformers.T5Config if kind == "t5" else transformers.CLIPTextConfig
            # ByT5's tokenizer: UTF-8 bytes + 3 special ids, built in code (nothing downloaded).
            self.tokenizer = transformers.ByT5Tokenizer()
            if config.get("vocab_size", 0) < len(self.tokenizer):
                raise ConfigError(f"data.cache.caption_encoder.init_args.config.vocab_size = {config.get('vocab_size')}: "
                                  f"the byte tokenizer needs at least {len(self.tokenizer)}")
            # The byte tokenizer's special ids, unless the config names others (CLIP's defaults are its BPE's).
            ids = {"pad_token_id": self.tokenizer.pad_token_id, "eos_token_id": self.tokenizer.eos_token_id}
            if kind == "clip":
                ids["bos_token_id"] = None
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                self.model = model_class(config_class(**{**ids, **config}))
        self.max_length = max_length

    def forward(self, texts: list[str]) -> torch.Tensor:
        tokens = self.tokenizer(list(texts), padding="max_length", truncation=True, max_length=self.max_length,
                                return_tensors="pt")
        device = next(self.model.parameters()).device
        out = self.model(input_ids=tokens["input_ids"].to(device), attention_mask=tokens["attention_mask"].to(device))
        return out.last_hidden_state  # (B, max_length, width)


# The T5 tokens per caption each family's pipeline uses by default (its ``max_sequence_length``); CLIP's are always
# its tokenizer's 77.
T5_TOKENS = {"sd3": 256, "flux": 512, "pixart": 300}


class PipelineTextEncoder(nn.Module):
    """A diffusers pipeline folder's own tokenizers and text encoders, as its pipeline encodes a prompt: captions ->
    the family's condition (lit_dist.model.nets.pipeline.CONDITION), a dict of (B, ...) tensors: ``hidden`` (the
    token states the denoiser attends to), ``pooled`` (SDXL, SD3, Flux) and ``mask`` (PixArt's T5 tokens)."""

    FOLDER_ARGS = ("pipeline",)  # the init argument naming the folder files_fingerprint reads

    def __init__(self, pipeline: str, max_length: int | None = None):
        """Load the folder's text encoders.

        Args:
            pipeline: A diffusers pipeline folder (SD 1.5/2.x, SDXL, SD3, Flux, PixArt): its text_encoder*/ and tokenizer*/.
            max_length: T5 tokens per caption (SD3, Flux, PixArt); default: the pipeline's (256, 512, 300).
        """
        super().__init__()
        require("transformers", "data.cache.caption_encoder PipelineTextEncoder")
        import transformers

        from lit_dist.cache.pipelines import read_folder

        folder = read_folder(pipeline, "data.cache.caption_encoder.init_args.pipeline")
        self.folder, self.family = folder, folder.family.name
        # SDXL's pipelines use zeros for an empty negative prompt, as SDXL was trained (model_index.json says so).
        self.zeros_for_empty = bool(folder.index.get("force_zeros_for_empty_prompt", False))
        self.encoders = nn.ModuleList()
        self.tokenizers = []
        for name in folder.family.text_encoders:
            self.encoders.append(folder.load(name, "data.cache.caption_encoder.init_args.pipeline"))
            self.tokenizers.append(transformers.AutoTokenizer.from_pretrained(folder.path,
                                                                              subfolder=name.replace("text_encoder", "tokenizer")))
        if max_length is not None and max_length < 1:
            raise ConfigError(f"data.cache.caption_encoder.init_args.max_length = {max_length}: must be at least 1")
        self.max_length = max_length or T5_TOKENS.get(self.family)

    @staticmethod
    def files_fingerprint(pipeline: str, max_length: int | None = None) -> str:
        """The folder's text encoders' and tokenizers' files (cache.pipelines.files_fingerprint): what keys the
        cache, read without loading them."""
        from lit_dist.cache.pipelines import read_folder

        folder = read_folder(pipeline, "data.cache.caption_encoder.init_args.pipeline")
        names = [n for e in folder.family.text_encoders for n in (e, e.replace("text_encoder", "tokenizer"))]
        return folder.fingerprint(*names)

    def empty_caption(self) -> dict[str, torch.Tensor]:
        """The condition for "no caption", as the family's pipeline makes it with no negative prompt: the caption ""
        encoded, or zeros of its shapes (SDXL's force_zeros_for_empty_prompt)."""
        empty = self([""])
        if self.zeros_for_empty:
            return {key: torch.zeros_like(value) for key, value in empty.items()}
        return empty

    def _tokens(self, i: int, texts: list[str], max_length: int | None = None) -> dict:
        tokenizer = self.tokenizers[i]
        device = next(self.encoders[i].parameters()).device
        tokens = tokenizer(texts, padding="max_length", max_length=max_length or tokenizer.model_max_length,
                           truncation=True, return_tensors="pt")
        return {k: v.to(device) for k, v in tokens.items()}

    def _clip(self, i: int, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """(penultimate hidden states, pooled output) of CLIP ``i``, as SDXL and SD3 take them."""
        out = self.encoders[i](self._tokens(i, texts)["input_ids"], output_hidden_states=True)
        return out.hidden_states[-2], out[0]

    def forward(self, texts: list[str]) -> dict[str, torch.Tensor]:
        texts = list(texts)
        if self.family == "sd15":
            return {"hidden": self.encoders[0](self._tokens(0, texts)["input_ids"])[0]}
        if self.family == "sdxl":
            (first, _), (second, pooled) = self._clip(0, texts), self._clip(1, texts)
            return {"hidden": torch.cat([first, second], dim=-1), "pooled": pooled}
        if self.family == "sd3":
            (first, pooled_1), (second, pooled_2) = self._clip(0, texts), self._clip(1, texts)
            t5 = self.encoders[2](self._tokens(2, texts, self.max_length)["input_ids"])[0]
            clip = torch.cat([first, second], dim=-1)
            clip = torch.nn.functional.pad(clip, (0, t5.shape[-1] - clip.shape[-1]))
            return {"hidden": torch.cat([clip, t5], dim=-2), "pooled": torch.cat([pooled_1, pooled_2], dim=-1)}
        if self.family == "flux":
            pooled = self.encoders[0](self._tokens(0, texts)["input_ids"], output_hidden_states=False).pooler_output
            return {"hidden": self.encoders[1](self._tokens(1, texts, self.max_length)["input_ids"])[0], "pooled": pooled}
        # PixArt lowercases a caption before its T5 sees it (its pipeline's clean_caption=False path).
        tokens = self._tokens(0, [t.lower().strip() for t in texts], self.max_length)
        hidden = self.encoders[0](tokens["input_ids"], attention_mask=tokens["attention_mask"])[0]
        return {"hidden": hidden, "mask": tokens["attention_mask"]}
