"""Data-order state that reshards: :class:`ReshardableSampler`, a drop-in ``DistributedSampler``
whose saved position is global, so a resume on another world size continues the same sample order."""

from shardsafe.data.sampler import ReshardableSampler

__all__ = ["ReshardableSampler"]
