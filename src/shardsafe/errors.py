"""Exception classes.

Everything shardsafe raises on purpose derives from :class:`ShardsafeError`, a plain
``Exception``, so ``except Exception`` in a training loop catches it (unlike
``torch.distributed.checkpoint.CheckpointException``, which derives from BaseException).
"""

from __future__ import annotations

__all__ = [
    "CheckpointExistsError",
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
    "SaveError",
    "ShardsafeError",
    "StateMismatchError",
]


class ShardsafeError(Exception):
    """Base class of every error shardsafe raises on purpose."""


class CheckpointNotFoundError(ShardsafeError, FileNotFoundError):
    """No committed checkpoint (no manifest) at the given path."""


class CheckpointExistsError(ShardsafeError, FileExistsError):
    """A committed checkpoint already exists and ``overwrite`` was not set."""


class FormatError(ShardsafeError):
    """A manifest, state file or shard header is malformed, unsafe or inconsistent."""


class IntegrityError(ShardsafeError):
    """Stored bytes do not match what the manifest promises (hash, size, missing file)."""


class StateMismatchError(ShardsafeError):
    """The checkpoint does not fit the objects it is loaded into (keys, shapes, dtypes)."""


class SaveError(ShardsafeError):
    """A save failed on one or more ranks; nothing was published."""


class DistributedError(ShardsafeError):
    """Ranks disagree or a collective step failed on another rank."""


class PeerFailedError(DistributedError):
    """This rank waited on another rank's part of a collective step that failed there (bytes it
    reads for others, protocol/shared_read.py). When the ranks agree, the failing rank's own error
    is what every rank raises; this one only stands in if no rank reported a cause."""


class ModelFolderError(ShardsafeError):
    """A model folder's weights are missing, empty, or smaller than its index or manifest says."""


class PushError(ShardsafeError):
    """Uploading a model folder to the Hub or an object store failed (names the destination and the file)."""


class LeaseHeldError(ShardsafeError):
    """Another live run holds the lease on this checkpoint root (names it: host, pid, run id, heartbeat age)."""


class LeaseLostError(ShardsafeError):
    """This run's lease on its checkpoint root was taken over by another run; it may publish and delete nothing."""


class NoLoadableCheckpointError(ShardsafeError):
    """``restore`` loaded nothing although the root holds committed checkpoints (names each, who wrote it and why it
    failed).

    Raised instead of returning None, so a run does not silently start from scratch over a history it could not read."""


class ReadOnlyError(ShardsafeError):
    """A read-only CheckpointManager (``read_only=True``) was asked to save or delete."""
