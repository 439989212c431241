"""Which diffusers pipeline a folder holds: its family, from ``model_index.json``.

A pipeline folder is what ``DiffusionPipeline.save_pretrained`` writes and what a hub download holds:
``model_index.json`` naming the pipeline class and each component's (library, class), and one subfolder per
component (``unet/`` or ``transformer/``, ``vae/``, ``text_encoder*/``, ``tokenizer*/``, ``scheduler/``). The
family decides how lit-dist calls the denoiser (lit_dist/model/nets/pipeline.py) and what the caches build with
the pipeline's own encoders; it sits here, in the caches' band, so that both can read it.
"""

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from lit_dist.errors import ConfigError


@dataclass(frozen=True)
class Family:
    """What lit-dist knows of one family of pipelines."""

    name: str
    pipelines: tuple[str, ...]  # model_index.json's _class_name of each pipeline of the family
    denoiser: str  # the subfolder of the trained part
    text_encoders: tuple[str, ...]  # the subfolders of its text encoders, in the pipeline's order
    flow: bool  # trained with flow matching (else a DDPM noise schedule)
    blocks: tuple[str, ...]  # the denoiser's repeated blocks: what FSDP2 shards one by one


_UNET_BLOCKS = ("diffusers.models.transformers.transformer_2d.Transformer2DModel", "diffusers.models.resnet.ResnetBlock2D")
FAMILIES = (
    Family("sd15", ("StableDiffusionPipeline",), "unet", ("text_encoder",), flow=False, blocks=_UNET_BLOCKS),
    Family("sdxl", ("StableDiffusionXLPipeline",), "unet", ("text_encoder", "text_encoder_2"), flow=False,
           blocks=_UNET_BLOCKS),
    Family("sd3", ("StableDiffusion3Pipeline",), "transformer", ("text_encoder", "text_encoder_2", "text_encoder_3"),
           flow=True, blocks=("diffusers.models.attention.JointTransformerBlock",)),
    Family("flux", ("FluxPipeline",), "transformer", ("text_encoder", "text_encoder_2"), flow=True,
           blocks=("diffusers.models.transformers.transformer_flux.FluxTransformerBlock",
                   "diffusers.models.transformers.transformer_flux.FluxSingleTransformerBlock")),
    Family("pixart", ("PixArtAlphaPipeline", "PixArtSigmaPipeline"), "transformer", ("text_encoder",), flow=False,
           blocks=("diffusers.models.attention.BasicTransformerBlock",)),
)


@dataclass(frozen=True)
class PipelineFolder:
    """A pipeline folder on disk, its family and its ``model_index.json``."""

    path: Path
    family: Family
    index: dict

    def load(self, name: str, field: str):
        """Component ``name`` (``unet``, ``text_encoder_2``, ...) loaded from its subfolder with the class
        ``model_index.json`` names for it; a ConfigError naming ``field`` if that class does not import here."""
        import importlib

        library, class_name = self.index[name]
        try:
            model_class = getattr(importlib.import_module(library), class_name)
        except (ImportError, AttributeError) as exc:
            raise ConfigError(f"{field} = {str(self.path)!r}: its {name} is a {library}.{class_name}, which does not "
                              f"import here ({exc}): update {library}") from exc
        return model_class.from_pretrained(self.path, subfolder=name)

    def fingerprint(self, *names: str) -> str:
        """What the components ``names`` (subfolders) are, without reading their weights whole: see files_fingerprint."""
        return files_fingerprint(self.path, names)


# A weight file is fingerprinted by its size, its header and SAMPLES reads of SAMPLE_BYTES spread over it: a few MB
# per encoder instead of reading (and hashing) GBs at every start. A trained or converted file differs in nearly every
# block, so the samples see it; the names, shapes and dtypes are in the header.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf")
SAMPLES, SAMPLE_BYTES = 16, 65536


def files_fingerprint(root: Path, names) -> str:
    """sha256 over the files of the subfolders ``names`` of ``root`` (their paths relative to ``root``, in order):
    small files whole (configs, tokenizers), weight files by size, safetensors header and evenly spaced samples.
    The same for a copy of the folder elsewhere; different when any file's content changes."""
    sha = hashlib.sha256()
    for name in names:
        for path in sorted(p for p in (Path(root) / name).rglob("*") if p.is_file() and not p.name.startswith(".")):
            size = path.stat().st_size
            sha.update(f"{path.relative_to(root).as_posix()}:{size}\n".encode())
            with open(path, "rb") as f:
                if not path.name.endswith(WEIGHT_SUFFIXES):
                    sha.update(f.read())
                    continue
                if path.name.endswith(".safetensors") and size >= 8:
                    header = int.from_bytes(f.read(8), "little")
                    sha.update(f.read(min(header, size - 8)))
                for i in range(SAMPLES):
                    f.seek(max(0, (size - SAMPLE_BYTES) * i // (SAMPLES - 1)))
                    sha.update(f.read(SAMPLE_BYTES))
    return sha.hexdigest()


def read_folder(path: str | Path, field: str = "model.net.init_args.pipeline") -> PipelineFolder:
    """The pipeline folder at ``path`` and its family; a ConfigError (exit 2) naming ``field`` for a path that is no
    pipeline folder or a pipeline of a family lit-dist does not know."""
    folder = Path(path).expanduser()
    index_path = folder / "model_index.json"
    if not index_path.is_file():
        what = "is not a folder" if not folder.is_dir() else "has no model_index.json"
        raise ConfigError(f"{field} = {str(path)!r} {what}: name a diffusers pipeline folder (what "
                          "DiffusionPipeline.save_pretrained writes, or a downloaded one: huggingface-cli download "
                          "REPO_ID --local-dir FOLDER)")
    try:
        index = json.loads(index_path.read_text())
        class_name = index["_class_name"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"{field}: {index_path} is not a pipeline's model_index.json ({exc!r})") from exc
    for family in FAMILIES:
        if class_name in family.pipelines:
            missing = [name for name in (family.denoiser, *family.text_encoders, "vae", "scheduler")
                       if not isinstance(index.get(name), list) or index[name][0] is None or not (folder / name).is_dir()]
            if missing:
                raise ConfigError(f"{field} = {str(path)!r}: a {class_name} folder without {', '.join(missing)}: "
                                  "lit-dist needs every component of the pipeline (download the whole folder)")
            return PipelineFolder(folder, family, index)
    found = sorted({v[1] for v in index.values() if isinstance(v, list) and len(v) == 2 and v[1]})
    known = ", ".join(f"{f.name} ({' or '.join(f.pipelines)})" for f in FAMILIES)
    raise ConfigError(f"{field} = {str(path)!r} holds a {class_name} (components: {', '.join(found)}): lit-dist "
                      f"fine-tunes the families {known}")
