"""Datasets for the benchmark: synthetic image-caption pairs (and, later, streaming LAION shards).

Every dataset yields dicts {'image': float tensor (3, H, W) in [-1, 1], 'input_ids': long tensor (77,)}:
images in the VAE's input range, captions as CLIP token ids padded to the text encoder's 77 positions.
"""

import torch
from torch.utils.data import Dataset

# CLIP's text encoder has 77 positions (SD2 tokenizes every caption to exactly this length).
CAPTION_LENGTH = 77
# CLIP BPE vocabulary size; random ids are drawn below it so any CLIP text encoder accepts them.
CLIP_VOCAB_SIZE = 49408


class SyntheticImageCaptionDataset(Dataset):
    """Random images in [-1, 1] and random caption token ids, as in the published benchmark.

    Each sample depends only on (seed, index), so every run, worker count and rank split sees the same
    data; the distributed sampler that splits indices across ranks comes from Composer.
    """

    def __init__(self, image_size: int, num_samples: int = 100_000, seed: int = 17,
                 vocab_size: int = CLIP_VOCAB_SIZE, caption_length: int = CAPTION_LENGTH):
        self.image_size = image_size
        self.num_samples = num_samples
        self.seed = seed
        self.vocab_size = vocab_size
        self.caption_length = caption_length

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < self.num_samples:
            raise IndexError(f'index {index} out of range for {self.num_samples} synthetic samples')
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        image = torch.rand(3, self.image_size, self.image_size, generator=generator) * 2 - 1
        input_ids = torch.randint(0, self.vocab_size, (self.caption_length,), generator=generator)
        return {'image': image, 'input_ids': input_ids}
