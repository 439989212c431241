"""``LitModel``: a LightningModule that wraps any ``torch.nn.Module`` named in the YAML.

Example (YAML)::

    model:
      net:
        class_path: lit_dist.model.nets.SimpleCNN
        init_args: {num_classes: 4}
      optimizer:
        class_path: torch.optim.AdamW
        init_args: {lr: 0.003}
      lr_scaling: linear
      base_batch_size: 32
      warmup_steps: 50

Metrics it logs:

=============================  ===========================================
``train/loss``, ``train/acc``  per step (acc only for classification)
``val/loss``, ``val/acc``      per validation epoch, every sample counted once
``train/lr``                   learning rate of the first parameter group
=============================  ===========================================

(Throughput, FLOPs and MFU come from ``lit_dist.callbacks.progress``, in every run.)

What a batch becomes is ``model.objective`` (lit_dist.model.objectives): classification by default,
flow matching or diffusion for a denoiser. For anything else, subclass it and override
``compute_loss``; name the subclass as ``model.class_path``.
"""

import inspect
import math
from contextlib import ExitStack, contextmanager, nullcontext
from typing import Literal

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import nn

from lit_dist.ckpt.init_weights import start_from
from lit_dist.ckpt.match import differences, left_out, may_lack, refuse
from lit_dist.errors import ConfigError
from lit_dist.model.adapters import Adapter, base_fingerprint, base_names
from lit_dist.model.conditions import Condition
from lit_dist.model.ema import EMA, fsdp2_modules, reshard
from lit_dist.model.objectives import Classification, Generative, Objective
from lit_dist.model.optimizers import evaluation_point, notes, refusals, sets_its_own_step, training_point
from lit_dist.runtime import compat


def lr_scale_factor(mode: str, effective_batch: int, base_batch: int) -> float:
    """How much ``lr_scaling`` multiplies the configured lr by at ``effective_batch``."""
    if mode == "none":
        return 1.0
    ratio = effective_batch / base_batch
    return ratio if mode == "linear" else math.sqrt(ratio)


def lr_decay_factor(kind: str, step: int, steps: int, floor: float) -> float:
    """The multiple of the lr at ``step`` of ``steps`` decay steps: from 1 down to ``floor`` at the last one."""
    progress = min(1.0, step / max(1, steps - 1))
    shape = 1 - progress if kind == "linear" else 0.5 * (1 + math.cos(math.pi * progress))
    return floor + (1 - floor) * shape


AVERAGE_STARTS = "lit-dist: the checkpoint has no weight average (model.ema): it starts from its weights"


class LitModel(LightningModule):
    """Trains ``net`` with a loss, an optimizer and an LR schedule given in the YAML."""

    def __init__(
        self,
        net: nn.Module | None = None,
        loss: nn.Module | None = None,
        objective: Objective | None = None,
        adapter: Adapter | None = None,
        ema: EMA | None = None,
        optimizer: OptimizerCallable = torch.optim.AdamW,
        lr_scheduler: LRSchedulerCallable | None = None,
        lr_scaling: Literal["none", "linear", "sqrt"] = "none",
        base_batch_size: int = 256,
        warmup_steps: int = 0,
        lr_decay: Literal["none", "linear", "cosine"] = "none",
        min_lr_ratio: float = 0.0,
        compile: bool = False,
        input_key: str = "image",
        target_key: str = "label",
        float32_matmul_precision: Literal["highest", "high", "medium"] = "high",
        init_weights: str | None = None,
        init_weights_skip: tuple[str, ...] = (),
    ):
        """Wrap a network.

        Args:
            net: The network to train; any torch.nn.Module, given by class_path and init_args (with pipeline.path:
                the pipeline's denoiser, filled in).
            loss: Classification loss module called as loss(logits, target); default: cross-entropy.
            objective: What a batch becomes (lit_dist.model.objectives): Classification (default), FlowMatching or Diffusion.
            adapter: Train an adapter (LoRA, LoHa or LoKr: lit_dist.model.adapters.Adapter) on the frozen net instead
                of the net itself; null: the whole net trains.
            ema: An exponential moving average of the network's weights (lit_dist.model.ema.EMA); null: none.
            optimizer: Optimizer class_path and init_args; its lr is the LR at base_batch_size. Adam and AdamW run
                fused unless init_args sets fused or foreach.
            lr_scheduler: LR scheduler class_path and init_args, stepped once per optimizer step.
            lr_scaling: Scale the optimizer's lr by the effective batch / base_batch_size: none, linear or sqrt.
            base_batch_size: Effective batch the configured lr was tuned for (used by lr_scaling).
            warmup_steps: Optimizer steps of linear LR warmup from lr / warmup_steps to lr; 0 turns it off.
            lr_decay: After warmup, decay the lr over the rest of the run (max_steps or max_epochs): none, linear or
                cosine.
            min_lr_ratio: The lr at the run's last step as a fraction of lr, for lr_decay.
            compile: Compile the network with torch.compile (keeps parameter names, so checkpoints stay portable).
            input_key: Key of the network input in a batch.
            target_key: Key of the target in a batch.
            float32_matmul_precision: float32 matrix products on GPUs: highest (true float32), high (TF32 tensor
                cores) or medium (bf16); CPU runs are left as they are.
            init_weights: Start the network from these weights: a file lit-dist export wrote, a checkpoint (its
                network's weights alone; the run starts at step 0), or a state dict (.safetensors, .pt, .pth, .bin).
                Keep it: a resume, validate and sample of the run read it again before their checkpoint.
            init_weights_skip: Tensors of the network left at their initialisation instead (fnmatch patterns of its
                state-dict names; head names head.weight and head.bias): a new head for other classes.
        """
        super().__init__()
        if net is None:
            raise ConfigError("model.net is not set: name the network to train (class_path and init_args), or a "
                              "pretrained diffusers pipeline folder with pipeline.path")
        problems = []
        if base_batch_size < 1:
            problems.append(f"model.base_batch_size = {base_batch_size}: must be >= 1")
        if warmup_steps < 0:
            problems.append(f"model.warmup_steps = {warmup_steps}: must be >= 0")
        if lr_decay not in ("none", "linear", "cosine"):
            problems.append(f"model.lr_decay = {lr_decay!r}: must be none, linear or cosine")
        if not 0 <= min_lr_ratio <= 1:
            problems.append(f"model.min_lr_ratio = {min_lr_ratio}: must be between 0 and 1")
        if lr_decay != "none" and lr_scheduler is not None:
            problems.append(f"model.lr_decay = {lr_decay!r} and model.lr_scheduler both set the lr after warmup: "
                            "keep one (lr_decay: none to use the scheduler)")
        if lr_scaling not in ("none", "linear", "sqrt"):
            problems.append(f"model.lr_scaling = {lr_scaling!r}: must be none, linear or sqrt")
        if float32_matmul_precision not in ("highest", "high", "medium"):
            problems.append(f"model.float32_matmul_precision = {float32_matmul_precision!r}: must be highest, high "
                            "or medium")
        if isinstance(objective, Generative):
            signature = inspect.signature(net.forward)
            try:
                signature.bind(None, None, None)
            except TypeError:
                problems.append(f"model.net ({type(net).__name__}) is called as net(x_t, timestep, condition) by "
                                f"model.objective ({type(objective).__name__}), and its forward{signature} does "
                                "not take them: name a denoiser (lit_dist.model.nets.TinyUNet, diffusers' "
                                "UNet2DConditionModel or DiTTransformer2DModel) or wrap yours")
        if init_weights_skip and init_weights is None:
            problems.append("model.init_weights_skip is set and model.init_weights is not: name the weights to start "
                            "from, or leave init_weights_skip out")
        if objective is not None and loss is not None:
            problems.append("model.loss is the classification loss; with model.objective set, give it as "
                            "model.objective.init_args.loss (Classification) or leave it out")
        ConfigError.collect(problems)
        if torch.cuda.is_available():
            # Process-wide, and before the Trainer sets up its device (which warns about tensor cores
            # left unused); every process of a run builds its own LitModel, so each gets it.
            torch.set_float32_matmul_precision(float32_matmul_precision)
        self.save_hyperparameters(ignore=["net", "loss", "objective", "adapter", "ema"])
        if init_weights is not None:  # before an adapter wraps the net, so its base is what the run starts from
            rank_zero_info(start_from(net, init_weights, init_weights_skip))
        self.adapter = adapter
        self.base_state: set[str] = set()  # the state-dict names of an adapter's frozen base: never in a checkpoint
        if adapter is not None:
            adapter.attach(net)  # before any strategy wraps or shards the net, and before the average sees it
            names = base_names(net)
            self.base_state = {f"net.{name}" for name in names}
            # A checkpoint holds the adapter and, in place of the base, this fingerprint of it (on_load_checkpoint).
            self.register_buffer("adapter_base", base_fingerprint(net, names))
            self._this_base = self.adapter_base.clone()
            self.register_state_dict_post_hook(left_out(self.base_state))
            self.register_load_state_dict_post_hook(may_lack(self.base_state))
        self.net = net
        self.ema = ema
        self.objective = objective if objective is not None else Classification(loss)
        self.objective.bind(input_key, target_key)
        if isinstance(self.objective, Classification):
            # A submodule, as before objectives: a loss with buffers (class weights) moves to the device with the
            # model, and its state_dict keys ("loss.*") stay where older checkpoints have them.
            self.loss = self.objective.loss_fn
        self.optimizer_factory = optimizer
        self.lr_scheduler_factory = lr_scheduler
        self.lr_scaling = lr_scaling
        self.base_batch_size = base_batch_size
        self.warmup_steps = warmup_steps
        self.lr_decay = lr_decay
        self.min_lr_ratio = min_lr_ratio
        self.compile = compile
        self.input_key = input_key
        self.target_key = target_key
        self._eval_sums: torch.Tensor | None = None  # per-metric weighted sums, then the sample count
        self._eval_names: list[str] = []
        self._loss_in_bar = True  # see on_train_start
        self._uncounted = False  # a strategy loaded an average without its count of updates (start_unsaved)
        self._kept = ExitStack()  # validation's weights_to_keep, open from on_validation_start to its epoch's end

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def compute_loss(self, batch: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Loss of one batch and extra per-batch metrics (means over the batch): the objective's, in training
        (self.training) or in evaluation. Override for other tasks."""
        return self.objective.loss(self.net, batch, train=self.training)

    # -- setup -----------------------------------------------------------------------------

    def configure_model(self) -> None:
        strategy = self._trainer.strategy if self._trainer is not None else None
        if hasattr(strategy, "shard"):  # FSDP2Strategy: per-block fully_shard before the optimizer exists
            strategy.shard(self.net)
        if self.compile and not getattr(self, "_compiled", False):
            self.net.compile()  # in place: state_dict keys stay free of "_orig_mod."
            self._compiled = True
        ignored = ["adapter_base"] if self.adapter is not None else []  # the same on every rank: no broadcast
        if self.ema is not None:
            # After sharding: the average is sharded as the parameters are. ZeRO-3 partitions them later, in its engine.
            self.ema.attach(self.net, partitioned_later=bool(getattr(strategy, "zero_stage_3", False)))
            # DDP would broadcast rank 0's buffers before every forward: a whole model copy per step, for an
            # average that every rank computes the same.
            ignored += [f"ema.average.{name}" for name in self.ema.names] + ["ema.updates", "ema.starts_at"]
        if ignored:
            self._ddp_params_and_buffers_to_ignore = ignored

    def effective_batch_size(self) -> int | None:
        """batch_size_per_device x world size x accumulate_grad_batches, once a trainer is attached."""
        per_device = getattr(self.trainer.datamodule, "batch_size_per_device", None)
        if per_device is None:
            return None
        return per_device * self.trainer.world_size * self.trainer.accumulate_grad_batches

    def lr_scale(self) -> float:
        if self.lr_scaling == "none":
            return 1.0
        effective = self.effective_batch_size()
        if effective is None:
            raise ConfigError(
                f"model.lr_scaling = {self.lr_scaling!r} needs the batch size per device, and the data module "
                f"{type(self.trainer.datamodule).__name__} has no `batch_size_per_device` attribute. "
                "Add that attribute to it, or set model.lr_scaling: none."
            )
        return lr_scale_factor(self.lr_scaling, effective, self.base_batch_size)

    def configure_optimizers(self):
        # With an adapter, its parameters alone: the frozen base has no optimizer state (and ZeRO and FSDP keep
        # none of it for the optimizer). Without one, every parameter, as checkpoints of earlier runs index them.
        params = [p for p in self.parameters() if p.requires_grad] if self.adapter is not None else self.parameters()
        optimizer = fused_where_unset(self.optimizer_factory(params))
        from lightning.pytorch.strategies import DeepSpeedStrategy

        strategy = "deepspeed" if isinstance(getattr(self.trainer, "strategy", None), DeepSpeedStrategy) else "other"
        ConfigError.collect(refusals(optimizer, strategy, ema=self.ema is not None))
        told = notes(optimizer, self.lr_scaling, self.warmup_steps, self.lr_decay, self.lr_scheduler_factory is not None)
        for note in told:
            rank_zero_warn(f"lit-dist: {note}")
        # An optimizer that sets its own step size (Prodigy) keeps its lr: scaling is for step sizes set by hand.
        scale = 1.0 if sets_its_own_step(optimizer) else self.lr_scale()
        for group in optimizer.param_groups:
            group["lr"] *= scale
        self._log_batch_and_lr(optimizer, scale)
        schedulers = []
        # The configured scheduler is built first: built after LinearLR it would take the warmup's
        # reduced lr as its starting point.
        if self.lr_scheduler_factory is not None:
            schedulers.append(self.lr_scheduler_factory(optimizer))
        if self.lr_decay != "none":
            schedulers.append(self._decay(optimizer))
        if self.warmup_steps > 1:
            # Step k runs at lr * (k + 1) / warmup_steps: lr / warmup_steps first, the full lr at the last warmup step.
            warmup = torch.optim.lr_scheduler.LinearLR(
                optimizer, start_factor=1 / self.warmup_steps, total_iters=self.warmup_steps - 1
            )
            schedulers.insert(0, warmup)
        if not schedulers:
            return optimizer
        if len(schedulers) == 1:
            scheduler = schedulers[0]
        else:
            scheduler = torch.optim.lr_scheduler.SequentialLR(optimizer, schedulers, milestones=[self.warmup_steps])
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def _decay(self, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
        """The lr after warmup, down to min_lr_ratio x lr at the run's last optimizer step."""
        total = self.trainer.estimated_stepping_batches
        if not math.isfinite(total):
            raise ConfigError(f"model.lr_decay = {self.lr_decay!r} decays over the whole run, and this run has no end: "
                              "set trainer.max_steps or trainer.max_epochs, or model.lr_decay: none")
        steps = int(total) - (self.warmup_steps if self.warmup_steps > 1 else 0)  # the milestone restarts it at 0
        kind, floor = self.lr_decay, self.min_lr_ratio
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_decay_factor(kind, step, steps, floor))

    def _log_batch_and_lr(self, optimizer: torch.optim.Optimizer, scale: float) -> None:
        lr = optimizer.param_groups[0]["lr"]
        effective = self.effective_batch_size()
        if effective is not None:
            per_device = effective // (self.trainer.world_size * self.trainer.accumulate_grad_batches)
            batch = (f"effective batch {effective} = {per_device} per device x {self.trainer.world_size} devices "
                     f"x {self.trainer.accumulate_grad_batches} accumulation")
        else:
            batch = "effective batch unknown (the data module has no batch_size_per_device)"
        decay = "" if self.lr_decay == "none" else f", then {self.lr_decay} decay to {self.min_lr_ratio:g} x lr"
        rank_zero_info(
            f"lit-dist: {batch}; lr {lr:.4g} (lr_scaling {self.lr_scaling}, x{scale:.4g} against base batch "
            f"{self.base_batch_size}); warmup {self.warmup_steps} steps{decay}"
        )
        if self.logger is not None:
            self.logger.log_hyperparams({"effective_batch_size": effective or 0, "scaled_lr": lr, "lr_scale": scale})

    # -- steps -----------------------------------------------------------------------------

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None) -> None:
        super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
        # A strategy that accumulates gradients itself (DeepSpeed) has this hook called for every micro-batch and
        # steps only at the boundary: the average moves once per optimizer step, when Lightning counts one.
        if self.ema is not None and compat.optimizer_steps_now(self.trainer):
            self.ema.update(self.trainer.global_step + 1)  # Lightning counts this step once the hook returns

    def averaged(self) -> bool:
        """Whether evaluation and samples use the weight average (model.ema with evaluate on, and an average that
        has had an update, in this run or in the one its checkpoint came from) rather than the trained weights."""
        return self.ema is not None and self.ema.evaluate and self.ema.has_average()

    def weights_used(self) -> str | None:
        """Which weights evaluation uses, in words, for result lines; None without model.ema."""
        if self.ema is None:
            return None
        if self.averaged():
            return f"the weight average of model.ema ({self.ema.count()} updates)"
        if not self.ema.evaluate:
            return "the trained weights (model.ema.evaluate is false)"
        return f"the trained weights (the average starts after optimizer step {self.ema.first_step})"

    @contextmanager
    def weights_to_keep(self):
        """Within: the parameters as checkpoints and exports hold them: a schedule-free optimizer's average (its eval
        mode; lit_dist.model.optimizers), else the trained weights as they are; the training point is put back at
        the end. Checkpoints and exports are written inside it."""
        with evaluation_point(self._optimizers(), self._reshard):
            yield

    def _reshard(self) -> None:
        """FSDP2: drop the gathered copies of parameters just moved (ema.reshard)."""
        reshard(fsdp2_modules(self.net))

    def _optimizers(self) -> list:
        trainer = self._trainer  # None outside a Trainer (the property would raise)
        return list(trainer.optimizers) if trainer is not None else []

    # Validation, test and prediction use the average (averaged) and put the trained weights back at their end:
    # before the callbacks' on_validation_end, where checkpoints are saved. A schedule-free optimizer's average is
    # swapped in the same way (weights_to_keep).
    def on_validation_start(self) -> None:
        self._kept.enter_context(self.weights_to_keep())
        if self.averaged():
            self.ema.swap_in()

    def on_test_start(self) -> None:
        self.on_validation_start()

    def on_predict_start(self) -> None:
        self.on_validation_start()

    def on_predict_end(self) -> None:
        if self.ema is not None:
            self.ema.swap_out()
        self._training_point()

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        if self.ema is not None and self.ema.swapped:
            raise RuntimeError("lit-dist: a checkpoint was asked for while validation holds the weight average in the "
                               "parameters; it would save the average as the raw weights")
        if self.adapter is not None:  # for the line that refuses a resume on another base
            checkpoint["adapter_base_name"] = self._base_name()

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        state = checkpoint.get("state_dict")
        if self.adapter is not None:
            # A sharded or DeepSpeed checkpoint is in the model already; a whole one is loaded after this hook.
            self.check_base(state.get("adapter_base") if state is not None else self.adapter_base,
                            getattr(self._trainer, "ckpt_path", None) or "being loaded", checkpoint.get("adapter_base_name"))
        if state is None:  # a sharded checkpoint: the strategy loaded the model itself (start_unsaved)
            if self.ema is not None and self._uncounted:
                self.ema.assume_updates(checkpoint.get("global_step", 0))
            self._uncounted = False
            return
        if self.strict_loading:
            model = {key: tuple(tensor.shape) for key, tensor in self.state_dict().items()}
            saved = {key: tuple(value.shape) if isinstance(value, torch.Tensor) else None for key, value in state.items()}
            refuse(getattr(self._trainer, "ckpt_path", None) or "being loaded",
                   differences(saved, model, self.optional_state))
        saved = [k for k in state if k.startswith("ema.average.")]
        if self.ema is None:
            for key in [k for k in state if k.startswith("ema.")]:  # averaged in an earlier run, not in this one
                del state[key]
            return
        if not saved and self.ema.names:
            # Turned on at this resume: the average starts from the weights the run resumes with.
            rank_zero_info(AVERAGE_STARTS)
            for name in self.ema.names:
                state[f"ema.average.{name}"] = state[f"net.{name}"].detach().clone().float()
            state["ema.updates"] = torch.zeros((), dtype=torch.int64)
        elif "ema.updates" not in state:  # an average saved before lit-dist counted its updates
            state["ema.updates"] = torch.tensor(self.ema.updates_by(checkpoint.get("global_step", 0)))
        state.setdefault("ema.starts_at", torch.tensor(self.ema.first_step))

    def optional_state(self, key: str) -> bool:
        """A state-dict key a checkpoint may lack (started from the weights) or hold without this model (dropped):
        the weight average's, which model.ema turns on or off at a resume; an adapter's base, which a checkpoint
        written before adapter checkpoints held the base may hold."""
        return key.startswith("ema.") or key in self.base_state or key == "adapter_base"

    def check_base(self, saved: torch.Tensor | None, checkpoint, trained_on: str | None = None) -> None:
        """Refuse (exit 2) a checkpoint of this run's adapter whose base fingerprint (``saved``; None: it held the
        base itself) is not the base this model has; ``trained_on``: the base it names."""
        if saved is None or torch.equal(saved.to("cpu"), self._this_base):
            return
        was = f" ({trained_on})" if trained_on else ""
        raise ConfigError(f"the checkpoint {checkpoint} holds an adapter trained on another base{was} than this run's "
                          f"model.net ({self._base_name()}): the checkpoint keeps the adapter, not the base. Resume "
                          "with the base it was trained on, or start a new run (another run.run_id)")

    def _base_name(self) -> str:
        return f"the pipeline folder {self.net.folder.path}" if hasattr(self.net, "folder") else type(self.net).__name__

    def start_unsaved(self, keys: list[str]) -> None:
        """After a load by the strategy (sharded, DeepSpeed) without the weight average (model.ema turned on at
        this resume): start it from the weights, as on_load_checkpoint does for a whole checkpoint. An average
        saved without its count of updates gets the schedule's count in on_load_checkpoint."""
        if self.ema is None:
            return
        if any(key.startswith("ema.average.") for key in keys):
            rank_zero_info(AVERAGE_STARTS)
            self.ema.restart()
        elif "ema.updates" in keys:
            self._uncounted = True

    def on_train_start(self) -> None:
        # Lightning copies every prog_bar metric to the host after every batch, bar or no bar: a host-device sync
        # per step on GPUs (GPU tier). So the loss is a bar metric only where a bar shows it (a terminal); the
        # plain progress lines read it once per line.
        self._loss_in_bar = self.trainer.progress_bar_callback is not None
        # A schedule-free optimizer steps at its training point: a fresh one, and one restored from a checkpoint
        # (which holds its average), start in eval mode.
        # (FSDP2: a sanity check's forward may have left a gathered copy of the average, which _reshard drops.)
        training_point(self.trainer.optimizers, self._reshard)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        loss, metrics = self.compute_loss(batch)
        batch_size = len(batch[self.input_key])
        self.log("train/loss", loss, prog_bar=self._loss_in_bar, batch_size=batch_size)
        for name, value in metrics.items():
            self.log(f"train/{name}", value, batch_size=batch_size)
        return loss

    def on_train_batch_end(self, outputs, batch: dict, batch_idx: int) -> None:
        # Only on logging steps: nothing extra on the other steps' hot path (throughput: lit_dist.callbacks.progress).
        # Straight to the loggers: self.log would copy the float to the device, a host-device sync (GPU tier).
        trainer = self.trainer
        if trainer.global_step % trainer.log_every_n_steps == 0 and trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics({"train/lr": trainer.optimizers[0].param_groups[0]["lr"]}, step=trainer.global_step)

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        self._eval_step(batch)

    def test_step(self, batch: dict, batch_idx: int) -> None:
        self._eval_step(batch)

    def on_validation_epoch_end(self) -> None:
        self._log_eval("val")
        if self.ema is not None:
            self.ema.swap_out()
        self._training_point()

    def _training_point(self) -> None:
        """Ends the weights_to_keep of on_validation_start: a schedule-free optimizer back at its training point."""
        self._kept.close()

    def on_test_epoch_end(self) -> None:
        self._log_eval("test")
        if self.ema is not None:
            self.ema.swap_out()
        self._training_point()

    def _eval_step(self, batch: dict) -> None:
        loss, metrics = self.compute_loss(batch)
        # Padding batches (weight 0) keep ranks in step without being counted.
        # In float32: under DeepSpeed's bf16 the weights arrive in bf16, where a sum over 256 is no longer exact.
        weight = (batch["weight"].sum(dtype=torch.float32) if "weight" in batch
                  else torch.full((), float(len(batch[self.input_key])), device=loss.device))
        values = torch.stack([loss.detach().float(), *(m.detach().float() for m in metrics.values())])
        sums = torch.cat([values * weight, weight.to(values).view(1)])  # (num_metrics + 1,)
        if self._eval_sums is None:
            self._eval_names, self._eval_sums = ["loss", *metrics], sums
        else:
            self._eval_sums += sums

    def _log_eval(self, prefix: str) -> None:
        if self._eval_sums is None:
            return
        # One all-reduce of sums and the sample count: exact means however batches fell on ranks.
        totals = self.trainer.strategy.reduce(self._eval_sums, reduce_op="sum")
        means = totals[:-1] / totals[-1].clamp_min(1)
        for name, value in zip(self._eval_names, means, strict=True):
            # The same value on every rank. The loss and its bands (loss_t...) stay out of the progress bar.
            self.log(f"{prefix}/{name}", value, prog_bar=not name.startswith("loss"))
        self._eval_sums = None

    @contextmanager
    def evaluation_weights(self):
        """Within: the weights evaluation uses (the average, model.ema, once it has had an update and evaluate is
        on; else the trained weights), swapped in once and the trained weights put back, bitwise, at the end."""
        swap = self.averaged() and not self.ema.swapped
        if swap:
            self.ema.swap_in()
        try:
            with self.weights_to_keep():
                yield
        finally:
            if swap:
                self.ema.swap_out()

    @torch.no_grad()
    def generate(self, condition: Condition, noise: torch.Tensor, steps: int, guidance: float,
                 empty: dict | None = None) -> torch.Tensor:
        """Images in the model's input space from a generative objective's sampler (lit_dist.model.sampling), with the
        weights evaluation uses (``evaluation_weights``), in eval mode and the run's precision (``empty``: a
        pipeline's empty caption, for guidance). The network's train/eval mode and weights are as before afterwards."""
        from lit_dist.model.sampling import sample

        if not isinstance(self.objective, Generative):
            raise ConfigError(f"model.objective is {type(self.objective).__name__}: only a generative objective "
                              "(FlowMatching, Diffusion) makes images")
        trainer = self._trainer
        training = self.net.training
        precision = trainer.precision_plugin.forward_context() if trainer is not None else nullcontext()
        try:
            self.net.eval()
            with self.evaluation_weights(), precision:
                return sample(self.net, self.objective, condition, noise, steps=steps, guidance=guidance, empty=empty)
        finally:
            self.net.train(training)

    def predict_step(self, batch: dict, batch_idx: int) -> dict[str, torch.Tensor]:
        out = self.objective.predict(self.net, batch)
        if "row" in batch:  # BucketDataModule's batches say which metadata row each sample is
            out["row"] = batch["row"]
        return out


def fused_where_unset(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """``optimizer`` again with ``fused=True`` when it is torch's Adam or AdamW, the config chose no implementation
    (neither ``fused`` nor ``foreach``) and the fused kernel takes its parameters; else ``optimizer`` as it is.

    Torch defaults to a loop over the parameters on CPU and to ``foreach`` on GPUs; one fused kernel over all of them
    is faster on both (an SDXL-shaped U-Net of 24 M parameters in 500 tensors: 150 -> 80 ms a step on CPU). It is
    built before any step, so nothing but the implementation changes; a checkpoint saved by either loads into the
    other."""
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        return optimizer
    defaults = optimizer.defaults
    if defaults.get("fused") is not None or defaults.get("foreach") is not None or defaults.get("differentiable"):
        return optimizer
    groups = [{k: v for k, v in group.items() if k not in ("fused", "foreach")} for group in optimizer.param_groups]
    accepted = inspect.signature(type(optimizer)).parameters  # AdamW's defaults hold a key its __init__ does not take
    settings = {k: v for k, v in defaults.items() if k in accepted and k not in ("fused", "foreach")}
    try:
        return type(optimizer)(groups, **settings, fused=True)
    except RuntimeError:  # a device or dtype without the fused kernel: the loop it was
        return optimizer
