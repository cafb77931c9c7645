"""CPU tests of the real data path: CLIP tokenization, image decoding, bad samples, and training from MDS
shards through benchmark.py (local folder, the default sample dataset, mid-epoch resumption, two ranks)."""

import contextlib
import importlib.util
import io
import json
import logging
import os
import random
import re
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from composer.core import Callback
from conftest import LAUNCHER, REPO, final_weights, good_samples, jpeg, run_process, settled, write_dataset
from PIL import Image
from tokenizers import Tokenizer

from data import StreamingLAIONDataset, collate
from datapath.images import BadSample, check_image, decode_image, unit_range
from guards.arguments import ConfigError
from runs.run import main
from settings import datasets as run_data
from settings import tokenizer
from settings.config import resolve_config
from settings.dataset_checks import DataError
from settings.flags import parse_args
from settings.model_folder import CAPTION_LENGTH
from settings.tokenizer import CaptionTokenizer, TokenizerError, clip_tokenizer_folder


def images(location, **kwargs):
    return list(StreamingLAIONDataset(local=location, image_size=32, shuffle=False, batch_size=1, **kwargs))


# ----------------------------------------------------------------------------------------- captions

CAPTIONS = [
    '',
    '   ',
    'A photo of a CAT',
    'Café crème brûlée à la carte, naïve façade',
    'İstanbul ΣΊΣΥΦΟΣ straße',
    '🐱 cat emoji 🚀🔥 family 👨\u200d👩\u200d👧 thumbs 👍🏽 flag 🇯🇵',
    '一只猫坐在沙发上，看着窗外。',
    '東京タワーの夜景',
    '서울의 밤',
    'Ｆｕｌｌｗｉｄｔｈ １２３！？',
    'fish &amp; chips &amp;amp; &lt;b&gt;bold&lt;/b&gt;',
    'mojibake: CafÃ© sÃ£o paulo',
    '“smart quotes” — dash … ellipsis ﬁne',
    "it's they're we've I'm you'll he'd",
    'wow!? really!!',
    'T\u0308 e\u0301',
    'tab\tnew\nline \u00a0nbsp\u2003em',
    'a\x00b\x1fc',
    '<|endoftext|> inside',
    'numbers 1234567 3.14 1,000',
    'Ελληνικά Русский עברית العربية हिन्दी ไทย',
    'very long ' * 60,
    'x' * 500,
]


def fuzz_captions(n, seed=0):
    pools = [
        'abcdefghij KLMNOP ',
        '0123456789 .,;:!?\'"-()<>/&',
        'éèçñßøÉÀ\u0301\u0308',
        '一只猫東京タワー서울，。！',
        '🐱🚀👍🏽🇯🇵👨\u200d👩',
        ' \t\n\u00a0\u3000',
        'ＡＢＣａｂ１',
        '&amp;&lt;&#39;',
        "'s 're 'll",
        'ΣσςİДж',
        'ﬁÃ©â€™',
    ]
    rng = random.Random(seed)
    return [''.join(rng.choice(rng.choice(pools)) for _ in range(rng.randint(0, 100))) for _ in range(n)]


def reference_clip_tokenizer():
    """OpenAI's SimpleTokenizer, the reference implementation, from clip-anytorch's file: `import clip` would import
    pkg_resources, which setuptools 82 and later no longer ship."""
    spec = importlib.util.find_spec('clip')
    path = Path(spec.submodule_search_locations[0]) / 'simple_tokenizer.py'
    module_spec = importlib.util.spec_from_file_location('clip_simple_tokenizer', path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.SimpleTokenizer()


@pytest.mark.stack
def test_tokenizer_ids_equal_the_reference_clip_tokenizer():
    reference = reference_clip_tokenizer()
    start, end = reference.encoder['<|startoftext|>'], reference.encoder['<|endoftext|>']
    tokenize = CaptionTokenizer()
    for caption in CAPTIONS + fuzz_captions(300):
        # As clip.tokenize(truncate=True) and OpenCLIP for SD2: <|endoftext|> kept last, then padding with 0.
        ids = [start, *reference.encode(caption)][: CAPTION_LENGTH - 1] + [end]
        expected = torch.tensor(ids + [0] * (CAPTION_LENGTH - len(ids)))
        assert torch.equal(tokenize(caption), expected), repr(caption)
    ids = tokenize('a photo of a cat')
    assert ids.shape == (77,) and ids.dtype == torch.long
    assert ids[:7].tolist() == [49406, 320, 1125, 539, 320, 2368, 49407] and not ids[7:].any()
    long_ids = tokenize('very long ' * 60)
    assert long_ids[0] == 49406 and long_ids[-1] == 49407 and long_ids.min() > 0


@pytest.mark.stack
def test_tokenizer_folder_is_loaded_from_disk(tmp_path):
    from transformers import AutoTokenizer

    # An SD2-style folder: the same BPE with pad token "!" (id 0), as stabilityai/stable-diffusion-2 ships it.
    tokenizer = AutoTokenizer.from_pretrained(clip_tokenizer_folder())
    tokenizer.pad_token = '!'
    tokenizer.save_pretrained(tmp_path / 'tokenizer')
    from_folder = CaptionTokenizer(str(tmp_path / 'tokenizer'))
    # Except around "!": a pad token is a special token, which Transformers splits out of the text first.
    for caption in [c for c in CAPTIONS if '!' not in c and '！' not in c]:
        assert torch.equal(from_folder(caption), CaptionTokenizer()(caption)), repr(caption)
    # The folder's own settings are the ones used: SD1's tokenizer pads with <|endoftext|> (49407), not 0.
    tokenizer.pad_token = '<|endoftext|>'
    tokenizer.save_pretrained(tmp_path / 'sd1-tokenizer')
    assert CaptionTokenizer(str(tmp_path / 'sd1-tokenizer'))('a cat')[-1] == 49407
    assert CaptionTokenizer()('a cat')[-1] == 0
    with pytest.raises(TokenizerError, match='no such folder'):
        CaptionTokenizer(str(tmp_path / 'missing'))


def test_a_builtin_tokenizer_built_differently_is_refused(tmp_path, monkeypatch):
    """transformers 5.x rebuilds CLIP's NFC normalizer (and ignores the vocabulary files): a cached tokenizer
    that differs from CLIP's ids must stop the run, not train on other captions."""
    built = json.loads((clip_tokenizer_folder() / 'tokenizer.json').read_text())
    assert built['normalizer'] is None
    shutil.copytree(clip_tokenizer_folder(), tmp_path / 'nfc')
    (tmp_path / 'nfc' / 'tokenizer.json').write_text(json.dumps({**built, 'normalizer': {'type': 'NFC'}}))
    monkeypatch.setattr(tokenizer, 'clip_tokenizer_folder', lambda: tmp_path / 'nfc')
    with pytest.raises(TokenizerError) as refused:
        CaptionTokenizer()('a cat')
    assert 'gives ids [49406, 157, 118, 501, 4166, 49407]' in str(refused.value)
    assert 'where CLIP gives [339, 136, 486, 4166]' in str(refused.value)
    assert 'delete that folder and run again' in str(refused.value)


def test_the_builtin_tokenizer_loads_once_per_length_and_again_when_its_file_changes(tmp_path, monkeypatch):
    """A process loads the built-in tokenizer once for each caption length; a file written anew (a folder deleted
    and built again, by this run or another) is loaded and checked again."""
    shutil.copytree(clip_tokenizer_folder(), tmp_path / 'clip')
    monkeypatch.setattr(tokenizer, 'clip_tokenizer_folder', lambda: tmp_path / 'clip')
    monkeypatch.setattr(tokenizer, 'BUILTIN_BACKENDS', {})
    loaded = []
    monkeypatch.setattr(
        tokenizer, 'Tokenizer', SimpleNamespace(from_file=lambda path: loaded.append(path) or Tokenizer.from_file(path))
    )
    cat = CaptionTokenizer()('a cat')
    assert torch.equal(CaptionTokenizer()('a cat'), cat) and len(loaded) == 1
    short = CaptionTokenizer(length=4)('a photo of a cat')
    assert short.tolist() == [49406, 320, 1125, 49407] and len(loaded) == 2
    assert torch.equal(CaptionTokenizer()('a cat'), cat) and len(loaded) == 2
    built = json.loads((tmp_path / 'clip' / 'tokenizer.json').read_text())
    (tmp_path / 'clip' / 'tokenizer.json').write_text(json.dumps({**built, 'normalizer': {'type': 'NFC'}}))
    with pytest.raises(TokenizerError, match='delete that folder and run again'):
        CaptionTokenizer()('a cat')
    assert len(loaded) == 3


# ------------------------------------------------------------------------------------------- images


def reference_resize_crop(image: Image.Image, size: int) -> torch.Tensor:
    """Resize the shorter side, then center-crop: the textbook pipeline (torchvision Resize + CenterCrop)."""
    width, height = image.size
    scale = size / min(width, height)
    image = image.resize((round(width * scale), round(height * scale)), Image.BILINEAR)
    left, top = (image.width - size) // 2, (image.height - size) // 2
    array = np.asarray(image.crop((left, top, left + size, top + size)), dtype=np.float32)
    return torch.from_numpy(array).permute(2, 0, 1) / 127.5 - 1


def blocks_png(size: tuple[int, int]) -> bytes:
    """A PNG of 4x4-pixel blocks of random colors: sharp edges, so that a crop one pixel off changes most pixels."""
    rng = np.random.default_rng(3)
    blocks = rng.integers(0, 256, (size[1] // 4, size[0] // 4, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(blocks).resize(size, Image.NEAREST).save(buffer, 'PNG')
    return buffer.getvalue()


@pytest.mark.parametrize('source', [(96, 64), (64, 128), (256, 128), (128, 256), (1024, 512)])
def test_shorter_side_resize_and_center_crop(source):
    """Sizes whose resized shorter side and centered crop fall on whole pixels: the same pixels as the textbook
    resize-then-crop, exactly (a crop one pixel off differs by 0.2-0.4 on average)."""
    data = blocks_png(source)
    image = decode_image(data, 64)
    assert image.shape == (3, 64, 64) and image.dtype == torch.uint8
    image = unit_range(image)
    assert image.dtype == torch.float32 and -1 <= image.min() and image.max() <= 1
    assert torch.equal(image, reference_resize_crop(Image.open(io.BytesIO(data)).convert('RGB'), 64))


def test_a_large_jpeg_decoded_in_draft_mode_is_close_to_the_full_decode():
    """1024x768 to 64px is decoded at 1/8 scale in the DCT domain: close to the full decode, not equal."""
    data = jpeg(3, (1024, 768))
    drafted, full = unit_range(decode_image(data, 64)), unit_range(decode_image(data, 64, draft=False))
    assert 0 < (drafted - full).abs().mean() < 0.02


def test_draft_mode_decodes_large_jpegs_at_reduced_scale(monkeypatch):
    from PIL import JpegImagePlugin

    scales = []
    draft = JpegImagePlugin.JpegImageFile.draft

    def spy(self, mode, size):
        result = draft(self, mode, size)
        scales.append(self.decoderconfig[0])
        return result

    monkeypatch.setattr(JpegImagePlugin.JpegImageFile, 'draft', spy)
    for source in [(1024, 1024), (1365, 1024), (768, 512), (640, 512)]:
        decode_image(jpeg(0, source), 512)
    assert scales == [2, 2, 1, 1]  # never below the target: 1024 -> 512, 768 -> 768


def encoded(image: Image.Image, format: str, **save) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format, **save)
    return buffer.getvalue()


def test_any_mode_becomes_rgb():
    gray = Image.new('L', (40, 30), 128)
    transparent = Image.new('RGBA', (40, 30), (255, 0, 0, 0))  # red, fully transparent: white once composited
    cmyk = Image.new('CMYK', (40, 30), (0, 255, 255, 0))  # red in CMYK
    deep = Image.fromarray(np.full((30, 40), 32768, dtype=np.uint16))  # mid-gray at 16 bits
    palette = Image.new('P', (40, 30), 3)
    palette.putpalette([0, 0, 0] * 3 + [0, 0, 255] + [0, 0, 0] * 252)
    cases = {
        'L': (encoded(gray, 'JPEG'), (128, 128, 128)),
        'RGBA': (encoded(transparent, 'PNG'), (255, 255, 255)),
        'CMYK': (encoded(cmyk, 'JPEG'), (255, 0, 0)),
        'I;16': (encoded(deep, 'PNG'), (128, 128, 128)),
        'P': (encoded(palette, 'PNG'), (0, 0, 255)),
        'LA': (encoded(Image.new('LA', (40, 30), (0, 255)), 'PNG'), (0, 0, 0)),
        '1': (encoded(Image.new('1', (40, 30), 1), 'PNG'), (255, 255, 255)),
    }
    for mode, (data, rgb) in cases.items():
        image = decode_image(data, 16)
        assert image.shape == (3, 16, 16), mode
        assert image[:, 8, 8].tolist() == pytest.approx(rgb, abs=3), mode


def test_exif_orientation_is_applied():
    # Stored 96x64, left half red and right half blue, with Orientation 6 ("rotate 90 clockwise to view"):
    # viewed upright it is 64x96 with red on top, so the center crop's top rows are red, bottom rows blue.
    stored = Image.new('RGB', (96, 64), (255, 0, 0))
    stored.paste((0, 0, 255), (48, 0, 96, 64))
    exif = Image.Exif()
    exif[0x0112] = 6
    image = decode_image(encoded(stored, 'JPEG', exif=exif.tobytes()), 32)
    top, bottom = image[:, 2, 16].tolist(), image[:, 29, 16].tolist()
    assert top[0] > 230 and top[2] < 25, top
    assert bottom[2] > 230 and bottom[0] < 25, bottom


def test_collate_keeps_the_image_layout_and_values():
    samples = [
        {'image': decode_image(jpeg(i), 32), 'input_ids': torch.full((77,), i), 'sample_id': i} for i in range(3)
    ]
    batch = collate(samples)
    assert batch['image'].shape == (3, 3, 32, 32) and batch['image'].dtype == torch.uint8
    assert all(torch.equal(batch['image'][i], samples[i]['image']) for i in range(3))
    assert batch['sample_id'].tolist() == [0, 1, 2] and batch['input_ids'].shape == (3, 77)
    assert unit_range(batch['image']).is_contiguous()


def test_the_model_maps_uint8_images_to_the_vae_range():
    from test_benchmark import fixed_randomness, tiny_model

    model = tiny_model()
    images = torch.randint(0, 256, (2, 3, 64, 64), dtype=torch.uint8)
    batch = fixed_randomness({'image': images, 'input_ids': torch.zeros(2, 77, dtype=torch.long)})
    as_float = {**batch, 'image': images.float() / 127.5 - 1}
    torch.testing.assert_close(model(batch), model(as_float))


# -------------------------------------------------------------------------------------- bad samples


def corrupt_huffman_table(data: bytes) -> bytes:
    start = data.find(b'\xff\xc4') + 4
    return data[:start] + b'\xff' * 20 + data[start + 20 :]


def bomb(data: bytes) -> bytes:
    """A small JPEG whose header claims 60000x60000 pixels: Pillow would allocate 10 GB to decode it."""
    frame = data.find(b'\xff\xc0') + 5
    return data[:frame] + (60000).to_bytes(2, 'big') * 2 + data[frame + 4 :]


BAD = {
    'empty bytes': ({'jpg': b''}, 'empty image bytes'),
    'truncated jpeg': ({'jpg': jpeg(5)[:600]}, 'corrupt image'),
    'corrupt jpeg': ({'jpg': corrupt_huffman_table(jpeg(5))}, 'corrupt image'),
    'html error page': ({'jpg': b'<!DOCTYPE html><html><body>403 Forbidden</body></html>'}, 'not an image'),
    'decompression bomb': ({'jpg': bomb(jpeg(5))}, 'decompression bomb'),
    'missing caption': ({'caption': None}, 'missing or non-string caption'),
    'non-string caption': ({'caption': 12345}, 'missing or non-string caption'),
}


def test_conversions_cheap_check_rejects_what_the_loader_rejects_and_keeps_the_rest():
    """convert.py checks each image with check_image (1/8 scale, nothing resized): it must skip exactly what
    decode_image would refuse at training time, for the same reason."""
    images = {f'bad: {kind}': change['jpg'] for kind, (change, _) in BAD.items() if 'jpg' in change}
    images |= {
        'bad: a PNG cut short': encoded(Image.new('RGB', (64, 48), (9, 9, 9)), 'PNG')[:80],
        'good: JPEG 640x480': jpeg(3, size=(640, 480)),
        'good: CMYK JPEG': encoded(Image.new('CMYK', (40, 30), (0, 255, 255, 0)), 'JPEG'),
        'good: 16-bit PNG': encoded(Image.fromarray(np.full((30, 40), 32768, dtype=np.uint16)), 'PNG'),
        'good: a 2x1 JPEG': encoded(Image.new('RGB', (2, 1)), 'JPEG'),
    }

    def refusal(check, data):
        try:
            check(data)
        except BadSample as error:
            return error.kind
        return None

    for name, data in images.items():
        loader = refusal(lambda d: decode_image(d, 32), data)
        assert refusal(check_image, data) == loader, name
        assert (loader is None) == name.startswith('good'), (name, loader)


@pytest.mark.parametrize('kind', BAD)
def test_bad_sample_is_replaced_counted_and_reported_once(kind, tmp_path, caplog):
    change, reason = BAD[kind]
    samples = good_samples(10)
    samples[4] = {**samples[4], **change}
    # A json caption column can hold what a str column cannot: null, numbers.
    location = write_dataset(tmp_path / 'mds', samples, {'jpg': 'bytes', 'caption': 'json'})
    dataset = StreamingLAIONDataset(local=location, image_size=32, shuffle=False, batch_size=1)
    with caplog.at_level(logging.WARNING, logger='data'):
        for _ in range(2):  # two epochs: reported once
            seen = list(dataset)
            assert [s['sample_id'] for s in seen] == list(range(10))
            assert [s['bad_samples'] for s in seen] == [0] * 4 + [1] + [0] * 5
            assert torch.equal(seen[4]['image'], seen[5]['image'])  # the next good sample, deterministically
            assert torch.equal(seen[4]['input_ids'], seen[5]['input_ids'])
    reports = [r.getMessage() for r in caplog.records if 'bad sample' in r.getMessage()]
    assert len(reports) == 1, reports
    assert f'bad sample 4 (shard shard.00000.mds, row 4, of {location}): {reason}' in reports[0]
    assert 'trained on sample 5 instead' in reports[0]


def test_bad_sample_lookup_is_per_shard_row(tmp_path, caplog):
    samples = good_samples(12)
    samples[9]['jpg'] = b''
    location = write_dataset(tmp_path / 'mds', samples, size_limit=4 * len(samples[0]['jpg']))
    with caplog.at_level(logging.WARNING, logger='data'):
        images(location)
    shard = [r.getMessage() for r in caplog.records if 'bad sample 9 ' in r.getMessage()]
    assert len(shard) == 1 and 'shard shard.00000.mds' not in shard[0] and ', row ' in shard[0]


def mostly_bad_dataset(folder, size) -> str:
    """Three of every four samples are failed downloads (empty bytes)."""
    samples = good_samples(size)
    for i in range(size):
        if i % 4:
            samples[i]['jpg'] = b''
    return write_dataset(folder, samples)


def test_mostly_bad_dataset_stops_with_a_clear_error(tmp_path):
    location = mostly_bad_dataset(tmp_path / 'mds', 40)
    with pytest.raises(DataError, match=rf'{location}: \d+ of the 32 samples read are bad .*empty image bytes'):
        images(location)


@pytest.mark.slow
def test_training_on_a_mostly_bad_dataset_ends_with_one_error_line(tmp_path):
    location = mostly_bad_dataset(tmp_path / 'mds', 160)
    run = run_process(
        [
            sys.executable,
            str(REPO / 'benchmark.py'),
            '--model_name',
            'tiny',
            '--local',
            location,
            '--image_size',
            '32',
            '--batch_size',
            '4',
            '--max_duration',
            '1ep',
            '--num_workers',
            '2',
        ],
        cwd=tmp_path,
        timeout=300,
    )
    assert run.returncode == 1
    # Raised in a loader worker, reported as its reason alone (the progress bar may share the line).
    errors = re.findall(r'error: (.*)', run.stderr)
    assert len(errors) == 1 and errors[0].startswith(f'{location}: ') and 'samples read are bad' in errors[0]
    assert 'Traceback' not in run.stderr


def test_missing_dataset_and_wrong_columns(tmp_path):
    with pytest.raises(DataError, match='no Streaming dataset at .*index.json is missing'):
        StreamingLAIONDataset(local=str(tmp_path / 'nothing'))
    location = write_dataset(tmp_path / 'mds', [{'image': b'x', 'text': 'y'}], {'image': 'bytes', 'text': 'str'})
    with pytest.raises(DataError, match=r"columns \['image', 'text'\]; expected jpg"):
        StreamingLAIONDataset(local=location)


def test_bad_flag_combinations():
    with pytest.raises(ConfigError, match='--use_synth_data trains on random tensors'):
        resolve_config(parse_args(['--model_name', 'tiny', '--use_synth_data', '--local', '/tmp/x']))
    with pytest.raises(ConfigError, match='--tokenizer /nowhere: no such folder'):
        resolve_config(parse_args(['--model_name', 'tiny', '--local', '/tmp/x', '--tokenizer', '/nowhere']))


# ----------------------------------------------------------------------------------------- training


class RecordSamples(Callback):
    """Sample ids of every batch the trainer receives."""

    def __init__(self, stop_after: int | None = None):
        self.batches = []
        self.stop_after = stop_after

    def after_dataloader(self, state, logger):
        if self.stop_after is not None and len(self.batches) == self.stop_after:
            raise RuntimeError('simulated crash')  # the checkpoint of batch `stop_after` is on disk
        self.batches.append(state.batch['sample_id'].tolist())


TINY = ['--model_name', 'tiny', '--image_size', '64']


def test_training_from_a_local_mds_dataset_logs_bad_samples(tmp_path, capfd):
    samples = good_samples(32)
    samples[3]['jpg'] = samples[17]['jpg'] = b''
    location = write_dataset(tmp_path / 'mds', samples)
    results = tmp_path / 'results.json'
    trainer = main(
        settled(
            TINY + ['--local', location, '--batch_size', '8', '--max_duration', '1ep', '--results_json', str(results)]
        )
    )
    assert int(trainer.state.timestamp.batch) == 4
    summary = json.loads(results.read_text())
    assert summary['bad_samples'] == 2 and summary['img_per_sec'] > 0
    assert 'data: 2 bad read(s) of 2 bad sample(s), each read replaced' in capfd.readouterr().out
    assert summary['bad_samples_distinct'] == 2
    # Two epochs read each bad sample twice: 4 reads of the same 2 samples.
    main(settled(TINY + ['--local', location, '--batch_size', '8', '--max_duration', '2ep']))
    assert 'data: 4 bad read(s) of 2 bad sample(s)' in capfd.readouterr().out


@pytest.mark.stack
def test_default_run_builds_and_trains_on_the_sample_dataset(tmp_path, monkeypatch, capfd):
    monkeypatch.setattr(run_data, 'SAMPLE_DATASET', tmp_path / 'sample-mds')
    record = RecordSamples()
    trainer = main(settled(['--model_name', 'tiny', '--batch_size', '8', '--max_duration', '3ba']), (record,))
    assert 'training on the sample dataset' in capfd.readouterr().out
    assert (tmp_path / 'sample-mds' / 'index.json').is_file()
    assert int(trainer.state.timestamp.batch) == 3 and len(record.batches) == 3
    sample = StreamingLAIONDataset(local=str(tmp_path / 'sample-mds'), image_size=64, batch_size=1)[0]
    assert sample['input_ids'][0] == 49406 and sample['image'].shape == (3, 64, 64)


def test_a_streaming_dataset_keeps_one_descriptor_per_shared_memory_block(tmp_path):
    """Streaming keeps every block of shared memory until the process exits: a new dataset keeps the mapping of
    each of its 6 blocks (one descriptor each), but neither the blocks' own descriptors nor its attachments to the
    other datasets' blocks, which it reads to pick its prefix (streaming_fixes): 216 a dataset here before, and
    the suite in two processes ran out at 20,000."""
    location = write_dataset(tmp_path / 'mds', good_samples(8))

    def shared_memory_descriptors() -> set[tuple[str, str]]:
        """This process's descriptors of /dev/shm, each as (number, target): a descriptor that another test's
        dataset, collected meanwhile, closes cannot hide a new one."""
        found = set()
        for number in os.listdir('/proc/self/fd'):
            with contextlib.suppress(OSError):  # the listing's own descriptor, closed by now
                target = os.readlink(f'/proc/self/fd/{number}')
                if target.startswith('/dev/shm/'):
                    found.add((number, target))
        return found

    StreamingLAIONDataset(local=location, image_size=32, batch_size=4)  # imports and caches settled first
    before = shared_memory_descriptors()
    datasets = [StreamingLAIONDataset(local=location, image_size=32, batch_size=4) for _ in range(3)]
    blocks = 6  # barrier, locals, next_epoch, cache_usage, shard_states, shard_access_times
    new = shared_memory_descriptors() - before
    assert 0 < len(new) <= 3 * blocks, sorted(new)
    assert all(dataset[0]['image'].shape == (3, 32, 32) for dataset in datasets)  # the mappings still read


@pytest.mark.slow
@pytest.mark.parametrize('workers, ema', [(0, False), (2, True)], ids=['0 workers', '2 workers, EMA'])
def test_mid_epoch_resumption_is_exact(workers, ema, tmp_path, monkeypatch, capfd):
    """Stopped after batch 2 of 6 and resumed: the same remaining batches, and bitwise the same weights (and
    average) as an uninterrupted run: the noise and timesteps continue where the checkpoint left them. The first
    two runs are given 2 CPU threads; the resumed one, given none, takes its checkpoint's count."""
    monkeypatch.delenv('OMP_NUM_THREADS', raising=False)
    location = write_dataset(tmp_path / 'mds', good_samples(24))
    flags = TINY + ['--local', location, '--batch_size', '4', '--max_duration', '1ep', '--num_workers', str(workers)]
    flags += ['--use_ema'] if ema else []
    uninterrupted = RecordSamples()
    expected = final_weights(main(settled([*flags, '--cpu_threads', '2']), (uninterrupted,)))
    assert len(uninterrupted.batches) == 6
    assert sorted(i for batch in uninterrupted.batches for i in batch) == list(range(24))

    checkpoints = [*flags, '--run_name', 'resume', '--save_folder', str(tmp_path / 'ckpt'), '--save_interval', '2ba']
    crashed = RecordSamples(stop_after=2)
    with pytest.raises(RuntimeError, match='simulated crash'):
        main(settled([*checkpoints, '--cpu_threads', '2']), (crashed,))
    capfd.readouterr()
    resumed = RecordSamples()
    trainer = main(settled([*checkpoints, '--autoresume']), (resumed,))
    assert crashed.batches == uninterrupted.batches[:2]
    assert resumed.batches == uninterrupted.batches[2:]
    assert int(trainer.state.timestamp.batch) == 6
    weights = final_weights(trainer)
    assert weights.keys() == expected.keys() and any(name.startswith('ema.') for name in weights) == ema
    different = [name for name in expected if not torch.equal(weights[name], expected[name])]
    assert different == []
    if workers == 0:  # the checkpoint's 2 threads, where this process would take the default 1
        assert "cpu threads: 2, the checkpoint's (this process would choose 1)" in capfd.readouterr().out
        assert torch.get_num_threads() == 2


@pytest.mark.slow
def test_two_ranks_see_every_sample_of_an_epoch_exactly_once(tmp_path):
    location = write_dataset(tmp_path / 'mds', good_samples(48))
    env = {**os.environ, 'PYTHONPATH': str(REPO), 'HF_HUB_OFFLINE': '1', 'WANDB_MODE': 'offline'}
    run = run_process(
        [
            LAUNCHER,
            '-n',
            '2',
            str(REPO / 'tests' / 'record_samples.py'),
            str(tmp_path / 'ids'),
            *TINY,
            '--local',
            location,
            '--batch_size',
            '8',
            '--max_duration',
            '1ep',
        ],
        cwd=REPO,
        env=env,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    per_rank = [json.loads((tmp_path / 'ids' / f'rank{rank}.json').read_text()) for rank in range(2)]
    assert all(len(batches) == 6 and all(len(batch) == 4 for batch in batches) for batches in per_rank)
    seen = [i for batches in per_rank for batch in batches for i in batch]
    assert sorted(seen) == list(range(48))
    assert not set(sum(per_rank[0], [])) & set(sum(per_rank[1], []))
    # One process group per rank for the whole run: Streaming and Composer reuse benchmark.py's. (Streaming
    # making and destroying its own, twice, on the same port as Composer's next one, hung a rank now and then.)
    assert [(tmp_path / 'ids' / f'rank{rank}.groups').read_text() for rank in range(2)] == ['1', '1']


def test_bad_sample_class_carries_its_kind():
    with pytest.raises(BadSample) as error:
        decode_image(b'', 8)
    assert error.value.kind == 'empty image bytes' and 'failed download' in str(error.value)
