"""The Triton kernels of fused_groupnorm.py's GroupNorm + SiLU, forward and backward, in both memory layouts, and
their launch plan: `triton_forward` and `triton_backward` take and return what the custom ops do; `triton_available`
says whether they run for a device's tensors (CUDA; a CPU when TRITON_INTERPRET=1 was set before this module was
imported, as Triton reads it when @triton.jit decorates a kernel: the interpreter, slow, for tests).

Kernels, each reading the activations once: forward, the per-group statistics (each group's spatial extent split
across programs when there are few groups, the partial sums merged by a small kernel), then normalize + SiLU;
backward, the per-channel sums of the SiLU-and-affine gradient (the weight and bias gradients and the two group
means the input gradient needs), then the input gradient. Block sizes are a first guess, not tuned: speed is for
the GPU campaign to measure.
"""

import functools
import math

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only torch wheels come without it: the PyTorch path only
    triton = None

# Elements per program's tile. The interpreter runs programs one after another, each block op in numpy: there the
# fewer programs the faster, and the kernel tests make its tile small so that tiny shapes run the loops, the splits
# and the masks.
GPU_TILE = 2048
INTERPRETER_TILE = 1024
# Programs wanted per SM before the per-group kernels split a group's spatial extent.
PROGRAMS_PER_SM = 4

if triton is not None:

    @triton.jit
    def _group_split(HW, num_groups, hw_per_split, CHANNELS_PER_GROUP: tl.constexpr, BLOCK_CG: tl.constexpr):
        """The part of one sample's group a program of the per-group kernels works on, one program per (sample,
        group, split of the spatial extent): its row (sample * num_groups + group), split, sample, group, the group's
        channels with their mask, and the positions [hw_start, hw_end) of its split."""
        row = tl.program_id(0)
        split = tl.program_id(1)
        channel_index = tl.arange(0, BLOCK_CG)
        channel_mask = channel_index < CHANNELS_PER_GROUP
        hw_start = split * hw_per_split
        hw_end = tl.minimum(hw_start + hw_per_split, HW)
        return row, split, row // num_groups, row % num_groups, channel_index, channel_mask, hw_start, hw_end

    @triton.jit
    def _group_stats_kernel(
        x_ptr,
        partial_ptr,
        partial_plane,
        HW,
        stride_n,
        stride_c,
        stride_hw,
        num_groups,
        hw_per_split,
        num_splits,
        CHANNELS_PER_GROUP: tl.constexpr,
        BLOCK_CG: tl.constexpr,
        BLOCK_HW: tl.constexpr,
    ):
        """One program per (sample, group, split of the spatial extent): count, mean and M2 (sum of squared
        deviations) of its part of the group, in fp32."""
        row, split, n, group, channel_index, channel_mask, hw_start, hw_end = _group_split(
            HW, num_groups, hw_per_split, CHANNELS_PER_GROUP, BLOCK_CG
        )
        channel_offsets = (group * CHANNELS_PER_GROUP + channel_index) * stride_c
        base = x_ptr + n.to(tl.int64) * stride_n

        # Sums of deviations from the first block's mean (shifted data): no cancellation when the mean is large
        # against the spread, without a Welford update per element.
        hw = hw_start + tl.arange(0, BLOCK_HW)
        mask = channel_mask[:, None] & (hw < hw_end)[None, :]
        first = tl.load(base + channel_offsets[:, None] + hw[None, :] * stride_hw, mask=mask, other=0.0)
        pivot = tl.sum(first.to(tl.float32)) / tl.sum(mask.to(tl.float32))
        deviation_sum = tl.zeros([BLOCK_CG, BLOCK_HW], dtype=tl.float32)
        squared_sum = tl.zeros([BLOCK_CG, BLOCK_HW], dtype=tl.float32)
        count = tl.zeros([BLOCK_CG, BLOCK_HW], dtype=tl.float32)
        for start in range(hw_start, hw_end, BLOCK_HW):
            hw = start + tl.arange(0, BLOCK_HW)
            mask = channel_mask[:, None] & (hw < hw_end)[None, :]
            x = tl.load(base + channel_offsets[:, None] + hw[None, :] * stride_hw, mask=mask, other=0.0)
            deviation = tl.where(mask, x.to(tl.float32) - pivot, 0.0)
            deviation_sum += deviation
            squared_sum += deviation * deviation
            count += mask.to(tl.float32)
        total = tl.sum(count)
        shift = tl.sum(deviation_sum) / total
        offset = row * num_splits + split
        tl.store(partial_ptr + offset, total)
        tl.store(partial_ptr + partial_plane + offset, pivot + shift)
        tl.store(partial_ptr + 2 * partial_plane + offset, tl.sum(squared_sum) - shift * tl.sum(deviation_sum))

    @triton.jit
    def _merge_stats_kernel(
        partial_ptr,
        mean_ptr,
        rstd_ptr,
        rows,
        num_splits,
        eps,
        BLOCK_ROWS: tl.constexpr,
        SPLITS: tl.constexpr,
    ):
        """Each group's mean and 1/sqrt(var + eps) from its splits' partial statistics (Chan et al.'s merge)."""
        row = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        split = tl.arange(0, SPLITS)
        row_mask = row < rows
        mask = row_mask[:, None] & (split < num_splits)[None, :]
        offsets = row[:, None] * num_splits + split[None, :]
        partial_plane = rows * num_splits
        count = tl.load(partial_ptr + offsets, mask=mask, other=0.0)
        split_mean = tl.load(partial_ptr + partial_plane + offsets, mask=mask, other=0.0)
        split_m2 = tl.load(partial_ptr + 2 * partial_plane + offsets, mask=mask, other=0.0)
        total = tl.maximum(tl.sum(count, axis=1), 1.0)  # rows past the end: no division by zero
        mean = tl.sum(count * split_mean, axis=1) / total
        spread = split_mean - mean[:, None]
        m2 = tl.sum(split_m2, axis=1) + tl.sum(count * spread * spread, axis=1)
        variance = tl.maximum(m2 / total, 0.0)
        tl.store(mean_ptr + row, mean, mask=row_mask)
        tl.store(rstd_ptr + row, 1.0 / tl.sqrt(variance + eps), mask=row_mask)

    @triton.jit
    def _tile(C, HW, num_groups, CHANNELS_PER_GROUP: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_HW: tl.constexpr):
        """The (channels, positions) tile of one sample a program of the elementwise kernels works on: the sample,
        its channels and positions, their masks, and each channel's index into the per-group statistics."""
        n = tl.program_id(2)
        channels = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        hw = tl.program_id(0) * BLOCK_HW + tl.arange(0, BLOCK_HW)
        channel_mask = channels < C
        mask = channel_mask[:, None] & (hw < HW)[None, :]
        stats = n * num_groups + channels // CHANNELS_PER_GROUP
        return n, channels, hw, channel_mask, mask, stats

    @triton.jit
    def _normalize_silu_kernel(
        x_ptr,
        out_ptr,
        weight_ptr,
        bias_ptr,
        mean_ptr,
        rstd_ptr,
        C,
        HW,
        stride_n,
        stride_c,
        stride_hw,
        num_groups,
        CHANNELS_PER_GROUP: tl.constexpr,
        BLOCK_C: tl.constexpr,
        BLOCK_HW: tl.constexpr,
    ):
        """out = silu((x - mean) * rstd * weight + bias) over a (channels, positions) tile of one sample."""
        n, channels, hw, channel_mask, mask, stats = _tile(C, HW, num_groups, CHANNELS_PER_GROUP, BLOCK_C, BLOCK_HW)
        mean = tl.load(mean_ptr + stats, mask=channel_mask, other=0.0)
        rstd = tl.load(rstd_ptr + stats, mask=channel_mask, other=0.0)
        weight = tl.load(weight_ptr + channels, mask=channel_mask, other=0.0).to(tl.float32)
        bias = tl.load(bias_ptr + channels, mask=channel_mask, other=0.0).to(tl.float32)
        offsets = n.to(tl.int64) * stride_n + channels[:, None] * stride_c + hw[None, :] * stride_hw
        x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        z = (x - mean[:, None]) * rstd[:, None] * weight[:, None] + bias[:, None]
        out = z * tl.sigmoid(z)
        tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _backward_sums_kernel(
        grad_ptr,
        x_ptr,
        weight_ptr,
        bias_ptr,
        mean_ptr,
        rstd_ptr,
        partial_ptr,
        partial_plane,
        C,
        HW,
        stride_n,
        stride_c,
        stride_hw,
        num_groups,
        hw_per_split,
        num_splits,
        CHANNELS_PER_GROUP: tl.constexpr,
        BLOCK_CG: tl.constexpr,
        BLOCK_HW: tl.constexpr,
    ):
        """One program per (sample, group, split): per channel, the sums over its positions of dz and dz * xhat,
        where dz is the gradient at the affine output z (through the SiLU) and xhat the normalized input."""
        row, split, n, group, channel_index, channel_mask, hw_start, hw_end = _group_split(
            HW, num_groups, hw_per_split, CHANNELS_PER_GROUP, BLOCK_CG
        )
        channels = group * CHANNELS_PER_GROUP + channel_index
        mean = tl.load(mean_ptr + row)
        rstd = tl.load(rstd_ptr + row)
        weight = tl.load(weight_ptr + channels, mask=channel_mask, other=0.0).to(tl.float32)
        bias = tl.load(bias_ptr + channels, mask=channel_mask, other=0.0).to(tl.float32)
        base = n.to(tl.int64) * stride_n + channels[:, None] * stride_c
        dz_sum = tl.zeros([BLOCK_CG, BLOCK_HW], dtype=tl.float32)
        dz_xhat_sum = tl.zeros([BLOCK_CG, BLOCK_HW], dtype=tl.float32)
        for start in range(hw_start, hw_end, BLOCK_HW):
            hw = start + tl.arange(0, BLOCK_HW)
            mask = channel_mask[:, None] & (hw < hw_end)[None, :]
            offsets = base + hw[None, :] * stride_hw
            x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
            grad = tl.load(grad_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
            xhat = (x - mean) * rstd
            z = xhat * weight[:, None] + bias[:, None]
            sigmoid = tl.sigmoid(z)
            dz = grad * sigmoid * (1.0 + z * (1.0 - sigmoid))  # masked lanes: grad 0, so dz 0
            dz_sum += dz
            dz_xhat_sum += dz * xhat
        offsets = (n * num_splits + split) * C + channels
        tl.store(partial_ptr + offsets, tl.sum(dz_sum, axis=1), mask=channel_mask)
        tl.store(partial_ptr + partial_plane + offsets, tl.sum(dz_xhat_sum, axis=1), mask=channel_mask)

    @triton.jit
    def _backward_merge_kernel(
        partial_ptr,
        weight_ptr,
        coefficient_ptr,
        grad_weight_ptr,
        grad_bias_ptr,
        N,
        C,
        num_groups,
        num_splits,
        partial_plane,
        inverse_group_size,
        CHANNELS_PER_GROUP: tl.constexpr,
        BLOCK_CG: tl.constexpr,
        SPLITS: tl.constexpr,
    ):
        """One program per group, over the samples in order (deterministic): the weight and bias gradients of its
        channels, and per sample the group means of dxhat = dz * weight and of dxhat * xhat."""
        group = tl.program_id(0)
        channel_index = tl.arange(0, BLOCK_CG)
        channel_mask = channel_index < CHANNELS_PER_GROUP
        channels = group * CHANNELS_PER_GROUP + channel_index
        split = tl.arange(0, SPLITS)
        mask = (split < num_splits)[:, None] & channel_mask[None, :]
        weight = tl.load(weight_ptr + channels, mask=channel_mask, other=0.0).to(tl.float32)
        grad_weight = tl.zeros([BLOCK_CG], dtype=tl.float32)
        grad_bias = tl.zeros([BLOCK_CG], dtype=tl.float32)
        coefficient_plane = N * num_groups
        for n in range(N):
            offsets = (n * num_splits + split[:, None]) * C + channels[None, :]
            dz_sum = tl.sum(tl.load(partial_ptr + offsets, mask=mask, other=0.0), axis=0)
            dz_xhat_sum = tl.sum(tl.load(partial_ptr + partial_plane + offsets, mask=mask, other=0.0), axis=0)
            grad_bias += dz_sum
            grad_weight += dz_xhat_sum
            tl.store(coefficient_ptr + n * num_groups + group, tl.sum(weight * dz_sum) * inverse_group_size)
            tl.store(
                coefficient_ptr + coefficient_plane + n * num_groups + group,
                tl.sum(weight * dz_xhat_sum) * inverse_group_size,
            )
        tl.store(grad_weight_ptr + channels, grad_weight.to(grad_weight_ptr.dtype.element_ty), mask=channel_mask)
        tl.store(grad_bias_ptr + channels, grad_bias.to(grad_bias_ptr.dtype.element_ty), mask=channel_mask)

    @triton.jit
    def _backward_input_kernel(
        grad_ptr,
        x_ptr,
        grad_x_ptr,
        weight_ptr,
        bias_ptr,
        mean_ptr,
        rstd_ptr,
        coefficient_ptr,
        C,
        HW,
        stride_n,
        stride_c,
        stride_hw,
        num_groups,
        coefficient_plane,
        CHANNELS_PER_GROUP: tl.constexpr,
        BLOCK_C: tl.constexpr,
        BLOCK_HW: tl.constexpr,
    ):
        """dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)), the means over x's group."""
        n, channels, hw, channel_mask, mask, stats = _tile(C, HW, num_groups, CHANNELS_PER_GROUP, BLOCK_C, BLOCK_HW)
        mean = tl.load(mean_ptr + stats, mask=channel_mask, other=0.0)
        rstd = tl.load(rstd_ptr + stats, mask=channel_mask, other=0.0)
        dxhat_mean = tl.load(coefficient_ptr + stats, mask=channel_mask, other=0.0)
        dxhat_xhat_mean = tl.load(coefficient_ptr + coefficient_plane + stats, mask=channel_mask, other=0.0)
        weight = tl.load(weight_ptr + channels, mask=channel_mask, other=0.0).to(tl.float32)
        bias = tl.load(bias_ptr + channels, mask=channel_mask, other=0.0).to(tl.float32)
        offsets = n.to(tl.int64) * stride_n + channels[:, None] * stride_c + hw[None, :] * stride_hw
        x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        grad = tl.load(grad_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        xhat = (x - mean[:, None]) * rstd[:, None]
        z = xhat * weight[:, None] + bias[:, None]
        sigmoid = tl.sigmoid(z)
        dxhat = grad * sigmoid * (1.0 + z * (1.0 - sigmoid)) * weight[:, None]
        grad_x = rstd[:, None] * (dxhat - dxhat_mean[:, None] - xhat * dxhat_xhat_mean[:, None])
        tl.store(grad_x_ptr + offsets, grad_x.to(grad_x_ptr.dtype.element_ty), mask=mask)


def _kernels_interpreted() -> bool:
    """Whether @triton.jit gave interpreter functions, TRITON_INTERPRET=1 having been set when this module loaded."""
    if triton is None:
        return False
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_normalize_silu_kernel, InterpretedFunction)


def triton_available(device: torch.device | str = 'cuda') -> bool:
    """Whether group_norm_silu runs its Triton kernels for tensors on this device (else the PyTorch path)."""
    if triton is None:
        return False
    return torch.device(device).type == 'cuda' or _kernels_interpreted()


# ------------------------------------------------------------------------------------- layouts and launch plan


def _is_channels_last(x: torch.Tensor) -> bool:
    # A tensor both contiguous and channels-last (C == 1, or H == W == 1) has one memory order: call it NCHW.
    return x.dim() == 4 and not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last)


def empty_output_like(x: torch.Tensor) -> torch.Tensor:
    """Where the op writes its result for x: channels-last for channels-last x, else contiguous (any other strides
    are made contiguous first). The fake kernel uses it too, so that compiled graphs see the strides it gives."""
    memory_format = torch.channels_last if _is_channels_last(x) else torch.contiguous_format
    return torch.empty_like(x, memory_format=memory_format)


def _readable(x: torch.Tensor) -> tuple[torch.Tensor, torch.memory_format, tuple[int, int, int]]:
    """x in a layout the kernels read (channels-last, else contiguous), that layout, and x's sample, channel and
    position strides (positions: the spatial dims flattened, one stride in either layout)."""
    c, hw = x.shape[1], math.prod(x.shape[2:])
    if _is_channels_last(x):
        return x, torch.channels_last, (hw * c, 1, c)
    return x.contiguous(), torch.contiguous_format, (c * hw, hw, 1)


def _pow2(value: int, floor: int = 2) -> int:
    # Block sizes are powers of two; two at least, so that no tile has a dimension of one.
    return max(floor, triton.next_power_of_2(value))


@functools.lru_cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def launch_plan(x: torch.Tensor, num_groups: int) -> dict:
    """Block sizes and the split of each group's positions across programs."""
    n, c, hw = x.shape[0], x.shape[1], math.prod(x.shape[2:])
    channels_per_group = c // num_groups
    interpreted = x.device.type != 'cuda'
    tile = INTERPRETER_TILE if interpreted else GPU_TILE
    # Elementwise tiles: on a GPU the contiguous dimension gets 64 channels (128 bytes of bf16) or 256 positions.
    if _is_channels_last(x):
        block_c = min(_pow2(c), _pow2(math.isqrt(tile)) if interpreted else 64)
        block_hw = min(_pow2(hw), max(2, tile // block_c))
    else:
        block_hw = min(_pow2(hw), _pow2(math.isqrt(tile)) if interpreted else 256)
        block_c = min(_pow2(c), max(2, tile // block_hw))
    # Per-group tiles: all of a group's channels, as many positions as fit.
    block_cg = _pow2(channels_per_group)
    group_block_hw = min(_pow2(hw), max(2, tile // block_cg))
    hw_blocks = triton.cdiv(hw, group_block_hw)
    wanted_programs = 8 if interpreted else PROGRAMS_PER_SM * _multiprocessors(x.device)
    splits = min(hw_blocks, 64, max(1, triton.cdiv(wanted_programs, n * num_groups)))
    blocks_per_split = triton.cdiv(hw_blocks, splits)
    return {
        'channels_per_group': channels_per_group,
        'block_c': block_c,
        'block_hw': block_hw,
        'block_cg': block_cg,
        'group_block_hw': group_block_hw,
        'hw_per_split': blocks_per_split * group_block_hw,
        'num_splits': triton.cdiv(hw_blocks, blocks_per_split),  # none empty
        'num_warps': 4,
    }


def triton_forward(x, weight, bias, num_groups, eps):
    x, _, (stride_n, stride_c, stride_hw) = _readable(x)
    weight, bias = weight.contiguous(), bias.contiguous()
    n, c, hw = x.shape[0], x.shape[1], math.prod(x.shape[2:])
    plan = launch_plan(x, num_groups)
    rows, splits = n * num_groups, plan['num_splits']
    out = empty_output_like(x)
    partials = torch.empty((3, rows, splits), device=x.device, dtype=torch.float32)
    mean = torch.empty((n, num_groups), device=x.device, dtype=torch.float32)
    rstd = torch.empty_like(mean)
    _group_stats_kernel[(rows, splits)](
        x,
        partials,
        rows * splits,
        hw,
        stride_n,
        stride_c,
        stride_hw,
        num_groups,
        plan['hw_per_split'],
        splits,
        CHANNELS_PER_GROUP=plan['channels_per_group'],
        BLOCK_CG=plan['block_cg'],
        BLOCK_HW=plan['group_block_hw'],
        num_warps=plan['num_warps'],
    )
    block_rows = 16
    _merge_stats_kernel[(triton.cdiv(rows, block_rows),)](
        partials, mean, rstd, rows, splits, eps, BLOCK_ROWS=block_rows, SPLITS=_pow2(splits)
    )
    grid = (triton.cdiv(hw, plan['block_hw']), triton.cdiv(c, plan['block_c']), n)
    _normalize_silu_kernel[grid](
        x,
        out,
        weight,
        bias,
        mean,
        rstd,
        c,
        hw,
        stride_n,
        stride_c,
        stride_hw,
        num_groups,
        CHANNELS_PER_GROUP=plan['channels_per_group'],
        BLOCK_C=plan['block_c'],
        BLOCK_HW=plan['block_hw'],
        num_warps=plan['num_warps'],
    )
    return out, mean, rstd


def triton_backward(grad_out, x, weight, bias, mean, rstd, num_groups):
    x, memory_format, (stride_n, stride_c, stride_hw) = _readable(x)
    # The incoming gradient in x's layout (autograd may hand over another), so that one set of strides reads both.
    grad_out = grad_out.contiguous(memory_format=memory_format)
    weight, bias = weight.contiguous(), bias.contiguous()
    n, c, hw = x.shape[0], x.shape[1], math.prod(x.shape[2:])
    plan = launch_plan(x, num_groups)
    rows, splits = n * num_groups, plan['num_splits']
    partials = torch.empty((2, n, splits, c), device=x.device, dtype=torch.float32)
    coefficients = torch.empty((2, n, num_groups), device=x.device, dtype=torch.float32)
    grad_x = empty_output_like(x)
    grad_weight = torch.empty_like(weight)
    grad_bias = torch.empty_like(bias)
    _backward_sums_kernel[(rows, splits)](
        grad_out,
        x,
        weight,
        bias,
        mean,
        rstd,
        partials,
        n * splits * c,
        c,
        hw,
        stride_n,
        stride_c,
        stride_hw,
        num_groups,
        plan['hw_per_split'],
        splits,
        CHANNELS_PER_GROUP=plan['channels_per_group'],
        BLOCK_CG=plan['block_cg'],
        BLOCK_HW=plan['group_block_hw'],
        num_warps=plan['num_warps'],
    )
    _backward_merge_kernel[(num_groups,)](
        partials,
        weight,
        coefficients,
        grad_weight,
        grad_bias,
        n,
        c,
        num_groups,
        splits,
        n * splits * c,
        1.0 / (plan['channels_per_group'] * hw),
        CHANNELS_PER_GROUP=plan['channels_per_group'],
        BLOCK_CG=plan['block_cg'],
        SPLITS=_pow2(splits),
    )
    grid = (triton.cdiv(hw, plan['block_hw']), triton.cdiv(c, plan['block_c']), n)
    _backward_input_kernel[grid](
        grad_out,
        x,
        grad_x,
        weight,
        bias,
        mean,
        rstd,
        coefficients,
        c,
        hw,
        stride_n,
        stride_c,
        stride_hw,
        num_groups,
        n * num_groups,
        CHANNELS_PER_GROUP=plan['channels_per_group'],
        BLOCK_C=plan['block_c'],
        BLOCK_HW=plan['block_hw'],
        num_warps=plan['num_warps'],
    )
    return grad_x, grad_weight, grad_bias
