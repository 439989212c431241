"""``ExportModel``: at the end of ``fit``, the trained network in the run directory, whatever the strategy.

A plain ``state_dict`` of the wrapped network (``LitModel.net``; the whole module for other
LightningModules), in float32, loadable without lit-dist or Lightning:

    net.load_state_dict(torch.load("runs/exp/run/model.pt", weights_only=True))

For a fine-tune of a diffusers pipeline (``PipelineDenoiser``), a pipeline folder as ``lit-dist export`` writes it,
with its model card (pipeline.path names it ``pipeline``):

    DiffusionPipeline.from_pretrained("runs/exp/run/pipeline")

Configured by the CLI's ``export`` group::

    export:
      filename: model.pt      # null: no export
"""

import os
from contextlib import nullcontext

import torch
from lightning.pytorch import Callback

from lit_dist.ckpt.export import save_atomically, strip_prefix, to_full_precision
from lit_dist.ckpt.space import full_error, room, room_text, size_text
from lit_dist.errors import StorageFull


class ExportModel(Callback):
    """Writes ``{run dir}/{filename}`` from rank 0 when training ends; sharded states are gathered first."""

    def __init__(self, filename: str | None = "model.pt"):
        """Export settings.

        Args:
            filename: Name in the run directory of the consolidated state_dict (a pipeline folder for a pipeline's denoiser); null turns the export off.
        """
        self.filename = filename
        self.path: str | None = None

    def on_train_end(self, trainer, pl_module) -> None:
        # Before the strategy is torn down: gathering a sharded state is a collective on every rank.
        if not self.filename:
            return
        # The weights a run keeps (a schedule-free optimizer's average) until written: on a CPU the state dict of
        # one process holds the parameters themselves, not copies.
        with getattr(pl_module, "weights_to_keep", nullcontext)():
            self._export(trainer, pl_module)

    def _export(self, trainer, pl_module) -> None:
        state = full_state_dict(trainer, pl_module)
        if trainer.is_global_zero:
            run_dir = getattr(trainer.logger, "log_dir", None) or trainer.default_root_dir
            self.path = os.path.join(run_dir, self.filename)
            state = to_full_precision(strip_prefix(state))
            try:
                if not _as_pipeline(trainer, pl_module, state, self.path):
                    save_atomically(state, self.path)
            except Exception as exc:
                if (full := full_error(exc)) is None:
                    raise
                last = getattr(trainer.checkpoint_callback, "last_path", None)
                raise StorageFull(_did_not_fit(self.path, state, last, full)) from exc


def _as_pipeline(trainer, pl_module, state: dict, path: str) -> bool:
    """A pipeline folder with its model card at ``path`` when the network is a pipeline's denoiser (the one a
    resumed run wrote before is replaced); False for any other network."""
    from pathlib import Path

    from lit_dist.ckpt.model_card import run_config, write_card
    from lit_dist.model.nets.pipeline import PipelineDenoiser, write_pipeline

    net = getattr(pl_module, "net", None)
    if not isinstance(net, PipelineDenoiser):
        return False
    adapter, card = getattr(pl_module, "adapter", None), None
    if adapter is None:
        target = write_pipeline(str(net.folder.path), state, path, replace=True)
    else:  # the adapter alone, in the format its users load (lit_dist/model/adapter_export.py)
        from lit_dist.model.adapter_export import adapter_card, write_adapter

        target = Path(path).expanduser().absolute()
        kind = write_adapter(net.folder, net.model, adapter, state, path, replace=True)
        card = adapter_card(adapter, net.folder, path, kind, pl_module.hparams.get("init_weights"))
    run = Path(path).parent
    facts = {"step": trainer.global_step, "world_size": trainer.world_size, "strategy": type(trainer.strategy).__name__}
    write_card(target, net.folder.path, net.family, net.folder.index["_class_name"], f"the end of the run {run}",
               run_config(run), False, facts, run, adapter=card)
    return True


def _did_not_fit(path: str, state: dict, checkpoint: str | None, error: OSError) -> str:
    """The one line of an export that found the disk full: training is done, so the fix is ``lit-dist export``
    (a rerun of the finished run trains nothing and exports nothing)."""
    size = size_text(sum(v.numel() * v.element_size() for v in state.values()))
    head = (f"the trained network ({size}) does not fit in {path} ({os.strerror(error.errno)}: "
            f"{room_text(room(os.path.dirname(path)))}). ")
    if checkpoint is None:
        return head + "This run wrote no checkpoint to write it from: free space there and run it again"
    return (head + f"Training is complete; free space there, then write it from its last checkpoint: lit-dist export "
            f"{checkpoint} --output {path}")


def full_state_dict(trainer, pl_module) -> dict:
    """The LightningModule's unsharded state dict on rank 0 (other ranks may get {}). Call on every rank."""
    from torch.distributed.tensor import DTensor

    strategy = trainer.strategy
    name = type(strategy).__name__.lower()
    if "deepspeed" in name:
        return _deepspeed_full_state(trainer)
    if any(isinstance(p, DTensor) for p in pl_module.parameters()):  # FSDP2 / ModelParallel
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(pl_module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if "fsdp" in name:  # FSDP1
        from torch.distributed.fsdp import FullStateDictConfig, StateDictType
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        config = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
        with FSDP.state_dict_type(strategy.model, StateDictType.FULL_STATE_DICT, config):
            return strategy.model.state_dict()
    return {k: v.detach().cpu() for k, v in pl_module.state_dict().items()}


def _deepspeed_full_state(trainer) -> dict:
    """DeepSpeed keeps the float32 master weights in the optimizer: save a checkpoint, convert it on rank 0."""
    import shutil

    from lit_dist.ckpt.export import load_checkpoint_state

    folder = os.path.join(trainer.default_root_dir, ".export-deepspeed")
    trainer.save_checkpoint(folder)  # collective: every rank writes its partition
    state = {}
    if trainer.is_global_zero:
        state = load_checkpoint_state(folder)
        shutil.rmtree(folder, ignore_errors=True)
    trainer.strategy.barrier("lit-dist-export")
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
