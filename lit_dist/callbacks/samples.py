"""``Samples``: images a generative run makes from fixed prompts and seeds, at every validation (and every
``every_n_steps``), as a grid in TensorBoard's images tab and in ``{run_dir}/samples/step-N.png``, with a prompt
adherence number (``samples/adherence``) when a judge is given.

Enabled in every run (the CLI's ``samples`` group); it does nothing unless ``model.objective`` is generative.
- The prompts are ``prompts`` from the YAML or, without them, ``num_prompts`` captions (labels, for a
  label-conditioned model) chosen once from the validation rows by ``seed``. Rank 0 encodes them with the run's
  caption encoder (``data.cache.caption_encoder``) and hands the embeddings to the other ranks; they travel in
  the checkpoint, so a resumed run draws the same images without the encoder.
- Image ``i`` (prompt ``i // per_prompt``) starts from noise seeded by (``seed``, ``i``). The images are made in
  fixed groups of ``batch_size``, dealt round-robin to the ranks, and gathered to rank 0: the same prompts and
  seeds give the same images after a resume and at any world size. Every rank runs the same number of groups
  (a rank without one repeats group 0 and drops it), so sharded models' collectives stay matched.
- Latents are decoded by the VAE decoder that matches ``data.cache.encoder``; pixels are un-normalised.
- The weights are validation's: the average (``model.ema``) once it has started and ``evaluate`` is on.
- Training's random state is left as it was: the run trains the same with or without samples.
- The time it takes goes into the goodput ledger as ``sampling`` (event ``samples.written``).

Example::

    samples:
      prompts: ["a red circle on a white background", "a blue cross on a yellow background"]
      per_prompt: 4
      guidance: 4.0
      every_n_steps: 500
      judge:                                    # the shapes demo: a classifier trained on the real shapes
        class_path: lit_dist.data.demo.judge.ShapesJudge
        init_args: {classifier: runs/quickstart/r1/model.pt}
"""

import logging
import math
import os
import time

import torch
from lightning.pytorch import Callback

from lit_dist.errors import ConfigError, DataError
from lit_dist.model import conditions
from lit_dist.model.adapters import scaled
from lit_dist.model.conditions import Condition
from lit_dist.model.judge import Judge
from lit_dist.runtime.control import Event, RunControl

log = logging.getLogger(__name__)


class Samples(Callback):
    """Images from fixed prompts and seeds at validation: a grid to TensorBoard and PNG, and their adherence."""

    def __init__(self, prompts: list[str] | None = None, num_prompts: int = 8, per_prompt: int = 4,
                 steps: int = 30, guidance: float = 4.0, seed: int = 0, at_validation: bool = True,
                 every_n_steps: int | None = None, at_end: bool = True, batch_size: int = 16, size: int | None = None,
                 judge: Judge | None = None, adapter_scale: float = 1.0):
        """Sample settings.

        Args:
            prompts: The prompts (labels, for a label-conditioned model); default: num_prompts validation captions.
            num_prompts: Prompts chosen from the validation rows when prompts is not given.
            per_prompt: Images per prompt (a row of the grid each).
            steps: Sampler steps per image.
            guidance: Classifier-free guidance scale (1: none).
            seed: Seed of the images' starting noise and of the prompts chosen from the validation rows.
            at_validation: Sample after every validation (of fit, and of lit-dist validate).
            every_n_steps: Also sample every this many optimizer steps; null: only at validation.
            at_end: Also sample when training ends (unless the last step was sampled already).
            batch_size: Images per denoiser call (a group); the groups are spread over the ranks.
            size: Side of the square images in pixels; default: data.resolution.
            judge: Scores each image against its prompt (lit_dist.model.judge); its mean is logged as samples/adherence.
            adapter_scale: Strength of model.adapter in the images: its update times this (0: the base alone).
        """
        problems = []
        for name, value in (("num_prompts", num_prompts), ("per_prompt", per_prompt), ("steps", steps),
                            ("batch_size", batch_size)):
            if value < 1:
                problems.append(f"samples.{name} = {value}: must be at least 1")
        if every_n_steps is not None and every_n_steps < 1:
            problems.append(f"samples.every_n_steps = {every_n_steps}: must be at least 1, or null")
        if size is not None and size < 8:
            problems.append(f"samples.size = {size}: must be at least 8, or null for data.resolution")
        if prompts is not None and not prompts:
            problems.append("samples.prompts is an empty list: give prompts, or null to choose validation captions")
        ConfigError.collect(problems)
        self.prompts, self.num_prompts, self.per_prompt = prompts, num_prompts, per_prompt
        self.steps, self.guidance, self.seed = steps, guidance, seed
        self.at_validation, self.every_n_steps, self.at_end = at_validation, every_n_steps, at_end
        self.batch_size, self.size, self.judge = batch_size, size, judge
        self.adapter_scale = adapter_scale
        self._control: RunControl | None = None
        self._chosen: list[str] | None = None  # the prompts as shown (captions, label names)
        self._condition = None  # (P, ...) on the CPU: embeddings (or a dict of them: a pipeline's fields), labels
        self._empty: dict | None = None  # a pipeline's empty caption, (1, ...) per field: guidance's "no caption"
        self._decoder = None
        self._shape: tuple[int, ...] | None = None
        self._sampled_step = -1
        self._prompts_logged = False  # the prompts go to TensorBoard once, with this process's first grid
        self._mean = self._std = None  # the data's normalisation, 0-255 scale
        self._loaded_step: int | None = None
        self.last_path: str | None = None

    def connect(self, control: RunControl) -> None:
        self._control = control

    def setup(self, trainer, pl_module, stage: str) -> None:
        # What the first grid will need, checked before the first step (every rank: each raises the same line).
        if not self._active(pl_module) or not (self.at_validation or self.every_n_steps or self.at_end):
            return
        if self.adapter_scale != 1.0 and getattr(pl_module, "adapter", None) is None:
            raise ConfigError(f"samples.adapter_scale = {self.adapter_scale:g}, and model.adapter is not set: it "
                              "scales an adapter's update; set model.adapter or leave samples.adapter_scale at 1")
        from lit_dist.runtime.extras import require

        objective = type(pl_module.objective).__name__
        require("diffusers", f"samples (the sampler of model.objective {objective}; samples.at_validation: false, "
                             "every_n_steps: null and at_end: false turn them off)")
        data = trainer.datamodule
        spec = getattr(getattr(data, "cache", None), "caption_encoder", None) or {}
        if pl_module.objective.condition == "caption" and str(spec.get("class_path", "")).endswith(".TextEncoder"):
            require("transformers", "samples (their prompts go through data.cache.caption_encoder TextEncoder)")

    def _active(self, pl_module) -> bool:
        from lit_dist.model.objectives import Generative

        return isinstance(getattr(pl_module, "objective", None), Generative) and hasattr(pl_module, "generate") \
            and hasattr(pl_module, "evaluation_weights")

    # -- when -------------------------------------------------------------------------------------

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        # Before LitModel's own hook: the average is still in the parameters when validation uses it.
        if self.at_validation and not trainer.sanity_checking and trainer.state.fn in ("fit", "validate"):
            self.sample(trainer, pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step  # still 0 after the first micro-batches under gradient accumulation
        if self.every_n_steps and step and step % self.every_n_steps == 0 and step != self._sampled_step:
            self.sample(trainer, pl_module)

    def on_train_end(self, trainer, pl_module) -> None:
        # Only at the planned end (every rank is there), not at a stop a callback asked for: a stop before a
        # requeue has better uses for its seconds.
        steps_done = trainer.max_steps not in (None, -1) and trainer.global_step >= trainer.max_steps
        epochs_done = trainer.max_epochs not in (None, -1) and trainer.current_epoch >= trainer.max_epochs
        if self.at_end and (steps_done or epochs_done):
            self.sample(trainer, pl_module)

    # -- what -------------------------------------------------------------------------------------

    def sample(self, trainer, pl_module) -> None:
        """Make, gather and write this step's grid. On every rank (collectives inside)."""
        if not self._active(pl_module) or self._sampled_step == self._step(trainer):
            return
        self._sampled_step = self._step(trainer)
        began = time.perf_counter()
        self._prepare(trainer, pl_module)
        total = len(self._chosen) * self.per_prompt
        groups = [list(range(start, min(start + self.batch_size, total))) for start in range(0, total, self.batch_size)]
        world, rank = trainer.world_size, trainer.global_rank
        made = []
        device = trainer.strategy.root_device
        # The average swapped in once for every group (each swap copies every local parameter; under ZeRO-3 it gathers).
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), _full_parameters(trainer), \
                pl_module.evaluation_weights(), scaled(pl_module.net, self.adapter_scale):
            for turn in range(math.ceil(len(groups) / world)):
                index = turn * world + rank
                pixels = self._group(pl_module, groups[index if index < len(groups) else 0], device)
                if index < len(groups):
                    made.append((index, pixels))
        gathered = _gather(made, world)
        if not trainer.is_global_zero:
            return
        pixels = torch.cat([p for _, p in sorted(gathered, key=lambda item: item[0])])  # (total, 3, H, W) uint8
        self._publish(trainer, pixels, began)

    def _group(self, pl_module, indices: list[int], device) -> torch.Tensor:
        from lit_dist.model.sampling import decode, initial_noise

        prompt_of = torch.tensor([i // self.per_prompt for i in indices])
        condition = conditions.take(self._condition, prompt_of)
        noise = initial_noise(self._shape, self.seed, indices)
        return decode(pl_module.generate(condition, noise, self.steps, self.guidance, self._empty), self._decoder,
                      self._mean, self._std)

    def _prepare(self, trainer, pl_module) -> None:
        """The prompts, their condition, the decoder and the image shape, once per process."""
        objective, data = pl_module.objective, trainer.datamodule
        if self._chosen is None:
            self._chosen, self._condition, self._empty = self._choose(trainer, objective, data)
            if self.judge is not None:  # on every rank, before any image: a judge that cannot read them says so now
                self.judge.check(self._chosen)
        if self._shape is not None:
            return
        half = torch.full((1, 3, 1, 1), 127.5)  # a data module without them: images in [-1, 1]
        self._mean, self._std = getattr(data, "mean", half), getattr(data, "std", half)
        size = self.size or getattr(data, "resolution", None)
        if size is None:
            raise ConfigError(f"samples.size is not set and the data module {type(data).__name__} has no resolution")
        from lit_dist.model.sampling import decoder_of, shape_of

        self._decoder = decoder_of(objective, data)
        if self._decoder is not None:
            self._decoder.to(trainer.strategy.root_device)
        self._shape = shape_of(self._decoder, size, "samples.size")

    def _choose(self, trainer, objective, data) -> tuple[list[str], Condition, dict | None]:
        """(prompts as shown, their condition on the CPU, a pipeline's empty caption): chosen and encoded by rank 0, the same on every rank; if
        that fails there, every rank raises (none is left waiting in the broadcast)."""
        if objective.condition == "none":
            return [""] * (len(self.prompts) if self.prompts else self.num_prompts), None, None
        from lit_dist.runtime.distributed import Comm

        comm = Comm(trainer.global_rank, trainer.world_size) if trainer.world_size > 1 else Comm()
        return comm.on_rank_zero(lambda: _encode(objective, data, self.prompts, self.num_prompts, self.seed),
                                 "encoding samples.prompts")

    def _publish(self, trainer, pixels: torch.Tensor, began: float) -> None:
        """Rank 0: the grid to its PNG and the loggers, the adherence, the event."""
        from lit_dist.model.sampling import grid, write_grid

        step, rows = self._step(trainer), len(self._chosen)
        path = os.path.join(trainer.default_root_dir, "samples", f"step-{step:09d}.png")
        try:
            write_grid(pixels, rows, self.per_prompt, path, self._chosen)
            self.last_path = path
        except OSError as exc:  # a full or read-only disk: the grid is lost, not the run (TensorBoard still gets it)
            log.warning("lit-dist: cannot write the sample grid %s (%s); training goes on", path, exc)
            path = None
        image = grid(pixels, rows, self.per_prompt)
        adherence = None
        if self.judge is not None:
            prompts = [p for p in self._chosen for _ in range(self.per_prompt)]
            adherence = float(self.judge(pixels, prompts).float().mean())
        for logger in trainer.loggers:
            experiment = getattr(logger, "experiment", None)
            if hasattr(experiment, "add_image"):
                experiment.add_image("samples", image, step, dataformats="HWC")
                if not self._prompts_logged:
                    experiment.add_text("samples/prompts", "  \n".join(f"{i}. {p}" for i, p in enumerate(self._chosen)),
                                        step)
            if adherence is not None:
                logger.log_metrics({"samples/adherence": adherence}, step=step)
        self._prompts_logged = True
        seconds = time.perf_counter() - began
        shown = f", adherence {adherence:.3f}" if adherence is not None else ""
        if self._control is not None:
            self._control.publish(Event("samples.written", "info", f"Samples at step {step}",
                                        f"{len(pixels)} images in {seconds:.1f} s -> {path or 'not written'}{shown}",
                                        {"step": step, "path": path, "images": len(pixels), "seconds": seconds,
                                         **({"adherence": adherence} if adherence is not None else {})}))

    def _step(self, trainer) -> int:
        """The training step the weights are from: lit-dist validate of a checkpoint does not restore the loop's."""
        if trainer.state.fn == "fit" or self._loaded_step is None:
            return trainer.global_step
        return self._loaded_step

    # -- resume -----------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        if self._chosen is None:
            return {}
        return {"prompts": list(self._chosen), "condition": self._condition, "empty": self._empty}

    def on_load_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        self._loaded_step = checkpoint.get("global_step")

    def load_state_dict(self, state_dict: dict) -> None:
        saved = list(state_dict.get("prompts") or [])
        # Kept unless the config now asks for other prompts (given ones, or another number to choose).
        if saved and (saved == self.prompts or (self.prompts is None and len(saved) == self.num_prompts)):
            self._chosen, self._condition, self._empty = saved, state_dict["condition"], state_dict.get("empty")


def _encode(objective, data, prompts: list[str] | None, num_prompts: int, seed: int) -> tuple[list[str], Condition,
                                                                                             dict | None]:
    """Rank 0: the prompts (given, or chosen from the validation rows), their condition on the CPU and the empty
    caption of a pipeline's encoders (sampling.encode_prompts)."""
    from lit_dist.model.sampling import encode_prompts

    if not prompts:
        prompts = data.pick("label" if objective.condition == "label" else "caption", num_prompts, seed) \
            if hasattr(data, "pick") else []
        if not prompts:
            raise ConfigError(f"samples.prompts is not set and the validation rows have no "
                              f"{'labels' if objective.condition == 'label' else 'captions'}: give samples.prompts")
    try:
        return encode_prompts(objective, data, [str(p) for p in prompts], "samples.prompts")
    except OSError as exc:  # the encoder's files (a pretrained folder, its tokenizer) could not be read
        raise DataError(f"samples.prompts: the caption encoder (data.cache.caption_encoder) could not encode them: "
                        f"{exc}") from exc


def _gather(made: list[tuple[int, torch.Tensor]], world: int) -> list[tuple[int, torch.Tensor]]:
    """Every rank's (group, pixels) on rank 0 (others get []): one object gather, only the groups made."""
    if world == 1 or not torch.distributed.is_initialized():
        return made
    rank = torch.distributed.get_rank()
    received = [None] * world if rank == 0 else None
    torch.distributed.gather_object(made, received, dst=0)
    return [item for part in received for item in part] if rank == 0 else []


def _full_parameters(trainer):
    """FSDP1 keeps the network's parameters flat and sharded outside the wrapped module's forward: gathered for the
    samples' denoiser calls (no write back). Other strategies gather in the denoiser's own forward."""
    from contextlib import nullcontext

    model = getattr(trainer.strategy, "model", None)
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    except ImportError:  # pragma: no cover - every supported torch has it
        return nullcontext()
    if isinstance(model, FSDP):
        return FSDP.summon_full_params(model, writeback=False)
    return nullcontext()
