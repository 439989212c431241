"""DeepSpeed's checkpoint folder: the tag folder its ``latest`` file names, and the files each rank wrote there
(``zero_pp_rank_{rank}_mp_rank_{mp}_model_states.pt``, ``..._optim_states.pt``, with a precision prefix)."""

import os
import re


def is_deepspeed(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a DeepSpeed checkpoint folder: a ``latest`` file, or a ``global_step*`` tag folder."""
    return os.path.isdir(path) and (os.path.isfile(os.path.join(path, "latest")) or
                                    any(n.startswith("global_step") for n in os.listdir(path)))


def tag_folder(path: str | os.PathLike) -> str:
    """The folder of the tag that ``path``'s ``latest`` file names, or ``path`` itself where it has none."""
    tag = os.path.join(path, "latest")
    if os.path.isfile(tag):
        with open(tag) as f:
            return os.path.join(path, f.read().strip())
    return os.fspath(path)


def rank_files(path: str | os.PathLike, kind: str) -> list[str]:
    """The tag folder's per-rank files of ``kind`` (``model_states`` or ``optim_states``), in rank order."""
    folder = tag_folder(path)
    if not os.path.isdir(folder):
        return []
    pattern = re.compile(rf"zero_pp_rank_(\d+)_mp_rank_\d+_{kind}\.pt$")
    found = {int(m.group(1)): os.path.join(folder, name) for name in os.listdir(folder) if (m := pattern.search(name))}
    return [found[rank] for rank in sorted(found)]
