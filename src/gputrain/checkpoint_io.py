"""The file layer of checkpoints: durable temporaries, CRC-32 while writing, the manifest, checks.

:mod:`gputrain.checkpoint` explains the design; this module holds the pieces it and
:class:`~gputrain.checkpoint.CheckpointStore` are built from.
"""

from __future__ import annotations

import errno
import functools
import json
import math
import mmap
import os
import re
import secrets
import shutil
import struct
import sys
import threading
import zipfile
import zlib
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch

MANIFEST = "manifest.json"
TEMPORARY = re.compile(r"^\..+\.[A-Za-z0-9_]+\.tmp$")  # ours (token_hex) and the old mkstemp names
_CHUNK = 8 << 20


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
        if self.size == written and PAUSE_ENV in os.environ:
            self.file.flush()
            _pause_for_test()
        return written

    def flush(self) -> None:
        self.file.flush()

    def finish(self) -> None:
        self.file.flush()

    def close(self) -> None:
        """Nothing to give back: the file is the caller's."""


DIRECT_IO_FILE_SYSTEMS = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "f2fs", "bcachefs"})
"""Local disk file systems whose files take O_DIRECT writes of 4 KiB-aligned blocks. Elsewhere (tmpfs keeps files in
memory anyway; a network file system would send every block to the server uncached) checkpoints go through the
page cache as before."""

_ALIGN = 4096  # covers the logical block size of every common disk (512 B or 4 KiB)
_staging_lock = threading.Lock()
_staging: list[mmap.mmap] = []  # page-aligned buffers whose pages are already mapped, kept for the next save


class _DirectWriter:
    """What ``torch.save`` writes to where the file takes O_DIRECT: bytes gathered in a page-aligned staging buffer
    and written around the page cache, 8 MiB at a time, with the CRC-32 of the whole file where ``crc``.

    Why, measured on the 2-core test machine (ResNet-18 + Adam, 135 MB, a save every 4 steps in a background thread):
    through the page cache every save copied the state once more, into pages that a new file had to get from the
    kernel (300-400 ms of CPU for each of the first saves of a run, against 75-90 ms into a recycled file), so the
    next save waited for it; and the copy ran in ``write`` with the GIL held, which the training thread then waited
    for. Here the copy into the staging buffer releases the GIL (numpy), the buffer's pages stay mapped across saves,
    and no page-cache pages are taken at all. The last block is padded to the alignment; the caller cuts the file
    back to :attr:`size`.
    """

    def __init__(self, fd: int, *, crc: bool) -> None:
        self.fd = fd
        self.size = 0  # bytes torch.save handed over
        self.end = 0  # bytes written to the file (whole blocks while direct)
        self.crc: int | None = 0 if crc else None
        with _staging_lock:
            # Private: a child forked after a save gets copy-on-write pages, not the parent's staging memory.
            self._buffer = _staging.pop() if _staging else mmap.mmap(-1, _CHUNK, flags=mmap.MAP_PRIVATE)
        self._stage = np.frombuffer(self._buffer, dtype=np.uint8)
        self._fill = 0
        self._direct = True

    def write(self, data: bytes | memoryview) -> int:
        source = np.frombuffer(data, dtype=np.uint8)
        done, n = 0, source.size
        while done < n:
            take = min(_CHUNK - self._fill, n - done)
            np.copyto(self._stage[self._fill:self._fill + take], source[done:done + take])  # no GIL held for long
            self._fill += take
            done += take
            if self._fill == _CHUNK:
                self._write_out(_CHUNK)
        if self.crc is not None:
            self.crc = zlib.crc32(data, self.crc)
        self.size += n
        if self.size == n and PAUSE_ENV in os.environ:
            _pause_for_test()
        return n

    def flush(self) -> None:
        """Nothing: whole blocks go out as they fill, and the rest waits for :meth:`finish`."""

    def finish(self) -> None:
        """Write what is staged, the last block padded with zeros while direct."""
        if self._fill:
            length = -(-self._fill // _ALIGN) * _ALIGN if self._direct else self._fill
            self._stage[self._fill:length] = 0
            self._write_out(length)

    def close(self) -> None:
        """Give the staging buffer back for the next save (two are kept: a save and an atomic_save beside it)."""
        del self._stage  # numpy's view exports the buffer: mmap.close() refuses while it lives
        with _staging_lock:
            if len(_staging) < 2:
                _staging.append(self._buffer)
            else:
                self._buffer.close()

    def _write_out(self, length: int) -> None:
        view = memoryview(self._buffer)[:length]
        try:
            while view:
                try:
                    written = os.write(self.fd, view)
                except OSError as err:
                    if err.errno != errno.EINVAL or not self._direct:
                        raise
                    self._leave_direct()  # this file or device refuses direct writes after all: go through the cache
                    continue
                view = view[written:]
                self.end += written
                if written % _ALIGN and self._direct:  # a short write leaves the next one unaligned
                    self._leave_direct()
        finally:
            view.release()
        self._fill = 0

    def _leave_direct(self) -> None:
        import fcntl

        fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) & ~os.O_DIRECT)
        self._direct = False


def _direct_io(fd: int, folder: Path) -> bool:
    """Turn on O_DIRECT for ``fd`` where its file system takes it (:data:`DIRECT_IO_FILE_SYSTEMS`); False elsewhere."""
    if not hasattr(os, "O_DIRECT") or file_system_type(str(folder)) not in DIRECT_IO_FILE_SYSTEMS:
        return False
    import fcntl

    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_DIRECT)
    except OSError:
        return False
    return True


PAUSE_ENV = "GPUTRAIN_TEST_PAUSE_SAVE"
"""Test hook: a FIFO path; every checkpoint write pauses after its first bytes until a test opens the FIFO."""


def _pause_for_test() -> None:
    """Block mid-write (the temporary exists; it may hold a part) until the test opens the FIFO, then closes it, or
    kills us.

    Lets a test SIGKILL a process at a known instant inside a save, with no sleep to tune.
    """
    with open(os.environ[PAUSE_ENV], "rb") as fifo:  # opening blocks until the test opens the other end
        fifo.read()  # returns once the test closes its end


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


def write_temporary(obj: Any, folder: Path, name: str, *, reuse: Path | None = None) -> tuple[Path, int, dict[str, str]]:
    """``torch.save`` into a durable temporary of ``folder`` for ``name``: (path, size, its checksum entry).

    The checksum entry is ``{"zip_crc32": ...}`` (:func:`zip_records_crc32`): torch computes the CRC-32 of
    every record as it writes the zip, so a second pass over the same bytes would only repeat it (50-55 ms
    of CPU per 135 MB on the test machine, a third of the CPU time of such a save). Where the user turned
    torch's record CRCs off (``torch.serialization.set_crc32_options(False)``) it is ``{"crc32": ...}``, the
    CRC-32 of the whole file computed as it is written.

    ``reuse``: a retired checkpoint no one else holds (:func:`only_we_hold`), renamed to the temporary and
    overwritten in place rather than a new file created: its disk blocks and cached pages are already
    allocated, so writing and fsync take about half as long (a 135 MB state on the test machine: 17 vs 32 ms
    to write, 23 vs 42 ms to fsync, and no 22 ms unlink of the retired file), as databases recycle log files.

    On local disk file systems (:data:`DIRECT_IO_FILE_SYSTEMS`) the bytes go to the disk with O_DIRECT, around the
    page cache (:class:`_DirectWriter` says why); the file's bytes are the same either way.
    """
    fd = -1
    if reuse is not None:
        path = folder / f".{name}.{secrets.token_hex(4)}.tmp"
        try:
            os.rename(reuse, path)
            # Durable before the bytes change: after a power cut the retired name must not come back holding them.
            fsync_folder(folder)
            fd = os.open(path, os.O_WRONLY | getattr(os, "O_CLOEXEC", 0))  # no O_TRUNC: keep the blocks; cut below
        except OSError:  # someone removed it meanwhile, say: write a new file
            path.unlink(missing_ok=True)
            reuse = None
    if fd < 0:
        path, fd = open_temporary(folder, name)
    try:
        try:
            direct = _direct_io(fd, folder)
        except BaseException:
            os.close(fd)
            raise
        with os.fdopen(fd, "wb", buffering=0 if direct else -1) as f:
            crc = not torch_writes_record_crcs()
            writer = _DirectWriter(f.fileno(), crc=crc) if direct else _ChecksumWriter(f, crc=crc)
            try:
                torch.save(obj, writer)  # type: ignore[arg-type]  # anything with write() and flush()
                writer.finish()
            finally:
                writer.close()
            written = writer.end if isinstance(writer, _DirectWriter) else writer.size
            if f.tell() != written:  # torch.save seeked: the checksum would not hold
                raise RuntimeError(f"torch.save wrote {written} bytes but {path} ends at byte {f.tell()}")
            if reuse is not None or direct:
                os.ftruncate(f.fileno(), writer.size)  # a recycled file may have been longer; the padded last block
            os.fsync(f.fileno())
        checksum = {"crc32": f"{writer.crc:08x}"} if writer.crc is not None else {"zip_crc32": zip_records_crc32(path)}
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    return path, writer.size, checksum


DAMAGED_ZIP_ERRORS = (zipfile.BadZipFile, OSError, EOFError, ValueError, NotImplementedError, zlib.error, struct.error)
"""What :mod:`zipfile` raises on damaged bytes (a flipped compression method, a header cut short, ...)."""


def torch_writes_record_crcs() -> bool:
    """Whether ``torch.save`` stores each zip record's CRC-32 (its default; torch before 2.6 always does)."""
    get = getattr(torch.serialization, "get_crc32_options", None)
    return bool(get()) if get is not None else True


def zip_records_crc32(path: Path) -> str:
    """CRC-32 of a torch zip's central directory as zipfile reads it (each record's name, CRC-32, size, offset).

    With :func:`zipfile.ZipFile.testzip` (every record's bytes against its CRC-32) it covers what loading reads:
    the central directory is read from the end of the file, not the whole file. Raises ``zipfile.BadZipFile``.
    """
    with zipfile.ZipFile(path) as archive:
        listing = "".join(f"{i.filename}\t{i.CRC:08x}\t{i.file_size}\t{i.compress_size}\t{i.compress_type}\t"
                          f"{i.header_offset}\n" for i in archive.infolist())
    return f"{zlib.crc32(listing.encode()):08x}"


LOCAL_FILE_SYSTEMS = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "f2fs", "zfs", "tmpfs", "overlay", "bcachefs"})
"""File systems whose every reader is on this machine, where a lease sees every open file."""


@functools.lru_cache(maxsize=64)
def file_system_type(folder: str) -> str:
    """The type of the file system ``folder`` lives on, from /proc/self/mountinfo ("" where unknown)."""
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return ""
    target, best, kind = os.path.realpath(folder), "", ""
    for line in lines:
        fields, _, rest = line.partition(" - ")
        parts = fields.split()
        if len(parts) < 5 or not rest:
            continue
        mount = parts[4].replace("\\040", " ")
        if (target == mount or target.startswith(mount.rstrip("/") + "/")) and len(mount) >= len(best):
            best, kind = mount, rest.split()[0]
    return kind


def only_we_hold(path: Path) -> bool:
    """Whether no process (this one included) has ``path`` open or mapped, so it may be overwritten in place.

    Linux grants a write lease only then (fcntl F_SETLEASE). A lease sees the opens of this machine only, so
    the answer is False on a file system other machines may read (NFS, Lustre, GPFS: anything not in
    :data:`LOCAL_FILE_SYSTEMS`), on other systems, and where leases are refused: the caller then deletes the
    file instead, which never disturbs a reader.
    """
    try:
        import fcntl
    except ImportError:  # Windows
        return False
    setlease = getattr(fcntl, "F_SETLEASE", None)
    if setlease is None or file_system_type(str(path.parent)) not in LOCAL_FILE_SYSTEMS:
        return False
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return False
    try:
        fcntl.fcntl(fd, setlease, fcntl.F_WRLCK)
        fcntl.fcntl(fd, setlease, fcntl.F_UNLCK)
        return True
    except OSError:  # EAGAIN: someone has it open; EINVAL, EACCES: no leases here
        return False
    finally:
        os.close(fd)


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


def write_manifest(folder: Path, manifest: dict[str, Any], *, sync_folder: bool = True) -> None:
    """Replace the manifest of ``folder`` atomically; strict JSON (NaN is refused, not written).

    ``sync_folder=False`` leaves the rename's durability to the file system's next commit: right
    for a manifest whose loss in a power cut only brings back the previous one.
    """
    data = json.dumps(manifest, indent=1, allow_nan=False).encode() + b"\n"
    tmp, fd = open_temporary(folder, MANIFEST)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, folder / MANIFEST)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if sync_folder:
        fsync_folder(folder)


def fsync_folder(folder: Path) -> None:
    """A rename is durable only once the folder entry is on disk too."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_crc32(path: Path) -> str:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def read_manifest(folder: Path) -> dict[str, Any]:
    """The manifest of ``folder`` ({} when there is none); ValueError naming it when it is unreadable."""
    path = folder / MANIFEST
    if not path.is_file():
        return {}

    def strict(token: str) -> Any:
        raise ValueError(f"{token} is not JSON")

    try:
        data = json.loads(path.read_bytes(), parse_constant=strict)
    except (ValueError, UnicodeDecodeError) as err:
        raise ValueError(f"{path} is not valid JSON ({err})") from None
    if not isinstance(data, dict) or not isinstance(data.get("files", {}), dict) \
            or not isinstance(data.get("pending", {}), dict) or not isinstance(data.get("retire", []), list) or not isinstance(data.get("seq", 0), int):
        raise ValueError(f"{path} is not a gputrain checkpoint manifest (no 'files' mapping)")
    for name, entry in [*data.get("files", {}).items(), *data.get("pending", {}).items()]:
        if not (isinstance(entry, dict) and isinstance(entry.get("size"), int) and isinstance(entry.get("seq"), int)
                and (isinstance(entry.get("crc32"), str) or isinstance(entry.get("zip_crc32"), str))):
            raise ValueError(f"{path} is not a gputrain checkpoint manifest (entry {name!r} lacks size, crc32 or seq)")
    return data


def check_against(path: Path, entries: list[dict[str, Any]]) -> str | None:
    """What is wrong with ``path`` given the manifest entries its content may match; None when it matches one.

    Sizes are compared first (cheap); the file is read only when one of them fits.
    """
    if not path.is_file():
        return "missing: listed in manifest.json but not on disk"
    size = path.stat().st_size
    if size == 0:
        return "0 bytes"
    if not entries:
        return None
    fitting = [e for e in entries if e.get("size") == size]
    if not fitting:
        want = entries[0].get("size")
        if isinstance(want, int) and size < want:
            return f"truncated: {size} of {want} bytes"
        return f"{size} bytes, manifest.json says {want}"
    zipped = [e for e in fitting if "zip_crc32" in e]
    whole = [e for e in fitting if "crc32" in e]  # written where torch's record CRCs were off, or by gputrain <= 0.1
    if zipped:
        try:
            records = zip_records_crc32(path)
            if any(e["zip_crc32"] == records for e in zipped):
                with zipfile.ZipFile(path) as archive:
                    bad = archive.testzip()
                return f"checksum mismatch: record {bad} does not match its crc32" if bad else None
        except DAMAGED_ZIP_ERRORS as err:
            return f"checksum mismatch: not a whole torch checkpoint ({err})"
        if not whole:
            return f"checksum mismatch: zip records crc32 {records}, manifest.json says {zipped[0]['zip_crc32']}"
    crc = file_crc32(path)
    if any(e["crc32"] == crc for e in whole):
        return None
    return f"checksum mismatch: crc32 {crc}, manifest.json says {whole[0]['crc32']}"


def manifest_entries(path: Path) -> list[dict[str, Any]]:
    """The manifest entries ``path`` may match: the pending one of a save in flight, then the committed one."""
    try:
        manifest = read_manifest(path.parent)
    except ValueError as err:
        # The checkpoint itself may be fine; say that it goes unchecked rather than refuse it.
        print(f"gputrain: warning: {err}; loading {path} without checking its checksum", file=sys.stderr)
        return []
    return [e for e in (manifest.get("pending", {}).get(path.name), manifest.get("files", {}).get(path.name))
            if e is not None]


def check_unlisted(path: Path, *, legacy_ok: bool = False) -> str | None:
    """Damage in a checkpoint no manifest lists: empty, or a torch zip whose own CRCs do not match.

    ``legacy_ok``: a file that is no zip at all (torch's format before 1.6, still found in some downloaded
    weights) passes unchecked; ``torch.load`` refuses it in one line if it is damaged where it can tell.
    """
    if path.stat().st_size == 0:
        return "0 bytes"
    if legacy_ok and not zipfile.is_zipfile(path):
        return None
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except DAMAGED_ZIP_ERRORS as err:
        return f"not a whole torch checkpoint ({err})"
    return f"zip CRC mismatch in record {bad}" if bad else None


def manifest_entry(state: dict[str, Any], size: int, checksum: dict[str, str], seq: int,
                   metrics: dict[str, float] | None) -> dict[str, Any]:
    """A manifest entry for a checkpoint of ``state`` written as ``size`` bytes with ``checksum``
    (:func:`write_temporary`'s)."""
    progress = state.get("state")
    if not isinstance(progress, dict):
        progress = {}
    step, epoch = progress.get("global_step"), progress.get("epoch")
    return {
        "size": size, **checksum, "seq": seq,
        "step": int(step) if isinstance(step, int) else None,
        "epoch": int(epoch) if isinstance(epoch, int) else None,
        "time": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        # Strict JSON has no NaN: a metric that is not finite is recorded as null.
        "metrics": {k: (float(v) if math.isfinite(float(v)) else None) for k, v in (metrics or {}).items()},
    }


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
