"""vLLM's ``metrics.speculative_decoding`` object of a chat or completion response.

Off unless ``--per-request-spec-decode-metrics`` is ``summary`` or ``detailed`` (and the engine
speculates): the response is then exactly what it is without speculation. The object sums the
counts of every completion the response carries (``n`` of them, of every prompt);
``detailed`` adds each spec step's accepted and drafted counts, completion after completion.
"""

from __future__ import annotations

from weir.outputs import RequestOutput


def speculative_metrics(level: str, outputs: list[RequestOutput]) -> dict | None:
    """``{"speculative_decoding": {...}}`` for a response of these outputs, or None (off)."""
    if level == "none":
        return None
    total = None
    for output in outputs:
        for completion in output.outputs:
            stats = completion.spec_decode_metrics
            if stats is not None:
                total = stats if total is None else total.merged(stats)
    if total is None:
        return None
    return {"speculative_decoding": total.to_dict(detailed=level == "detailed")}
