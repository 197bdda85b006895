"""shardsafe: collective, crash-safe, resharding checkpoints for sharded PyTorch training."""

from __future__ import annotations

__version__ = "0.1.0"

from .api import load, save, verify  # noqa: E402
from .deepspeed_zero import convert_deepspeed  # noqa: E402
from .errors import (  # noqa: E402
    CheckpointExistsError,
    CheckpointNotFoundError,
    DistributedError,
    FormatError,
    IntegrityError,
    PushError,
    SaveError,
    ShardsafeError,
    StateMismatchError,
)
from .export import export_hf  # noqa: E402
from .hub import push  # noqa: E402
from .manager import CheckpointManager, collect_garbage, list_checkpoints  # noqa: E402
from .pretrained import save_pretrained  # noqa: E402
from .rng import RNGState  # noqa: E402

__all__ = [
    "CheckpointExistsError",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "DistributedError",
    "FormatError",
    "IntegrityError",
    "PushError",
    "RNGState",
    "SaveError",
    "ShardsafeError",
    "StateMismatchError",
    "__version__",
    "collect_garbage",
    "convert_deepspeed",
    "export_hf",
    "list_checkpoints",
    "load",
    "push",
    "save",
    "save_pretrained",
    "verify",
]
