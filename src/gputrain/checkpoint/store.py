"""A run's checkpoint folder: numbered checkpoints, ``last.pt``, ``best.pt`` and ``manifest.json``.

Crash order of a save: (1) write the checkpoint to a temporary; (2) hard-link it (or copy) to the temporaries of
``last.pt`` and ``best.pt``; (3) write the manifest with the new entries as *pending*; (4) rename the temporaries
into place; (5) delete what rotation retired; (6) commit the manifest. A name's file is valid when it matches its
pending or its committed entry, so a kill at any point leaves every final name valid or absent; the next save
settles what a killed one left pending. :meth:`CheckpointStore.latest_valid` (``--resume auto``) falls back to the
newest whole checkpoint.
"""

from __future__ import annotations

import math
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gputrain.checkpoint.files import Write, check_plain, fsync_folder, link_or_copy, write_temporary
from gputrain.checkpoint.manifest import (
    MANIFEST,
    check_against,
    check_unlisted,
    manifest_entry,
    read_manifest,
    write_manifest,
)

ALIASES = ("last.pt", "best.pt")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


class CheckpointStore:
    """A run's checkpoint folder: numbered checkpoints, ``last.pt``, ``best.pt`` and ``manifest.json``.

    One process (rank 0) saves; building a store touches no file, so every rank may hold one.
    ``keep_last`` numbered checkpoints (``epoch_*`` and ``step_*`` alike, newest by save order) are
    kept besides ``last.pt`` and ``best.pt``; ``best.pt`` follows ``metrics[monitor]`` when
    ``monitor`` is set.
    """

    def __init__(self, folder: str | Path, *, keep_last: int = 3, monitor: str = "", monitor_mode: str = "min") -> None:
        if keep_last < 2:
            raise ValueError(f"trainer.keep_last={keep_last} is too few: the newest checkpoint may be the one a crash "
                             "cut short, so at least 2 are kept; set trainer.keep_last=2 or more")
        if monitor_mode not in ("min", "max"):
            raise ValueError(f"trainer.monitor_mode={monitor_mode!r} is neither 'min' nor 'max'; use min when a "
                             f"smaller {monitor or 'monitored metric'} is better, max when a larger one is")
        self.folder = Path(folder)
        self.keep_last = keep_last
        self.monitor = monitor
        self.monitor_mode = monitor_mode
        self.skipped: list[tuple[Path, str]] = []
        """What the last :meth:`latest_valid` passed over, and why."""

    def save(self, state: dict[str, Any], *, name: str, metrics: dict[str, float] | None = None,
             before_commit: Callable[[], None] | None = None, write: Write = write_temporary) -> Path:
        """Write ``<name>.pt`` (unless ``name`` is empty), ``last.pt``, and ``best.pt`` when the monitor improves.

        Returns the numbered file, or ``last.pt`` when ``name`` is empty. Step and epoch for the
        manifest come from ``state["state"]`` (``global_step``, ``epoch``) when it has them.
        ``before_commit`` runs once the file is written and before any name points to it; if it raises,
        nothing is committed and the temporaries are removed (the background writer's last check).
        ``write`` writes the temporary (:func:`~gputrain.checkpoint.files.write_temporary`; a test gives its own).
        """
        numbered = _file_name(name)
        check_plain(state)  # fail now, not when a resume hours later cannot load the file
        self.folder.mkdir(parents=True, exist_ok=True)
        manifest = self._settled_manifest()
        seq = manifest["seq"] + 1
        targets = ([numbered] if numbered else []) + ["last.pt"]
        if self._improves(metrics, manifest["files"].get("best.pt")):
            targets.append("best.pt")
        tmp, size, checksum = write(state, self.folder, targets[0])
        temps = {targets[0]: tmp}
        try:
            for target in targets[1:]:
                temps[target] = link_or_copy(tmp, self.folder, target)
            if before_commit is not None:
                before_commit()
            entry = manifest_entry(state, size, checksum, seq, metrics)
            pending = {target: dict(entry) for target in targets}
            if numbered:
                pending["last.pt"]["same_as"] = numbered
            if "best.pt" in pending:
                pending["best.pt"] |= {"same_as": numbered or "last.pt", "monitor": self.monitor,
                                       "monitor_mode": self.monitor_mode}
            manifest |= {"seq": seq, "pending": pending, "retire": self._retire(manifest, pending)}
            # From this write on, a kill leaves every name holding its committed or its pending content.
            write_manifest(self.folder, manifest)
        except BaseException:
            for path in temps.values():
                path.unlink(missing_ok=True)
            raise
        for target in targets:
            os.replace(temps[target], self.folder / target)
        fsync_folder(self.folder)
        for old in manifest["retire"]:
            (self.folder / old).unlink(missing_ok=True)
        files = {n: e for n, e in manifest["files"].items() if n not in manifest["retire"]} | pending
        # Lost in a power cut, this commit leaves the intent above, which the next save settles.
        write_manifest(self.folder, manifest | {"files": files, "pending": {}, "retire": []}, sync_folder=False)
        return self.folder / targets[0]

    def path_for(self, name: str) -> Path:
        """The path :meth:`save` with this ``name`` returns: ``<name>.pt``, or ``last.pt`` when ``name`` is empty."""
        return self.folder / (_file_name(name) or "last.pt")

    def latest_valid(self) -> Path | None:
        """The newest checkpoint that is whole (``--resume auto``); None only when no file is.

        Newest by save order (the manifest's sequence numbers), then files no manifest lists, newest
        modified first. Each damaged file passed over is printed as one line and kept in :attr:`skipped`.
        """
        self.skipped = []
        for path, entries in self._candidates():
            problem = check_unlisted(path) if entries is None else check_against(path, entries)
            if problem is None:
                return path
            self.skipped.append((path, problem))
            print(f"gputrain: skipping checkpoint {path}: {problem}", file=sys.stderr)
        return None

    def resume_path(self) -> Path | None:
        """What ``--resume auto`` continues from: :meth:`latest_valid`; None only for a folder with no checkpoint.

        When there are checkpoints but none is whole, raise instead of letting the run restart from step 0.
        """
        found = self.latest_valid()
        if found is not None and self.skipped:
            print(f"gputrain: --resume auto uses {found}, the newest intact checkpoint", file=sys.stderr)
        if found is None and self.skipped:
            damaged = "; ".join(f"{path.name} ({why})" for path, why in self.skipped)
            raise ValueError(f"no usable checkpoint in {self.folder}: {damaged}; resume from an intact copy with "
                             "--resume PATH, or start afresh in another --out")
        return found

    def _candidates(self) -> list[tuple[Path, list[dict[str, Any]] | None]]:
        """Files to try, newest first, each with the manifest entries it may match (None: not listed)."""
        try:
            manifest = read_manifest(self.folder)
        except ValueError as err:
            self.skipped.append((self.folder / MANIFEST, str(err)))
            print(f"gputrain: warning: {err}; checking the checkpoints without it", file=sys.stderr)
            manifest = {}
        files, pending = manifest.get("files", {}), manifest.get("pending", {})
        retired = set(manifest.get("retire", []))
        listed: dict[str, list[dict[str, Any]]] = {}
        for name in (set(files) | set(pending)) - retired:
            if name in files or (self.folder / name).exists():  # a pending name never renamed was never saved
                listed[name] = [e for e in (pending.get(name), files.get(name)) if e is not None]
        order = sorted(listed, key=lambda n: (max(e["seq"] for e in listed[n]), n not in ALIASES), reverse=True)
        unlisted = [p for p in self.folder.glob("*.pt") if p.is_file() and p.name not in files
                    and p.name not in pending and p.name not in retired]
        unlisted.sort(key=lambda p: p.stat().st_mtime, reverse=True)
        return [(self.folder / n, listed[n]) for n in order] + [(p, None) for p in unlisted]

    def _settled_manifest(self) -> dict[str, Any]:
        """The manifest with what a killed save left pending resolved against the files on disk."""
        try:
            manifest = read_manifest(self.folder)
        except ValueError as err:
            print(f"gputrain: warning: {err}; writing a new one (the checkpoints it listed stay, unchecked)",
                  file=sys.stderr)
            manifest = {}
        files = dict(manifest.get("files", {}))
        for name, entry in manifest.get("pending", {}).items():
            path, committed = self.folder / name, files.get(name)
            # Read the file only when a save was killed mid-way: which of the two contents does it hold?
            if committed is None or check_against(path, [committed]) is not None:
                files[name] = entry
        retire = [n for n in manifest.get("retire", []) if (self.folder / n).exists()]
        files = {n: e for n, e in files.items() if (self.folder / n).exists() and n not in retire}
        seq = max([int(manifest.get("seq", 0))] + [e["seq"] for e in files.values()])
        return {"format": 1, "checksum": "crc32", "seq": seq, "files": files, "pending": {}, "retire": retire}

    def _retire(self, manifest: dict[str, Any], pending: dict[str, Any]) -> list[str]:
        """Numbered checkpoints beyond the newest ``keep_last`` (and any a killed save meant to delete)."""
        numbered = {n: e for n, e in (manifest["files"] | pending).items() if n not in ALIASES}
        newest = sorted(numbered, key=lambda n: numbered[n]["seq"], reverse=True)
        return sorted(set(newest[self.keep_last:] + manifest["retire"]) - set(pending))

    def _improves(self, metrics: dict[str, float] | None, best: dict[str, Any] | None) -> bool:
        if not self.monitor or not metrics or self.monitor not in metrics:
            return False
        value = float(metrics[self.monitor])
        if not math.isfinite(value):
            return False
        if not best or (best.get("monitor"), best.get("monitor_mode")) != (self.monitor, self.monitor_mode):
            return True
        old = best.get("metrics", {}).get(self.monitor)
        if not isinstance(old, (int, float)):
            return True
        return value < old if self.monitor_mode == "min" else value > old


def _file_name(name: str) -> str | None:
    """``epoch_0003`` -> ``epoch_0003.pt``; empty -> None (only last.pt); names that are not plain files refused."""
    if not name:
        return None
    stem = name[:-3] if name.endswith(".pt") else name
    if not _NAME.match(stem) or f"{stem}.pt" in ALIASES or stem == Path(MANIFEST).stem:
        raise ValueError(f"checkpoint name {name!r} must be a plain file name such as epoch_0003 or step_000120, "
                         "not last, best or manifest")
    return f"{stem}.pt"
