"""Readers of other checkpoint formats (DeepSpeed ZeRO, torch DCP) behind one restricted unpickler."""

__all__: list[str] = []
