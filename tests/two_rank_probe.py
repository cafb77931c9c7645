"""Runs benchmark.main under a launcher and records, per rank, what the distributed tests check.

Writes $PROBE_DIR/rank{N}.json: the batches this rank trained (first batch index and, per batch, the
device batch size and a digest of each image), and a digest of its final UNet weights.
$PROBE_FAIL_RANK makes that rank raise at its second batch, to test that a failure ends the job.
"""

import hashlib
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from composer.core import Callback  # noqa: E402
from composer.utils import dist  # noqa: E402

from benchmark import main, parse_args  # noqa: E402


def digest(tensor) -> str:
    return hashlib.sha256(tensor.detach().cpu().contiguous().numpy().tobytes()).hexdigest()[:16]


class Probe(Callback):
    def __init__(self):
        self.first_batch = None
        self.batches = []

    def after_dataloader(self, state, logger):
        if self.first_batch is None:
            self.first_batch = int(state.timestamp.batch)
        if os.environ.get('PROBE_FAIL_RANK') == str(dist.get_global_rank()) and len(self.batches) == 1:
            raise RuntimeError('probe: simulated failure on this rank')
        self.batches.append([digest(image) for image in state.batch['image']])


if __name__ == '__main__':
    probe = Probe()
    trainer = main(parse_args(), callbacks=(probe,))
    unet = trainer.state.model.module.unet if hasattr(trainer.state.model, 'module') else trainer.state.model.unet
    weights = hashlib.sha256()
    for name, tensor in sorted(unet.state_dict().items()):
        weights.update(name.encode() + tensor.detach().cpu().numpy().tobytes())
    record = {'first_batch': probe.first_batch, 'batches': probe.batches, 'unet': weights.hexdigest(),
              'world_size': dist.get_world_size()}
    Path(os.environ['PROBE_DIR'], f'rank{dist.get_global_rank()}.json').write_text(json.dumps(record))
