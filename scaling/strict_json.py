"""JSON that every reader takes: Python's json writes NaN and Infinity, which are not JSON
(JavaScript's JSON.parse, jq and many loaders refuse them). Non-finite floats become null."""

from __future__ import annotations

import json
import math
from typing import Any


def strict(obj: Any) -> Any:
    """obj with every non-finite float (a diverged loss, a bound that ran off to infinity) as None,
    through dicts, lists and tuples."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: strict(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [strict(v) for v in obj]
    return obj


def dumps(obj: Any, **kwargs) -> str:
    """json.dumps of strict(obj); refuses (ValueError) a non-finite float it could not reach."""
    return json.dumps(strict(obj), allow_nan=False, **kwargs)
