"""The ``lit-dist`` command: LightningCLI with lit-dist's defaults. Thin on purpose.

    lit-dist fit --config configs/quickstart.yaml
    lit-dist fit --config configs/quickstart.yaml --trainer.devices 2 --trainer.strategy ddp
    lit-dist fit --help
    lit-dist plan --config configs/quickstart.yaml --trainer.devices 8 --trainer.num_nodes 4
    lit-dist index /datasets/photos --output photos.parquet
    lit-dist cache --config configs/latent_quickstart.yaml [--check]
    lit-dist --help                     # every subcommand (the table in lit_dist/cli/commands/__init__.py)
"""

import argparse
import inspect
import os
import sys

from lightning.pytorch.cli import LightningCLI

from lit_dist.cli.commands import COMMANDS, NAMES, usage
from lit_dist.errors import ConfigError, ExitCode, LitDistError, explain_parse_error
from lit_dist.runtime.run_dir import RunConfig, check_writable, run_dir

MODEL = "lit_dist.model.module.LitModel"
DATA = "lit_dist.data.datamodule.BucketDataModule"


def strategy_classes(argv: list[str]) -> list[str]:
    """``--trainer.strategy a.b.Class`` as ``{"class_path": "a.b.Class"}``: Lightning's ``trainer.strategy`` takes a
    string as a registered strategy's name ("ddp"), so a dotted class path there would reach its registry and fail."""
    import json
    import re

    dotted = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+")
    out = list(argv)
    for i, arg in enumerate(out):
        if arg == "--trainer.strategy" and i + 1 < len(out) and dotted.fullmatch(out[i + 1]):
            out[i + 1] = json.dumps({"class_path": out[i + 1]})
        elif arg.startswith("--trainer.strategy=") and dotted.fullmatch(arg.split("=", 1)[1]):
            out[i] = "--trainer.strategy=" + json.dumps({"class_path": arg.split("=", 1)[1]})
    return out


class LitDistCLI(LightningCLI):
    """LightningCLI whose model and data default to ``LitModel`` and ``BucketDataModule``.

    Both accept a ``class_path`` to use a subclass or any LightningModule / LightningDataModule.
    """

    writes_run_dir = True  # fit, validate, test, predict: its logs, config, checkpoints and hang files

    def __init__(self, args: list[str] | None = None, **kwargs):
        from lightning.pytorch import LightningDataModule

        from lit_dist.cli.saved_config import SaveConfig
        from lit_dist.model.module import LitModel

        argv = sys.argv[1:] if args is None else args
        # In subclass mode `--help` would hide every model and data knob behind `--model.help CLASS`;
        # for help only, parse the default classes directly so that all knobs are listed.
        show_all = any(a in ("-h", "--help") for a in argv)
        # The parser of the command given, not of all four: each is a whole parser of the model, data and trainer
        # (0.3 s of every start for the three unused).
        given = next((a for a in argv if not a.startswith("-")), None)
        if given in LightningCLI.subcommands():
            self.subcommands = lambda: {given: LightningCLI.subcommands()[given]}
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})  # a rerun never aborts on config.yaml
        kwargs.setdefault("save_config_callback", SaveConfig)  # a config.yaml that cannot be written: every rank ends
        # exit_on_error=False: main() turns parse errors into one line instead of a usage wall.
        kwargs["parser_kwargs"] = {"exit_on_error": False, "description": "lit-dist: training from one YAML file.",
                                   **kwargs.get("parser_kwargs", {})}
        if show_all:
            from lit_dist.data.datamodule import BucketDataModule

            model_class, data_class = LitModel, BucketDataModule
        else:
            model_class, data_class = LitModel, LightningDataModule
        super().__init__(
            model_class,
            data_class,
            subclass_mode_model=not show_all,
            subclass_mode_data=not show_all,
            auto_configure_optimizers=False,  # LitModel owns its optimizer and scheduler arguments
            seed_everything_default=0,
            args=args,
            **kwargs,
        )

    def add_arguments_to_parser(self, parser) -> None:
        from lit_dist.callbacks.checkpoint import Checkpointing
        from lit_dist.callbacks.export import ExportModel
        from lit_dist.callbacks.preemption import Preemption
        from lit_dist.callbacks.preflight import Preflight
        from lit_dist.callbacks.progress import Progress
        from lit_dist.callbacks.samples import Samples
        from lit_dist.callbacks.stragglers import StragglerDetector
        from lit_dist.callbacks.watchdog import HangWatchdog
        from lit_dist.cli.pipeline import PipelineConfig
        from lit_dist.runtime.control import RunControl

        parser.add_class_arguments(RunConfig, "run")
        parser.add_class_arguments(PipelineConfig, "pipeline")
        parser.add_lightning_class_args(RunControl, "control")
        parser.add_lightning_class_args(Progress, "progress")
        parser.add_lightning_class_args(Checkpointing, "checkpoint")
        parser.add_lightning_class_args(Preemption, "preemption")
        parser.add_lightning_class_args(HangWatchdog, "watchdog")
        parser.add_lightning_class_args(StragglerDetector, "straggler")
        parser.add_lightning_class_args(Preflight, "preflight")
        parser.add_lightning_class_args(ExportModel, "export")
        parser.add_lightning_class_args(Samples, "samples")
        if self.subclass_mode_model:
            parser.set_defaults({"model": {"class_path": MODEL}, "data": {"class_path": DATA}})

    def _prepare_subcommand_parser(self, klass: type, subcommand: str, **kwargs):
        # LightningCLI adds `ckpt_path` from Trainer.fit's signature (default None) after
        # add_arguments_to_parser runs, so its default can only be changed here.
        parser = super()._prepare_subcommand_parser(klass, subcommand, **kwargs)
        if "ckpt_path" in self._subcommand_method_arguments[subcommand]:
            parser.set_defaults(ckpt_path="auto")
        # A config saved by another command (a run directory's config.yaml is fit's) works here as it is: the
        # arguments of Lightning's other commands are accepted, left unused and named (before_instantiate_classes).
        own = set(self._subcommand_method_arguments[subcommand])
        for key, (kind, commands) in other_command_keys().items():
            if key not in own:
                parser.add_argument(f"--{key}", type=kind | None, default=None,
                                    help=f"Ignored by {subcommand} ({' and '.join(commands)}'s, kept in saved configs).")
        return parser

    def _parse_ckpt_path(self) -> None:
        """The model's hyperparameters from an explicit ``--ckpt_path`` file, as Lightning's, but read the way a
        resume reads the file (``lit_dist.ckpt.pickles``): Lightning's own ``torch.load(weights_only=True)``
        made a refused type a traceback and ignored ``--weights_only false``. A refused type or a file that is
        no checkpoint is one line (exit 3)."""
        from pathlib import Path

        from lit_dist.ckpt import pickles
        from lit_dist.ckpt.io import TRUST

        subcommand = self.config.get("subcommand")
        arguments = self.config[subcommand] if subcommand else None
        path = arguments.get("ckpt_path") if arguments else None
        if not path or not Path(path).is_file():
            return  # none, "auto", or a sharded checkpoint's folder: read when the run loads it
        checkpoint = pickles.load(path, TRUST, trust=arguments.get("weights_only") is False)
        hparams = dict(checkpoint.get("hyper_parameters") or {}) if isinstance(checkpoint, dict) else {}
        hparams.pop("_instantiator", None)
        if not hparams:
            return
        if "_class_path" in hparams:
            hparams = {"class_path": hparams.pop("_class_path"), "dict_kwargs": hparams}
        self.config = self.parser.parse_object({subcommand: {"model": hparams}}, self.config)

    def parse_arguments(self, parser, args) -> None:
        if not isinstance(args, dict) and not hasattr(args, "as_dict"):
            given = sys.argv[1:] if args is None else list(args)
            rewritten = strategy_classes(given)
            if rewritten != given:  # parsed here: LightningCLI warns when it is handed args beside sys.argv
                self.config = parser.parse_args(rewritten)
                return
        super().parse_arguments(parser, args)

    def before_instantiate_classes(self) -> None:
        from jsonargparse import Namespace

        config = self.config[self.subcommand] if self.subcommand else self.config
        self._say_ignored(config)
        from lightning.pytorch.utilities.rank_zero import rank_zero_only

        from lit_dist.cli.pipeline import fill

        filled = fill(config)  # first: the model and data a pipeline folder implies, before anything reads them
        if filled and rank_zero_only.rank == 0:
            print(f"lit-dist: from pipeline.path: {', '.join(filled)}", flush=True)
        if self.subcommand not in (None, "fit"):
            # The run directory's config.yaml stays fit's (what a resume and these commands read): theirs beside it.
            self.save_config_kwargs = {**self.save_config_kwargs, "config_filename": f"config-{self.subcommand}.yaml"}
        run = RunConfig(**vars(config.run))
        config.run.run_id, path = run_dir(run)
        given = config.trainer.default_root_dir
        if given not in (self._parser(self.subcommand).get_default("trainer.default_root_dir"), path):
            # Equal to `path` only in a config lit-dist saved for this run, which a rerun may load.
            raise ConfigError(f"trainer.default_root_dir = {given!r}: lit-dist puts every run in its own directory, "
                              f"{{run.root_dir}}/{{run.name}}/{{run.run_id}} (here {path}). Remove "
                              f"trainer.default_root_dir and set run.root_dir (e.g. --run.root_dir {given}) instead.")
        config.trainer.default_root_dir = path
        if self.writes_run_dir:
            check_writable(path)  # on every process: each writes its own files there
        from lit_dist.runtime.launch import apply_launch_layout
        from lit_dist.strategies.checks import prepare_strategy

        filled = apply_launch_layout(config.trainer)  # first: the strategy checks size the run by it
        if filled and rank_zero_only.rank == 0:  # the launcher's rank: no process group yet
            print(f"lit-dist: from the launcher: {', '.join(filled)}", flush=True)
        prepare_strategy(config)
        if config.trainer.enable_progress_bar is not False:
            # The bar's redraws fill a log file (a Slurm output) with unreadable megabytes: where stdout is not
            # a terminal, Progress writes one plain line every progress.log_every_s seconds instead.
            bar = config.progress.bar
            config.trainer.enable_progress_bar = bar == "always" or (bar == "auto" and sys.stdout.isatty())
        if config.trainer.enable_checkpointing is False:
            # lit-dist's Checkpointing is a Lightning Checkpoint, which Lightning refuses next to this flag.
            config.trainer.enable_checkpointing = True
            config.checkpoint.every_n_steps = config.checkpoint.every_n_epochs = config.checkpoint.every_n_minutes = None
            config.checkpoint.save_last = False
        if config.trainer.logger in (None, True):
            config.trainer.logger = Namespace(
                class_path="lit_dist.watch.tensorboard.TensorBoardLogger",
                init_args=Namespace(save_dir=run.root_dir, name=run.name, version=config.run.run_id, default_hp_metric=False),
            )

    def _say_ignored(self, config) -> None:
        """One line naming the keys of another command's config that this command leaves unused (rank 0)."""
        from lightning.pytorch.utilities.rank_zero import rank_zero_only

        own = set(self._subcommand_method_arguments.get(self.subcommand, ())) if self.subcommand else set()
        # ckpt_path auto is fit's default, in every config it saves: nothing to say about it.
        ignored = [key for key in other_command_keys() if key not in own and config.get(key) not in (None, "auto")]
        if self.subcommand:
            for key in other_command_keys():  # out of this command's saved config: another reads it as its own
                if key not in own and key in config:
                    del config[key]
        if ignored and rank_zero_only.rank == 0:
            name = self.subcommand or self.parser.prog.removeprefix("lit-dist ")
            print(f"lit-dist: {name} leaves unused the config's {', '.join(ignored)} "
                  f"(keys of {' and '.join(sorted({c for k in ignored for c in other_command_keys()[k][1]}))})",
                  flush=True)

    def _resolve_ckpt_path(self) -> None:
        """``ckpt_path: auto`` (the default) -> the newest usable checkpoint of this run, or None."""
        arguments = self.config_init[self.subcommand]
        checkpointing = arguments.get("checkpoint")  # the instance the `checkpoint` group made
        if checkpointing is not None:
            arguments["ckpt_path"] = checkpointing.resolve_ckpt_path(self.trainer, arguments.get("ckpt_path"))
        elif arguments.get("ckpt_path") == "auto":
            arguments["ckpt_path"] = None
        if arguments.get("ckpt_path"):
            from lit_dist.ckpt import vetting
            from lit_dist.ckpt.io import TRUST

            # A sharded or DeepSpeed checkpoint is unpickled in full by torch or DeepSpeed: vetted first.
            vetting.vet(str(arguments["ckpt_path"]), TRUST, trust=arguments.get("weights_only") is False)

    before_validate = before_test = before_predict = _resolve_ckpt_path

    def before_fit(self) -> None:
        self._resolve_ckpt_path()
        arguments = self.config_init[self.subcommand]
        preflight, checkpointing = arguments.get("preflight"), arguments.get("checkpoint")
        if preflight is not None and preflight.enabled and checkpointing is not None:
            preflight.checkpoint_store = checkpointing.store(self.trainer)  # its write test writes where checkpoints go

    def after_fit(self) -> None:
        self._report("fit")

    def after_validate(self) -> None:
        self._report("validate")

    def after_test(self) -> None:
        self._report("test")

    def after_predict(self) -> None:
        from lit_dist.cli.predictions import write_predictions

        trainer = self.trainer
        path = write_predictions(trainer.predict_loop.predictions or [], self._run_path(), trainer.global_rank)
        if path and trainer.is_global_zero:
            print(f"\nlit-dist: predictions written to {path} (one file per rank)", flush=True)
            self._say_weights()

    def _run_path(self) -> str:
        # Not trainer.log_dir: that is a broadcast, a collective that must never sit behind a rank check.
        return getattr(self.trainer.logger, "log_dir", None) or self.trainer.default_root_dir

    def _report(self, what: str) -> None:
        trainer = self.trainer
        if not trainer.is_global_zero:
            return
        run_path = self._run_path()
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.split("/")[0] in ("val", "test")}
        shown = ", ".join(f"{k} {v:.4f}" for k, v in sorted(metrics.items())) or "no validation metrics"
        print(f"\nlit-dist: {what} finished: {shown}")
        self._say_weights(bool(metrics))
        own = "" if what == "fit" else f" (the run's own: its config-{what}.yaml and TensorBoard events went there)"
        print(f"  run directory: {run_path}{own}")
        checkpointing = self.config_init[self.subcommand].get("checkpoint")
        if what == "fit" and checkpointing is not None and checkpointing.last_path:
            print(f"  checkpoint:    {checkpointing.last_path}")
        print(f"  watch it:      tensorboard --logdir {run_path}")
        print(f"  summary:       lit-dist report {run_path}\n", flush=True)

    def _say_weights(self, evaluated: bool = True) -> None:
        """Which weights the evaluation used (model.ema's average or the trained ones), where it matters."""
        weights = getattr(self.trainer.lightning_module, "weights_used", lambda: None)()
        if weights and evaluated:
            print(f"  weights:       {weights}")


class RunConfigCLI(LitDistCLI):
    """Parses a run config and builds the model and data module, but no Trainer: nothing touches a GPU.
    ``instantiate_trainer()`` builds the Trainer for a command that needs one."""

    writes_run_dir = False  # `lit-dist sample` of a checkpoint in a read-only folder, say

    def add_arguments_to_parser(self, parser) -> None:
        super().add_arguments_to_parser(parser)
        # A run directory's config.yaml (what fit saved) holds fit's ckpt_path and weights_only: accepted, so
        # that config works here as it is; these commands take a checkpoint, if any, as a flag of their own.
        for key, (kind, commands) in other_command_keys().items():
            parser.add_argument(f"--{key}", type=kind | None, default=None,
                                help=f"Ignored here ({' and '.join(commands)}'s, kept in saved configs).")

    def instantiate_classes(self) -> None:
        self.config_init = self.parser.instantiate_classes(self.config)
        self.datamodule = self._get(self.config_init, "data")
        self.model = self._get(self.config_init, "model")
        self.trainer = None


def other_command_keys() -> dict[str, tuple[type, list[str]]]:
    """{key: (type, commands)}: the arguments of Lightning's commands (Trainer.fit, validate, test, predict) beyond
    the model and data, which LightningCLI writes into each command's saved config."""
    from lightning.pytorch import Trainer

    found: dict[str, tuple[type, list[str]]] = {}
    for command, skip in LitDistCLI.subcommands().items():
        for name in inspect.signature(getattr(Trainer, command)).parameters:
            if name == "self" or name in skip:
                continue
            kind = bool if name in ("verbose", "return_predictions", "weights_only") else str
            found.setdefault(name, (kind, []))[1].append(command)
    return found


def _dispatch(argv: list[str]) -> int | None:
    """Run one of lit-dist's own subcommands (the table in lit_dist/cli/commands); None for Lightning's."""
    if not argv or (argv[0] in ("-h", "--help") and not set(argv) & set(NAMES)):
        # LightningCLI's own top-level help would list only Lightning's four subcommands.
        print(usage(), end="", file=sys.stdout if argv else sys.stderr)
        if not argv:
            print("lit-dist: error: name a command, e.g. lit-dist fit --config configs/quickstart.yaml", file=sys.stderr)
        return int(ExitCode.OK if argv else ExitCode.CONFIG_ERROR)
    if argv[0] not in NAMES and not argv[0].startswith("-"):
        print(f"lit-dist: error: unknown command {argv[0]!r}; the commands are {', '.join(NAMES)} (lit-dist --help)",
              file=sys.stderr)
        return int(ExitCode.CONFIG_ERROR)
    command = COMMANDS.get(argv[0])
    if command is None:
        return None
    function, prog = command.function(), f"lit-dist {argv[0]}"
    args = argv[1:]
    if command.positional and args and not args[0].startswith("-"):
        args = [f"--{command.positional}", *args]
    if not command.run_config:
        from jsonargparse import CLI

        CLI(function, args=args, prog=prog, exit_on_error=False)
        return int(ExitCode.OK)
    # The command's own flags, its parameters after `cli`, parsed by jsonargparse from its signature; not checked
    # when the user asks for the help that lists them (sample's checkpoint is required).
    helping = bool({"-h", "--help"} & set(args))
    own, rest = _own_flags(function, args, check=not helping)
    if command.config_of and not helping and not any(a in ("-c", "--config") or a.startswith(("-c=", "--config="))
                                                     for a in rest):
        rest = [*_config_of(own[command.config_of], prog, given=bool(rest)), *rest]
    from jsonargparse import DefaultHelpFormatter

    # The description holds the own flags' help as jsonargparse lays it out: keep its lines.
    formatter = type("Formatter", (argparse.RawDescriptionHelpFormatter, DefaultHelpFormatter), {})
    cli = RunConfigCLI(args=rest, run=False, parser_kwargs={"prog": prog, "description": _describe(function),
                                                            "formatter_class": formatter})
    cli.args = rest  # the run config's own arguments, for a command that starts fits of it
    return function(cli, **own)


def _config_of(checkpoint: str, prog: str, given: bool) -> list[str]:
    """``--config`` and the config.yaml of the run directory that holds ``checkpoint``, which that run saved and
    loads again; outside a run directory none, or a ConfigError if no run config was ``given`` on the command line
    either (the defaults name no network)."""
    from lit_dist.ckpt.model_card import run_dir_of

    run = run_dir_of(checkpoint)
    if run is None and not given:
        raise ConfigError(f"checkpoint {checkpoint} is in no run directory (no config.yaml in it or up to three "
                          f"folders above it): give its run's config, {prog} {checkpoint} --config FILE")
    if run is None:
        return []
    print(f"{prog}: the run config {run / 'config.yaml'} (--config FILE for another)", flush=True)
    return ["--config", str(run / "config.yaml")]


def _own_parser(function):
    """A jsonargparse parser of a run-config command's own arguments: its parameters after ``cli``, typed and
    described by its signature and docstring, as jsonargparse's ``CLI`` does for the other commands."""
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(exit_on_error=False, add_help=False)
    parser.add_function_arguments(function, skip={next(iter(inspect.signature(function).parameters))}, as_group=False)
    return parser


def _own_flags(function, argv: list[str], check: bool = True) -> tuple[dict, list[str]]:
    """(the command's own arguments by name, the rest of argv: the run config's); without ``check``, ({}, the rest).

    ``--name VALUE`` or ``--name=VALUE``, parsed and checked by jsonargparse (a bad value raises its
    ArgumentError: exit code 2); a bool may also be given alone, ``--check`` for ``--check true``.
    """
    parameters = {f"--{p.name}": p for p in list(inspect.signature(function).parameters.values())[1:]}
    own, rest, i = [], [], 0
    while i < len(argv):
        name, equals, _ = argv[i].partition("=")
        parameter = parameters.get(name)
        if parameter is None or equals:
            (rest if parameter is None else own).append(argv[i])
            i += 1
            continue
        is_bool = parameter.annotation is bool or isinstance(parameter.default, bool)
        # After a bool, a word without a dash is its value: no argument of the run config is one.
        if i + 1 < len(argv) and not (is_bool and argv[i + 1].startswith("-")):
            own += argv[i : i + 2]
            i += 2
        else:  # alone: a bool is set; any other flag lacks its value, which jsonargparse reports
            own.append(f"{name}=true" if is_bool else name)
            i += 1
    if not check:
        return {}, rest
    values = _own_parser(function).parse_args(own)
    return {name[2:]: values[name[2:]] for name in parameters}, rest


def _describe(function) -> str:
    """A run-config command's ``--help`` description: its docstring before ``Args:``, each paragraph filled to the
    terminal's width as argparse fills text, then its own flags' help as jsonargparse lays it out."""
    import shutil
    import textwrap

    width = shutil.get_terminal_size().columns - 2  # argparse's HelpFormatter width
    text = (inspect.getdoc(function) or "").partition("\nArgs:")[0].strip()
    paragraphs = [textwrap.fill(" ".join(p.split()), width) for p in text.split("\n\n") if p.strip()]
    flags = _own_parser(function).format_help().partition("options:\n")[2].rstrip()
    return "\n\n".join([*paragraphs, *([f"its own options:\n{flags}"] if flags else [])])


def _user_error(exc: BaseException | None) -> LitDistError | None:
    """The LitDistError that ``exc`` is or wraps by explicit chaining (``raise ... from``), as jsonargparse wraps
    errors raised while building classes (``raise_union_unexpected_value``: ``raise ValueError(...) from``).

    ``__context__`` is not followed: an error raised while a user error was being handled (a callback's
    ``on_exception`` that fails, say) is a bug of its own, and its traceback must be seen.
    """
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, LitDistError):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__
    return None


def _ranks_started(procs: list) -> None:
    """Lightning's launcher has started this machine's other ranks: watch them; their zygote is done."""
    from lit_dist.runtime import processes, warm_ranks

    warm_ranks.done()
    processes.ChildRanks.start_for(procs)


def _drop_local_rank(argv: list[str]) -> list[str]:
    """Remove ``--local_rank N``, which the DeepSpeed launcher and torch.distributed.launch add to the command
    line; it is also in the LOCAL_RANK variable, where Lightning reads it."""
    launcher = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    launcher.add_argument("--local_rank", "--local-rank")
    given, rest = launcher.parse_known_args(argv)
    if given.local_rank is not None:
        os.environ.setdefault("LOCAL_RANK", given.local_rank)
    return rest


def _leave_process_group() -> None:
    """Tear down a still-open process group: left to interpreter exit, gloo's threads can abort the
    process (SIGABRT), which would replace the documented exit code."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _rank() -> int:
    """This process's global rank (for messages), from the process group or the launcher's environment."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", 0)))


def _world() -> int:
    """The number of ranks of the run, from the process group or the launcher's environment."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", 1))


def main(args: list[str] | None = None) -> None:
    """Entry point of the ``lit-dist`` console script."""
    argv = _drop_local_rank(sys.argv[1:] if args is None else args)
    try:
        from lit_dist.runtime import compat, processes, warm_ranks
        from lit_dist.watch.console import quiet_lightning, whole_lines

        whole_lines()  # before any line: the ranks of a run share one console
        processes.join_launcher()
        compat.observe_child_ranks(_ranks_started)
        compat.launch_local_ranks_with(warm_ranks.launch)
        compat.plain_console()
        quiet_lightning()
        code = _dispatch(argv)
        if code is not None:
            sys.exit(code)
        LitDistCLI(args=argv)
    except argparse.ArgumentError as err:
        from lit_dist.strategies.deepspeed import missing_deepspeed

        if message := missing_deepspeed(str(err)):
            print(f"lit-dist: error: {message}", file=sys.stderr)
            sys.exit(int(ExitCode.CONFIG_ERROR))
        subcommand = next((a for a in argv if a in NAMES), "fit")
        print(f"lit-dist: error: {explain_parse_error(str(err))}", file=sys.stderr)
        print(f"  Fix it in the config file or on the command line; `lit-dist {subcommand} --help` lists every option.",
              file=sys.stderr)
        sys.exit(int(ExitCode.CONFIG_ERROR))
    except Exception as exc:
        from lit_dist.ckpt.space import storage_full
        from lit_dist.runtime import processes, roll_call

        who = f"rank {_rank()}: " if _world() > 1 else ""
        err = _user_error(exc) or processes.worker_death(exc, _rank()) or storage_full(exc, who)
        if err is None:
            lost = roll_call.peer_lost(exc, _rank(), _world())
            # A child rank that ended first broke this rank's collective: its end is the run's (one that closed
            # its connection may take a while to exit: its interpreter, its workers).
            if (code := processes.blame_child(wait_s=30.0 if lost else 3.0)) is not None:
                processes.end_run(code)  # no unwinding: the process group has a dead member
            if lost is not None:
                print(f"lit-dist: error: {lost}", file=sys.stderr)
                processes.end_run(lost.exit_code)  # leaving the process group could wait on the dead peer
            raise
        print(f"lit-dist: error: {err}", file=sys.stderr)
        processes.let_children_finish(err.exit_code)  # before this process's exit (and its store) ends them
        _leave_process_group()
        sys.exit(int(err.exit_code))
    except KeyboardInterrupt:
        sys.exit(130)
    sys.exit(int(ExitCode.OK))


if __name__ == "__main__":
    main()
