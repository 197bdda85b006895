"""Per-rank random number generator state as a saveable object."""

from __future__ import annotations

import random
from typing import Any

import torch


class RNGState:
    """Captures and restores python, numpy (if installed), torch CPU and CUDA RNG state.

    Put an instance in the state dict (``{"rng": shardsafe.RNGState()}``); every rank saves its
    own generators (``per_rank``), and on load each rank gets back the state it saved. Loading
    onto more ranks than were saved reuses saved ranks round-robin.
    """

    per_rank = True

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
        try:
            import numpy as np
        except ImportError:  # pragma: no cover - numpy is optional
            pass
        else:
            kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)  # type: ignore[misc,union-attr]
            state["numpy"] = {
                "kind": kind,
                "keys": torch.from_numpy(keys.astype("int64")),  # type: ignore[union-attr]
                "pos": int(pos),
                "has_gauss": int(has_gauss),
                "cached": float(cached),
            }
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
        torch.set_rng_state(state["torch"])
        if "numpy" in state:
            import numpy as np

            n = state["numpy"]
            np.random.set_state((n["kind"], n["keys"].numpy().astype("uint32"), n["pos"], n["has_gauss"], n["cached"]))
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda"][: torch.cuda.device_count()])
