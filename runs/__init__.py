"""A run's machinery: one run from settled flags to reported throughput, the Trainer assembled from a `RunConfig`,
evaluation, checkpoints, signals, progress, the exported pipeline, and the work of generate.py and precompute.py.
The top floor of the folders: imports every other, and `data.py` and `ema.py`."""
