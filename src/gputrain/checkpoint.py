"""Checkpoint files that cannot lie: atomic writes, a checksummed manifest, rotation, safe loads.

* **Atomic.** Every file is written to ``.<name>.<random>.tmp`` in its folder, fsync'ed, and renamed
  over its final name: a reader, or a run killed at any instant, sees the old file or the whole new
  one. The temporary is created with mode 0o666 less the umask, as ``open(path, "w")`` would, so a
  team on a shared cluster can read the result (``mkstemp`` made it 0600). Temporaries left by a
  killed worker are removed by :func:`remove_stale_temporaries` at the next start.
* **Manifest.** ``manifest.json`` (strict JSON, itself replaced atomically) lists each checkpoint of
  a :class:`CheckpointStore` with its size, a CRC-32 of the bytes as written (computed on the way to
  the disk, so nothing is read back), sequence number, step, epoch, time and metrics.
* **Why checksums.** ``torch.load`` loads a file whose tensor bytes were flipped without a word, and
  a node that dies mid-copy or a full disk can leave the right name on the wrong bytes. Size and
  CRC-32 turn that into an error naming the file, and :meth:`CheckpointStore.latest_valid` (``--resume
  auto``) falls back to the newest whole checkpoint. CRC-32 detects accidental damage (every burst up
  to 32 bits; other damage passes with odds of 2^-32); like any checksum kept beside the files it is no
  defence against tampering. zlib's CRC-32 ran 2.2 to 3.5 times as fast as sha256 on the 2-core test
  machine (a CPU with SHA instructions): see benchmarks/checkpoint_save.py.
* **Crash order of a save.** (1) write the checkpoint to a temporary; (2) hard-link it (or copy) to the
  temporaries of ``last.pt`` and ``best.pt``; (3) write the manifest with the new entries as *pending*;
  (4) rename the temporaries into place; (5) delete what rotation retired (or, where no other name or
  process holds it, rename it to a hidden temporary the next save overwrites); (6) commit the manifest.
  A name's file is valid when it matches its pending or its committed entry, so a kill at any point
  leaves every final name valid or absent; the next save settles what a killed one left pending.
* **Safe loads.** Always ``torch.load(weights_only=True)``: tensors and plain containers only.
"""

from __future__ import annotations

import math
import os
import random
import re
import secrets
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from gputrain.checkpoint_io import (
    MANIFEST,
    TEMPORARY,
    check_against,
    check_plain,
    check_unlisted,
    fsync_folder,
    link_or_copy,
    manifest_entries,
    manifest_entry,
    only_we_hold,
    read_manifest,
    write_manifest,
    write_temporary,
)

ALIASES = ("last.pt", "best.pt")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


def atomic_save(obj: Any, path: str | Path) -> Path:
    """``torch.save`` to ``path`` so that readers see the old file or the whole new one, never a part.

    The file gets the permissions ``open(path, "w")`` would give. It is not entered in a manifest: a
    run's checkpoints go through :class:`CheckpointStore`.
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


def verify(path: str | Path) -> None:
    """Raise naming ``path`` and what is wrong when it is missing, empty, truncated or corrupt.

    A file the manifest of its folder lists is checked for size and checksum; any other file (a copy shared
    elsewhere, a download) against the CRC-32 that torch's zip format stores for each of its records, so a
    damaged file is refused wherever it lies.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    entries = manifest_entries(path)
    problem = check_against(path, entries) if entries else check_unlisted(path, legacy_ok=True)
    if problem:
        raise ValueError(f"checkpoint {path} is damaged ({problem}); --resume auto skips it, or pass an older "
                         "checkpoint")


def _load_safely(path: Path, map_location: str | torch.device) -> Any:
    """``torch.load(weights_only=True)``; torch's several-paragraph refusal becomes one line naming the file."""
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as err:  # torch raises UnpicklingError, RuntimeError or EOFError by cause
        raise ValueError(
            f"checkpoint {path} cannot be loaded safely ({type(err).__name__}: {str(err).splitlines()[0]}); "
            "it is truncated, corrupt, or holds objects other than tensors and plain containers"
        ) from None


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu", *,
                    gather_sharded: bool = False) -> dict[str, Any]:
    """Load a gputrain checkpoint with ``weights_only=True`` after :func:`verify`; errors name the file.

    ``gather_sharded``: a sharded checkpoint's weights (``parallel.sharded_checkpoint``, in a DCP folder beside
    the file) are gathered into ``state["model"]`` in this process, as the tools that evaluate, export or
    predict need them; resuming leaves them in the folder, for each rank to read its own shards.
    """
    path = Path(path)
    verify(path)
    state = _load_safely(path, map_location)
    if not isinstance(state, dict) or "model" not in state:
        raise ValueError(f"checkpoint {path} is not a gputrain checkpoint (no 'model' entry)")
    if gather_sharded and state.get("sharded"):
        state["model"] = _sharded_weights(path, state["sharded"])
    return state


def _sharded_weights(path: Path, folder_name: str) -> dict[str, torch.Tensor]:
    """The full model weights of sharded checkpoint ``path``, read from its DCP folder without a process group."""
    from gputrain.strategies.fsdp_checkpoint import dcp_model_weights

    folder = path.parent / folder_name
    if not folder.is_dir():
        raise FileNotFoundError(f"checkpoint {path} is sharded: its weights are in the folder {folder}, which is "
                                f"missing; copy {folder_name}/ beside it (it sits beside the file in the run's "
                                "checkpoints/), or use a checkpoint saved without parallel.sharded_checkpoint")
    return dcp_model_weights(folder)


def model_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """Just the model state_dict of a checkpoint (a sharded one's gathered), or of a bare state_dict file."""
    path = Path(path)
    verify(path)
    state = _load_safely(path, "cpu")
    if isinstance(state, dict) and state.get("sharded"):  # model and optimizer live in a DCP folder beside it
        return _sharded_weights(path, state["sharded"])
    if isinstance(state, dict) and "model" in state and isinstance(state["model"], dict):
        return state["model"]
    if isinstance(state, dict) and all(isinstance(v, torch.Tensor) for v in state.values()):
        return state
    raise ValueError(f"{path} holds neither a gputrain checkpoint nor a state_dict of tensors")


def rng_state() -> dict[str, Any]:
    """Random generator states that decide dropout and augmentation on this rank."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


MAX_SPARES = 2
"""Retired checkpoint files a recycling store keeps for reuse (each one checkpoint's worth of disk)."""


class CheckpointStore:
    """A run's checkpoint folder: numbered checkpoints, ``last.pt``, ``best.pt`` and ``manifest.json``.

    One process (rank 0) saves; building a store touches no file, so every rank may hold one.
    ``keep_last`` numbered checkpoints (``epoch_*`` and ``step_*`` alike, newest by save order) are
    kept besides ``last.pt`` and ``best.pt``; ``best.pt`` follows ``metrics[monitor]`` when
    ``monitor`` is set.
    """

    def __init__(self, folder: str | Path, *, keep_last: int = 3, monitor: str = "", monitor_mode: str = "min",
                 recycle: bool = False) -> None:
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
        self.recycle = recycle
        """Overwrite a rotated-out checkpoint with the next save instead of deleting it (see :meth:`_retire_file`);
        whoever turns it on calls :meth:`discard_spare` after the last save."""
        self._spares: list[Path] = []  # retired files no name points to, for the next saves to overwrite

    def save(self, state: dict[str, Any], *, name: str, metrics: dict[str, float] | None = None,
             before_commit: Callable[[], None] | None = None,
             write: Callable[..., tuple[Path, int, dict[str, str]]] = write_temporary) -> Path:
        """Write ``<name>.pt`` (unless ``name`` is empty), ``last.pt``, and ``best.pt`` when the monitor improves.

        Returns the numbered file, or ``last.pt`` when ``name`` is empty. Step and epoch for the
        manifest come from ``state["state"]`` (``global_step``, ``epoch``) when it has them.
        ``before_commit`` runs once the file is written and before any name points to it; if it raises,
        nothing is committed and the temporaries are removed (the background writer's last check).
        ``write`` writes the temporary (:func:`~gputrain.checkpoint_io.write_temporary`, or the same in the
        checkpoint writer process).
        """
        numbered = _file_name(name)
        check_plain(state)  # fail now, not when a resume hours later cannot load the file
        self.folder.mkdir(parents=True, exist_ok=True)
        manifest = self._settled_manifest()
        seq = manifest["seq"] + 1
        targets = ([numbered] if numbered else []) + ["last.pt"]
        if self._improves(metrics, manifest["files"].get("best.pt")):
            targets.append("best.pt")
        spare = self._spares.pop() if self._spares else None
        try:
            tmp, size, checksum = write(state, self.folder, targets[0], reuse=spare)
        except BaseException:
            if spare is not None and spare.exists():  # refused before it took the file (a NaN check, say): keep it
                self._spares.append(spare)
            raise
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
            replaced = self._second_name(self.folder / target)  # else the rename would free last.pt's old file
            os.replace(temps[target], self.folder / target)
            if replaced is not None:
                self._adopt_spare(replaced)
        fsync_folder(self.folder)
        for old in manifest["retire"]:
            self._retire_file(self.folder / old)
        files = {n: e for n, e in manifest["files"].items() if n not in manifest["retire"]} | pending
        # Lost in a power cut, this commit leaves the intent above, which the next save settles.
        write_manifest(self.folder, manifest | {"files": files, "pending": {}, "retire": []}, sync_folder=False)
        return self.folder / targets[0]

    def _retire_file(self, path: Path) -> None:
        """Take a rotated-out checkpoint's name away; keep its blocks for the next save where that is safe.

        Only a file no other name shares (``best.pt`` is often a hard link to a numbered file) and no process
        has open or mapped (a reader keeps the bytes it opened, as it would after a delete) is kept, under a
        hidden temporary name that :func:`remove_stale_temporaries` clears after a crash; two at most, so a save
        that retires nothing (``last.pt`` alone, at an epoch's end) does not leave the next one without.
        """
        try:
            keep = self._may_keep(path)
        except FileNotFoundError:
            return
        if not keep:
            path.unlink(missing_ok=True)
            return
        spare = self.folder / f".spare.{secrets.token_hex(4)}.tmp"
        os.rename(path, spare)  # gone from its name at once, as a delete would make it
        self._adopt_spare(spare)

    def _second_name(self, path: Path) -> Path | None:
        """Before ``path`` is replaced: a hidden second name for its file when no other name shares it.

        A save of ``last.pt`` alone (an epoch's end with ``checkpoint_every_n_epochs=0``) replaces a file that
        nothing retires; without this the next save would find no spare and write a new file.
        """
        try:
            if not self._may_keep(path):
                return None
            spare = self.folder / f".spare.{secrets.token_hex(4)}.tmp"
            os.link(path, spare)
        except OSError:  # no such file yet, or no hard links on this file system
            return None
        return spare

    def _may_keep(self, path: Path) -> bool:
        """Whether ``path``'s file may become a spare: recycling on, room for one more, no other name shares it."""
        return self.recycle and len(self._spares) < MAX_SPARES and path.stat().st_nlink == 1

    def _adopt_spare(self, spare: Path) -> None:
        """Keep ``spare`` (a file no name points to any more) for the next save, or delete it if anyone holds it."""
        if len(self._spares) < MAX_SPARES and only_we_hold(spare):
            self._spares.append(spare)
        else:
            spare.unlink(missing_ok=True)

    def discard_spare(self) -> None:
        """Delete the retired files kept for the next saves (the end of training: no next save)."""
        spares, self._spares = self._spares, []
        for spare in spares:
            spare.unlink(missing_ok=True)

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
