"""Silencing the libraries we drive: their progress notes and advice are not our users' business."""

from __future__ import annotations

import contextlib
import logging
import warnings


@contextlib.contextmanager
def quiet(*logger_names: str):
    """Only errors from these loggers ("" is the root logger) and no Python warnings, for a while."""
    loggers = [logging.getLogger(name or None) for name in logger_names]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
