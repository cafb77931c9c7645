"""Checkpoint uploads to a remote --save_folder that fail for good: the file kept on local disk, not lost, and the run
ended in one line that says where it is.

Composer uploads each checkpoint from a staging copy in a process pool (composer.utils.remote_uploader), retrying
transient errors; when the retries are spent the worker raises, the copy is deleted with the staging folder at exit,
and the run ends in the worker's traceback. Here the pool runs `upload_or_keep` instead (installed by
composer_fixes.keep_failed_uploads), which moves the copy of a file that could not be uploaded to a local folder under
its remote name, and raises UploadFailed, one line that crosses the process boundary (a plain string)."""

import concurrent.futures
import shutil
from pathlib import Path

from composer.utils import remote_uploader

# Composer's own upload, by the name it has in a pool process: the pool spawns its processes, which import this
# module afresh and never install the patch; the replacement reaches them pickled by reference to upload_or_keep.
from composer.utils.remote_uploader import _upload_file_to_object_store as upload_to_object_store


class UploadFailed(Exception):
    """A file of the run that was not uploaded after its retries; the message names it, why, and where it is kept."""


def settle_failed_uploads(uploader: remote_uploader.RemoteUploader) -> None:
    """Waits for the uploads still in flight (a failure among them keeps its file too) and forgets them, so that
    Composer does not report the failure a second time as the Trainer closes."""
    concurrent.futures.wait(uploader.futures)
    uploader.futures = []


def upload_or_keep(keep_in: str, remote_file_name: str, local_file_path: str, **upload) -> int:
    """Composer's upload of one staged file; where it fails for good, the file moved to keep_in/remote_file_name."""
    try:
        return upload_to_object_store(remote_file_name=remote_file_name, local_file_path=local_file_path, **upload)
    except Exception as error:
        kept = Path(keep_in, remote_file_name)
        kept.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(local_file_path, kept)
        raise UploadFailed(f'uploading {remote_file_name} failed after its retries ({reason(error)}); kept as {kept}')


def reason(error: BaseException) -> str:
    """The object store's answer (its error code and message, as botocore reads them), else the error's last line."""
    seen = error
    while seen is not None:
        answer = getattr(seen, 'response', None)
        if isinstance(answer, dict) and answer.get('Error'):
            code, message = answer['Error'].get('Code'), answer['Error'].get('Message')
            return ': '.join(str(part) for part in (code, message) if part)
        seen = seen.__cause__ or seen.__context__
    lines = str(error).strip().splitlines()
    return lines[-1] if lines else type(error).__name__
