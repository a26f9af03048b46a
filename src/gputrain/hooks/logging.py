"""Metric loggers (JSONL always; CSV, TensorBoard, Weights & Biases by choice) and the hook that feeds them.

Only rank 0 creates loggers, so a job of any size is one logged run. Metrics arrive already
reduced over ranks (the trainer does that), so what rank 0 writes describes the whole job.
"""

from __future__ import annotations

import csv
import json
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gputrain.hooks.base import Hook
from gputrain.preflight import require

if TYPE_CHECKING:
    from gputrain.loop import Trainer


def finite_or_none(value: Any) -> Any:
    """``value`` with every NaN or infinite float (nested in dicts and lists) replaced by ``None``."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_or_none(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_none(v) for v in value]
    if hasattr(value, "item") and getattr(value, "ndim", None) == 0:  # a 0-d tensor or numpy scalar
        return finite_or_none(value.item())
    return value


def strict_json(value: Any, **kwargs: Any) -> str:
    """JSON that every parser accepts: non-finite floats become ``null`` (Python's default writes ``NaN``)."""
    return json.dumps(finite_or_none(value), allow_nan=False, **kwargs)


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
        self.file = path.open("a" if append else "w", encoding="utf-8")

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
    """Raise :class:`~gputrain.preflight.MissingExtra` on every rank alike if a chosen logger's package is absent."""
    for name in names:
        if name in LOGGER_PACKAGES:
            require(LOGGER_PACKAGES[name], f"trainer.loggers=[{name}]")


class LoggingHook(Hook):
    def __init__(self, names: list[str]) -> None:
        check_logger_packages(names)  # all ranks, at construction: not rank 0 alone after the others wait
        self.names = names
        self.loggers: list[MetricLogger] = []

    def before_fit(self, trainer: Trainer) -> None:
        if trainer.dist.is_main:
            self.loggers = build_loggers(self.names, trainer.out, resume=trainer.resumed,
                                         config=trainer.config_dict, cfg_trainer=trainer.cfg.trainer)

    def _log(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        for logger in self.loggers:
            logger.log(metrics, step=trainer.state.global_step, epoch=trainer.state.epoch)

    def after_step(self, trainer: Trainer, logs: dict[str, float] | None) -> None:
        if logs:
            self._log(trainer, logs)

    def after_epoch(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        self._log(trainer, metrics)
        if any(n in LOGGER_PACKAGES for n in self.names) and any(k.startswith("val/") for k in metrics):
            from gputrain.hooks.pictures import samples_image

            image = samples_image(trainer)  # every rank runs the sample forwards; rank 0 gets the grid
            for logger in self.loggers if image is not None else []:
                logger.log_image("val/samples", image, step=trainer.state.global_step)

    def after_fit(self, trainer: Trainer, summary: dict[str, Any]) -> None:
        for logger in self.loggers:
            logger.close()
        self.loggers = []

    on_exception = after_fit  # type: ignore[assignment]  # close files on failure too
