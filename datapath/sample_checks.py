"""The one check every conversion route applies to a sample (convert.py's processes and the Spark route alike), so
that both keep and skip the same samples: what the training loader would reject is skipped, with its reason.

Light on purpose (no Streaming): a Spark executor imports it with nothing else of this repo.
"""

from datapath.images import BadSample, check_image


def why_unusable(image: bytes, caption) -> str | None:
    """Why the training loader would reject a sample (its caption not text, its image not decodable), or None."""
    if isinstance(caption, bytes):
        try:
            caption = caption.decode('utf-8')
        except UnicodeDecodeError:
            return 'caption is not UTF-8'
    if not isinstance(caption, str):
        return 'caption is not text'
    try:
        check_image(image)
    except BadSample as error:
        return error.kind
    return None


def usable_sample(image, caption) -> dict | str:
    """The MDS sample written for an image and its caption ({'jpg': the bytes as they are, 'caption': text}), or the
    reason it is skipped."""
    if image is None:
        return 'no image'
    if caption is None:
        return 'no caption'
    reason = why_unusable(image, caption)
    if reason is not None:
        return reason
    if isinstance(caption, bytes):
        caption = caption.decode('utf-8')
    return {'jpg': bytes(image), 'caption': caption.strip()}
