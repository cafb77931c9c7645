"""Options that keep long runs stable, all off by default so the published run is unchanged: gradient clipping by
norm (Composer's GradientClipping), a linear learning-rate warmup into the published constant rate (Composer's
ConstantWithWarmupScheduler), and caption dropout, which trains on the empty caption with a given probability so
that the model also learns the unconditional prediction classifier-free guidance needs.
"""

import torch
from composer.algorithms import GradientClipping
from composer.core import Algorithm, Event, State
from composer.loggers import Logger
from composer.optim import ConstantScheduler, ConstantWithWarmupScheduler

from tokenizer import CaptionTokenizer


class CaptionDropout(Algorithm):
    """Replaces each caption of a batch by the empty one with probability `probability`, after the loader.

    The draws come from torch's global generator, whose state Composer's checkpoints save and restore, so a resumed
    run drops the same captions as an uninterrupted one."""

    def __init__(self, probability: float, empty_caption: torch.Tensor):
        self.probability = probability
        self.empty_caption = empty_caption  # the 77 token ids of ''

    def match(self, event: Event, state: State) -> bool:
        return event == Event.AFTER_DATALOADER and self.probability > 0

    def apply(self, event: Event, state: State, logger: Logger) -> None:
        input_ids = state.batch['input_ids']
        dropped = torch.rand(input_ids.shape[0]) < self.probability
        input_ids[dropped.to(input_ids.device)] = self.empty_caption.to(input_ids.device)


def stability_algorithms(config) -> list[Algorithm]:
    algorithms = []
    if config.grad_clip_norm:
        algorithms.append(GradientClipping(clipping_type='norm', clipping_threshold=config.grad_clip_norm))
    if config.caption_dropout:
        algorithms.append(CaptionDropout(config.caption_dropout, CaptionTokenizer(config.tokenizer)('')))
    return algorithms


def lr_scheduler(config):
    """The published constant learning rate, reached by a linear warmup from 0 over --lr_warmup when given."""
    if config.lr_warmup is None:
        return ConstantScheduler()
    return ConstantWithWarmupScheduler(t_warmup=config.lr_warmup)
