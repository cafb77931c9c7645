"""Bytes to training samples: images decoded, Streaming's faults mended, the loader a signal may stop, and the sample
dataset a run writes on first use. The datasets themselves are `data.py`. Imports `settings/` and `guards/`."""
