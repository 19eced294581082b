"""The `prunelight` command: LightningCLI over PruneLM and PruneDataModule (fit, validate, test)."""

from __future__ import annotations

import copy
import logging
import sys

from lightning.pytorch import Trainer
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, SaveConfigCallback

from prunelight import _env
from prunelight.checkpoint_io import AtomicCheckpointIO
from prunelight.data import PruneDataModule
from prunelight.distributed import uses_checkpoint_io
from prunelight.module import PruneLM

log = logging.getLogger(__name__)


class PrunelightCLI(LightningCLI):
    """LightningCLI with the tokenizer linked to the model and context length checked before work starts.

    Under DeepSpeed the cut model cannot stay in the engine that scored it: PruningCallback writes it
    and stops, and `after_fit` continues the recovery from it with a fresh Trainer and strategy.
    """

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.link_arguments("model.pretrained", "data.tokenizer")

    def _instantiate_trainer(self, config: dict, callbacks: list) -> Trainer:
        trainer = super()._instantiate_trainer(config, callbacks)
        # Atomic checkpoint files where the strategy writes through a CheckpointIO (DeepSpeed writes
        # its own sharded folders) and the user did not choose another plugin.
        strategy = trainer.strategy
        if uses_checkpoint_io(strategy) and type(strategy.checkpoint_io).__name__ == "TorchCheckpointIO":
            strategy.checkpoint_io = AtomicCheckpointIO()
        return trainer

    def after_fit(self) -> None:
        handoff = getattr(self.model, "handoff", None)
        if not handoff:
            return
        log.info(
            "continuing recovery from %s in a fresh %s",
            handoff["pretrained"], type(self.trainer.strategy).__name__,
        )
        # Same YAML, with the written pruned folder as the pretrained model; a new strategy object,
        # since the old one holds the engine (and optimizer state) of the uncut model.
        config = copy.deepcopy(self.config[self.subcommand])
        config.model.pretrained = handoff["pretrained"]
        fresh = self._parser(self.subcommand).instantiate_classes(config)
        model = fresh.model
        model.adopt_pruned(handoff["plan"], run_report=self.model.run_report)
        # The same callback objects carry on (PruningCallback is marked done); the config saver ran already.
        callbacks = [cb for cb in self.trainer.callbacks if not isinstance(cb, SaveConfigCallback)]
        self.model = model
        self.trainer = self._instantiate_trainer(
            {**self._get(fresh, "trainer", default={}), "callbacks": callbacks}, []
        )
        self.trainer.fit(model, datamodule=self.datamodule)


def cli_main(args: list[str] | None = None, run: bool = True):
    """Entry point; `args` lets tests call it in-process. `evaluate` goes to prunelight.evaluation.command."""
    argv = sys.argv[1:] if args is None else list(args)
    if argv and argv[0] == "evaluate":
        from prunelight.evaluation.command import evaluate_main

        return evaluate_main(argv[1:])
    _env.offline_if_local(argv)
    _env.deepspeed_logs_to_stderr()
    return PrunelightCLI(
        PruneLM,
        PruneDataModule,
        args=args,
        run=run,
        save_config_kwargs={"overwrite": True},
        seed_everything_default=0,
    )


def main() -> int:
    """Console-script entry: run the command and return 0 (the CLI object is not an exit status)."""
    cli_main()
    return 0


if __name__ == "__main__":
    sys.exit(main())
