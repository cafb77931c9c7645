"""What a model's training step keeps for its backward, counted on the meta device: the measurement behind
benchmarks/activation_memory.py (whose docstring says what is counted and how)."""

import torch
from torch.utils.data import default_collate

from data import SyntheticLatentsDataset
from models.stable_diffusion import DiffusionTransformer, build_model
from settings.families import is_flow_matching
from settings.model_folder import LATENT_DOWNSAMPLE, resolve_model_dir

BYTES_PER_ELEMENT = 2  # bf16 autocast


class FusedAttentionSaves(torch.autograd.Function):
    """Attention with what a fused kernel saves for its backward; the forward only gives the output's shape."""

    @staticmethod
    def forward(ctx, query, key, value):
        output = query.new_empty(*query.shape[:-1], value.shape[-1])
        log_sum_exp = query.new_empty(query.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(query, key, value, output, log_sum_exp)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        raise NotImplementedError('counts memory only')


def fused_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    return FusedAttentionSaves.apply(query, key, value)


def saved_bytes_per_image(model_name: str, image_size: int, activation_checkpointing: bool = False) -> int:
    """Bytes the training step of one `image_size` image keeps for the backward, as bf16. With activation
    checkpointing (Diffusers' gradient checkpointing of the denoiser's blocks): what is saved outside the blocks,
    each block's inputs, and the most one block keeps while the backward recomputes it."""
    with torch.device('meta'):
        model = build_model(resolve_model_dir(model_name), precomputed=True)
    # Tensors are told apart by id(), so every tensor counted is kept alive until the count ends: a freed tensor's
    # id can be reused by the next one, which would then be taken for it and counted once for both.
    block_inputs, largest_block, kept = {}, [0], []
    if activation_checkpointing:

        def checkpointed(block, *args):
            # What torch.utils.checkpoint keeps of a block (its tensor inputs), and what the block alone saves,
            # which its recomputation holds during the backward; on the meta device nothing is recomputed.
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            kept.extend(tensors)
            block_inputs.update({id(a): a.numel() * BYTES_PER_ELEMENT for a in tensors})
            inside = {}
            with torch.autograd.graph.saved_tensors_hooks(counter(inside, parameters, kept), lambda tensor: tensor):
                output = block(*args)
            largest_block[0] = max(largest_block[0], sum(inside.values()))
            return output

        model.denoiser.enable_gradient_checkpointing(checkpointed)
    shapes = model.precomputed_shapes(image_size // LATENT_DOWNSAMPLE)
    sample = SyntheticLatentsDataset(**shapes, num_samples=1)[0]
    batch = {name: tensor.to('meta') for name, tensor in default_collate([sample]).items()}
    latent = batch['latent_mean'].shape
    batch['noise'] = batch['latent_noise'] = torch.empty(latent, device='meta')
    if isinstance(model, DiffusionTransformer) and is_flow_matching(model.family):
        batch['sigmas'] = torch.empty(1, device='meta')
    else:
        batch['timesteps'] = torch.zeros(1, dtype=torch.long, device='meta')
    parameters = {id(p) for p in model.parameters()}
    saved = {}

    sdpa = torch.nn.functional.scaled_dot_product_attention
    torch.nn.functional.scaled_dot_product_attention = fused_attention
    try:
        with torch.autograd.graph.saved_tensors_hooks(counter(saved, parameters, kept), lambda tensor: tensor):
            model.loss(model(batch), batch)
    finally:
        torch.nn.functional.scaled_dot_product_attention = sdpa
    return sum({**saved, **block_inputs}.values()) + largest_block[0]  # a tensor both saved and an input: once


def counter(saved: dict, parameters: set[int], kept: list):
    """A saved-tensor hook that records each saved tensor's bytes in `saved`, once per tensor, weights left out;
    each tensor counted is appended to `kept`, which holds it until the count ends."""

    def count(tensor):
        is_weight = id(tensor) in parameters or (tensor._base is not None and id(tensor._base) in parameters)
        if not is_weight:
            size = BYTES_PER_ELEMENT if tensor.is_floating_point() else tensor.element_size()
            saved[id(tensor)] = tensor.numel() * size  # by identity: a tensor saved twice is held once
            kept.append(tensor)
        return tensor

    return count
