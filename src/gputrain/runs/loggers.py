"""Metric loggers: ``metrics.jsonl`` always; ``metrics.csv``, TensorBoard and Weights & Biases by choice.

Only rank 0 creates loggers, so a job of any size is one logged run. Metrics arrive already reduced over ranks
(the engine does that), so what rank 0 writes describes the whole job.
"""

from __future__ import annotations

import csv
import time
from pathlib import Path
from typing import Any

from gputrain.extras import require
from gputrain.runs.records import strict_json


class MetricLogger:
    """One destination for metrics."""

    def log(self, metrics: dict[str, float], *, step: int, epoch: int) -> None:
        raise NotImplementedError

    def log_image(self, name: str, image: Any, *, step: int) -> None:
        """An ``(H, W, 3)`` uint8 picture; loggers that show no images ignore it."""

    def close(self) -> None:
        pass


class JsonlLogger(MetricLogger):
    """``metrics.jsonl``: one JSON object per logged step or epoch, flushed as written."""

    def __init__(self, path: Path, *, append: bool = False) -> None:
        if not append:
            path.write_text("", encoding="utf-8")
        # Always in append mode: the run's events (pace, membership) are appended to the same file by other writers
        # (runs.records.append_record), and a handle opened with "w" would write over them at its own offset.
        self.file = path.open("a", encoding="utf-8")

    def log(self, metrics: dict[str, float], *, step: int, epoch: int) -> None:
        record = {"time": round(time.time(), 3), "epoch": epoch, "step": step, **metrics}
        self.file.write(strict_json(record) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


class CsvLogger(MetricLogger):
    """``metrics.csv``: one row per record, one column per metric name seen so far."""

    def __init__(self, path: Path, *, append: bool = False) -> None:
        self.path = path
        self.rows: list[dict[str, Any]] = []
        self.columns: list[str] = ["epoch", "step"]
        if append and path.is_file():  # a resumed run continues the file instead of starting it over
            with path.open(newline="", encoding="utf-8") as f:
                reader = csv.DictReader(f)
                self.columns = list(reader.fieldnames or self.columns)
                self.rows = list(reader)

    def log(self, metrics: dict[str, float], *, step: int, epoch: int) -> None:
        self.rows.append({"epoch": epoch, "step": step, **metrics})
        new = [k for k in metrics if k not in self.columns]
        self.columns += new
        if new or not self.path.is_file():
            self._rewrite()  # a new column changes the header: write the whole file again
        else:
            with self.path.open("a", newline="", encoding="utf-8") as f:
                csv.DictWriter(f, self.columns).writerow(self.rows[-1])

    def _rewrite(self) -> None:
        with self.path.open("w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, self.columns)
            writer.writeheader()
            writer.writerows(self.rows)


class TensorBoardLogger(MetricLogger):
    def __init__(self, folder: Path) -> None:
        require("tensorboard", "trainer.loggers=[tensorboard]")
        from torch.utils.tensorboard import SummaryWriter  # imports tensorboard: only when chosen

        self.writer = SummaryWriter(log_dir=str(folder))

    def log(self, metrics: dict[str, float], *, step: int, epoch: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, global_step=step)

    def log_image(self, name: str, image: Any, *, step: int) -> None:
        self.writer.add_image(name, image, global_step=step, dataformats="HWC")

    def close(self) -> None:
        self.writer.close()


class WandbLogger(MetricLogger):
    """Weights & Biases; ``mode="offline"`` writes a local run that ``wandb sync`` can upload later."""

    def __init__(self, folder: Path, *, project: str, mode: str, config: dict[str, Any], name: str) -> None:
        require("wandb", "trainer.loggers=[wandb]")
        import wandb
        folder.mkdir(parents=True, exist_ok=True)
        # mode: wandb types it as a Literal; trainer.wandb_mode is checked by config validation.
        self.run = wandb.init(project=project, mode=mode, dir=str(folder), config=config, name=name,  # type: ignore[arg-type]
                              settings=wandb.Settings(silent=True, console="off"))

    def log(self, metrics: dict[str, float], *, step: int, epoch: int) -> None:
        self.run.log({**metrics, "epoch": epoch}, step=step)

    def log_image(self, name: str, image: Any, *, step: int) -> None:
        import wandb

        self.run.log({name: wandb.Image(image)}, step=step)

    def close(self) -> None:
        self.run.finish()


def build_loggers(names: list[str], out: Path, *, resume: bool, config: dict[str, Any], cfg_trainer: Any) -> list[MetricLogger]:
    loggers: list[MetricLogger] = [JsonlLogger(out / "metrics.jsonl", append=resume)]
    for name in names:
        if name == "csv":
            loggers.append(CsvLogger(out / "metrics.csv", append=resume))
        elif name == "tensorboard":
            loggers.append(TensorBoardLogger(out / "tensorboard"))
        elif name == "wandb":
            loggers.append(WandbLogger(out / "wandb", project=cfg_trainer.wandb_project, mode=cfg_trainer.wandb_mode,
                                       config=config, name=out.name))
        elif name != "jsonl":
            raise ValueError(f"trainer.loggers has {name!r}; choose from csv, tensorboard, wandb")
    return loggers


LOGGER_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}
"""Optional packages each logger needs (the ``loggers`` extra)."""


def check_logger_packages(names: list[str]) -> None:
    """Raise :class:`~gputrain.errors.MissingExtra` on every rank alike if a chosen logger's package is absent."""
    for name in names:
        if name in LOGGER_PACKAGES:
            require(LOGGER_PACKAGES[name], f"trainer.loggers=[{name}]")
