"""Checkpoint files that are whole or absent: durable temporaries renamed into place, and what may go into them.

Every file is written to ``.<name>.<random>.tmp`` in its folder, fsync'ed, and renamed over its final name: a
reader, or a run killed at any instant, sees the old file or the whole new one. The temporary is created with
mode 0o666 less the umask, as ``open(path, "w")`` would, so a team on a shared cluster can read the result.
Temporaries left by a killed worker are removed by :func:`remove_stale_temporaries` at the next start.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import zipfile
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import torch

TEMPORARY = re.compile(r"^\..+\.[A-Za-z0-9_]+\.tmp$")  # ours (token_hex) and the old mkstemp names

Write = Callable[[Any, Path, str], tuple[Path, int, dict[str, str]]]
"""How a checkpoint's temporary is written: ``(state, folder, name) -> (temporary, size, checksum entry)``; tests
give their own (one that pauses mid-write, or fails) to :meth:`~gputrain.checkpoint.store.CheckpointStore.save`."""


class _ChecksumWriter:
    """What ``torch.save`` writes to: passes bytes on to the file, counting them, and with ``crc`` updating a
    CRC-32 of the whole file (needed only where torch writes its zip records without their CRC-32s)."""

    def __init__(self, file: BinaryIO, *, crc: bool) -> None:
        self.file = file
        self.size = 0
        self.crc: int | None = 0 if crc else None

    def write(self, data: bytes | memoryview) -> int:
        written = self.file.write(data)
        if self.crc is not None:
            self.crc = zlib.crc32(data, self.crc)
        self.size += written
        return written

    def flush(self) -> None:
        self.file.flush()


def open_temporary(folder: Path, name: str) -> tuple[Path, int]:
    """A new ``.<name>.<random>.tmp`` opened for writing with the permissions a plain ``open`` gives."""
    for _ in range(100):
        path = folder / f".{name}.{secrets.token_hex(4)}.tmp"
        try:
            # O_EXCL: never write into a file someone else holds; 0o666 & ~umask, like open(path, "w").
            return path, os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary name for {name} in {folder}; run remove_stale_temporaries on it")


def write_temporary(obj: Any, folder: Path, name: str) -> tuple[Path, int, dict[str, str]]:
    """``torch.save`` into a durable temporary of ``folder`` for ``name``: (path, size, its checksum entry).

    The checksum entry is ``{"zip_crc32": ...}`` (:func:`zip_records_crc32`): torch
    computes the CRC-32 of every record as it writes the zip, so a second pass over the same bytes would only
    repeat it (a third of the CPU time of a save of 135 MB on the test machine). Where the user turned torch's
    record CRCs off (``torch.serialization.set_crc32_options(False)``) it is ``{"crc32": ...}``, the CRC-32 of the
    whole file computed as it is written.
    """
    path, fd = open_temporary(folder, name)
    try:
        with os.fdopen(fd, "wb") as f:
            writer = _ChecksumWriter(f, crc=not torch_writes_record_crcs())
            torch.save(obj, writer)  # type: ignore[arg-type]  # anything with write() and flush()
            f.flush()
            if f.tell() != writer.size:  # torch.save seeked: the checksum would not hold
                raise RuntimeError(f"torch.save wrote {writer.size} bytes but {path} ends at byte {f.tell()}")
            os.fsync(f.fileno())
        checksum = {"crc32": f"{writer.crc:08x}"} if writer.crc is not None else {"zip_crc32": zip_records_crc32(path)}
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    return path, writer.size, checksum


def zip_records_crc32(path: Path) -> str:
    """CRC-32 of a torch zip's central directory as zipfile reads it (each record's name, CRC-32, size, offset).

    With :func:`zipfile.ZipFile.testzip` (every record's bytes against its CRC-32) it covers what loading reads:
    the central directory is read from the end of the file, not the whole file. Raises ``zipfile.BadZipFile``.
    """
    with zipfile.ZipFile(path) as archive:
        listing = "".join(f"{i.filename}\t{i.CRC:08x}\t{i.file_size}\t{i.compress_size}\t{i.compress_type}\t"
                          f"{i.header_offset}\n" for i in archive.infolist())
    return f"{zlib.crc32(listing.encode()):08x}"


def torch_writes_record_crcs() -> bool:
    """Whether ``torch.save`` stores each zip record's CRC-32 (its default; torch before 2.6 always does)."""
    get = getattr(torch.serialization, "get_crc32_options", None)
    return bool(get()) if get is not None else True


def link_or_copy(src: Path, folder: Path, name: str) -> Path:
    """A second temporary for ``name`` holding ``src``'s bytes: a hard link (nothing copied) where possible."""
    for _ in range(100):
        dst = folder / f".{name}.{secrets.token_hex(4)}.tmp"
        try:
            os.link(src, dst)
            return dst
        except FileExistsError:
            continue
        except OSError:  # file systems without hard links (some FUSE and SMB mounts): copy below
            break
    dst, fd = open_temporary(folder, name)
    os.close(fd)
    shutil.copyfile(src, dst)
    with open(dst, "rb+") as f:
        os.fsync(f.fileno())
    return dst


def fsync_folder(folder: Path) -> None:
    """A rename is durable only once the folder entry is on disk too."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_save(obj: Any, path: str | Path) -> Path:
    """``torch.save`` to ``path`` so that readers see the old file or the whole new one, never a part.

    The file gets the permissions ``open(path, "w")`` would give. It is not entered in a manifest: a run's
    checkpoints go through :class:`~gputrain.checkpoint.store.CheckpointStore`.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp, _, _ = write_temporary(obj, path.parent, path.name)
    try:
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_folder(path.parent)
    return path


def remove_stale_temporaries(folder: str | Path) -> list[Path]:
    """Delete the ``.<name>.*.tmp`` files a worker killed mid-save left in ``folder``; returns them.

    Call it only while nothing writes to ``folder`` (at the start of a run, on rank 0).
    """
    folder = Path(folder)
    if not folder.is_dir():
        return []
    removed = []
    for path in sorted(folder.iterdir()):
        if TEMPORARY.match(path.name) and path.is_file():
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


_PLAIN = (torch.Tensor, int, float, complex, bool, str, bytes, bytearray, type(None), torch.Size, torch.dtype,
          torch.device)


def check_plain(obj: Any, where: str = "state") -> None:
    """Refuse, naming the entry, anything ``torch.load(weights_only=True)`` would refuse at resume time.

    Checking the types costs about 0.3 ms for ResNet-18 with Adam (the entry's name is worked out only for a
    refusal); reading the file back would cost a third of the save.
    """
    registered = tuple(g[0] if isinstance(g, tuple) else g for g in torch.serialization.get_safe_globals())
    allowed = _PLAIN + tuple(g for g in registered if isinstance(g, type))
    stack = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple, set)):
            stack.extend(item)
        elif not isinstance(item, allowed):
            raise ValueError(
                f"checkpoint entry {_entry_path(obj, allowed, where)} is a {type(item).__module__}."
                f"{type(item).__qualname__}, which torch.load(weights_only=True) refuses; store tensors and plain "
                "containers (torch.from_numpy(x), x.tolist(), str(x)), or register the type with "
                "torch.serialization.add_safe_globals"
            )


def _entry_path(obj: Any, allowed: tuple[type, ...], where: str) -> str:
    """The name of the entry :func:`check_plain` refused: the same walk, in the same order, with the names."""
    stack = [(obj, where)]
    while stack:
        item, path = stack.pop()
        if isinstance(item, dict):
            stack.extend((v, f"{path}[{k!r}]") for k, v in item.items())
        elif isinstance(item, (list, tuple, set)):
            stack.extend((v, f"{path}[{i}]") for i, v in enumerate(item))
        elif not isinstance(item, allowed):
            return path
    return where


def tensors_finite(tensors: list[torch.Tensor]) -> bool:
    """Whether every element of every tensor is finite (not NaN, not +-inf).

    Why sums: this runs for every checkpoint and at every epoch's end, and ``isfinite(t).all()`` writes a
    mask as large as the state (73 ms for ResNet-18 with Adam on one CPU thread); a sum reads it once (6 ms).
    A sum is NaN or inf whenever an element is; the rare finite tensor whose sum overflows is checked exactly.
    """
    if not tensors:
        return True
    # float32 accumulation at least: a float16 sum overflows at 65504 and would send every tensor to the exact check.
    sums = [t.sum() if t.dtype in (torch.float32, torch.float64) or t.is_complex() else t.sum(dtype=torch.float32)
            for t in tensors]
    # One isfinite and one host sync per device and dtype, not per tensor (model_parallel's stages hold their
    # tensors on different devices, so the sums cannot all be stacked together).
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, x in enumerate(sums):
        groups.setdefault((x.device, x.dtype), []).append(i)
    flags = [True] * len(sums)
    for members in groups.values():
        for i, ok in zip(members, torch.isfinite(torch.stack([sums[i] for i in members])).tolist(), strict=True):
            flags[i] = ok
    return all(ok or bool(torch.isfinite(t).all()) for t, ok in zip(tensors, flags, strict=True))
