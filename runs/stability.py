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

from settings.model_folder import T5_VOCAB_SIZE
from datapath.tokenizer import CaptionTokenizer, empty_caption_ids


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


def stability_algorithms(config) -> list[Algorithm]:
    algorithms = []
    if config.grad_clip_norm:
        algorithms.append(GradientClipping(clipping_type='norm', clipping_threshold=config.grad_clip_norm))
    if config.caption_dropout:
        inputs = config.caption_inputs
        # With a T5 encoder beside them, --tokenizer names T5's tokenizer and the CLIP columns use the built-in one.
        clip_tokenizer = None if inputs.uses_t5 else config.tokenizer
        empty = {
            column: empty_caption_ids(pad, length)
            if vocab_size == T5_VOCAB_SIZE
            else CaptionTokenizer(clip_tokenizer, pad)('')
            for column, pad, length, vocab_size in zip(
                inputs.id_columns, inputs.pad_ids, inputs.lengths, inputs.vocab_sizes, strict=True
            )
        }
        algorithms.append(CaptionDropout(config.caption_dropout, empty))
    return algorithms


def lr_scheduler(config):
    """The published constant learning rate, reached by a linear warmup from 0 over --lr_warmup when given."""
    if config.lr_warmup is None:
        return ConstantScheduler()
    return ConstantWithWarmupScheduler(t_warmup=config.lr_warmup)
