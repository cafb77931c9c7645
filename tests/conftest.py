"""Tests run offline on CPU: no hub, no W&B account, no GPU (hidden where there is one, so that the CPU
defaults and checks under test are the ones that apply)."""

import os

os.environ['CUDA_VISIBLE_DEVICES'] = ''

os.environ.setdefault('HF_HUB_OFFLINE', '1')
os.environ.setdefault('WANDB_MODE', 'offline')
os.environ.setdefault('TOKENIZERS_PARALLELISM', 'false')
