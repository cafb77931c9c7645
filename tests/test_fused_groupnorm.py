"""fused_groupnorm.py: GroupNorm + SiLU as one custom op, checked against PyTorch's silu(group_norm(x)), forward and
backward, in both memory layouts; the op kept as one node by torch.compile; and its swap into the tiny UNet.

The Triton kernels run here through Triton's interpreter, in a subprocess started with TRITON_INTERPRET=1 (this file
run as a script): Triton reads the variable when @triton.jit decorates a kernel, that is when fused_groupnorm is
imported, and another test module of the same pytest process may have imported it before (kernels.py). In this
process the op takes its PyTorch path (a CPU without the interpreter), which the in-process tests check the same way.
"""

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from diffusers import UNet2DConditionModel
from diffusers.models.resnet import ResnetBlock2D

from models import fused_groupnorm, groupnorm_silu_kernels

REPO = Path(__file__).resolve().parent.parent
EPS = 1e-5
# fp32: the op's arithmetic is PyTorch's up to summation order. bf16: both sides computed in fp32 from the same bf16
# values and rounded once; Triton's interpreter truncates fp32 to bf16 where a GPU rounds to nearest (one ulp).
TOLERANCES = {torch.float32: {'rtol': 1e-5, 'atol': 1e-5}, torch.bfloat16: {'rtol': 1.6e-2, 'atol': 1e-5}}
# (shape, groups): batch 1 (a group's positions split across programs), groups of one channel, groups of three
# channels that straddle the kernels' channel blocks; 5x7 positions, a multiple of no block.
SHAPES = [((1, 6, 5, 7), 3), ((3, 6, 5, 7), 6), ((3, 12, 5, 7), 4)]
LAYOUTS = ['contiguous', 'channels_last', 'strided']


def make_input(shape, layout: str, dtype, device) -> torch.Tensor:
    """Activations with a mean far from zero (where one-pass variance cancels) in the layout asked for; 'strided':
    every other column of a wider tensor, neither layout, which the op reads as a contiguous copy."""
    generator = torch.Generator().manual_seed(0)
    wide = shape[:-1] + (2 * shape[-1],)
    x = torch.randn(wide if layout == 'strided' else shape, generator=generator) * 2 + 3
    x = x.to(device, dtype)
    if layout == 'strided':
        return x[..., ::2]
    return x.contiguous(memory_format=torch.channels_last if layout == 'channels_last' else torch.contiguous_format)


def check_against_pytorch(
    shape, num_groups, layout, dtype, weight_dtype=torch.float32, device='cpu', fp32_rtol=1e-5, sum_rtol=1e-5
):
    """The op's output and its gradients for x, weight and bias against silu(group_norm(...)) in fp32 on the same
    values; the output and x's gradient in x's dtype and (but for 'strided') memory format."""
    channels = shape[1]
    generator = torch.Generator().manual_seed(1)
    weight = (1 + 0.5 * torch.randn(channels, generator=generator)).to(device, weight_dtype).requires_grad_()
    bias = (0.5 * torch.randn(channels, generator=generator)).to(device, weight_dtype).requires_grad_()
    grad = torch.randn(shape, generator=generator).to(device, dtype)
    x = make_input(shape, layout, dtype, device).requires_grad_()

    out = fused_groupnorm.group_norm_silu(x, weight, bias, num_groups, EPS)
    # autograd.grad, not .backward(): a leaf's .grad is put in the leaf's layout whatever the op returned.
    x_grad, weight_grad, bias_grad = torch.autograd.grad(out, (x, weight, bias), grad)

    reference_inputs = [tensor.detach().float().requires_grad_() for tensor in (x, weight, bias)]
    reference_x, reference_weight, reference_bias = reference_inputs
    reference = F.silu(F.group_norm(reference_x, num_groups, reference_weight, reference_bias, EPS))
    reference.backward(grad.float())

    memory_format = torch.channels_last if layout == 'channels_last' else torch.contiguous_format
    case = f'{shape} in {num_groups} groups, {layout}, {dtype}, weights {weight_dtype}'
    assert out.dtype == dtype and x_grad.dtype == dtype, case
    assert out.is_contiguous(memory_format=memory_format), case
    assert x_grad.is_contiguous(memory_format=memory_format), case
    for name, actual, expected, rtol in [
        ('out', out, reference, fp32_rtol),
        ('x grad', x_grad, reference_x.grad, fp32_rtol),
        ('weight grad', weight_grad, reference_weight.grad, sum_rtol),
        ('bias grad', bias_grad, reference_bias.grad, sum_rtol),
    ]:
        tolerance = dict(TOLERANCES[actual.dtype])
        if actual.dtype == torch.float32:
            tolerance['rtol'] = rtol
        message = f'{case}, {name}'
        torch.testing.assert_close(
            actual, expected.to(actual.dtype), **tolerance, msg=lambda m, at=message: f'{at}: {m}'
        )


def tiny_unet() -> UNet2DConditionModel:
    torch.manual_seed(0)
    return UNet2DConditionModel.from_config(
        UNet2DConditionModel.load_config(str(REPO / 'configs/tiny'), subfolder='unet')
    )


def unet_inputs(batch: int, memory_format) -> tuple:
    generator = torch.Generator().manual_seed(2)
    sample = torch.randn(batch, 4, 8, 8, generator=generator).contiguous(memory_format=memory_format)
    timesteps = torch.tensor([10, 500, 990][:batch])
    text = torch.randn(batch, 3, 32, generator=generator)
    return sample, timesteps, text


def check_fused_unet_matches(batch: int, memory_format) -> None:
    """The swapped UNet's output and parameter gradients against the unswapped one's (fp32)."""
    unet = tiny_unet()
    fused = copy.deepcopy(unet)
    assert fused_groupnorm.use_fused_groupnorm_silu(fused) == 29
    inputs = unet_inputs(batch, memory_format)
    expected = unet(*inputs).sample
    actual = fused(*inputs).sample
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    grad = torch.randn(expected.shape, generator=torch.Generator().manual_seed(3))
    expected.backward(grad)
    actual.backward(grad)
    for (name, parameter), fused_parameter in zip(unet.named_parameters(), fused.parameters()):
        torch.testing.assert_close(fused_parameter.grad, parameter.grad, rtol=1e-4, atol=1e-5, msg=name)


# ------------------------------------------------------------------------------------- in this process


@pytest.mark.parametrize('layout', LAYOUTS)
def test_pytorch_path_matches_pytorch(layout):
    for shape, num_groups in SHAPES:
        check_against_pytorch(shape, num_groups, layout, torch.float32)
        check_against_pytorch(shape, num_groups, layout, torch.bfloat16)


def test_op_is_one_node_of_the_compiled_forward_and_backward():
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.utils import counters

    graphs = {}

    def recorder(name):
        def compiler(graph_module, example_inputs):
            graphs[name] = graph_module
            return make_boxed_func(graph_module.forward)

        return compiler

    def block(x, weight, bias):
        return fused_groupnorm.group_norm_silu(x * 2, weight, bias, 2, EPS) + 1

    torch._dynamo.reset()
    counters.clear()
    # aot_eager with the graphs kept to look at.
    compiled = torch.compile(
        block, backend=aot_autograd(fw_compiler=recorder('forward'), bw_compiler=recorder('backward'))
    )
    x = make_input((2, 4, 3, 5), 'channels_last', torch.float32, 'cpu').requires_grad_()
    weight = torch.ones(4, requires_grad=True)
    bias = torch.zeros(4, requires_grad=True)
    out = compiled(x, weight, bias)
    out.sum().backward()

    assert not counters['graph_break']
    assert hasattr(torch.ops.sd2, 'group_norm_silu') and hasattr(torch.ops.sd2, 'group_norm_silu_backward')
    for name, op in [
        ('forward', torch.ops.sd2.group_norm_silu.default),
        ('backward', torch.ops.sd2.group_norm_silu_backward.default),
    ]:
        targets = [node.target for node in graphs[name].graph.nodes if node.op == 'call_function']
        assert targets.count(op) == 1, (name, targets)
        assert not any('group_norm' in str(target) and target != op for target in targets), (name, targets)
    assert out.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(out, block(x, weight, bias))


def test_unet_swap_keeps_parameters_and_counts_the_pairs():
    unet = tiny_unet()
    state = {name: tensor.clone() for name, tensor in unet.state_dict().items()}
    parameters = list(unet.parameters())
    resnets = sum(type(module) is ResnetBlock2D for module in unet.modules())

    assert fused_groupnorm.use_fused_groupnorm_silu(unet) == 2 * resnets + 1 == 29  # two per block, and the head's
    assert fused_groupnorm.use_fused_groupnorm_silu(unet) == 0  # already swapped
    assert all(type(module) is not ResnetBlock2D for module in unet.modules())
    assert isinstance(unet.conv_norm_out, fused_groupnorm.GroupNormSiLU)
    assert isinstance(unet.conv_act, torch.nn.Identity)
    # The same Parameter objects (an optimizer built before keeps them), names and values.
    assert len(list(unet.parameters())) == len(parameters)
    assert all(after is before for after, before in zip(unet.parameters(), parameters))
    after = unet.state_dict()
    assert list(after) == list(state)
    assert all(torch.equal(after[name], tensor) for name, tensor in state.items())


def test_swapped_unet_matches_on_the_pytorch_path():
    check_fused_unet_matches(2, torch.contiguous_format)


# ------------------------------------------------------------------------------------- Triton's interpreter


def run_interpreted(check: str) -> None:
    """Runs one of this file's checks (below) in a subprocess under Triton's interpreter."""
    path = os.pathsep.join([str(REPO), os.environ.get('PYTHONPATH', '')])
    env = {**os.environ, 'TRITON_INTERPRET': '1', 'PYTHONPATH': path}
    run = subprocess.run(
        [sys.executable, __file__, check], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert f'{check}: ok' in run.stdout


@pytest.mark.slow
def test_triton_kernels_match_pytorch_in_the_interpreter():
    run_interpreted('interpreted_kernels_match_pytorch')


@pytest.mark.slow
def test_swapped_unet_matches_with_the_triton_kernels_in_the_interpreter():
    run_interpreted('interpreted_unet_matches')


@pytest.mark.slow
def test_a_tiny_training_run_keeps_its_losses_with_the_triton_kernels_in_the_interpreter():
    run_interpreted('interpreted_training_matches')


def test_the_fused_op_saves_host_launches_on_the_meta_device():
    """benchmarks/campaign_probes.py's launches row: the same step counted with and without --fused_groupnorm."""
    from benchmarks.campaign_probes import launches

    counted = launches('tiny', 32, 1)
    pairs = fused_groupnorm.use_fused_groupnorm_silu(tiny_unet())
    assert counted['ops'] - counted['ops_fused'] >= 2 * pairs  # at least the SiLU of each pair, each way


def triton_only() -> None:
    """Under the interpreter: the kernels run, not the PyTorch path."""
    assert fused_groupnorm.triton_available('cpu'), 'TRITON_INTERPRET=1 was not set before fused_groupnorm loaded'

    def refuse(*args):
        raise AssertionError('the PyTorch path ran instead of the Triton kernels')

    fused_groupnorm._torch_forward = fused_groupnorm._torch_backward = refuse


def interpreted_kernels_match_pytorch() -> None:
    triton_only()
    groupnorm_silu_kernels.INTERPRETER_TILE = 64  # several blocks and splits per group even on these tiny shapes
    (shape, num_groups), *_ = SHAPES
    assert (
        groupnorm_silu_kernels.launch_plan(make_input(shape, 'contiguous', torch.float32, 'cpu'), num_groups)[
            'num_splits'
        ]
        > 1
    )
    # The interpreter takes about half a second a case: every shape in fp32, bf16 on the last (its channel blocks
    # straddle groups), once with bf16 parameters too, and the strided input once.
    for shape, num_groups in SHAPES:
        for layout in ['contiguous', 'channels_last']:
            check_against_pytorch(shape, num_groups, layout, torch.float32)
    shape, num_groups = SHAPES[-1]
    for layout in ['contiguous', 'channels_last']:
        check_against_pytorch(shape, num_groups, layout, torch.bfloat16)
    check_against_pytorch(shape, num_groups, 'channels_last', torch.bfloat16, weight_dtype=torch.bfloat16)
    check_against_pytorch(shape, num_groups, 'strided', torch.float32)


def interpreted_training_matches() -> None:
    """Two batches of the tiny model with and without --fused_groupnorm: the same losses, within float rounding."""
    from composer.core import Callback

    from runs.run import main
    from settings.config import resolve_config
    from settings.flags import parse_args

    triton_only()

    class Losses(Callback):
        def __init__(self):
            self.values = []

        def after_loss(self, state, logger):
            self.values.append(state.loss.item())

    flags = ['--model_name', 'tiny', '--use_synth_data', '--image_size', '32', '--batch_size', '2']
    flags += ['--max_duration', '2ba']
    plain, fused = Losses(), Losses()
    main(resolve_config(parse_args(flags)), (plain,))
    main(resolve_config(parse_args([*flags, '--fused_groupnorm'])), (fused,))
    assert len(fused.values) == 2, fused.values
    torch.testing.assert_close(fused.values, plain.values, rtol=1e-4, atol=1e-6)


def interpreted_unet_matches() -> None:
    triton_only()
    # Channels-last: its 1x1 level is contiguous too, so both of the kernels' layouts run.
    check_fused_unet_matches(1, torch.channels_last)


# ------------------------------------------------------------------------------------- a GPU


@pytest.mark.gpu
@pytest.mark.parametrize('layout', ['contiguous', 'channels_last'])
def test_kernels_match_pytorch_on_a_gpu(layout):
    assert fused_groupnorm.triton_available('cuda')
    # SD2's widths and GroupNorm's 32 groups at a 256-pixel image's latent sizes, bf16 activations and fp32
    # parameters as under amp_bf16; and fp32. Sums over thousands of positions: a looser rtol for weight and bias.
    for shape in [(4, 320, 32, 32), (2, 640, 16, 16), (4, 1280, 8, 8), (3, 96, 5, 7)]:
        check_against_pytorch(shape, 32, layout, torch.bfloat16, device='cuda', sum_rtol=1e-3)
        check_against_pytorch(shape, 32, layout, torch.float32, device='cuda', fp32_rtol=1e-4, sum_rtol=1e-3)


@pytest.mark.gpu
def test_op_runs_in_an_inductor_graph_on_a_gpu():
    x = make_input((2, 320, 16, 16), 'channels_last', torch.bfloat16, 'cuda').requires_grad_()
    weight = torch.randn(320, device='cuda', requires_grad=True)
    bias = torch.randn(320, device='cuda', requires_grad=True)

    def block(x, weight, bias):
        return fused_groupnorm.group_norm_silu(x * 0.5, weight, bias, 32, EPS) + 1

    torch._dynamo.reset()
    compiled = torch.compile(block)(x, weight, bias)  # Inductor
    compiled.float().square().sum().backward()
    compiled_grads = [tensor.grad.clone() for tensor in (x, weight, bias)]
    for tensor in (x, weight, bias):
        tensor.grad = None
    eager = block(x, weight, bias)
    eager.float().square().sum().backward()
    assert compiled.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(compiled, eager)
    for actual, tensor in zip(compiled_grads, (x, weight, bias)):
        torch.testing.assert_close(actual, tensor.grad, rtol=2e-2, atol=1e-2)


if __name__ == '__main__':
    # A subprocess of the interpreter tests above, TRITON_INTERPRET=1 set before fused_groupnorm was imported.
    check = sys.argv[1]
    globals()[check]()
    print(f'{check}: ok')
