"""The GPU campaign's probes on a CPU: the correctness checks' verdicts (a NaN or a large error never passes; the
fp8 check runs with torchao's casts emulated) and the transformers' blocks compiled once per class."""

import math

import pytest
import torch

from benchmarks import campaign_probes
from models.stable_diffusion import build_model
from settings.model_folder import resolve_model_dir


def test_a_check_passes_within_its_bound_and_never_on_a_nan():
    reference = torch.randn(64, dtype=torch.float64)
    assert campaign_probes.relative_error(reference, reference) == 0
    assert campaign_probes.verdict(campaign_probes.relative_error(reference * 1.001, reference), 1e-2)['passed']
    assert not campaign_probes.verdict(campaign_probes.relative_error(reference * 1.1, reference), 1e-2)['passed']
    poisoned = reference.clone()
    poisoned[3] = math.nan
    assert not campaign_probes.verdict(campaign_probes.relative_error(poisoned, reference), 1e-2)['passed']


def test_the_checks_on_a_cpu_run_fp8_emulated_and_skip_the_cuda_kernels():
    checks = campaign_probes.checks()
    assert checks['fp8']['passed'] and checks['fp8']['error'] < checks['fp8']['bound']
    assert checks['attention_cudnn'] == {'skipped': 'cuDNN attention runs on CUDA GPUs only'}
    assert checks['fused_groupnorm'] == {'skipped': 'no Triton kernels on this device'}


@pytest.mark.parametrize(
    'name, blocks',
    [('tiny-flux-schnell', {'FluxTransformerBlock', 'FluxSingleTransformerBlock'}), ('tiny-pixart-sigma', None)],
)
def test_a_transformers_repeated_blocks_are_compiled_not_the_whole_model(name, blocks):
    """Flux declares its repeated blocks (Diffusers' compile_repeated_blocks); PixArt does not, and each block of its
    block list is compiled. Either way the model itself stays uncompiled."""
    denoiser = build_model(resolve_model_dir(name), precomputed=True).denoiser
    assert (set(denoiser._repeated_blocks) or None) == blocks
    compiled = campaign_probes.compile_blocks(denoiser)
    wrapped = [module for module in denoiser.modules() if getattr(module, '_compiled_call_impl', None) is not None]
    assert compiled == len(wrapped) > 0
    assert denoiser not in wrapped
    if blocks is None:
        assert all(module in denoiser.transformer_blocks for module in wrapped)
    else:
        assert {type(module).__name__ for module in wrapped} == blocks
