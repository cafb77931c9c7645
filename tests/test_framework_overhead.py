"""benchmarks/framework_overhead.py: Composer's Trainer and a bare loop timed step by step, phase by phase."""

import torch
from conftest import TINY

from benchmarks import framework_overhead, interleaved_loops
from settings.config import resolve_config
from settings.flags import parse_args


def test_framework_overhead_times_every_phase_of_both_loops_and_composers_host_work():
    args = resolve_config(
        parse_args(
            TINY
            + [
                '--image_size',
                '32',
                '--batch_size',
                '4',
                '--max_duration',
                '7ba',
                '--precomputed_latents',
                '--fused_adamw',
                '--channels_last',
            ]
        )
    )
    originals = {part: vars(owner)[name] for part, (owner, name) in interleaved_loops.COMPOSER_PARTS.items()}
    bare, composer, parts = interleaved_loops.interleaved_round(args, warmup=2)
    # 7 Composer steps: the first precedes any bare step; of the 6 after bare steps, 2 are warm-up.
    assert len(bare) == len(composer) == len(parts) == 4
    for step in bare + composer:
        assert list(step) == list(interleaved_loops.PHASES) and all(seconds > 0 for seconds in step.values())
    assert framework_overhead.median_ms(composer, 'forward') < framework_overhead.median_ms(composer)
    for step_parts in parts:  # each part runs every batch
        assert list(step_parts) == list(interleaved_loops.COMPOSER_PARTS)
        assert all(seconds > 0 for seconds in step_parts.values())
    # The bare step runs inside Composer's BATCH_END dispatch and is not counted as Composer's events.
    assert framework_overhead.median_ms(parts) < framework_overhead.median_ms(composer) / 2
    assert all(vars(owner)[name] is originals[part] for part, (owner, name) in interleaved_loops.COMPOSER_PARTS.items())


def test_framework_overhead_bare_loop_mirrors_channels_last():
    for flags, expected in (([], False), (['--channels_last'], True)):
        args = resolve_config(parse_args(TINY + ['--precomputed_latents', *flags]))
        model = interleaved_loops.InterleavedBareLoop(args, interleaved_loops.ComposerHostTimer()).model
        conv = model.unet.conv_in.weight
        assert conv.is_contiguous(memory_format=torch.channels_last) is expected
