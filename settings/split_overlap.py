"""Images a validation split shares with the training set. A validation loss over images the run trains on
measures nothing held out, and nothing else would show it: the run validates, the loss falls, exit 0.

Checked at start by each image's bytes (a 64-bit xxh3 digest), where the training set and the split are local
folders of convert.py's columns and the training set's shards are small enough to read in seconds; otherwise the
start lines say it was not checked, and why.
"""

from pathlib import Path

from guards.arguments import ConfigError
from settings.dataset_checks import read_index

MAX_TRAINING_BYTES = 2 << 30  # read whole at start: seconds from a local disk
REFUSED_SHARE = 0.05  # of the split's images also trained on: more is no held-out split (LAION repeats a few images)


def image_digests(folder: str, shards: list[dict]) -> list[int] | str:
    """The xxh3 digest of each image of a local MDS dataset of convert.py's columns (its index's `shards`), or why
    they cannot be read cheaply."""
    import xxhash
    from streaming.base.format import reader_from_json

    if any(
        dict(zip(s.get('column_names') or [], s.get('column_encodings') or [])).get('jpg') != 'bytes' for s in shards
    ):
        return 'its images are not a column of bytes'
    if any(not (Path(folder) / shard['raw_data']['basename']).is_file() for shard in shards):
        return 'its shards are compressed'
    digests = []
    for shard in shards:
        reader = reader_from_json(folder, None, shard)
        digests += [xxhash.xxh3_64_intdigest(reader.get_item(index)['jpg']) for index in range(shard['samples'])]
    return digests


def shared_images(training: str, split: str) -> tuple[int, int] | str:
    """(images of the split also in the training set, images of the split), or why it was not checked."""
    training_shards = read_index(training, training, (training,))
    size = sum(shard['raw_data'].get('bytes') or 0 for shard in training_shards)
    if size > MAX_TRAINING_BYTES:
        return f'the training set is {size / 2**30:.1f} GiB, more than the {MAX_TRAINING_BYTES >> 30} GiB read at start'
    held_out = image_digests(split, read_index(split, split, (split,)))
    if isinstance(held_out, str):
        return f'the split: {held_out}'
    trained = image_digests(training, training_shards)
    if isinstance(trained, str):
        return f'the training set: {trained}'
    trained = set(trained)
    return sum(digest in trained for digest in held_out), len(held_out)


def check_split_overlap(training: str, split: str, notes: list) -> None:
    """Refuses a split whose images are mostly trained on; notes a few shared, or why nothing was checked. Both
    local folders of images and captions."""
    found = shared_images(training, split)
    if isinstance(found, str):
        notes.append(f'validation split {split}: not checked for images the run trains on ({found})')
        return
    shared, total = found
    if shared > REFUSED_SHARE * total:
        raise ConfigError(
            f'validation split {split}: {shared} of its {total} images are also in the training set {training} (the '
            'same bytes), so its loss would not measure held-out data; convert the split apart from the training '
            'images (convert.py --validation_fraction holds some out and writes them in OUT/validation)'
        )
    if shared:
        notes.append(
            f'validation split {split}: {shared} of its {total} images are also in the training set (the same '
            'bytes; repeated images are common in web data)'
        )
