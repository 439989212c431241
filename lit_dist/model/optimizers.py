"""What lit-dist knows of optimizers users name by ``class_path`` that set their own step size: Prodigy
(``prodigyopt``) and D-Adaptation (``dadaptation``). Their ``lr`` multiplies the step size they estimate, so it is
1.0 and lit-dist's LR scaling, made for a step size set by hand, is not applied to it; a warmup moves the estimate
unless the optimizer guards it (Prodigy's ``safeguard_warmup``). A config that mixes them is told so, once.
"""

import torch

SETS_ITS_OWN_STEP = ("prodigyopt", "dadaptation", "prodigyplus")  # the modules of such optimizers


def sets_its_own_step(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` estimates its own step size (its lr is a multiplier of it)."""
    return type(optimizer).__module__.split(".")[0] in SETS_ITS_OWN_STEP


def notes(optimizer: torch.optim.Optimizer, lr_scaling: str, warmup_steps: int) -> list[str]:
    """What a run should know about settings that do not fit an optimizer that sets its own step size; [] for any
    other optimizer."""
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
