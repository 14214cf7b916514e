"""float64 -> the nearest bf16 (ties to even) by ml_dtypes, back in float64: the oracles' one rounding."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import numpy.typing as npt


def bf16_nearest(x: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    return np.asarray(x.astype(ml_dtypes.bfloat16).astype(np.float64))
