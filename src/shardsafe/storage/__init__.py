"""Where bytes land: the local filesystem (local.py) and fsspec URLs such as s3:// (remote.py)."""
