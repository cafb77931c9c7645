"""The resolved configuration as a person reads it at a run's start: a few grouped lines of at most 120 characters,
each field as `name value`. Fields left at nothing (None, off, empty) are not printed; the results file
(--results_json) keeps every field as JSON."""

from settings.config import RunConfig

WIDTH = 120
INDENT = '    '

# Each field under the heading a reader looks for it; a field not named here is printed under 'other'.
GROUPS = {
    'model': (
        'model_name',
        'model_dir',
        'prediction_type',
        'tokenizer',
        'image_size',
        'precision',
        'attention',
        'compile',
        'fp8',
        'activation_checkpointing',
        'encoders_bf16',
    ),
    'recipe': ('run_recipe', 'recipe', 'channels_last', 'fused_adamw', 'low_precision_norm', 'pin_memory'),
    'batch': ('batch_size', 'world_size', 'device_batch_size', 'device_train_microbatch_size', 'fsdp'),
    'data': (
        'use_synth_data',
        'sample_data',
        'local',
        'remote',
        'precomputed_latents',
        'epoch_size',
        'dataset_identity',
        'num_workers',
        'caption_dropout',
    ),
    'training': (
        'max_duration',
        'num_batches',
        'seed',
        'lr_warmup',
        'grad_clip_norm',
        'use_ema',
        'ema_half_life',
        'ema_offload',
        'timestep_density',
        'logit_mean',
        'logit_std',
        'mode_scale',
        'loss_weighting',
        'precondition_outputs',
        'flux_guidance',
    ),
    'evaluation': (
        'eval_interval',
        'eval_local',
        'eval_remote',
        'sample_interval',
        'sample_dir',
        'sample_prompts',
        'sample_steps',
        'sample_scheduler',
        'guidance_scale',
    ),
    'saving': (
        'run_name',
        'save_folder',
        'save_interval',
        'save_num_checkpoints_to_keep',
        'autoresume',
        'trust_checkpoint',
        'export_pipeline',
        'export_ema_unet',
        'results_json',
        'wandb_project',
        'wandb_name',
        'profile',
    ),
}
# Said elsewhere in the start's lines, or a detail of another field.
UNPRINTED = ('cpu_threads', 'cpu_threads_given', 'sample_validation', 'fsdp_state_dict_type')
# Printed only where the field they qualify is set.
QUALIFYING = {
    'ema_half_life': 'use_ema',
    'ema_offload': 'use_ema',
    'sample_dir': 'sample_interval',
    'sample_prompts': 'sample_interval',
    'sample_steps': 'sample_interval',
    'sample_scheduler': 'sample_interval',
    'guidance_scale': 'sample_interval',
    'save_interval': 'save_folder',
    'save_num_checkpoints_to_keep': 'save_folder',
    'trust_checkpoint': 'autoresume',
}


def start_lines(config: RunConfig) -> list[str]:
    """What a run prints first: the notes of its flags' settling (defaults, threads, data), then its configuration."""
    return [*config.notes, *config_lines(config.as_dict())]


def config_lines(fields: dict) -> list[str]:
    """`fields`: RunConfig.as_dict(). The heading line, then one or more lines per group."""
    grouped = {name for names in GROUPS.values() for name in names}
    other = tuple(sorted(name for name in fields if name not in grouped and name not in UNPRINTED))
    where = f'every field in {fields["results_json"]}' if fields.get('results_json') else 'every field: --results_json'
    lines = [f'config ({where}):']
    for group, names in (*GROUPS.items(), ('other', other)):
        printed = [name for name in names if name in fields and is_set(fields[name])]
        items = [f'{name} {shown(fields[name])}' for name in printed if is_set(fields.get(QUALIFYING.get(name), 1))]
        if items:
            lines += wrapped(f'{INDENT}{group}: ', items)
    return lines


def is_set(value) -> bool:
    return value is not None and value is not False and value != [] and value != ''


def shown(value) -> str:
    """A value as a short text: a list of texts (the sample prompts) by its count when it would fill a line."""
    if isinstance(value, list):
        joined = '; '.join(map(str, value))
        return joined if len(joined) <= 60 else f'({len(value)} items)'
    return 'on' if value is True else str(value)


def wrapped(start: str, items: list[str]) -> list[str]:
    """The items after `start`, comma-separated, broken between items at WIDTH (an item longer than a line
    keeps a line of its own)."""
    lines, line = [], start
    for item in items:
        addition = item if line == start else f', {item}'
        if line != start and len(line) + len(addition) > WIDTH:
            lines.append(line + ',')
            line = INDENT * 2 + item
        else:
            line += addition
    return [*lines, line]
