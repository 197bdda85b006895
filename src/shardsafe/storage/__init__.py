"""Where bytes land: the local filesystem (local.py), fsspec URLs such as s3:// (remote.py), pinned host buffers for GPU
copies (pinned.py)."""

__all__: list[str] = []
