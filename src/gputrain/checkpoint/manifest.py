"""A checkpoint folder's ``manifest.json`` and the checks a file must pass against it (or against itself).

The manifest (strict JSON, itself replaced atomically) lists each checkpoint with its size, a checksum of the
bytes as written, a sequence number, step, epoch, time and metrics. Why checksums: ``torch.load`` loads a file
whose tensor bytes were flipped without a word, and a node that dies mid-copy or a full disk can leave the right
name on the wrong bytes; size and CRC-32 turn that into an error naming the file. A file no manifest lists (a
copy shared elsewhere) is checked against the CRC-32 that torch's zip format stores for each of its records.
CRC-32 detects accidental damage (every burst up to 32 bits; other damage passes with odds of 2^-32); like any
checksum kept beside the files it is no defence against tampering.
"""

from __future__ import annotations

import json
import math
import os
import struct
import sys
import zipfile
import zlib
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from gputrain.checkpoint.files import fsync_folder, open_temporary, zip_records_crc32

MANIFEST = "manifest.json"
_CHUNK = 8 << 20


DAMAGED_ZIP_ERRORS = (zipfile.BadZipFile, OSError, EOFError, ValueError, NotImplementedError, zlib.error, struct.error)
"""What :mod:`zipfile` raises on damaged bytes (a flipped compression method, a header cut short, ...)."""


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
