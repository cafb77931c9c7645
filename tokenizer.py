"""Captions -> CLIP token ids, as SD2's text encoder (OpenCLIP's ViT-H/14 text tower) was trained on them.

The built-in tokenizer is Transformers' fast CLIP tokenizer built from the BPE merges clip-anytorch ships (no
download), checked against CLIP's own ids when it loads; `--tokenizer` loads a local folder instead.
"""

import gzip
import html
import importlib.util
import json
import shutil
import tempfile
from pathlib import Path

import ftfy
import regex
import torch
import transformers
from transformers import AutoTokenizer, CLIPTokenizerFast
from transformers.convert_slow_tokenizer import bytes_to_unicode

# CLIP's text encoder has 77 positions (SD2 tokenizes every caption to exactly this length).
CAPTION_LENGTH = 77
# CLIP BPE vocabulary size; random ids are drawn below it so any CLIP text encoder accepts them.
CLIP_VOCAB_SIZE = 49408
# OpenCLIP (SD2's text tower) pads with id 0 ("!") after the end-of-text token, not with end-of-text.
CLIP_PAD_ID = 0
CLIP_START_ID, CLIP_END_ID = 49406, 49407  # <|startoftext|>, <|endoftext|>
TOKENIZER_CACHE = Path(__file__).resolve().parent / 'data' / 'clip-tokenizer-v1'  # bump when the build changes
# CLIP's own ids (clip-anytorch's SimpleTokenizer) for captions with merges, punctuation and a combining mark.
# The built-in tokenizer is checked against them when it loads: another transformers release can build it
# differently (5.x ignores the vocabulary files and normalizes to NFC) and would train on wrong captions silently.
TOKENIZER_CHECKS = {
    'a photo of a cat, on the mat!': [320, 1125, 539, 320, 2368, 267, 525, 518, 9063, 256],
    'T\u0308 \u00e9': [339, 136, 486, 4166],
}


class TokenizerError(ValueError):
    """A tokenizer that cannot be used: a missing folder, a missing vocabulary, or ids that differ from CLIP's."""


def clean_caption(text: str) -> str:
    """CLIP's text cleaning (its SimpleTokenizer): fix mojibake, unescape HTML twice, collapse whitespace, lowercase."""
    text = html.unescape(html.unescape(ftfy.fix_text(text)))
    return regex.sub(r'\s+', ' ', text).strip().lower()


def clip_tokenizer_folder(folder: Path = TOKENIZER_CACHE) -> Path:
    """Transformers' fast CLIP tokenizer, built once from the BPE merges that clip-anytorch ships.

    The vocabulary is the 256 byte symbols, the same with the end-of-word mark, one token per merge,
    then <|startoftext|> (49406) and <|endoftext|> (49407): 256 + 256 + 48,894 + 2 = 49,408.
    """
    if (folder / 'tokenizer.json').is_file():
        return folder
    spec = importlib.util.find_spec('clip')  # finds the package without importing it (and torchvision)
    if spec is None or not spec.submodule_search_locations:
        raise TokenizerError(
            'the CLIP vocabulary comes from the clip-anytorch package: pip install clip-anytorch==2.6.0, '
            'or pass --tokenizer with a local tokenizer folder'
        )
    bpe_file = Path(spec.submodule_search_locations[0]) / 'bpe_simple_vocab_16e6.txt.gz'
    merges = gzip.open(bpe_file).read().decode('utf-8').split('\n')[1 : 49152 - 256 - 2 + 1]
    symbols = list(bytes_to_unicode().values())
    vocab = symbols + [s + '</w>' for s in symbols] + [m.replace(' ', '') for m in merges]
    vocab += ['<|startoftext|>', '<|endoftext|>']
    folder.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f'.{folder.name}-'))
    (work / 'vocab.json').write_text(json.dumps({token: i for i, token in enumerate(vocab)}))
    (work / 'merges.txt').write_text('#version: 0.2\n' + '\n'.join(merges) + '\n')
    tokenizer = CLIPTokenizerFast(
        vocab_file=str(work / 'vocab.json'), merges_file=str(work / 'merges.txt'), model_max_length=CAPTION_LENGTH
    )
    # Captions arrive cleaned by clean_caption(); the default normalizer's NFC would recompose characters
    # after lowercasing ('T' + combining diaeresis -> one letter) and differ from CLIP's own ids.
    tokenizer.backend_tokenizer.normalizer = None
    tokenizer.save_pretrained(work)
    try:
        work.rename(folder)  # atomic: concurrent ranks or workers never read a half-written folder
    except OSError:  # another process got there first
        shutil.rmtree(work, ignore_errors=True)
    return folder


def caption_pad_ids(model_dir: Path) -> tuple[int, ...]:
    """The padding id of each text encoder of a model folder, from its config's pad_token_id: 0 for OpenCLIP's
    encoders (SD 2, SDXL's second), the end-of-text token for OpenAI's CLIP (SD 1.5, SDXL's first). Configs
    exported from OpenAI's CLIP carry a meaningless pad_token_id (1): CLIP's own end-of-text is used then."""
    pad_ids = []
    for name in ('text_encoder', 'text_encoder_2'):
        path = model_dir / name / 'config.json'
        if path.is_file():
            pad = json.loads(path.read_text()).get('pad_token_id')
            pad_ids.append(pad if pad in (CLIP_PAD_ID, CLIP_END_ID) else CLIP_END_ID)
    return tuple(pad_ids)


class CaptionTokenizer:
    """Caption -> 77 CLIP token ids: <|startoftext|>, tokens, <|endoftext|> kept last when truncating, then padding.

    Built-in: ids equal OpenAI/OpenCLIP's SimpleTokenizer, padded with `pad_id` (default 0, as SD2's OpenCLIP
    encoder was trained; see caption_pad_ids). A folder (`--tokenizer`) is loaded with AutoTokenizer and pads
    with its own pad token. Loads lazily, so that each dataloader worker builds its own after the fork.
    """

    def __init__(self, folder: str | None = None, pad_id: int = CLIP_PAD_ID):
        if folder is not None and not Path(folder).is_dir():
            raise TokenizerError(f'--tokenizer {folder}: no such folder')
        self.folder = str(clip_tokenizer_folder()) if folder is None else folder
        self.builtin = folder is None
        self.builtin_pad_id = pad_id
        self._encode = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, '_encode': None}  # workers started by spawn load their own

    def load(self) -> None:
        tokenizer = AutoTokenizer.from_pretrained(self.folder)
        pad = tokenizer.pad_token_id
        self.pad_id = self.builtin_pad_id if self.builtin or pad is None else pad
        if tokenizer.is_fast:  # the Rust tokenizer itself: half the time of the Python wrapper around it
            backend = tokenizer.backend_tokenizer
            backend.no_padding()
            backend.enable_truncation(CAPTION_LENGTH)  # keeps room for the special tokens, so <|endoftext|> stays
            self._encode = lambda text: backend.encode(text).ids
        else:
            self._encode = lambda text: tokenizer(text, truncation=True, max_length=CAPTION_LENGTH).input_ids
        if self.builtin:
            for text, expected in TOKENIZER_CHECKS.items():
                got = self._encode(clean_caption(text))
                if got != [CLIP_START_ID, *expected, CLIP_END_ID]:
                    raise TokenizerError(
                        f'the built-in CLIP tokenizer ({self.folder}) gives ids {got} for {text!r}, where '
                        f'CLIP gives {expected} between start and end. Transformers releases other than '
                        f'the pinned one build it differently (this is {transformers.__version__}): '
                        'install requirements.txt, delete that folder and run again, or pass --tokenizer'
                    )

    def __call__(self, caption: str) -> torch.Tensor:
        if self._encode is None:
            self.load()
        ids = self._encode(clean_caption(caption))
        return torch.tensor(ids + [self.pad_id] * (CAPTION_LENGTH - len(ids)), dtype=torch.long)
