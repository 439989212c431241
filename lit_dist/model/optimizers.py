"""What lit-dist knows of optimizers users name by ``class_path`` that a plain ``torch.optim`` loop would get wrong.

- **They set their own step size**: Prodigy (``prodigyopt``) and D-Adaptation (``dadaptation``). Their ``lr``
  multiplies the step size they estimate, so it is 1.0 and lit-dist's LR scaling, made for a step size set by hand,
  is not applied to it; a warmup moves the estimate unless the optimizer guards it (Prodigy's ``safeguard_warmup``).
- **Schedule-free** (``schedulefree``'s AdamWScheduleFree, RAdamScheduleFree, SGDScheduleFree, and any optimizer with
  their ``train()``/``eval()`` and ``train_mode``): the parameters hold the point gradients are taken at, and
  ``eval()`` moves them to the average the optimizer keeps, the weights to evaluate and keep. lit-dist puts it in
  train mode for training steps and in eval mode for validation, samples, checkpoints and exports
  (``weights_to_keep``), so a checkpoint holds the average (its ``lit-dist export`` and ``sample`` use it) and a
  resume takes the same steps as the run that went on. With DeepSpeed (ZeRO moves its own float32 copy of the
  weights, not the module's parameters) and with ``model.ema`` (an average of the training point, where the
  optimizer keeps a better one) a run is refused.

A config that mixes them with settings made for other optimizers is told so, once.
"""

from contextlib import contextmanager

import torch

SETS_ITS_OWN_STEP = ("prodigyopt", "dadaptation", "prodigyplus")  # the modules of such optimizers


def sets_its_own_step(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` estimates its own step size (its lr is a multiplier of it)."""
    return type(optimizer).__module__.split(".")[0] in SETS_ITS_OWN_STEP


def schedule_free(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` keeps a training point and an average, switched by its ``train()`` and ``eval()``."""
    return schedule_free_class(type(optimizer)) and all("train_mode" in group for group in optimizer.param_groups)


def schedule_free_class(cls: type) -> bool:
    """Whether an optimizer class switches between two points with ``train()`` and ``eval()`` (torch's have
    neither)."""
    return callable(getattr(cls, "train", None)) and callable(getattr(cls, "eval", None))


def under_deepspeed(name: str) -> str:
    """The line that refuses the schedule-free optimizer class ``name`` under DeepSpeed."""
    return (f"model.optimizer {name} is schedule-free, and under DeepSpeed its eval() would move ZeRO's float32 copy "
            "of the weights but not the model's: evaluation, samples and checkpoints would get the training point; "
            "use trainer.strategy ddp or fsdp2")


@contextmanager
def evaluation_point(optimizers, after_move=lambda: None):
    """Within: the parameters of every schedule-free optimizer among ``optimizers`` in training mode moved to its
    average (``eval()``); moved back (``train()``) at the end. Others, and ones already in eval mode, untouched.
    ``after_move`` runs after each move (FSDP2: drop the gathered copies of the old values)."""
    moved = [o for o in optimizers if schedule_free(o) and o.param_groups[0]["train_mode"]]
    for optimizer in moved:
        optimizer.eval()
    if moved:
        after_move()
    try:
        yield
    finally:
        training_point(moved, after_move)


def training_point(optimizers, after_move=lambda: None) -> None:
    """Every schedule-free optimizer among ``optimizers`` in eval mode moved to its training point (``train()``),
    then ``after_move`` once if any moved."""
    moved = [o for o in optimizers if schedule_free(o) and not o.param_groups[0]["train_mode"]]
    for optimizer in moved:
        optimizer.train()
    if moved:
        after_move()


def refusals(optimizer: torch.optim.Optimizer, strategy: str, ema: bool) -> list[str]:
    """Settings a run cannot train ``optimizer`` with, each a line; [] when it can."""
    if not schedule_free(optimizer):
        return []
    name, out = type(optimizer).__name__, []
    if strategy == "deepspeed":
        out.append(under_deepspeed(name))
    if ema:
        out.append(f"model.optimizer {name} is schedule-free: it keeps an average of the weights itself, which "
                   "evaluation, samples and checkpoints use; model.ema would average the training point instead. "
                   "Remove model.ema, or name another optimizer")
    return out


def notes(optimizer: torch.optim.Optimizer, lr_scaling: str, warmup_steps: int, lr_decay: str = "none",
          scheduler: bool = False) -> list[str]:
    """What a run should know about settings that do not fit an optimizer that sets its own step size or is
    schedule-free; [] for any other optimizer."""
    if schedule_free(optimizer):
        name = type(optimizer).__name__
        if lr_decay != "none" or scheduler:
            what = f"model.lr_decay {lr_decay}" if lr_decay != "none" else "model.lr_scheduler"
            return [f"model.optimizer {name} is schedule-free: it needs no decay of the lr, and {what} shrinks the "
                    "steps its average is built from; set model.lr_decay: none and no model.lr_scheduler (a warmup "
                    "is fine: model.warmup_steps or its own warmup_steps)"]
        return []
    if not sets_its_own_step(optimizer):
        return []
    name, group = type(optimizer).__name__, optimizer.param_groups[0]
    out = []
    if lr_scaling != "none":
        out.append(f"model.optimizer {name} estimates its own step size: model.lr_scaling {lr_scaling} is not applied "
                   f"to its lr ({group['lr']:g}); set model.lr_scaling: none to silence this")
    if group["lr"] != 1.0:
        out.append(f"model.optimizer {name} is meant to run at lr 1.0 (the lr multiplies the step size it estimates), "
                   f"and this run's is {group['lr']:g}")
    if warmup_steps > 0 and not group.get("safeguard_warmup", False):
        out.append(f"model.optimizer {name} with model.warmup_steps {warmup_steps}: its estimate of the step size "
                   "grows from the warmup's small steps; set model.warmup_steps: 0, or its safeguard_warmup: true")
    return out
