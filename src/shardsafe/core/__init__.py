"""The pure core: the on-disk schema, block hashes, who writes/reads what, collectives, fault points. No file I/O."""

__all__: list[str] = []
