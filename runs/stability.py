"""Options that keep long runs stable, all off by default for the UNets so the published run is unchanged: gradient
clipping by norm (Composer's GradientClipping), and caption dropout, which trains on the empty caption with a given
probability so that the model also learns the unconditional prediction classifier-free guidance needs. (--lr_warmup,
a learning-rate schedule, is built beside the optimizer: training.build_lr_schedule.)
"""

import torch
from composer.algorithms import GradientClipping
from composer.core import Algorithm, Event, State
from composer.loggers import Logger

from settings.run_sections import ObjectiveSection


class CaptionDropout(Algorithm):
    """Replaces each caption of a batch by the empty one with probability `probability`, after the loader: in every
    caption column (SDXL has one per text encoder), each padded as its encoder was trained.

    The draws come from torch's global generator, whose state Composer's checkpoints save and restore, so a resumed
    run drops the same captions as an uninterrupted one."""

    def __init__(self, probability: float, empty_captions: dict[str, torch.Tensor]):
        self.probability = probability
        self.empty_captions = empty_captions  # caption column -> the token ids of '', padded to the column's length

    def match(self, event: Event, state: State) -> bool:
        return event == Event.AFTER_DATALOADER and self.probability > 0

    def apply(self, event: Event, state: State, logger: Logger) -> None:
        dropped = torch.rand(state.batch['input_ids'].shape[0]) < self.probability
        for column, empty in self.empty_captions.items():  # the same captions dropped in every column
            ids = state.batch[column]
            ids[dropped.to(ids.device)] = empty.to(ids.device)


def stability_algorithms(objective: ObjectiveSection, dataset) -> list[Algorithm]:
    """Gradient clipping and caption dropout as the run's objective asks; the empty caption is the training
    dataset's own (data.py's `empty_caption_ids`: its tokenizers' ids of '')."""
    algorithms = []
    if objective.grad_clip_norm:
        algorithms.append(GradientClipping(clipping_type='norm', clipping_threshold=objective.grad_clip_norm))
    if objective.caption_dropout:
        algorithms.append(CaptionDropout(objective.caption_dropout, dataset.empty_caption_ids()))
    return algorithms
