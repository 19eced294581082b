"""Folder names inside a run's output folder, shared by the callbacks."""

FAST_DEV_RUN_DIR = "fast_dev_run"  # smoke tests write here, inside out_dir, never over a real run's results
