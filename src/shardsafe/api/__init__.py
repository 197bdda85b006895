"""The collective entry points save(), load(), verify(), and whole-tensor sources over a checkpoint."""

__all__: list[str] = []
