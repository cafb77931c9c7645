"""GroupNorm followed by SiLU as one custom op, forward and backward, in Triton; and the swap that puts it into a
Diffusers UNet (--fused_groupnorm).

Every ResNet block of the SD UNets runs GroupNorm then SiLU twice, and the UNet's output head once more. Eager
PyTorch runs each pair as two kernels with the normalized activations written and read back in between, and its
CUDA GroupNorm returns NCHW for a channels-last input (pytorch#111824), so a channels-last UNet pays a layout copy
around every GroupNorm. NVIDIA's MLPerf Stable Diffusion submissions fuse GroupNorm + SiLU in NHWC. Here:

- `group_norm_silu(x, weight, bias, num_groups, eps)`: silu(group_norm(x)) of an (N, C, *) tensor, contiguous or
  (4-D) channels-last; the output keeps the input's memory format and dtype; the statistics are fp32 whatever the
  input's dtype (bf16, fp16, fp32). It is the custom op `torch.ops.sd2.group_norm_silu`, with a fake (meta) kernel
  and an autograd formula whose backward is the custom op `torch.ops.sd2.group_norm_silu_backward`, so that
  torch.compile keeps each as one node of its forward and backward graphs. Like aten's native_group_norm, the op
  returns (out, mean, rstd), the statistics saved for the backward; `group_norm_silu` returns out.
- `use_fused_groupnorm_silu(unet)`: swaps the op into a built UNet wherever GroupNorm is directly followed by SiLU;
  the parameters (names, values, the Parameter objects themselves) are untouched.
- `triton_available(device)`: whether the op runs its Triton kernels for tensors on that device.

Where it runs: the Triton kernels on CUDA tensors; on CPU tensors too when TRITON_INTERPRET=1 was set before this
module was imported (Triton reads it when @triton.jit decorates the kernels, at import): Triton's interpreter, slow,
for tests. Everywhere else (CPU without the interpreter, or no triton installed) the op runs the same math in plain
PyTorch (fp32, then the input's dtype), so a swapped UNet still runs on a CPU; the --fused_groupnorm flag itself is
refused where triton_available is false (device_checks.py), since that would measure nothing.

Under autocast (amp_bf16) the op runs in its input's dtype, as a custom op does: a bf16 activation gives a bf16
output, where eager autocast runs GroupNorm (and then SiLU) in fp32; the convolution that follows casts to bf16
either way. The backward is not itself differentiable (no double backward).

The Triton kernels and their launch plan are in groupnorm_silu_kernels.py. Nothing here is on by default.
"""

import contextlib
import math

import torch
import torch.nn.functional as F
from diffusers.models.resnet import ResnetBlock2D
from torch import nn

from models.groupnorm_silu_kernels import empty_output_like, triton_available, triton_backward, triton_forward

# ------------------------------------------------------------------------------------- the PyTorch path


def _torch_forward(x, weight, bias, num_groups, eps):
    """The same result in plain PyTorch, fp32 throughout (silu(group_norm(x)) plus the statistics it used): where
    Triton cannot run, a CPU without the interpreter or no triton installed."""
    n, c = x.shape[:2]
    group_size = math.prod(x.shape[1:]) // num_groups
    grouped = x.float().reshape(n, num_groups, group_size)
    variance, mean = torch.var_mean(grouped, dim=-1, correction=0)
    rstd = torch.rsqrt(variance + eps)
    xhat = ((grouped - mean[..., None]) * rstd[..., None]).reshape(x.shape)
    affine_shape = (1, c) + (1,) * (x.dim() - 2)
    z = xhat * weight.float().reshape(affine_shape) + bias.float().reshape(affine_shape)
    return empty_output_like(x).copy_(F.silu(z)), mean, rstd


def _torch_backward(grad_out, x, weight, bias, mean, rstd, num_groups):
    n, c = x.shape[:2]
    group_size = math.prod(x.shape[1:]) // num_groups
    affine_shape = (1, c) + (1,) * (x.dim() - 2)
    xhat = (x.float().reshape(n, num_groups, group_size) - mean[..., None]) * rstd[..., None]
    z = xhat.reshape(x.shape) * weight.float().reshape(affine_shape) + bias.float().reshape(affine_shape)
    sigmoid = torch.sigmoid(z)
    dz = grad_out.float() * sigmoid * (1 + z * (1 - sigmoid))
    reduced_dims = [0, *range(2, x.dim())]
    grad_bias = dz.sum(reduced_dims)
    grad_weight = (dz * xhat.reshape(x.shape)).sum(reduced_dims)
    dxhat = (dz * weight.float().reshape(affine_shape)).reshape(n, num_groups, group_size)
    grad_x = rstd[..., None] * (dxhat - dxhat.mean(-1, keepdim=True) - xhat * (dxhat * xhat).mean(-1, keepdim=True))
    return (
        empty_output_like(x).copy_(grad_x.reshape(x.shape)),
        grad_weight.to(weight.dtype),
        grad_bias.to(bias.dtype),
    )


# ------------------------------------------------------------------------------------- the custom ops


def _check_arguments(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, num_groups: int) -> None:
    if x.dim() < 2 or x.shape[1] % num_groups:
        raise ValueError(
            f'group_norm_silu: x of shape {tuple(x.shape)} is not (N, C, ...) with C in {num_groups} groups'
        )
    if weight.shape != (x.shape[1],) or bias.shape != (x.shape[1],):
        raise ValueError(f'group_norm_silu: weight and bias of {x.shape[1]} channels, not {weight.shape}, {bias.shape}')


def _runs_triton(x: torch.Tensor) -> bool:
    return triton_available(x.device) and x.numel() > 0


def _on_device(x: torch.Tensor) -> contextlib.AbstractContextManager:
    # Triton launches on the current CUDA device's current stream: x's device.
    return torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()


@torch.library.custom_op('sd2::group_norm_silu', mutates_args=())
def _group_norm_silu_op(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, num_groups: int, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _check_arguments(x, weight, bias, num_groups)
    if not _runs_triton(x):
        return _torch_forward(x, weight, bias, num_groups, eps)
    with _on_device(x):
        return triton_forward(x, weight, bias, num_groups, eps)


@_group_norm_silu_op.register_fake
def _(x, weight, bias, num_groups, eps):
    _check_arguments(x, weight, bias, num_groups)
    stats_shape = (x.shape[0], num_groups)
    return (
        empty_output_like(x),
        x.new_empty(stats_shape, dtype=torch.float32),
        x.new_empty(stats_shape, dtype=torch.float32),
    )


@torch.library.custom_op('sd2::group_norm_silu_backward', mutates_args=())
def _group_norm_silu_backward_op(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    num_groups: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if not _runs_triton(x):
        return _torch_backward(grad_out, x, weight, bias, mean, rstd, num_groups)
    with _on_device(x):
        return triton_backward(grad_out, x, weight, bias, mean, rstd, num_groups)


@_group_norm_silu_backward_op.register_fake
def _(grad_out, x, weight, bias, mean, rstd, num_groups):
    return empty_output_like(x), torch.empty_like(weight), torch.empty_like(bias)


def _setup_context(ctx, inputs, output):
    x, weight, bias, num_groups, _ = inputs
    _, mean, rstd = output
    ctx.save_for_backward(x, weight, bias, mean, rstd)
    ctx.num_groups = num_groups
    ctx.mark_non_differentiable(mean, rstd)


def _backward(ctx, grad_out, _grad_mean, _grad_rstd):
    x, weight, bias, mean, rstd = ctx.saved_tensors
    grad_x, grad_weight, grad_bias = torch.ops.sd2.group_norm_silu_backward(
        grad_out, x, weight, bias, mean, rstd, ctx.num_groups
    )
    return grad_x, grad_weight, grad_bias, None, None


torch.library.register_autograd('sd2::group_norm_silu', _backward, setup_context=_setup_context)


def group_norm_silu(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, num_groups: int, eps: float = 1e-5
) -> torch.Tensor:
    """silu(group_norm(x, num_groups, weight, bias, eps)) in x's dtype and memory format, fp32 statistics."""
    return torch.ops.sd2.group_norm_silu(x, weight, bias, num_groups, eps)[0]


# ------------------------------------------------------------------------------------- the UNet swap


class GroupNormSiLU(nn.GroupNorm):
    """A GroupNorm that applies SiLU after itself, as the fused op: what a GroupNorm module directly followed by a
    SiLU module becomes (its class swapped, so its parameters stay the same objects)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return group_norm_silu(x, self.weight, self.bias, self.num_groups, self.eps)


class FusedResnetBlock2D(ResnetBlock2D):
    """Diffusers' ResnetBlock2D with norm1 -> nonlinearity and norm2 -> nonlinearity as the fused op.

    The block's one `nonlinearity` module also activates the time embedding, so it cannot become an Identity, and
    norm1/norm2 cannot become GroupNormSiLU modules under Diffusers' forward (which would apply SiLU twice). This
    forward is Diffusers' for the blocks it is given to (time_embedding_norm 'default', a SiLU nonlinearity;
    upsampling, downsampling and the shortcut as they are), calling the op on norm1's and norm2's own parameters;
    norm1 and norm2 stay plain GroupNorms, so the original forward still holds for a call it does not cover."""

    def forward(self, input_tensor: torch.Tensor, temb: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if args or kwargs.get('scale') is not None:
            return super().forward(input_tensor, temb, *args, **kwargs)  # Diffusers' deprecation warning
        hidden_states = group_norm_silu(
            input_tensor, self.norm1.weight, self.norm1.bias, self.norm1.num_groups, self.norm1.eps
        )
        if self.upsample is not None:
            # As Diffusers: upsample_nearest_nhwc fails with large batch sizes (diffusers#984).
            if hidden_states.shape[0] >= 64:
                input_tensor = input_tensor.contiguous()
                hidden_states = hidden_states.contiguous()
            input_tensor = self.upsample(input_tensor)
            hidden_states = self.upsample(hidden_states)
        elif self.downsample is not None:
            input_tensor = self.downsample(input_tensor)
            hidden_states = self.downsample(hidden_states)
        hidden_states = self.conv1(hidden_states)
        if self.time_emb_proj is not None:
            if not self.skip_time_act:
                temb = self.nonlinearity(temb)
            temb = self.time_emb_proj(temb)[:, :, None, None]
        if temb is not None:
            hidden_states = hidden_states + temb
        hidden_states = group_norm_silu(
            hidden_states, self.norm2.weight, self.norm2.bias, self.norm2.num_groups, self.norm2.eps
        )
        hidden_states = self.dropout(hidden_states)
        hidden_states = self.conv2(hidden_states)
        if self.conv_shortcut is not None:
            input_tensor = self.conv_shortcut(input_tensor.contiguous())
        return (input_tensor + hidden_states) / self.output_scale_factor


def _is_affine_group_norm(module: nn.Module) -> bool:
    return type(module) is nn.GroupNorm and module.affine


def use_fused_groupnorm_silu(unet: nn.Module) -> int:
    """Swaps the fused op into a built UNet (or any module holding one) wherever GroupNorm is directly followed by
    SiLU: each ResnetBlock2D's two pairs (blocks of time_embedding_norm 'default' with a SiLU nonlinearity; others
    left as they are) and the output head's conv_norm_out + conv_act. Modules change class in place, so parameter
    names, values and objects stay as they were (checkpoints, EMA and an optimizer already built keep working).
    Returns the number of GroupNorm + SiLU pairs fused (none on a second call)."""
    fused = 0
    for module in list(unet.modules()):
        if (
            type(module) is ResnetBlock2D
            and module.time_embedding_norm == 'default'
            and isinstance(module.nonlinearity, nn.SiLU)
            and _is_affine_group_norm(module.norm1)
            and _is_affine_group_norm(module.norm2)
        ):
            module.__class__ = FusedResnetBlock2D
            fused += 2
        norm, activation = getattr(module, 'conv_norm_out', None), getattr(module, 'conv_act', None)
        if _is_affine_group_norm(norm) and isinstance(activation, nn.SiLU):
            norm.__class__ = GroupNormSiLU
            module.conv_act = nn.Identity()
            fused += 1
    return fused
