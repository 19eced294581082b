"""Process setup done by `prunelight`'s `main()` (never at import): offline mode for local runs, a fast hub check,
DeepSpeed's import-time logging kept off stdout, Lightning's advertising tips dropped."""

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


def go_offline() -> None:
    """Set HF_HUB_OFFLINE / HF_DATASETS_OFFLINE (unless the user set them) in the environment and loaded hub modules."""
    for var in OFFLINE_VARS:
        os.environ.setdefault(var, "1")
    # The hub libraries read these at import; update their constants if they are already loaded.
    hub = sys.modules.get("huggingface_hub.constants")
    if hub is not None and os.environ["HF_HUB_OFFLINE"] == "1":
        hub.HF_HUB_OFFLINE = True
    dsc = sys.modules.get("datasets.config")
    if dsc is not None and os.environ["HF_DATASETS_OFFLINE"] == "1":
        dsc.HF_DATASETS_OFFLINE = True


def _is_local_model(value: str) -> bool:
    """Whether a `model.pretrained` value names files on this machine (a folder, a GGUF file, a `pkg://` file)."""
    from prunelight.sources import local_path

    try:
        path = local_path(value, "model.pretrained")
    except Exception:  # a bad pkg:// value is reported by the run's own checks, with the option named
        return False
    return path is not None and path.exists()


def offline_if_local(argv: list[str]) -> bool:
    """Go offline when every model the command names is local (folder, GGUF file, package file): nothing needs the
    network."""
    paths = _pretrained_from_args(argv)
    if not paths or not all(_is_local_model(p) for p in paths):
        return False
    go_offline()
    return True


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the Hugging Face hub answers a TCP connection within `timeout` seconds."""
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants

    url = urlparse(constants.ENDPOINT)
    try:
        with socket.create_connection((url.hostname, url.port or 443), timeout=timeout):
            return True
    except OSError:
        return False


def offline_if_unreachable() -> bool:
    """Without network, go offline at once (cached files still load) instead of retrying each download for ~25 s."""
    if os.environ.get("HF_HUB_OFFLINE") == "1" or hub_reachable():
        return False
    go_offline()
    return True


def deepspeed_logs_to_stderr() -> None:
    """Import DeepSpeed (when installed) with stdout pointed at stderr.

    DeepSpeed's logger binds a handler to sys.stdout at import and warns there at once ("Setting
    accelerator to CPU"), which corrupts `--print_config > run.yaml`; bound to stderr it stays out of it.
    That one warning says nothing on a CPU run and is filtered out.
    """
    import contextlib
    import importlib.util
    import logging

    if "deepspeed" in sys.modules or importlib.util.find_spec("deepspeed") is None:
        return
    logging.getLogger("DeepSpeed").addFilter(lambda r: not str(r.msg).startswith("Setting accelerator to CPU"))
    try:
        with contextlib.redirect_stdout(sys.stderr):
            import deepspeed  # noqa: F401
    except Exception:  # a broken DeepSpeed install is reported by Lightning if the run asks for it
        pass


# Lightning's rank-zero info logger(s): whichever of these `rank_zero_info` writes to in this version.
_LIGHTNING_INFO_LOGGERS = ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero")


def _not_a_tip(record) -> bool:
    """False for Lightning's advertising lines ("💡 Tip: ... try installing litlogger / litmodels")."""
    return "Tip:" not in str(record.msg) or "pypi.org/project/lit" not in str(record.msg)


def quiet_lightning_tips() -> None:
    """Drop the two "💡 Tip: ... litlogger / litmodels" lines Lightning logs at the start of every run.

    What a run prints is prunelight's: the tips advertise optional cloud services and say nothing about the run.
    Every other Lightning message passes (the filter is added once per logger). Lightning's own warning that it
    calls torch's deprecated `LeafSpec` (in `lightning/pytorch/utilities/_pytree.py`, printed on every fit) is
    dropped too: it is about Lightning's code and asks nothing of the user.
    """
    import logging
    import warnings

    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)", category=Warning)

    for name in _LIGHTNING_INFO_LOGGERS:
        logger = logging.getLogger(name)
        if _not_a_tip not in logger.filters:
            logger.addFilter(_not_a_tip)
