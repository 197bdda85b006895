"""Per-rank random number generator state as a saveable object."""

from __future__ import annotations

import random
from typing import Any

import torch

__all__ = ["RNGState"]


class RNGState:
    """Captures and restores python, numpy (if installed), torch CPU and CUDA RNG state.

    Put an instance in the state dict (``{"rng": shardsafe.RNGState()}``); every rank saves its
    own generators (``per_rank``), and on load each rank gets back the state it saved. Loading
    onto more ranks than were saved reuses saved ranks round-robin. A load first checks every
    saved generator state on a scratch generator (:meth:`check_state_dict`), so a bad one is
    refused before anything, the global generators included, is modified.
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

    def check_state_dict(self, state: Any) -> list[str]:
        """Problems with ``state``, found by the generators' own setters on scratch generators."""
        if not isinstance(state, dict) or "python" not in state or "torch" not in state:
            return ["an RNG state needs 'python' and 'torch' entries"]
        problems = []
        try:
            version, internal, gauss = state["python"]
            random.Random().setstate((version, tuple(internal), gauss))
        except Exception as exc:
            problems.append(f"python RNG state: {type(exc).__name__}: {exc}")
        try:
            torch.Generator().set_state(state["torch"])
        except Exception as exc:
            problems.append(f"torch RNG state: {type(exc).__name__}: {exc}")
        if "numpy" in state:
            try:
                import numpy as np

                n = state["numpy"]
                np.random.RandomState().set_state(
                    (n["kind"], n["keys"].numpy().astype("uint32"), n["pos"], n["has_gauss"], n["cached"])
                )
            except Exception as exc:
                problems.append(f"numpy RNG state: {type(exc).__name__}: {exc}")
        cuda = state.get("cuda")
        if cuda is not None and not (
            isinstance(cuda, list) and all(isinstance(t, torch.Tensor) and t.dtype == torch.uint8 for t in cuda)
        ):
            problems.append("cuda RNG state: not a list of uint8 tensors")
        return problems

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
