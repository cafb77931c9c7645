"""Run by test_data.py under `composer -n 2`: trains through benchmark.main and writes, per rank, the
sample ids of every batch that rank trained on to OUT/rank{N}.json, and how many process groups it made
to OUT/rank{N}.groups.

    composer -n 2 tests/record_samples.py OUT [benchmark.py flags]
"""

import json
import sys
from pathlib import Path

import torch.distributed
from composer.core import Callback
from composer.utils import dist

from runs import run
from settings import flags
from settings.config import resolve_config


class RecordSamples(Callback):
    def __init__(self):
        self.batches = []

    def after_dataloader(self, state, logger):
        self.batches.append(state.batch['sample_id'].tolist())


def counting_process_groups():
    made = []
    init = torch.distributed.init_process_group
    torch.distributed.init_process_group = lambda *args, **kwargs: made.append(1) or init(*args, **kwargs)
    return made


if __name__ == '__main__':
    out = Path(sys.argv[1])
    groups = counting_process_groups()
    record = RecordSamples()
    run.main(resolve_config(flags.parse_args(sys.argv[2:])), (record,))
    out.mkdir(parents=True, exist_ok=True)
    (out / f'rank{dist.get_global_rank()}.json').write_text(json.dumps(record.batches))
    (out / f'rank{dist.get_global_rank()}.groups').write_text(str(len(groups)))
