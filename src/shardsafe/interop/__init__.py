"""Readers of other checkpoint formats (DeepSpeed ZeRO) behind one restricted unpickler."""
