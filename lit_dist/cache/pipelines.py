"""Which diffusers pipeline a folder holds: its family, from ``model_index.json``.

A pipeline folder is what ``DiffusionPipeline.save_pretrained`` writes and what a hub download holds:
``model_index.json`` naming the pipeline class and each component's (library, class), and one subfolder per
component (``unet/`` or ``transformer/``, ``vae/``, ``text_encoder*/``, ``tokenizer*/``, ``scheduler/``). The
family decides how lit-dist calls the denoiser (lit_dist/model/nets/pipeline.py) and what the caches build with
the pipeline's own encoders; it sits here, in the caches' band, so that both can read it.
"""

import hashlib
import json
import re
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

        from lit_dist.runtime.extras import quiet_loading

        library, class_name = self.index[name]
        try:
            model_class = getattr(importlib.import_module(library), class_name)
        except (ImportError, AttributeError) as exc:
            raise ConfigError(f"{field} = {str(self.path)!r}: its {name} is a {library}.{class_name}, which does not "
                              f"import here ({exc}): update {library}") from exc
        with quiet_loading():
            return model_class.from_pretrained(self.path, subfolder=name,
                                               variant=weights_variant(self.path / name, field))

    def pipeline_class(self):
        """diffusers' pipeline class that ``model_index.json`` names (DiffusionPipeline where diffusers lacks it)."""
        import diffusers

        from lit_dist.runtime.extras import quiet_loading

        with quiet_loading():  # its module imports transformers' image processors: the torchvision notice
            return getattr(diffusers, self.index["_class_name"], diffusers.DiffusionPipeline)

    def fingerprint(self, *names: str) -> str:
        """What the components ``names`` (subfolders) are, without reading their weights whole: see files_fingerprint."""
        return files_fingerprint(self.path, names)


def _download(repo_id: str, field: str) -> Path:
    """The hub pipeline ``repo_id``'s snapshot in the Hugging Face cache, with what its pipeline loads (diffusers'
    choice of files: no single-file checkpoints beside the components); only the cache with HF_HUB_OFFLINE=1."""
    from lit_dist.runtime.extras import require

    require("diffusers", f"{field} = {repo_id!r} (a hub id)")
    import diffusers
    from huggingface_hub import constants

    offline = constants.HF_HUB_OFFLINE
    try:
        return Path(diffusers.DiffusionPipeline.download(repo_id, local_files_only=offline))
    except (OSError, ValueError) as exc:  # the hub's errors (not found, gated, not cached offline); a malformed id
        where = "in the Hugging Face cache (HF_HUB_OFFLINE=1)" if offline else "in the Hugging Face cache or on the hub"
        raise ConfigError(f"{field} = {repo_id!r} is no folder, and no pipeline of that id is {where} "
                          f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}): download it "
                          f"beforehand (huggingface-cli download {repo_id} --local-dir FOLDER) and give the "
                          "folder, or check the id and the network") from exc


def weights_variant(folder: Path, field: str) -> str | None:
    """The variant to load ``folder``'s weights as: None where it has plain weights files, else the one variant it
    holds (a folder downloaded with ``--variant fp16`` has only ``*.fp16.safetensors``); a ConfigError naming
    ``field`` where it holds only several variants."""
    variants = {m["variant"] for p in Path(folder).glob("*") if (m := _WEIGHTS_NAME.fullmatch(p.name))}
    if None in variants or not variants:
        return None
    if len(variants) > 1:
        raise ConfigError(f"{field}: {folder} holds the weights variants {', '.join(sorted(variants))} and no plain "
                          "weights: keep one variant's files in it")
    return variants.pop()


def plain_name(filename: str, variant: str) -> str:
    """``filename`` of ``variant``'s files as the plain one's: diffusion_pytorch_model.fp16.safetensors ->
    diffusion_pytorch_model.safetensors, model.fp16-00001-of-00002.safetensors -> model-00001-of-00002.safetensors,
    model.safetensors.index.fp16.json -> model.safetensors.index.json; other names as they are."""
    if (m := _WEIGHTS_NAME.fullmatch(filename)) and m["variant"] == variant:
        return filename.replace(f".{variant}", "", 1)
    if filename.endswith(f".index.{variant}.json"):
        return filename.removesuffix(f".{variant}.json") + ".json"
    return filename


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


# A hub repository id (owner/name), as opposed to a relative path: no "./", "~", "..", nor more than one "/".
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]*[A-Za-z0-9]")
# A weights file's name: plain (model.safetensors, model-00001-of-00002.safetensors) or a variant's
# (diffusion_pytorch_model.fp16.safetensors, model.fp16-00001-of-00002.safetensors).
_WEIGHTS_NAME = re.compile(r"[^.]+(?:\.(?P<variant>[^.-]+))?(?:-\d+-of-\d+)?\.(?:safetensors|bin)")


def read_folder(path: str | Path, field: str = "model.net.init_args.pipeline") -> PipelineFolder:
    """The pipeline folder at ``path`` (a folder, or a hub id: its snapshot in the Hugging Face cache, downloaded
    there if missing) and its family; a ConfigError (exit 2) naming ``field`` for a path that is no pipeline folder,
    a hub id that is neither cached nor reachable, or a pipeline of a family lit-dist does not know."""
    folder = Path(path).expanduser()
    if not folder.exists() and isinstance(path, str) and _REPO_ID.fullmatch(path):
        folder = _download(path, field)
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
