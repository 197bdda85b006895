"""shardsafe: collective, crash-safe, resharding checkpoints for sharded PyTorch training."""

from __future__ import annotations

from shardsafe._version import __version__
from shardsafe.api.checkpoint import load, save, verify  # noqa: E402
from shardsafe.errors import (  # noqa: E402
    CheckpointExistsError,
    CheckpointNotFoundError,
    DistributedError,
    FormatError,
    IntegrityError,
    LeaseHeldError,
    LeaseLostError,
    ModelFolderError,
    NoLoadableCheckpointError,
    PeerFailedError,
    PushError,
    ReadOnlyError,
    SaveError,
    ShardsafeError,
    StateMismatchError,
)
from shardsafe.hf.export import export_hf  # noqa: E402
from shardsafe.hf.load_pretrained import load_pretrained  # noqa: E402
from shardsafe.hf.pretrained import save_pretrained  # noqa: E402
from shardsafe.hf.push import push  # noqa: E402
from shardsafe.interop import dcp_load as _dcp_load  # noqa: E402,F401  (registers DCP folders with shardsafe.load)
from shardsafe.interop.dcp_convert import convert_dcp, export_dcp  # noqa: E402
from shardsafe.interop.deepspeed_convert import convert_deepspeed  # noqa: E402
from shardsafe.manager.catalog import list_checkpoints  # noqa: E402
from shardsafe.manager.gc import collect_garbage  # noqa: E402
from shardsafe.manager.manager import CheckpointManager  # noqa: E402
from shardsafe.state.rng import RNGState  # noqa: E402
from shardsafe.state.subclasses import register_tensor_subclass, unregister_tensor_subclass  # noqa: E402

__all__ = [
    "CheckpointExistsError",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "DistributedError",
    "FormatError",
    "IntegrityError",
    "LeaseHeldError",
    "LeaseLostError",
    "ModelFolderError",
    "NoLoadableCheckpointError",
    "PeerFailedError",
    "PushError",
    "ReadOnlyError",
    "RNGState",
    "SaveError",
    "ShardsafeError",
    "StateMismatchError",
    "__version__",
    "collect_garbage",
    "convert_dcp",
    "convert_deepspeed",
    "export_dcp",
    "export_hf",
    "list_checkpoints",
    "load",
    "load_pretrained",
    "push",
    "register_tensor_subclass",
    "save",
    "save_pretrained",
    "unregister_tensor_subclass",
    "verify",
]
