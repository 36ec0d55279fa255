"""The progress bar of a checkpoint load: shown on a terminal once loading has taken a while."""

from __future__ import annotations

from typing import Any

# A load that ends sooner shows no bar at all.
SHOW_AFTER_SECONDS = 1.0


def loading_progress(total: int, description: str, unit: str = "tensor") -> Any:
    """A tqdm bar on stderr, drawn only after ``SHOW_AFTER_SECONDS`` and only on a terminal (tqdm's
    ``disable=None``), so logs, pipes and tests see nothing."""
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=description, unit=unit, unit_scale=unit == "B", delay=SHOW_AFTER_SECONDS,
                disable=None, leave=False, dynamic_ncols=True)
