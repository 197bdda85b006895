"""How bytes move and how a checkpoint becomes visible: rank files out, verified reads in, the commit."""

__all__: list[str] = []
