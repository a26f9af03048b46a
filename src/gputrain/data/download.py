"""``data.download=true``: fetch a data set that torchvision offers into ``data.root``, once per node.

CIFAR-10 is the one built-in format torchvision downloads. Its archive comes from torchvision's URL and is
checked against torchvision's md5 (``data.download_url`` and ``data.download_md5`` name a mirror and its
checksum instead), with torchvision's own download and extraction utilities. The launcher runs this before
any worker starts, so each node downloads once and its workers read the extracted files.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gputrain.config import RunConfig

DOWNLOADABLE = {"classification:cifar10"}
"""``task:data.format`` pairs whose data torchvision can download."""


def cifar10_source(url: str = "", md5: str = "") -> tuple[str, str, str]:
    """(url, archive file name, md5): torchvision's unless a mirror is given."""
    import torchvision

    tv = torchvision.datasets.CIFAR10
    return url or tv.url, Path(url).name if url else tv.filename, md5 or tv.tgz_md5


def download_data(cfg: RunConfig) -> None:
    """Download and extract ``cfg``'s data set into ``data.root`` unless it is there (one ``ValueError`` line)."""
    if not cfg.data.download:
        return
    kind = f"{cfg.task}:{cfg.data.format}"
    if kind not in DOWNLOADABLE:
        raise ValueError(f"data.download=true: torchvision downloads CIFAR-10 only (task classification with "
                         f"data.format=cifar10), not task={cfg.task} data.format={cfg.data.format or '(none)'}; "
                         f"drop data.download and point data.root at your files")
    from torchvision.datasets.utils import check_integrity, download_and_extract_archive

    from gputrain.data.cifar10 import META_FILE, batches_folder

    root = Path(cfg.data.root)
    if (batches_folder(root) / META_FILE).is_file():
        return  # already here: the dataset checks every file's md5 before reading it
    url, filename, md5 = cifar10_source(cfg.data.download_url, cfg.data.download_md5)
    try:
        download_and_extract_archive(url, download_root=str(root), filename=filename, md5=md5)
    except (OSError, RuntimeError) as err:  # URLError is an OSError; a checksum mismatch a RuntimeError
        archive = root / filename
        if archive.is_file() and not check_integrity(str(archive), md5):
            archive.unlink()  # a damaged archive must not be taken for the data next time
            raise ValueError(f"data.download: {url} does not match md5 {md5}; the file was removed. Check "
                             f"data.download_url/data.download_md5, or download it by hand into {root}") from None
        reason = str(getattr(err, "reason", "") or err).splitlines()[0]
        raise ValueError(f"data.download: cannot download {url} ({reason}); put {filename} in {root} and run "
                         f"again (it is checked and extracted there), or set data.download_url to a mirror") from None
