"""The hook that feeds the metric loggers (:mod:`gputrain.runs.loggers`): step and epoch records, sample grids."""

from __future__ import annotations

from typing import Any

from gputrain.engine.hooks import Hook, RunContext
from gputrain.runs.loggers import LOGGER_PACKAGES, MetricLogger, build_loggers, check_logger_packages


class LoggingHook(Hook):
    def __init__(self, names: list[str]) -> None:
        check_logger_packages(names)  # all ranks, at construction: not rank 0 alone after the others wait
        self.names = names
        self.loggers: list[MetricLogger] = []

    def before_fit(self, ctx: RunContext) -> None:
        if ctx.dist.is_main:
            self.loggers = build_loggers(self.names, ctx.out, resume=ctx.resumed, config=ctx.config_dict,
                                         cfg_trainer=ctx.cfg.trainer)

    def _log(self, ctx: RunContext, metrics: dict[str, float]) -> None:
        state = ctx.state
        for logger in self.loggers:
            logger.log(metrics, step=state.global_step, epoch=state.epoch)

    def after_step(self, ctx: RunContext, logs: dict[str, float] | None) -> None:
        if logs:
            self._log(ctx, logs)

    def after_epoch(self, ctx: RunContext, metrics: dict[str, float]) -> None:
        self._log(ctx, metrics)
        if any(n in LOGGER_PACKAGES for n in self.names) and any(k.startswith("val/") for k in metrics):
            from gputrain.engine.callbacks.pictures import samples_image

            image = samples_image(ctx)  # every rank runs the sample forwards; rank 0 gets the grid
            for logger in self.loggers if image is not None else []:
                logger.log_image("val/samples", image, step=ctx.state.global_step)

    def after_fit(self, ctx: RunContext, summary: dict[str, Any]) -> None:
        for logger in self.loggers:
            logger.close()
        self.loggers = []

    on_exception = after_fit  # type: ignore[assignment]  # close files on failure too
