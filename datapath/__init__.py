"""From files to batches: a dataset's location and index checked, images decoded, captions tokenized, Streaming's
faults mended, the loader a signal may stop, and precompute.py's work. The datasets themselves are `data.py`."""
