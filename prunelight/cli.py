"""The `prunelight` command: LightningCLI over PruneLM and PruneDataModule (fit, validate, test)."""

from __future__ import annotations

import sys

from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from prunelight import _env
from prunelight.checkpoint_io import AtomicCheckpointIO
from prunelight.data import PruneDataModule
from prunelight.module import PruneLM


class PrunelightCLI(LightningCLI):
    """LightningCLI with the tokenizer linked to the model and context length checked before work starts."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.link_arguments("model.pretrained", "data.tokenizer")


def cli_main(args: list[str] | None = None, run: bool = True):
    """Entry point; `args` lets tests call it in-process. `evaluate` goes to prunelight.evaluation.command."""
    argv = sys.argv[1:] if args is None else list(args)
    if argv and argv[0] == "evaluate":
        from prunelight.evaluation.command import evaluate_main

        return evaluate_main(argv[1:])
    _env.offline_if_local(argv)
    return PrunelightCLI(
        PruneLM,
        PruneDataModule,
        args=args,
        run=run,
        save_config_kwargs={"overwrite": True},
        trainer_defaults={"plugins": [AtomicCheckpointIO()]},
        seed_everything_default=0,
    )


if __name__ == "__main__":
    cli_main()
