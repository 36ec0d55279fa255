"""The engine loop in a process of its own, for ``weir serve`` (see ``client``)."""

from weir.multiproc.client import LOG_FORMAT, ProcessEngine

__all__ = ["LOG_FORMAT", "ProcessEngine"]
