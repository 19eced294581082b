"""`prunelight sweep`: grid and Optuna searches over run-config keys, resumable, reusing calibration scores.

One module per job: `settings` (SweepSettings), `space` (the search space, checked against the run config),
`store` (Optuna storage, trial records, heartbeats), `runner` (one trial as a `prunelight fit` subprocess),
`cache` (calibration-score cache), `driver` (the worker loop), `tables` and `figures` (the outputs),
`command` (the command line). Importing this package does no work.
"""
