"""Where bytes land: the local filesystem and fsspec URLs behind one Location, the safetensors writer and header reader."""
