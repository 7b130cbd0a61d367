"""Which weights of a checkpoint of this trainer a network takes (for --weights, evaluate.py and
demo.py): those of the EMA (engine/ema.py's entry) when the run kept one."""
from __future__ import annotations

import torch

EMA_KEY = "ema"         # {"model": state dict, "decay", "tau", "updates"}


def preferred_weights(obj) -> tuple[object, str]:
    """(what to load, a note): a checkpoint's EMA weights (with a note), anything else as it is."""
    ema = obj.get(EMA_KEY) if isinstance(obj, dict) else None
    averaged = ema.get("model") if isinstance(ema, dict) else None
    if not (isinstance(averaged, dict) and averaged and all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in averaged.items())):
        return obj, ""
    return averaged, (f"the EMA weights (decay {ema.get('decay', '?')}, {ema.get('updates')} updates), "
                      "not the training weights")
