"""The `prunelight` command: LightningCLI over PruneLM and PruneDataModule, with `prune:`, `evaluation:` and
`export:` sections (fit, validate, test), plus `prunelight evaluate`."""

from __future__ import annotations

import copy
import importlib.util
import logging
import os
import sys

import jsonargparse
from lightning.pytorch import Trainer
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, SaveConfigCallback
from lightning.pytorch.loggers import CSVLogger

from prunelight import _env
from prunelight.callbacks import ExportCallback, PruningCallback
from prunelight.callbacks.pruning import run_facts
from prunelight.checkpoint_io import AtomicCheckpointIO
from prunelight.console import setup_logging
from prunelight.data import PruneDataModule
from prunelight.distributed import uses_checkpoint_io
from prunelight.errors import PrunelightError, one_line
from prunelight.evaluation.run import RunEvaluator
from prunelight.module import PruneLM
from prunelight.run_plan import prepare_run
from prunelight.settings import (
    ExportSettings,
    PruneSettings,
    RunEvaluation,
    allocation_options_help,
    refresh_allocation_choices,
)
from prunelight.sources import one_value

log = logging.getLogger("prunelight")

SUBCOMMANDS = ("fit", "validate", "test", "predict")
# Errors a user can fix from the message alone: printed as one line, no traceback (PRUNELIGHT_DEBUG=1 shows it).
USER_ERRORS = (PrunelightError, ValueError, FileNotFoundError, OSError, FloatingPointError)


class PrunelightCLI(LightningCLI):
    """LightningCLI with the pruning job's sections and checks of the model and data before any work.

    Under DeepSpeed the cut model cannot stay in the engine that scored it: PruningCallback writes it
    and stops, and `after_fit` continues the recovery from it with a fresh Trainer and strategy.
    """

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        refresh_allocation_choices()  # rows registered since import are choices too
        parser.add_class_arguments(PruneSettings, "prune")
        # allocation_args is one mapping for every row: its help lists each row's own options (their dataclasses).
        args = parser._option_string_actions["--prune.allocation_args"]
        args.help = f"{args.help} {allocation_options_help()}"
        parser.add_class_arguments(RunEvaluation, "evaluation")
        parser.add_class_arguments(ExportSettings, "export")
        # The data's tokenizer is the model's: one value, so a GGUF folder + file name becomes the file's path.
        parser.link_arguments(("model.pretrained", "model.gguf_file"), "data.tokenizer", compute_fn=one_value)
        # The output folder is named once: Lightning's logs and checkpoints go inside it too.
        parser.link_arguments("export.out_dir", "trainer.default_root_dir")

    def instantiate_trainer(self, **kwargs) -> Trainer:
        evaluator = RunEvaluator(self._get(self.config_init, "evaluation"))
        export = self._get(self.config_init, "export")
        self.job_callbacks = [
            PruningCallback(self._get(self.config_init, "prune"), evaluator, export=export),
            ExportCallback(export, evaluator),
        ]
        trainer_config = {**self._get(self.config_init, "trainer", default={}), **kwargs}
        if trainer_config.get("logger") in (None, True) and importlib.util.find_spec("tensorboard") is None:
            # Lightning's own fallback, chosen here so it does not warn about tensorboardX on every run.
            trainer_config["logger"] = CSVLogger(save_dir=trainer_config.get("default_root_dir") or ".")
        return self._instantiate_trainer(trainer_config, list(self.job_callbacks))

    def _instantiate_trainer(self, config: dict, callbacks: list) -> Trainer:
        trainer = super()._instantiate_trainer(config, callbacks)
        # Atomic checkpoint files where the strategy writes through a CheckpointIO (DeepSpeed writes
        # its own sharded folders) and the user did not choose another plugin.
        strategy = trainer.strategy
        if uses_checkpoint_io(strategy) and type(strategy.checkpoint_io).__name__ == "TorchCheckpointIO":
            strategy.checkpoint_io = AtomicCheckpointIO()
        return trainer

    def before_fit(self) -> None:
        """Model, data and settings checked against each other before calibration data or weights load: the run
        plan, handed to the pruning callback (it re-checks nothing)."""
        config = self.model.check_pretrained()
        self.datamodule.check_sources()
        self.datamodule.check_context(getattr(config, "max_position_embeddings", None))
        export = self._get(self.config_init, "export")
        self.job_callbacks[0].run_plan = prepare_run(self._get(self.config_init, "prune"), export.shape, config,
                                                     run_facts(self.trainer, self.model, export))

    def after_fit(self) -> None:
        handoff = self.model.cut_state.handoff
        if handoff is None:
            return
        log.info("continuing recovery from %s in a fresh %s", handoff.folder,
                 type(self.trainer.strategy).__name__)
        # Same YAML, with the written pruned folder as the pretrained model; a new strategy object,
        # since the old one holds the engine (and optimizer state) of the uncut model.
        config = copy.deepcopy(self.config[self.subcommand])
        config.model.pretrained = handoff.folder
        config.model.gguf_file = None  # the written folder is a Hugging Face folder, whatever the source was
        fresh = self._parser(self.subcommand).instantiate_classes(config)
        model = fresh.model
        model.adopt_pruned(handoff.plan, record=self.model.record, dense=self.model.dense_pretrained)
        # The same callback objects carry on (PruningCallback is marked done); the config saver ran already.
        callbacks = [cb for cb in self.trainer.callbacks if not isinstance(cb, SaveConfigCallback)]
        self.model = model
        self.trainer = self._instantiate_trainer(
            {**self._get(fresh, "trainer", default={}), "callbacks": callbacks}, []
        )
        self.trainer.fit(model, datamodule=self.datamodule)


def cli_main(args: list[str] | None = None, run: bool = True):
    """Entry point; `args` lets tests call it in-process. `evaluate` goes to prunelight.evaluation.command, `sweep`
    to prunelight.sweep.command."""
    argv = sys.argv[1:] if args is None else list(args)
    # `--help` of every subcommand shows each settings field's docstring (the attribute docstrings under it).
    jsonargparse.set_parsing_settings(docstring_parse_attribute_docstrings=True)
    if argv and argv[0] == "sweep":
        from prunelight.sweep.command import sweep_main

        return sweep_main(argv[1:])
    if argv and argv[0] == "evaluate":
        from prunelight.evaluation.command import evaluate_main

        return evaluate_main(argv[1:])
    if not _env.offline_if_local(argv):
        _env.offline_if_unreachable()
    _env.deepspeed_logs_to_stderr()
    _env.quiet_lightning_tips()
    quiet = {"exit_on_error": False}  # parse errors raise, and main() prints them as one line
    return PrunelightCLI(
        PruneLM,
        PruneDataModule,
        args=args,
        run=run,
        save_config_kwargs={"overwrite": True},
        seed_everything_default=0,
        parser_kwargs={**quiet, **{cmd: dict(quiet) for cmd in SUBCOMMANDS}},
    )


def main(args: list[str] | None = None) -> int:
    """Console-script entry: 0 on success; a user error is one line on stderr and exit status 2."""
    setup_logging()
    try:
        cli_main(args)
    except USER_ERRORS as err:
        if os.environ.get("PRUNELIGHT_DEBUG"):
            raise
        print(f"prunelight: error: {one_line(err)}", file=sys.stderr)
        return 2
    except Exception as err:  # jsonargparse's ArgumentError is not a ValueError
        if type(err).__name__ != "ArgumentError" or os.environ.get("PRUNELIGHT_DEBUG"):
            raise
        print(f"prunelight: error: {one_line(err)}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
