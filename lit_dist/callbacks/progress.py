"""``Progress``: throughput that means something on GPUs, and a console that suits where it goes.

Every run has it (the CLI's ``progress`` group). It measures, per window of ``log_every_n_steps``
optimizer steps, on every rank and without a host-device synchronisation (host clocks around the
loop, tensor shapes, a FLOP count taken once per batch shape):

===========================================  =============================================================
``throughput/samples_per_s``                 the job's samples per second (every rank trains as many)
``throughput/samples_per_s_per_device``      this device's
``throughput/tflops_per_device``             model FLOPs (forward and backward) per second per device
``throughput/mfu``                           the same against the device's peak at the run's precision (table
                                             in lit_dist.watch.perf, or ``peak_tflops``); on CPU only with ``peak_tflops``
``throughput/data_wait``                     share of the loop's wall time between one step's end and the next
                                             one's start: the wait for the batch, and the loop's own work
``throughput/samples_per_s_bucket_WxH``      per bucket shape (time from a batch's start to its end)
===========================================  =============================================================

Goodput (``lit_dist.watch.goodput``): where the wall time went (training, data waits, checkpoint stalls,
validation, sample grids (event ``samples.written``), start-up, work lost to restarts), kept in every checkpoint so that it adds up over
requeues; logged as ``goodput/*``, printed at the end of ``fit`` and sent with ``run.finished``.

Console: in a terminal Lightning's progress bar stays. When stdout is not a terminal (a Slurm
output file, a pipe) the bar is off and rank 0 writes one plain line every ``log_every_s`` seconds,
and one at each validation, checkpoint and sample grid::

    lit-dist: step 1200/40000 (3%) epoch 3 | loss 0.412 | lr 1.2e-04 | 5,120 samples/s | 81.2 TFLOP/s/device | MFU 41% | data wait 2% | ETA 2:13:40
"""

import logging
import math
import os
import sys
import time
from typing import Literal

from lightning.pytorch import Callback

from lit_dist.errors import ConfigError
from lit_dist.runtime.control import Event, RunControl
from lit_dist.runtime.processes import age_s
from lit_dist.watch import goodput
from lit_dist.watch.perf import FlopMeter, Totals, peak_tflops

log = logging.getLogger(__name__)


class Progress(Callback):
    """Throughput, FLOPs, MFU and data wait to TensorBoard; plain progress lines where there is no terminal."""

    def __init__(self, log_every_s: float = 30.0, peak_tflops: float | None = None,
                 bar: Literal["auto", "always", "never"] = "auto"):
        """Progress settings.

        Args:
            log_every_s: Seconds between progress lines when the bar is off (stdout not a terminal, or bar: never).
            peak_tflops: Peak TFLOP/s of one device for MFU; default: from the GPU's name and the run's precision.
            bar: Lightning's progress bar: auto (only when stdout is a terminal), always or never.
        """
        problems = []
        if log_every_s <= 0:
            problems.append(f"progress.log_every_s: {log_every_s} must be positive")
        if peak_tflops is not None and peak_tflops <= 0:
            problems.append(f"progress.peak_tflops: {peak_tflops} must be positive (TFLOP/s of one device), or null")
        if bar not in ("auto", "always", "never"):
            problems.append(f"progress.bar: {bar!r} must be auto, always or never")
        ConfigError.collect(problems)
        self.log_every_s = log_every_s
        self.peak_tflops = peak_tflops
        self.bar = bar
        self.flops_per_sample: dict[tuple, float] = {}  # batch shape (C, H, W) -> FLOPs of one sample
        self._measured: list | None = None  # every rank's measured shapes, from the checkpoint
        self.last: dict[str, float] = {}  # the figures of the last window
        self._meter = FlopMeter()
        self._measuring: tuple | None = None
        self._totals = Totals()
        self._log_mark = self._line_mark = self._totals.mark()  # where the TensorBoard and console windows began
        self._batch_started: float | None = None
        self._shape: tuple | None = None  # the batch in flight's input shape
        self._batch_ended: float | None = None
        self._paused_at: float | None = None
        self._lines = False
        self._peak: float | None = None
        self._total_steps: int | None = None
        self._step: int | None = None
        # Goodput: the ledger of earlier attempts (from the checkpoint), this attempt's journal (rank 0).
        self._carried: goodput.Ledger | None = None  # as loaded from the checkpoint
        self._carried_from: tuple[int | None, float | None] = (None, None)  # (attempt that saved it, when)
        self._ledger = goodput.Ledger()  # earlier attempts; this one's seconds are added when asked
        self._journal: goodput.Journal | None = None
        self._started = time.time() - age_s()  # this attempt's start: the process's
        self._first_batch: float | None = None  # perf_counter of this attempt's first training batch
        self._blocked = 0.0  # checkpoint stall not yet taken out of the interval it fell in

    def connect(self, control: RunControl) -> None:
        control.subscribe(self)
        control.summarize("goodput", lambda: self.ledger().to_dict())

    # -- console lines: events of the run control ------------------------------------------------

    def send(self, event: Event) -> None:
        if event.type == "checkpoint.saved":
            self._saved(event)
        elif event.type == "samples.written":
            self._sampled(float(event.data.get("seconds", 0.0)))
        if not self._lines:
            return
        if event.type == "validation.finished":
            shown = ", ".join(f"{k} {v:.4f}" for k, v in sorted(event.data.items()) if k.startswith("val/"))
            self._print(f"validation at step {event.data.get('step')}: {shown or 'no metrics'}")
        elif event.type == "checkpoint.saved":
            self._print(f"checkpoint at step {event.data['step']} ({event.data['bytes'] / 1e6:.1f} MB, "
                        f"{event.data['seconds']:.1f} s, {event.data['reason']})")
        elif event.type == "samples.written":
            self._print(f"samples at step {event.data['step']}: {event.message}")

    def _saved(self, event: Event) -> None:
        """Rank 0: a checkpoint was written; the loop was held ``blocked_s`` of it."""
        blocked = float(event.data.get("blocked_s", 0.0))
        self._totals.checkpoint += blocked
        self._blocked += blocked
        if self._journal is not None:
            self._journal.saved(int(event.data["step"]), time.time())

    def _sampled(self, seconds: float) -> None:
        """Rank 0: samples took ``seconds``, out of validation's time or the interval between two steps they fell in."""
        self._totals.sampling += seconds
        if self._paused_at is not None:  # in validation: on_validation_end adds its whole time to paused
            self._totals.paused -= seconds
        else:
            self._blocked += seconds

    def flush(self, timeout_s: float | None = None) -> bool:
        sys.stdout.flush()
        return True

    def _print(self, text: str) -> None:
        print(f"lit-dist: {text}", flush=True)

    # -- measuring --------------------------------------------------------------------------------

    def on_train_start(self, trainer, pl_module) -> None:
        import torch

        self._lines = trainer.is_global_zero and trainer.progress_bar_callback is None
        device = trainer.strategy.root_device
        # The peak of the dtype the matrix products run in: bf16/fp16 under half precision, TF32 or fp32 for float32.
        self._peak = self.peak_tflops or (peak_tflops(torch.cuda.get_device_name(device), trainer.precision,
                                                      torch.get_float32_matmul_precision())
                                          if device.type == "cuda" else None)
        # inf: no end (max_epochs -1); max_steps, so -1 without it, for a loader without a length: no total, no ETA
        estimate = trainer.estimated_stepping_batches
        self._total_steps = int(estimate) if math.isfinite(estimate) and estimate > 0 else None
        self._totals = Totals()
        self._log_mark = self._line_mark = self._totals.mark()
        self._first_batch, self._blocked = None, 0.0
        measured, self._measured = self._measured, None
        if measured:  # this rank's own shapes; another world size: every rank's (the same FLOPs per shape)
            chosen = [measured[trainer.global_rank]] if len(measured) == trainer.world_size else measured
            self.flops_per_sample.update({tuple(shape): flops for part in chosen for shape, flops in part})
        if trainer.is_global_zero:
            self._open_journal(trainer)

    def _open_journal(self, trainer) -> None:
        """Rank 0: account for what earlier attempts lost, and start this attempt's journal."""
        folder = os.path.join(trainer.default_root_dir, "goodput")
        previous = goodput.attempts(folder)
        ledger = self._carried or goodput.Ledger(attempts=0)
        saved_by, saved_at = self._carried_from
        resumed = trainer.global_step if self._carried is not None else 0
        lost = goodput.losses(previous, resumed, saved_by, saved_at)
        seconds = dict(ledger.seconds)
        seconds["lost"] += sum(item["lost_s"] for item in lost)
        self._ledger = goodput.Ledger(seconds, ledger.steps_redone + sum(item["steps_redone"] for item in lost),
                                      ledger.attempts + sum(item["attempt"] != saved_by for item in lost) + 1,
                                      ledger.restarts + lost)
        attempt = max([info["attempt"] for info in previous], default=0) + 1
        try:
            self._journal = goodput.Journal(folder, attempt, self._started, resumed if self._carried else None,
                                            self._total_steps)
        except OSError as exc:  # a read-only run directory: no ledger across requeues, training goes on
            log.warning("lit-dist: cannot write the goodput journal in %s (%s)", folder, exc)
            self._journal = None
        if lost:
            self._print(f"restart {len(self._ledger.restarts)}: {self._ledger.steps_redone} steps redone so far, "
                        f"{goodput.hms(seconds['lost'])} lost to restarts")

    def ledger(self) -> goodput.Ledger:
        """Every attempt so far, this one up to now."""
        totals = self._totals
        wall = time.time() - self._started
        if self._first_batch is None:
            return self._ledger.plus({"startup": wall})
        startup = wall - (time.perf_counter() - self._first_batch)
        mine = {"startup": startup, "train": totals.training, "data_wait": totals.waiting,
                "checkpoint": totals.checkpoint, "validation": totals.paused, "sampling": totals.sampling}
        mine["other"] = max(wall - sum(mine.values()), 0.0)
        return self._ledger.plus(mine)

    def state_dict(self) -> dict:
        ledger = self.ledger()
        attempt = self._journal.attempt if self._journal is not None else None
        return {"goodput": ledger.to_dict(), "attempt": attempt, "saved_at": time.time()}

    def load_state_dict(self, state_dict: dict) -> None:
        if "goodput" in state_dict:
            self._carried = goodput.Ledger.from_dict(state_dict["goodput"])
            self._carried_from = (state_dict.get("attempt"), state_dict.get("saved_at"))
        self._measured = state_dict.get("flops_per_sample")  # per rank; taken at on_train_start

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        # A step measured under torch's FlopCounterMode computes its gradients a little differently (bitwise), so a
        # resumed run must measure the steps the uninterrupted run measured, not each shape again: every rank's
        # measured shapes travel in the checkpoint (a collective: every rank saves).
        from lit_dist.runtime.distributed import all_gather_object

        mine = [[list(shape), flops] for shape, flops in self.flops_per_sample.items()]
        state = checkpoint.get("callbacks", {}).get(self.state_key)
        measured = all_gather_object(trainer, mine)
        if state is not None:
            state["flops_per_sample"] = measured

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        now = time.perf_counter()
        if self._batch_ended is not None:
            self._totals.waiting += max(now - self._batch_ended - self._blocked, 0.0)
        elif self._first_batch is None:
            self._first_batch = now
            if self._journal is not None:
                self._journal.first_batch(trainer.global_step, time.time())
        self._blocked = 0.0  # a save after validation fell in no measured interval
        self._batch_started = now
        shape = self._shape = _input_shape(batch)
        if shape is not None and shape[1:] not in self.flops_per_sample and not self._meter.running:
            self._measuring = shape
            try:
                self._meter.start()  # this one step's forward and backward, once per shape
            except Exception as exc:  # noqa: BLE001 - torch documents nothing; only a metric is lost
                # Entering torch's FlopCounterMode pushes a dispatch mode and module hooks (RuntimeError or
                # AssertionError from its mode stack in practice). Whatever it raises costs only this shape's
                # TFLOP/s and MFU, said in the warning; the meter stays stopped (FlopMeter sets its mode
                # only once entered), so on_after_backward does not stop a half-entered one.
                log.warning("lit-dist: cannot count the FLOPs of a step (%s: %s); no TFLOP/s or MFU",
                            type(exc).__name__, exc)
                self._measuring = None
                self.flops_per_sample[shape[1:]] = 0.0

    def on_after_backward(self, trainer, pl_module) -> None:
        if self._meter.running:
            shape, self._measuring = self._measuring, None
            self.flops_per_sample[shape[1:]] = self._meter.stop() / shape[0]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._meter.running:  # no backward ran (manual optimisation skipped it): nothing counted
            self._meter.stop()
            self._measuring = None
        now = self._batch_ended = time.perf_counter()
        totals, shape = self._totals, self._shape
        totals.training += max(now - self._batch_started - self._blocked, 0.0)
        self._blocked = 0.0
        if shape is not None:
            totals.samples += shape[0]
            totals.flops += self.flops_per_sample.get(shape[1:], 0.0) * shape[0]
            bucket = totals.buckets.setdefault(shape[2:], [0, 0.0])
            bucket[0] += shape[0]
            bucket[1] += now - self._batch_started
        step = trainer.global_step
        if step != self._step:  # an optimizer step ended (not an accumulated micro-batch)
            self._step = step
            totals.steps += 1
            if self._journal is not None:
                self._journal.step(step, time.time())
            if step % trainer.log_every_n_steps == 0:
                self.last = totals.figures(self._log_mark, trainer.world_size, self._peak)
                self._log_mark = totals.mark()
                if trainer.is_global_zero and trainer.logger is not None:
                    logged = {f"throughput/{k}": v for k, v in self.last.items() if k != "seconds_per_step"}
                    trainer.logger.log_metrics(logged | _goodput_metrics(self.ledger()), step=step)
        if self._lines and now - self._line_mark[0] >= self.log_every_s:
            self._print_line(trainer)

    def on_validation_start(self, trainer, pl_module) -> None:
        self._paused_at = time.perf_counter()

    def on_validation_end(self, trainer, pl_module) -> None:
        if self._paused_at is not None:
            self._totals.paused += time.perf_counter() - self._paused_at
            self._paused_at = None
        self._batch_ended = None  # the wait for the first batch after validation is the loader's start-up

    def on_train_end(self, trainer, pl_module) -> None:
        if self._lines and self._totals.steps > self._line_mark[1].steps:
            self._print_line(trainer)

    def on_fit_end(self, trainer, pl_module) -> None:
        self._end(trainer, "finished")

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        from lit_dist.errors import ExitCode, Preempted

        how = "preempted" if isinstance(exception, Preempted) else \
            f"failed (exit {int(getattr(exception, 'exit_code', ExitCode.FAILURE))}, {type(exception).__name__})"
        self._end(trainer, how)  # a journal that can no longer be written says so in a warning (goodput.Journal)

    def _end(self, trainer, how: str) -> None:
        """Rank 0: close the journal, print the goodput, log it."""
        if self._journal is None:
            return
        journal, self._journal = self._journal, None
        journal.ended(how, trainer.global_step, time.time())
        ledger = self.ledger()
        self._print(ledger.summary())
        if trainer.logger is not None:
            trainer.logger.log_metrics(_goodput_metrics(ledger), step=trainer.global_step)

    def _print_line(self, trainer) -> None:
        figures = self._totals.figures(self._line_mark, trainer.world_size, self._peak)
        self._line_mark = self._totals.mark()
        self._print(self._line(trainer, figures))

    def _line(self, trainer, figures: dict[str, float]) -> str:
        step, total = trainer.global_step, self._total_steps
        parts = [f"step {step}/{total} ({step / total:.0%})" if total else f"step {step}",
                 f"epoch {trainer.current_epoch}"]
        loss = trainer.callback_metrics.get("train/loss")  # one copy to the host per line, not per step
        head = [" ".join(parts)]
        if loss is not None:
            head.append(f"loss {float(loss):.4g}")
        if trainer.optimizers:
            head.append(f"lr {trainer.optimizers[0].param_groups[0]['lr']:.3g}")
        head.append(f"{figures['samples_per_s']:,.0f} samples/s")
        if "tflops_per_device" in figures:
            head.append(f"{figures['tflops_per_device']:.3g} TFLOP/s/device")
        if "mfu" in figures:
            head.append(f"MFU {figures['mfu']:.0%}")
        head.append(f"data wait {figures['data_wait']:.0%}")
        if total and step < total:
            head.append(f"ETA {goodput.hms((total - step) * figures['seconds_per_step'])}")
        return " | ".join(head)


def _goodput_metrics(ledger: goodput.Ledger) -> dict[str, float]:
    return {"goodput/fraction": ledger.goodput, "goodput/steps_redone": float(ledger.steps_redone),
            **{f"goodput/{k}_s": v for k, v in ledger.seconds.items()}}


def _input_shape(batch) -> tuple | None:
    """The shape of a batch's first tensor with a batch, channel and spatial dimensions (images, latents)."""
    values = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else [batch]
    for value in values:
        shape = getattr(value, "shape", None)
        if shape is not None and len(shape) == 4:
            return tuple(int(d) for d in shape)
    return None
