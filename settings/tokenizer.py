"""Captions -> token ids: CLIP's, as SD2's text encoder (OpenCLIP's ViT-H/14 text tower) was trained on them, and
T5's for the diffusion transformers.

The built-in CLIP tokenizer is a `tokenizers` BPE built from the merges clip-anytorch ships (no download) with
CLIP's own split pattern and byte symbols, checked against CLIP's ids when it loads; `--tokenizer` loads a local
folder with Transformers' AutoTokenizer instead. No package here ships T5's SentencePiece vocabulary: a model with
a T5 encoder reads real captions only with `--tokenizer` naming a local folder of T5's tokenizer (its CLIP
columns keep the built-in one). For smoke runs, `t5_smoke_tokenizer_folder` (`make t5-smoke-tokenizer`) writes
such a folder offline: T5's conventions with a vocabulary of under 200 pieces.
"""

from __future__ import annotations

import gzip
import html
import importlib.util
import json
import shutil
import tempfile
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

import ftfy
import regex
import tokenizers
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

if TYPE_CHECKING:
    import torch

from guards.arguments import ConfigError
from settings.model_folder import (
    CAPTION_LENGTH,
    CLIP_END_ID,
    CLIP_PAD_ID,
    CLIP_START_ID,
    CLIP_VOCAB_SIZE,
    T5_END_ID,
    T5_PAD_ID,
    T5_VOCAB_SIZE,
    CaptionInputs,
    t5_tokenizer_needed,
)

CLIP_START, CLIP_END = '<|startoftext|>', '<|endoftext|>'
# CLIP's SimpleTokenizer splits cleaned text into words with this pattern (its special tokens aside).
CLIP_WORDS = r"""'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+"""
TOKENIZER_CACHE = Path(__file__).resolve().parents[1] / 'data' / 'clip-tokenizer-v2'  # bump when the build changes
# CLIP's own ids (clip-anytorch's SimpleTokenizer) for captions with merges, punctuation and a combining mark.
# The built-in tokenizer is checked against them when it loads: a cached file from another build (v1 came from
# Transformers, whose 5.x releases ignore the vocabulary files and normalize to NFC) must not train on wrong ids.
TOKENIZER_CHECKS = {
    'a photo of a cat, on the mat!': [320, 1125, 539, 320, 2368, 267, 525, 518, 9063, 256],
    'T\u0308 \u00e9': [339, 136, 486, 4166],
}


class TokenizerError(ValueError):
    """A tokenizer that cannot be used: a missing folder, a missing vocabulary, or ids that differ from CLIP's."""


def clean_caption(text: str, lowercase: bool = True) -> str:
    """CLIP's text cleaning (its SimpleTokenizer): fix mojibake, unescape HTML twice, collapse whitespace, lowercase.
    T5 is cased: its captions keep their case (lowercase False)."""
    text = regex.sub(r'\s+', ' ', html.unescape(html.unescape(ftfy.fix_text(text)))).strip()
    return text.lower() if lowercase else text


@cache
def byte_symbols() -> list[str]:
    """CLIP's 256 byte symbols in its vocabulary's order (the same table as GPT-2's, which the `tokenizers`
    ByteLevel pre-tokenizer applies): first the printable bytes, each standing for itself, then the others in
    byte order, each shifted to the next character from 256 on."""
    printable = [*range(ord('!'), ord('~') + 1), *range(ord('¡'), ord('¬') + 1), *range(ord('®'), ord('ÿ') + 1)]
    others = [b for b in range(256) if b not in printable]
    return [chr(b) for b in printable] + [chr(256 + i) for i in range(len(others))]


def clip_merges() -> list[str]:
    """The 48,894 BPE merges of CLIP's vocabulary file, shipped in the clip-anytorch package."""
    spec = importlib.util.find_spec('clip')  # finds the package without importing it (and torchvision)
    if spec is None or not spec.submodule_search_locations:
        raise TokenizerError(
            'the CLIP vocabulary comes from the clip-anytorch package: pip install clip-anytorch==2.6.0, '
            'or pass --tokenizer with a local tokenizer folder'
        )
    bpe_file = Path(spec.submodule_search_locations[0]) / 'bpe_simple_vocab_16e6.txt.gz'
    return gzip.open(bpe_file).read().decode('utf-8').split('\n')[1 : 49152 - 256 - 2 + 1]


def build_clip_tokenizer() -> Tokenizer:
    """CLIP's tokenizer in the `tokenizers` library alone, so that no Transformers release can change it.

    The vocabulary is the 256 byte symbols, the same with the end-of-word mark, one token per merge, then
    <|startoftext|> (49406) and <|endoftext|> (49407): 256 + 256 + 48,894 + 2 = 49,408. No normalizer: captions
    arrive cleaned by clean_caption(), and a Unicode normalization after lowercasing would recompose characters
    ('T' + combining diaeresis -> one letter) and differ from CLIP's ids.
    """
    merges = clip_merges()
    symbols = byte_symbols()
    vocab = [*symbols, *(s + '</w>' for s in symbols), *(m.replace(' ', '') for m in merges), CLIP_START, CLIP_END]
    bpe = models.BPE(
        {token: i for i, token in enumerate(vocab)},
        [tuple(merge.split(' ')) for merge in merges],
        end_of_word_suffix='</w>',
        unk_token=CLIP_END,
    )
    tokenizer = Tokenizer(bpe)
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(CLIP_WORDS), behavior='removed', invert=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([CLIP_START, CLIP_END])
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f'{CLIP_START} $A {CLIP_END}', special_tokens=[(CLIP_START, CLIP_START_ID), (CLIP_END, CLIP_END_ID)]
    )
    return tokenizer


def clip_tokenizer_folder(folder: Path = TOKENIZER_CACHE) -> Path:
    """A folder with the built-in tokenizer's tokenizer.json, built once (building reads 49k merges)."""
    return written_once(folder, lambda work: build_clip_tokenizer().save(str(work / 'tokenizer.json')))


def written_once(folder: Path, write) -> Path:
    """`folder` as write(a new folder) fills it, unless it holds a tokenizer.json already."""
    folder = Path(folder)
    if (folder / 'tokenizer.json').is_file():
        return folder
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise TokenizerError(f'{folder}: not empty, and no tokenizer.json in it: give a new folder')
    folder.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f'.{folder.name}-'))
    write(work)
    try:
        work.rename(folder)  # atomic: concurrent ranks or workers never read a half-written folder
    except OSError:  # another process got there first
        shutil.rmtree(work, ignore_errors=True)
    if not (folder / 'tokenizer.json').is_file():
        raise TokenizerError(f'{folder}: cannot be written (a mount point, or no permission?): give another folder')
    return folder


# ------------------------------------------------------------------------------- T5's, for smoke runs

T5_SMOKE_TOKENIZER = TOKENIZER_CACHE.parent / 't5-smoke-tokenizer'
T5_PAD, T5_END, T5_UNKNOWN = '<pad>', '</s>', '<unk>'  # ids 0, 1, 2 as in T5's vocabulary
# The smoke tokenizer's whole words: those of the sample dataset's captions and a few common ones. Any other
# printable ASCII text is spelled out one character at a time; any other character is <unk>, as T5 reads characters
# its vocabulary lacks.
T5_SMOKE_WORDS = (
    'a an the of on in at by with and or to from is are this that it its',
    'photo picture image painting drawing render close up view number caption',
    'red orange yellow green blue purple white black gray brown pink',
    'circle square triangle shape background small large big little old new',
    'cat dog bird horse person man woman child tree flower house car street city sky water mountain',
)


def build_t5_smoke_tokenizer() -> Tokenizer:
    """A stand-in for T5's tokenizer, for smoke runs of the T5 models on captions: T5's conventions, not its
    vocabulary, so a model trained with it reads captions only with it.

    As T5's own tokenizer.json: a SentencePiece unigram model (words start with '\u2581'), runs of spaces
    collapsed, case kept, <pad> 0, </s> 1 after every caption (the empty caption is [</s>]), <unk> 2; every id far
    below T5's 32,128.
    """
    specials = [T5_PAD, T5_END, T5_UNKNOWN]  # in id order: T5_PAD_ID, T5_END_ID, then <unk>
    words = [word for line in T5_SMOKE_WORDS for word in line.split()]
    pieces = [(token, 0.0) for token in specials]
    # Scores: a whole word always beats spelling it out.
    pieces += [(f'\u2581{word}', -1.0) for word in words] + [('\u2581', -10.0)]
    pieces += [(chr(code), -10.0) for code in range(ord('!'), ord('~') + 1)]
    tokenizer = Tokenizer(models.Unigram(pieces, unk_id=specials.index(T5_UNKNOWN)))
    tokenizer.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Replace(Regex(' {2,}'), ' ')])
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    tokenizer.add_special_tokens(specials)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f'$A {T5_END}', special_tokens=[(T5_END, T5_END_ID)]
    )
    return tokenizer


def t5_smoke_tokenizer_folder(folder: Path = T5_SMOKE_TOKENIZER) -> Path:
    """A `--tokenizer` folder of the smoke T5 tokenizer in Transformers' layout (AutoTokenizer loads tokenizer.json
    as it is, in the generic fast class), written once."""

    def write(work: Path) -> None:
        build_t5_smoke_tokenizer().save(str(work / 'tokenizer.json'))
        special = {'pad_token': T5_PAD, 'eos_token': T5_END, 'unk_token': T5_UNKNOWN}
        (work / 'special_tokens_map.json').write_text(json.dumps(special, indent=2))
        config = {'tokenizer_class': 'PreTrainedTokenizerFast', **special, 'model_max_length': 512}
        (work / 'tokenizer_config.json').write_text(json.dumps({**config, 'clean_up_tokenization_spaces': False}))

    return written_once(folder, write)


def id_tensor(ids: list[int]) -> torch.Tensor:
    import torch  # here, not at the top: config.py checks a --tokenizer folder before torch loads

    return torch.tensor(ids, dtype=torch.long)


def empty_caption_ids(pad_id: int, length: int) -> torch.Tensor:
    """T5's ids of the empty caption: its end-of-text token, then padding (T5's tokenizer adds nothing else)."""
    return id_tensor([T5_END_ID] + [pad_id] * (length - 1))


class CaptionTokenizer:
    """Caption -> `length` token ids (77 for CLIP): the tokenizer's special tokens, the end-of-text one kept last when
    truncating (CLIP's <|startoftext|> ... <|endoftext|>, T5's ... </s>), then padding.

    Built-in: ids equal OpenAI/OpenCLIP's SimpleTokenizer, padded with `pad_id` (default 0, as SD2's OpenCLIP
    encoder was trained; see caption_pad_ids). A folder (`--tokenizer`) is loaded with AutoTokenizer and pads
    with its own pad token. Loads lazily, so that each dataloader worker builds its own after the fork.
    """

    def __init__(
        self, folder: str | None = None, pad_id: int = CLIP_PAD_ID, length: int = CAPTION_LENGTH, lowercase: bool = True
    ):
        if folder is not None and not Path(folder).is_dir():
            raise TokenizerError(f'--tokenizer {folder}: no such folder')
        self.folder = str(clip_tokenizer_folder()) if folder is None else folder
        self.builtin = folder is None
        self.builtin_pad_id = pad_id
        self.length, self.lowercase = length, lowercase
        self._encode = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, '_encode': None}  # workers started by spawn load their own

    def load(self) -> None:
        if self.builtin:
            backend = builtin_backend(self.folder, self.length)
            self.pad_id = self.builtin_pad_id
            self._encode = lambda text: backend.encode(text).ids
            return
        from transformers import AutoTokenizer  # only for a folder: the built-in tokenizer never needs it

        tokenizer = AutoTokenizer.from_pretrained(self.folder)
        self.pad_id = self.builtin_pad_id if tokenizer.pad_token_id is None else tokenizer.pad_token_id
        if not tokenizer.is_fast:
            self._encode = lambda text: tokenizer(text, truncation=True, max_length=self.length).input_ids
            return
        backend = tokenizer.backend_tokenizer  # the Rust tokenizer: half the time of the Python wrapper
        backend.no_padding()
        backend.enable_truncation(self.length)  # keeps room for the special tokens, so the end-of-text one stays
        self._encode = lambda text: backend.encode(text).ids

    def __call__(self, caption: str) -> torch.Tensor:
        return id_tensor(self.ids(caption))

    def ids(self, caption: str) -> list[int]:
        """The caption's ids, padded, as a list: without torch, for the checks at start."""
        if self._encode is None:
            self.load()
        ids = self._encode(clean_caption(caption, self.lowercase))
        return ids + [self.pad_id] * (self.length - len(ids))


# The built-in tokenizer by file and caption length, loaded once per process: a load parses its 49k merges, and a
# run's checks, its dataset, its sample grids and a process's later runs ask again. Loader workers forked after it
# loaded share it.
BUILTIN_BACKENDS: dict[tuple, Tokenizer] = {}


def builtin_backend(folder: str, length: int) -> Tokenizer:
    """The built-in tokenizer of `folder` (its tokenizer.json as it is now), truncating at `length`, checked against
    CLIP's ids. Nothing else may change its settings: it is shared."""
    path = Path(folder) / 'tokenizer.json'
    written = path.stat()
    key = (str(path), written.st_ino, written.st_mtime_ns, written.st_size, length)
    if key not in BUILTIN_BACKENDS:
        backend = Tokenizer.from_file(str(path))
        backend.no_padding()
        for text, expected in TOKENIZER_CHECKS.items():
            got = backend.encode(clean_caption(text)).ids
            if got != [CLIP_START_ID, *expected, CLIP_END_ID]:
                raise TokenizerError(
                    f'the built-in CLIP tokenizer ({folder}) gives ids {got} for {text!r}, where CLIP gives '
                    f'{expected} between start and end (tokenizers {tokenizers.__version__}): delete that folder '
                    'and run again, or pass --tokenizer'
                )
        backend.enable_truncation(length)  # keeps room for the special tokens, so the end-of-text one stays
        BUILTIN_BACKENDS[key] = backend
    return BUILTIN_BACKENDS[key]


def column_tokenizers(folder: str | None, inputs) -> dict[str, CaptionTokenizer]:
    """A tokenizer for each caption column of data.CaptionInputs `inputs`. `folder` (--tokenizer) is T5's where the
    model has a T5 encoder (its CLIP columns use the built-in tokenizer), CLIP's otherwise. T5's captions keep their
    case, as its pipelines give them."""
    tokenizers_by_column = {}
    for column, pad, length, vocab_size in zip(
        inputs.id_columns, inputs.pad_ids, inputs.lengths, inputs.vocab_sizes, strict=True
    ):
        if vocab_size == T5_VOCAB_SIZE:
            if folder is None:
                raise TokenizerError(t5_tokenizer_needed('this model'))
            tokenizers_by_column[column] = CaptionTokenizer(folder, pad, length, lowercase=False)
        else:
            tokenizers_by_column[column] = CaptionTokenizer(None if inputs.uses_t5 else folder, pad, length)
    return tokenizers_by_column


def check_tokenizer(folder: str, inputs: CaptionInputs) -> None:
    """Loads the tokenizer once before a run builds anything, so that a folder without one fails at start rather than
    in every loader worker; for a model with a T5 encoder, the folder must give T5's ids (below its vocabulary,
    ending in its end of text)."""
    if not Path(folder).is_dir():
        raise ConfigError(f'--tokenizer {folder}: no such folder')
    try:
        ids = CaptionTokenizer(folder, length=max(inputs.lengths)).ids('a photo')
    except Exception as error:  # Transformers raises several kinds (OSError, ValueError, TypeError, ...)
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ConfigError(f'--tokenizer {folder}: no tokenizer Transformers can load ({reason})')
    wrong = why_wrong_family(ids, inputs)
    if wrong:
        raise ConfigError(f'--tokenizer {folder}: {wrong}')


def check_tokenizer_file(folder: str, inputs: CaptionInputs) -> None:
    """check_tokenizer's check of the family, without Transformers, whose import loads torch (seconds): of the
    folder's tokenizer.json, with the `tokenizers` library alone; a folder without one is loaded when it is used."""
    if not Path(folder).is_dir():
        raise ConfigError(f'--tokenizer {folder}: no such folder')
    if not (Path(folder) / 'tokenizer.json').is_file():
        return
    try:
        ids = Tokenizer.from_file(str(Path(folder) / 'tokenizer.json')).encode('a photo').ids
    except Exception as error:  # the Rust library's own exception, for a file that is not a tokenizer's
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ConfigError(f'--tokenizer {folder}: its tokenizer.json does not load ({reason})')
    wrong = why_wrong_family(ids, inputs)
    if wrong:
        raise ConfigError(f'--tokenizer {folder}: {wrong}')


def why_wrong_family(ids: list[int], inputs: CaptionInputs) -> str | None:
    """Why a tokenizer's ids for 'a photo' (padded or not) are not those the model's text encoders read, or None:
    a model with a T5 encoder reads T5's (below its vocabulary, ending in its end of text), the others CLIP's.
    Another family's would index the embedding out of range, or train on the wrong tokens."""
    if inputs.uses_t5:
        ids = [token for token in ids if token != T5_PAD_ID]
        if not ids or max(ids) >= T5_VOCAB_SIZE or ids[-1] != T5_END_ID:
            return (
                f"gives ids {ids[:8]} for 'a photo', not T5's (below {T5_VOCAB_SIZE}, ending in </s> = "
                f"{T5_END_ID}); this model's --tokenizer is its T5 encoder's"
            )
    elif not clip_ids(ids):
        return (
            f"gives ids {ids[:8]} for 'a photo', not CLIP's ({CLIP_START} = {CLIP_START_ID} first, {CLIP_END} = "
            f"{CLIP_END_ID} after the words, all below {CLIP_VOCAB_SIZE}): another model's tokenizer (T5's?); "
            "this model's text encoder is CLIP: pass a CLIP tokenizer folder, or leave --tokenizer out for the "
            'built-in one'
        )
    return None


def clip_ids(ids: list[int]) -> bool:
    """Whether a caption's ids, padded, are as CLIP's tokenizer gives them."""
    return bool(ids) and ids[0] == CLIP_START_ID and CLIP_END_ID in ids[1:] and max(ids) < CLIP_VOCAB_SIZE
