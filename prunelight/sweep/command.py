"""`prunelight sweep --config sweep.yaml [--report-only]`: run (or join) a sweep, then write its tables and figures."""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from prunelight.atomic import atomic_write_text
from prunelight.sweep.settings import SweepSettings

log = logging.getLogger("prunelight")


def build_parser():
    """jsonargparse parser: the SweepSettings fields, `--config`, and `--report-only`."""
    from jsonargparse import ActionConfigFile, ArgumentParser

    parser = ArgumentParser(prog="prunelight sweep", exit_on_error=False,
                            description="Grid or Optuna search over run-config keys, resumable, reusing scores.")
    parser.add_argument("--config", action=ActionConfigFile, help="a sweep YAML (configs/sweeps/*.yaml)")
    parser.add_argument("--report_only", "--report-only", action="store_true",
                        help="write the tables and figures from the persisted trials and stop (no model needed)")
    parser.add_class_arguments(SweepSettings, None, instantiate=False)
    return parser


def parse(argv: list[str]) -> tuple[SweepSettings, bool]:
    """The settings and --report-only from the command line (a sweep YAML holds SweepSettings' fields)."""
    from dataclasses import fields

    cfg = build_parser().parse_args(argv).as_dict()
    settings = SweepSettings(**{f.name: cfg[f.name] for f in fields(SweepSettings) if f.name in cfg})
    return settings, bool(cfg.get("report_only"))


def write_outputs(results: dict[str, Any], out_dir: str | os.PathLike) -> list[Path]:
    """tables.md, tables.tex and figures/*.png from a results document."""
    from prunelight.sweep.figures import heatmaps, scatter
    from prunelight.sweep.tables import all_tables, to_latex, to_markdown

    out = Path(out_dir)
    tables = all_tables(results)
    figures = out / "figures"
    pngs = heatmaps(results, figures)
    sc = scatter(results, figures)
    pngs += [sc] if sc else []
    md = [f"# Sweep {results.get('study')} ({results.get('mode')}, {results['objective'].get('describe')})", ""]
    md += [to_markdown(tables)]
    if pngs:
        md += ["### Figures", ""] + [f"![{p.stem}](figures/{p.name})" for p in pngs] + [""]
    paths = [atomic_write_text(out / "tables.md", "\n".join(md)), atomic_write_text(out / "tables.tex",
                                                                                      to_latex(tables))]
    return paths + pngs


def load_results(settings: SweepSettings) -> dict[str, Any]:
    """The results document from the study's storage, else from results.json."""
    from prunelight.sweep.driver import RESULTS_FILE, write_results
    from prunelight.sweep.store import JOURNAL_FILE, open_study, results_document

    out = Path(settings.out_dir)
    if settings.storage is not None or (out / JOURNAL_FILE).exists():
        study = open_study(settings)
        write_results(study, settings)
        return results_document(study, settings)
    path = out / RESULTS_FILE
    if not path.exists():
        raise FileNotFoundError(f"sweep.out_dir={settings.out_dir!r} holds no study ({JOURNAL_FILE}) and no "
                                f"{RESULTS_FILE}: run the sweep first")
    return json.loads(path.read_text())


def sweep_main(argv: list[str], runner=None) -> int:
    """Run the sweep described by the command line (or only its outputs, with --report-only)."""
    from prunelight.console import setup_logging

    setup_logging()
    settings, report_only = parse(argv)
    if not report_only:
        from prunelight.sweep.driver import run_sweep, total_trials
        from prunelight.sweep.space import check_keys, check_values, resolved_config
        from prunelight.sweep.store import open_storage, shown_url

        if settings.storage is not None:  # a bad URL or an unreachable server: one line before any run config
            open_storage(settings)
            log.info("sweep: study %r in %s", settings.study_name, shown_url(settings.storage))
        config = resolved_config(settings.base)
        check_keys(settings.space, config, settings.base)
        check_values(settings.space, config)
        log.info("sweep: %s mode, %d trials, %s, %d worker(s), out_dir %s", settings.mode, total_trials(settings),
                 settings.objective.describe(), settings.workers, settings.out_dir)
        results = run_sweep(settings, config, runner)
    else:
        results = load_results(settings)
    paths = write_outputs(results, settings.out_dir)
    log.info("sweep: tables and figures written: %s", ", ".join(str(p) for p in paths))
    return 0


if __name__ == "__main__":
    sys.exit(sweep_main(sys.argv[1:]))
