"""Whether a checkpoint's tensors fit the model that resumes from it: one line naming the first that does not,
instead of torch's size-mismatch or missing-key traceback from the middle of the load."""

from collections.abc import Callable, Mapping

from lit_dist.errors import ConfigError

Shapes = Mapping[str, tuple[int, ...] | None]  # state-dict key -> shape (None: not a tensor)


def differences(saved: Shapes, model: Shapes, optional: Callable[[str], bool] = lambda key: False) -> list[str]:
    """What differs between a checkpoint's state dict and the model's, as "... of the checkpoint" phrases.
    ``optional`` keys may be missing on either side (the model starts or drops them: a weight average)."""
    found = []
    for key, shape in model.items():
        if key not in saved:
            if not optional(key):
                found.append(f"has no {key}")
        elif saved[key] is not None and shape is not None and tuple(saved[key]) != tuple(shape):
            found.append(f"holds {key} of shape {tuple(saved[key])}, this model's is {tuple(shape)}")
    found += [f"holds {key}, which this model does not have" for key in saved if key not in model and not optional(key)]
    return found


def refuse(path, found: list[str]) -> None:
    """Raise the one-line error (exit 2) for ``found`` differences, if any."""
    if not found:
        return
    more = f" ({len(found) - 1} more tensors differ)" if len(found) > 1 else ""
    raise ConfigError(f"the checkpoint {path} {found[0]}{more}: it was saved by another model.net or other settings. "
                      "Resume with the configuration it was saved with (config.yaml in its run directory), or start "
                      "a new run (another run.run_id)")


def left_out(keys):
    """A state-dict post-hook that leaves ``keys`` (under the module's prefix) out of what the module saves."""
    def hook(module, state_dict, prefix, local_metadata) -> None:
        for key in keys:
            state_dict.pop(prefix + key, None)
    return hook


def may_lack(keys):
    """A load-state-dict post-hook: a state dict may lack ``keys`` (under whatever prefix a wrapper adds, as
    DeepSpeed's ``_forward_module.``); a strict load then asks for the rest only."""
    keys = set(keys)

    def hook(module, incompatible) -> None:
        incompatible.missing_keys[:] = [k for k in incompatible.missing_keys if not _under_a_prefix(k, keys)]
    return hook


def _under_a_prefix(key: str, keys: set[str]) -> bool:
    parts = key.split(".")
    return any(".".join(parts[i:]) in keys for i in range(len(parts)))
