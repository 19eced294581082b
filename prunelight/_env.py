"""Turn on Hugging Face offline mode before the hub libraries read it, when the run uses local paths."""

from __future__ import annotations

import os
import sys
from pathlib import Path

OFFLINE_VARS = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")


def _pretrained_from_args(argv: list[str]) -> list[str]:
    """Candidate `model.pretrained` values named by --config files or --model.pretrained on the command line."""
    found: list[str] = []
    for i, arg in enumerate(argv):
        value = None
        if arg.startswith("--model.pretrained="):
            found.append(arg.split("=", 1)[1])
        elif arg == "--model.pretrained" and i + 1 < len(argv):
            found.append(argv[i + 1])
        elif arg.startswith("--config="):
            value = arg.split("=", 1)[1]
        elif arg in ("--config", "-c") and i + 1 < len(argv):
            value = argv[i + 1]
        if value and Path(value).is_file():
            try:
                import yaml

                cfg = yaml.safe_load(Path(value).read_text()) or {}
                pretrained = (cfg.get("model") or {}).get("pretrained")
                if pretrained:
                    found.append(str(pretrained))
            except Exception:  # a config we cannot read here is reported by the CLI itself
                pass
    return found


def offline_if_local(argv: list[str] | None = None) -> bool:
    """Set HF_HUB_OFFLINE / HF_DATASETS_OFFLINE when the model is a local folder (unless the user set them)."""
    argv = sys.argv[1:] if argv is None else argv
    paths = _pretrained_from_args(argv)
    if not paths or not all(Path(p).expanduser().is_dir() for p in paths):
        return False
    for var in OFFLINE_VARS:
        os.environ.setdefault(var, "1")
    # The hub libraries read these at import; update their constants if they are already loaded.
    hub = sys.modules.get("huggingface_hub.constants")
    if hub is not None and os.environ["HF_HUB_OFFLINE"] == "1":
        hub.HF_HUB_OFFLINE = True
    dsc = sys.modules.get("datasets.config")
    if dsc is not None and os.environ["HF_DATASETS_OFFLINE"] == "1":
        dsc.HF_DATASETS_OFFLINE = True
    return True


def running_as_cli() -> bool:
    """True for the `prunelight` console script and `python -m prunelight` (also under torchrun)."""
    prog = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else ""
    return prog == "prunelight" or sys.argv[0].endswith(os.path.join("prunelight", "__main__.py"))


def deepspeed_logs_to_stderr() -> None:
    """Import DeepSpeed (when installed) with stdout pointed at stderr.

    DeepSpeed's logger binds a handler to sys.stdout at import and warns there at once ("Setting
    accelerator to CPU"), which corrupts `--print_config > run.yaml`; bound to stderr it stays out of it.
    """
    import contextlib
    import importlib.util

    if "deepspeed" in sys.modules or importlib.util.find_spec("deepspeed") is None:
        return
    try:
        with contextlib.redirect_stdout(sys.stderr):
            import deepspeed  # noqa: F401
    except Exception:  # a broken DeepSpeed install is reported by Lightning if the run asks for it
        pass
