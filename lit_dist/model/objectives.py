"""What a batch becomes: the objective of a ``LitModel`` (``model.objective`` in the YAML).

One LightningModule trains every task; the objective only says how a batch becomes a loss, what
evaluation measures and what prediction returns. Optimisation, LR scaling, warmup, checkpoints and
every strategy stay in ``LitModel``.

- ``Classification`` (the default): ``net(image) -> logits``; loss, accuracy, the predicted class.
- ``FlowMatching``: rectified flow, the SD3 / Flux objective. ``x_t = (1 - t) x0 + t noise`` and the
  network predicts the velocity ``noise - x0``.
- ``Diffusion``: a DDPM noise schedule (diffusers' ``DDPMScheduler``), predicting the noise (epsilon)
  or the velocity (v).

A generative objective calls the network (the denoiser) as ``net(x_t, timestep, condition)``:
``x_t`` the noisy input (B, C, H, W), ``timestep`` float (B,) on diffusers' scale (0 to 1000),
``condition`` the caption embeddings (B, ...), a dict of them (a pipeline's caption fields,
lit_dist.model.conditions), the class labels (B,) int64, or None. It may return a tensor or an
object with a ``.sample`` tensor (diffusers' models). The objective owns condition dropout (for
classifier-free guidance): a denoiser must not drop labels itself. A dropped caption is the empty
caption the batch carries beside a pipeline's captions (else all zeros), a dropped label is
``null_label``.

Example (YAML)::

    model:
      objective:
        class_path: lit_dist.model.objectives.FlowMatching
        init_args: {condition: caption, condition_dropout: 0.1, timesteps: logit_normal}
"""

import math
from typing import Literal

import torch
from torch import nn
from torch.nn import functional as F

from lit_dist.cache.captions import empty_key
from lit_dist.errors import ConfigError
from lit_dist.model import conditions
from lit_dist.runtime.extras import require


class Objective:
    """How a batch becomes a loss (training and evaluation) and what prediction returns."""

    def bind(self, input_key: str, target_key: str) -> None:
        """The batch keys the model was given (``model.input_key``, ``model.target_key``)."""
        self.input_key, self.target_key = input_key, target_key

    def take(self, batch: dict, which: str) -> torch.Tensor:
        """``batch[model.input_key]`` (which: input) or ``[model.target_key]`` (target), or one ConfigError naming
        the keys the batches hold (a latent model without its cache, labels in a table without them)."""
        key = self.input_key if which == "input" else self.target_key
        if key not in batch:
            raise ConfigError(f"model.{which}_key = {key!r}, and the batches hold {sorted(batch)}: set model.{which}_key "
                              "to one of them (latents come from data.cache.encoder: key data.cache.encoder_key)")
        return batch[key]

    def loss(self, net: nn.Module, batch: dict, train: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The loss of one batch and extra per-batch metrics (means over the batch)."""
        raise NotImplementedError

    def predict(self, net: nn.Module, batch: dict) -> dict[str, torch.Tensor]:
        raise NotImplementedError


class Classification(Objective):
    """``net(image)`` gives logits; the loss is ``model.loss`` (cross-entropy by default)."""

    def __init__(self, loss: nn.Module | None = None):
        """Classify.

        Args:
            loss: Loss module called as loss(logits, target); default: cross-entropy.
        """
        self.loss_fn = loss if loss is not None else nn.CrossEntropyLoss()

    def loss(self, net, batch, train):
        if "mask" in batch:  # a class has no pixels to weigh: the masks would be read and silently left unused
            raise ConfigError("the data has loss masks (mask_column or alpha_mask), which weigh the pixels of a "
                              "generative objective's loss, and model.objective is Classification: remove them")
        logits = net(self.take(batch, "input"))  # (B, num_classes)
        target = self.take(batch, "target")  # (B,)
        loss = self.loss_fn(logits, target)
        with torch.no_grad():
            acc = (logits.argmax(dim=-1) == target).float().mean()
        return loss, {"acc": acc}

    def predict(self, net, batch):
        logits = net(self.take(batch, "input"))  # (B, num_classes)
        return {"prediction": logits.argmax(dim=-1), "probability": logits.softmax(-1).amax(-1)}


def seeded_normal(shape: tuple[int, ...], seed: int, index: int) -> torch.Tensor:
    """Standard normal values of ``shape`` drawn on the CPU from their own seed (``seed``, ``index``): the same on any
    device, at any world size and whatever else shares the batch (validation noises, samples' starting noises)."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed * 1_000_003 + int(index)))


def denoise(net: nn.Module, x: torch.Tensor, timestep: torch.Tensor, condition) -> torch.Tensor:
    """``net(x, timestep, condition)`` as a tensor (diffusers' models return an object with ``.sample``)."""
    out = net(x, timestep, condition)
    out = getattr(out, "sample", out)
    if isinstance(out, (tuple, list)):
        out = out[0]
    if not isinstance(out, torch.Tensor) or out.shape != x.shape:
        raise ConfigError(f"model.net ({type(net).__name__}) returned {type(out).__name__} "
                          f"{tuple(getattr(out, 'shape', ()))} for a noisy input of {tuple(x.shape)}: a denoiser "
                          "is called as net(x_t, timestep, condition) and returns a tensor of x_t's shape")
    return out


class Generative(Objective):
    """What flow matching and diffusion share: conditioning, its dropout, timestep sampling and a
    deterministic evaluation loss."""

    def __init__(self, condition: Literal["caption", "label", "none"], condition_key: str | None,
                 condition_dropout: float, null_label: int | None, timesteps: str, logit_mean: float,
                 logit_std: float, eval_timesteps: int, eval_seed: int, noise_offset: float = 0.0,
                 noise_offset_probability: float = 1.0, input_perturbation: float = 0.0, eval_bands: int = 4):
        problems = []
        if eval_bands == 1 or not 0 <= eval_bands <= eval_timesteps:
            problems.append(f"model.objective.eval_bands = {eval_bands}: must be 0 (none) or 2 to eval_timesteps "
                            f"({eval_timesteps})")
        if noise_offset < 0:
            problems.append(f"model.objective.noise_offset = {noise_offset}: must be >= 0 (0: none; 0.05-0.1 usual)")
        if not 0 <= noise_offset_probability <= 1:
            problems.append(f"model.objective.noise_offset_probability = {noise_offset_probability}: must be in [0, 1]")
        if input_perturbation < 0:
            problems.append(f"model.objective.input_perturbation = {input_perturbation}: must be >= 0 (0: none; 0.1 "
                            "usual)")
        if condition not in ("caption", "label", "none"):
            problems.append(f"model.objective.condition = {condition!r}: must be caption, label or none")
        if not 0.0 <= condition_dropout < 1.0:
            problems.append(f"model.objective.condition_dropout = {condition_dropout}: must be in [0, 1)")
        if condition == "label" and condition_dropout > 0 and null_label is None:
            problems.append("model.objective.condition_dropout > 0 with labels needs model.objective.null_label: "
                            "the label the denoiser reserves for 'no label' (usually its number of classes)")
        if timesteps not in ("uniform", "logit_normal"):
            problems.append(f"model.objective.timesteps = {timesteps!r}: must be uniform or logit_normal")
        if logit_std <= 0:
            problems.append(f"model.objective.logit_std = {logit_std}: must be positive")
        if eval_timesteps < 1:
            problems.append(f"model.objective.eval_timesteps = {eval_timesteps}: must be at least 1")
        ConfigError.collect(problems)
        self.condition, self.condition_dropout, self.null_label = condition, condition_dropout, null_label
        self.condition_key = condition_key
        self.timesteps, self.logit_mean, self.logit_std = timesteps, logit_mean, logit_std
        self.eval_timesteps, self.eval_seed = eval_timesteps, eval_seed
        self.noise_offset, self.noise_offset_probability = noise_offset, noise_offset_probability
        self.input_perturbation, self.eval_bands = input_perturbation, eval_bands

    def bind(self, input_key, target_key):
        super().bind(input_key, target_key)
        if self.condition_key is None:
            self.condition_key = {"caption": "caption_embedding", "label": target_key, "none": None}[self.condition]

    def condition_of(self, batch: dict, train: bool) -> conditions.Condition:
        """The batch's condition; in training, each sample's dropped with probability condition_dropout, or its
        dataset's own (data.caption_dropout: the batch's ``caption_dropout``)."""
        rate = batch.get("caption_dropout") if train else None
        if rate is not None and self.condition != "caption":
            raise ConfigError(f"data.caption_dropout drops captions, and model.objective.condition = {self.condition}:"
                              " remove caption_dropout from the data config (condition_dropout drops labels)")
        if self.condition == "none":
            return None
        if self.condition_key not in batch:
            raise ConfigError(f"model.objective.condition = {self.condition} reads the batch key "
                              f"{self.condition_key!r}, and the batches hold {sorted(batch)}: set "
                              "model.objective.condition_key, or data.cache.caption_key for cached captions")
        cond = batch[self.condition_key]
        if not train or (self.condition_dropout == 0 and rate is None):
            return cond
        device = conditions.device(cond)
        drop = torch.rand(conditions.size(cond), device=device) < (self.condition_dropout if rate is None
                                                                    else rate.to(device))
        if self.condition == "label":
            return torch.where(drop, torch.full_like(cond, self.null_label), cond)
        # "No caption" is the empty caption as the family's pipeline encodes it, which the data module sends beside
        # the captions of a pipeline's caption cache; else an all-zero embedding (as SDXL's
        # force_zeros_for_empty_prompt). The sampler's guidance uses the same.
        return conditions.replace(cond, drop, batch.get(empty_key(self.condition_key)))

    def sample_t(self, n: int, device, generator: torch.Generator | None = None) -> torch.Tensor:
        """Training times in (0, 1): uniform, or the sigmoid of a normal (logit-normal, SD3's default)."""
        if self.timesteps == "uniform":
            return torch.rand(n, device=device, generator=generator)
        z = torch.randn(n, device=device, generator=generator) * self.logit_std + self.logit_mean
        return torch.sigmoid(z)

    def loss(self, net, batch, train):
        x0 = self.take(batch, "input")
        cond = self.condition_of(batch, train)
        mask = loss_mask(batch.get("mask"), x0)
        if train:
            t = self.sample_t(len(x0), x0.device)
            noise, noised_with = self.training_noise(x0)
            per_sample = self.per_sample_loss(net, x0, noise, t, cond, noised_with, mask)
            return per_sample.mean(), {}
        # Evaluation: the same timesteps and noises for every sample at every validation (as torchtitan's
        # Flux does), so that the number compares across runs, resumes and world sizes.
        per_time = self.losses_by_time(net, x0, cond, batch.get("row"), mask)
        return (sum(per_time) / self.eval_timesteps).mean(), self.band_losses(per_time)

    def training_noise(self, x0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the noise the target is made of, the noise the input is noised with, None where it is the same), drawn
        as diffusers' train_text_to_image.py draws them: the noise, plus ``noise_offset`` x a normal per sample and
        channel (in a ``noise_offset_probability`` share of batches, as SimpleTuner's); the input's noise that plus
        ``input_perturbation`` x another normal. Off (both 0), one draw, as ever: a run is bitwise the same."""
        noise = torch.randn_like(x0)
        if self.noise_offset and (self.noise_offset_probability == 1
                                  or torch.rand((), device=x0.device) < self.noise_offset_probability):
            shape = (*x0.shape[:2], *[1] * (x0.dim() - 2))  # one value per sample and channel
            noise = noise + self.noise_offset * torch.randn(shape, device=x0.device).to(x0.dtype)
        if not self.input_perturbation:
            return noise, None
        return noise, noise + self.input_perturbation * torch.randn_like(noise)

    def fixed_losses(self, net, x0: torch.Tensor, cond, rows: torch.Tensor | None,
                     mask: torch.Tensor | None = None) -> torch.Tensor:
        """(B,) losses, each the mean over ``eval_timesteps`` evenly spaced times, with one noise per sample seeded
        by its metadata row (by its place in the batch where the batches have no rows)."""
        return sum(self.losses_by_time(net, x0, cond, rows, mask)) / self.eval_timesteps

    def losses_by_time(self, net, x0: torch.Tensor, cond, rows: torch.Tensor | None,
                       mask: torch.Tensor | None = None) -> list[torch.Tensor]:
        """(B,) losses at each of the ``eval_timesteps`` evenly spaced times (``fixed_losses``)."""
        noise = torch.stack([self.eval_noise(x0[i], i if rows is None else int(rows[i])) for i in range(len(x0))])
        times = (torch.arange(self.eval_timesteps, dtype=torch.float32, device=x0.device) + 0.5) / self.eval_timesteps
        return [self.per_sample_loss(net, x0, noise, t.expand(len(x0)), cond, mask=mask) for t in times]

    def band_losses(self, per_time: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """The evaluation loss in ``eval_bands`` equal bands of training time (before any flow shift), named on
        diffusers' 0-1000 scale: ``loss_t000-250`` is the mean over the times below 0.25, the least noised."""
        bands: dict[str, list[torch.Tensor]] = {}
        for i, losses in enumerate(per_time if self.eval_bands else []):
            k = (2 * i + 1) * self.eval_bands // (2 * self.eval_timesteps)  # the band of time (i + 0.5) / T
            bands.setdefault(f"loss_t{k * 1000 // self.eval_bands:03d}-{(k + 1) * 1000 // self.eval_bands}",
                             []).append(losses)
        return {name: (sum(parts) / len(parts)).mean() for name, parts in bands.items()}

    def eval_noise(self, like: torch.Tensor, row: int) -> torch.Tensor:
        return seeded_normal(tuple(like.shape), self.eval_seed, row).to(like)

    def per_sample_loss(self, net, x0, noise, t, cond, noised_with=None, mask=None) -> torch.Tensor:
        """(B,) losses at times ``t`` in (0, 1); the input noised with ``noised_with`` where given (input
        perturbation), the target made of ``noise``; each the mean over the pixels ``mask`` weighs (``loss_mask``)
        where given."""
        raise NotImplementedError

    def predict(self, net, batch):
        cond = self.condition_of(batch, train=False)
        x0 = self.take(batch, "input")
        return {"loss": self.fixed_losses(net, x0, cond, batch.get("row"), loss_mask(batch.get("mask"), x0))}


def loss_mask(mask: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor | None:
    """A batch's ``mask`` (B, H, W) uint8, 255 where the loss counts (its dataset's mask_column or alpha_mask), as
    float weights (B, 1, h, w) in [0, 1] on the grid of ``like`` (B, C, h, w): averaged over each cell where the
    grids differ (a mask cached beside latents is on their grid already). None without one."""
    if mask is None:
        return None
    weights = mask.to(like.device, torch.float32).unsqueeze(1) / 255
    if weights.shape[-2:] != like.shape[-2:]:
        weights = F.adaptive_avg_pool2d(weights, like.shape[-2:])
    return weights


def _mse(pred: torch.Tensor, target: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """(B,) mean squared error per sample, in float32; with ``mask`` (B, 1, h, w) the mean weighted by it: its
    zeros count for nothing, and a sample whose mask is all zeros has loss 0."""
    errors = F.mse_loss(pred.float(), target.float(), reduction="none")
    if mask is None:
        return errors.flatten(1).mean(1)
    weights = mask.expand_as(errors).flatten(1)
    return (errors.flatten(1) * weights).sum(1) / weights.sum(1).clamp_min(1e-12)


class FlowMatching(Generative):
    """Rectified flow: ``x_t = (1 - s) x0 + s noise`` at noise level ``s``; the denoiser predicts ``noise - x0``.

    ``s`` is the training time ``t`` shifted towards noise as the model's scheduler shifts it
    (diffusers' ``FlowMatchEulerDiscreteScheduler``): by a constant ``shift`` (SD3: 3.0), or by one that grows
    with the image's token count (``dynamic_shift``, Flux: latent height x width / 4 tokens). Validation and the
    sampler use the same shift."""

    def __init__(self, condition: Literal["caption", "label", "none"] = "caption", condition_key: str | None = None,
                 condition_dropout: float = 0.1, null_label: int | None = None,
                 timesteps: Literal["uniform", "logit_normal"] = "logit_normal", logit_mean: float = 0.0,
                 logit_std: float = 1.0, eval_timesteps: int = 8, eval_seed: int = 0, shift: float = 1.0,
                 dynamic_shift: bool = False, base_shift: float = 0.5, max_shift: float = 1.15,
                 base_image_seq_len: int = 256, max_image_seq_len: int = 4096, noise_offset: float = 0.0,
                 noise_offset_probability: float = 1.0, input_perturbation: float = 0.0, eval_bands: int = 4):
        """Train a denoiser by flow matching.

        Args:
            condition: What the denoiser is conditioned on: caption (embeddings from the cache), label or none.
            condition_key: Batch key of the condition; default: data.cache.caption_key's default, or model.target_key.
            condition_dropout: Probability a training sample's condition is dropped, for classifier-free guidance (a dataset's data caption_dropout wins for its samples).
            null_label: With labels: the label that stands for "no label" (the denoiser's number of classes).
            timesteps: Training time distribution: uniform, or logit_normal (SD3's default).
            logit_mean: Mean of the normal behind logit_normal times.
            logit_std: Standard deviation of the normal behind logit_normal times.
            eval_timesteps: Evenly spaced times of the deterministic validation loss.
            eval_seed: Seed of the validation loss's noises (one per sample, by its metadata row).
            shift: Constant timestep shift, s = shift t / (1 + (shift - 1) t): SD3's 3.0; 1 leaves times as drawn.
            dynamic_shift: Shift by the image's token count instead (Flux's use_dynamic_shifting): s = e^mu / (e^mu +
                1/t - 1), mu from base_shift at base_image_seq_len to max_shift at max_image_seq_len tokens.
            base_shift: mu at base_image_seq_len tokens (dynamic_shift).
            max_shift: mu at max_image_seq_len tokens (dynamic_shift).
            base_image_seq_len: Tokens at which mu is base_shift (dynamic_shift).
            max_image_seq_len: Tokens at which mu is max_shift (dynamic_shift).
            noise_offset: Add this x a normal per sample and channel to the training noise (offset noise: images of other overall brightness; 0.05-0.1 usual).
            noise_offset_probability: Share of training batches given the noise offset (SimpleTuner's noise_offset_probability).
            input_perturbation: Noise the input with the noise plus this x another normal, the target keeping the noise (Ning et al. 2023; 0.1 usual).
            eval_bands: Also log val/loss in this many equal bands of time (val/loss_t000-250, ...): where the model is still bad; 0: none.
        """
        super().__init__(condition, condition_key, condition_dropout, null_label, timesteps, logit_mean, logit_std,
                         eval_timesteps, eval_seed, noise_offset, noise_offset_probability, input_perturbation,
                         eval_bands)
        problems = []
        if shift <= 0:
            problems.append(f"model.objective.shift = {shift}: must be positive (1: no shift)")
        if dynamic_shift and shift != 1.0:
            problems.append(f"model.objective.shift = {shift} with dynamic_shift: true: the shift is either constant or "
                            "by the token count; set one")
        if dynamic_shift and max_image_seq_len <= base_image_seq_len:
            problems.append(f"model.objective.max_image_seq_len = {max_image_seq_len}: must be above "
                            f"base_image_seq_len ({base_image_seq_len})")
        ConfigError.collect(problems)
        self.shift, self.dynamic_shift = shift, dynamic_shift
        self.base_shift, self.max_shift = base_shift, max_shift
        self.base_image_seq_len, self.max_image_seq_len = base_image_seq_len, max_image_seq_len

    def mu(self, height: int, width: int) -> float:
        """The dynamic shift's mu for latents of ``height`` x ``width`` (FluxPipeline's calculate_shift of its
        2 x 2-patch token count)."""
        slope = (self.max_shift - self.base_shift) / (self.max_image_seq_len - self.base_image_seq_len)
        return (height // 2) * (width // 2) * slope + self.base_shift - slope * self.base_image_seq_len

    def noise_level(self, t: torch.Tensor, x0: torch.Tensor) -> torch.Tensor:
        """The noise level ``s`` of times ``t`` in (0, 1) for inputs like ``x0`` (see the class docstring)."""
        if self.dynamic_shift:
            scale = math.exp(self.mu(x0.shape[-2], x0.shape[-1]))
            return scale / (scale + (1 / t - 1))
        if self.shift != 1.0:
            return self.shift * t / (1 + (self.shift - 1) * t)
        return t

    def per_sample_loss(self, net, x0, noise, t, cond, noised_with=None, mask=None):
        t = self.noise_level(t, x0)
        tt = t.view(-1, *[1] * (x0.dim() - 1)).to(x0.dtype)
        x_t = (1 - tt) * x0 + tt * (noise if noised_with is None else noised_with)
        pred = denoise(net, x_t, t * 1000, cond)  # diffusers' timestep scale (SD3: sigma x 1000)
        return _mse(pred, noise - x0, mask)


class Diffusion(Generative):
    """A DDPM noise schedule (diffusers' ``DDPMScheduler``); the denoiser predicts the noise or the velocity."""

    def __init__(self, prediction: Literal["epsilon", "v_prediction"] = "epsilon",
                 beta_schedule: Literal["linear", "scaled_linear", "squaredcos_cap_v2"] = "scaled_linear",
                 num_train_timesteps: int = 1000, snr_gamma: float | None = None,
                 condition: Literal["caption", "label", "none"] = "caption", condition_key: str | None = None,
                 condition_dropout: float = 0.1, null_label: int | None = None,
                 timesteps: Literal["uniform", "logit_normal"] = "uniform", logit_mean: float = 0.0,
                 logit_std: float = 1.0, eval_timesteps: int = 8, eval_seed: int = 0, beta_start: float = 0.0001,
                 beta_end: float = 0.02, rescale_betas_zero_snr: bool = False, noise_offset: float = 0.0,
                 noise_offset_probability: float = 1.0, input_perturbation: float = 0.0, eval_bands: int = 4):
        """Train a denoiser by diffusion.

        Args:
            prediction: What the denoiser predicts: epsilon (the noise) or v_prediction (the velocity).
            beta_schedule: The noise schedule, as diffusers names it.
            num_train_timesteps: Steps of the noise schedule.
            snr_gamma: Min-SNR-gamma loss weighting (5 is usual); null: every timestep weighs the same.
            condition: What the denoiser is conditioned on: caption (embeddings from the cache), label or none.
            condition_key: Batch key of the condition; default: data.cache.caption_key's default, or model.target_key.
            condition_dropout: Probability a training sample's condition is dropped, for classifier-free guidance (a dataset's data caption_dropout wins for its samples).
            null_label: With labels: the label that stands for "no label" (the denoiser's number of classes).
            timesteps: Training timestep distribution: uniform, or logit_normal.
            logit_mean: Mean of the normal behind logit_normal timesteps.
            logit_std: Standard deviation of the normal behind logit_normal timesteps.
            eval_timesteps: Evenly spaced timesteps of the deterministic validation loss.
            eval_seed: Seed of the validation loss's noises (one per sample, by its metadata row).
            beta_start: The schedule's first beta (Stable Diffusion's scheduler: 0.00085).
            beta_end: The schedule's last beta (Stable Diffusion's scheduler: 0.012).
            rescale_betas_zero_snr: Rescale the schedule so that its last step is pure noise (Lin et al. 2023; needs
                v_prediction): an image's overall colour then comes from the caption, not from the noise.
            noise_offset: Add this x a normal per sample and channel to the training noise (offset noise: images of other overall brightness; 0.05-0.1 usual).
            noise_offset_probability: Share of training batches given the noise offset (SimpleTuner's noise_offset_probability).
            input_perturbation: Noise the input with the noise plus this x another normal, the target keeping the noise (Ning et al. 2023; 0.1 usual).
            eval_bands: Also log val/loss in this many equal bands of time (val/loss_t000-250, ...): where the model is still bad; 0: none.
        """
        super().__init__(condition, condition_key, condition_dropout, null_label, timesteps, logit_mean, logit_std,
                         eval_timesteps, eval_seed, noise_offset, noise_offset_probability, input_perturbation,
                         eval_bands)
        problems = []
        if not 0 < beta_start < beta_end < 1:
            problems.append(f"model.objective.beta_start = {beta_start}, beta_end = {beta_end}: need "
                            "0 < beta_start < beta_end < 1")
        if prediction not in ("epsilon", "v_prediction"):
            problems.append(f"model.objective.prediction = {prediction!r}: must be epsilon or v_prediction")
        if snr_gamma is not None and snr_gamma <= 0:
            problems.append(f"model.objective.snr_gamma = {snr_gamma}: must be positive, or null for no weighting")
        if num_train_timesteps < 2:
            problems.append(f"model.objective.num_train_timesteps = {num_train_timesteps}: must be at least 2")
        if rescale_betas_zero_snr and prediction == "epsilon":
            # At zero SNR the noise is the input itself: nothing of the image can be predicted from it.
            problems.append("model.objective.rescale_betas_zero_snr = true needs prediction: v_prediction (the "
                            "noise of the last step is its input; Lin et al. 2023)")
        ConfigError.collect(problems)
        require("diffusers", "model.objective Diffusion (its noise schedule, diffusers' DDPMScheduler)")
        from diffusers import DDPMScheduler

        self.scheduler = DDPMScheduler(num_train_timesteps=num_train_timesteps, beta_schedule=beta_schedule,
                                       beta_start=beta_start, beta_end=beta_end, prediction_type=prediction,
                                       rescale_betas_zero_snr=rescale_betas_zero_snr)
        self.prediction, self.snr_gamma, self.num_train_timesteps = prediction, snr_gamma, num_train_timesteps
        self._alphas_cumprod = self.scheduler.alphas_cumprod  # moved to the batches' device once, not every step

    def per_sample_loss(self, net, x0, noise, t, cond, noised_with=None, mask=None):
        steps = (t * self.num_train_timesteps).long().clamp_(0, self.num_train_timesteps - 1)
        if self._alphas_cumprod.device != x0.device:
            self._alphas_cumprod = self._alphas_cumprod.to(x0.device)
        alphas = self._alphas_cumprod[steps]  # (B,) float32
        a = alphas.sqrt().view(-1, *[1] * (x0.dim() - 1))
        s = (1 - alphas).sqrt().view(-1, *[1] * (x0.dim() - 1))
        x_t = (a * x0.float() + s * (noise if noised_with is None else noised_with).float()).to(x0.dtype)
        target = noise if self.prediction == "epsilon" else a * noise.float() - s * x0.float()
        losses = _mse(denoise(net, x_t, steps.float(), cond), target, mask)
        if self.snr_gamma is None:
            return losses
        # Min-SNR-gamma (Hang et al. 2023): weight min(SNR, gamma) / SNR for epsilon, / (SNR + 1) for v.
        snr = alphas / (1 - alphas)  # 0 at a zero-SNR schedule's last step: v's weight is then 0, never 0 / 0
        clipped = snr.clamp(max=self.snr_gamma)
        weight = clipped / snr if self.prediction == "epsilon" else clipped / (snr + 1)
        return losses * weight

