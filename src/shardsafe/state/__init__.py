"""Live objects <-> named tensor chunks + JSON: one adapter per kind of state value."""

__all__: list[str] = []
