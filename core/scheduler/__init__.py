"""The scheduler: one token budget per step, no prefill or decode phases."""

from weir.scheduler.output import CachedRequestData, NewRequestData, SchedulerOutput
from weir.scheduler.scheduler import Scheduler

__all__ = ["CachedRequestData", "NewRequestData", "Scheduler", "SchedulerOutput"]
