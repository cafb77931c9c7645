"""The DataLoader of a job that a signal may stop (stopping.py): its workers leave a job-wide Ctrl-C or SIGTERM to
the main process, which handles it and shuts them down; and a stop that comes while it starts its workers waits
until they have started, as a loader stopped halfway through starting them prints PyTorch's traceback
(`'_MultiProcessingDataLoaderIter' object has no attribute '_workers'`) when it is collected."""

from torch.utils.data import DataLoader

from guards.stopping import quiet_loader_worker, stops_held


class StoppableDataLoader(DataLoader):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, worker_init_fn=quiet_loader_worker, **kwargs)

    def _get_iterator(self):
        with stops_held():
            return super()._get_iterator()
