"""Tests run offline on CPU: no hub, no W&B account, no GPU."""

import os

os.environ.setdefault('HF_HUB_OFFLINE', '1')
os.environ.setdefault('WANDB_MODE', 'offline')
os.environ.setdefault('TOKENIZERS_PARALLELISM', 'false')
