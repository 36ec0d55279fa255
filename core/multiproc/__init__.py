"""The engine loop in a process of its own, for ``weir serve`` (see ``client``)."""

from weir.multiproc.client import ProcessEngine

__all__ = ["ProcessEngine"]
