"""Every `shardsafe ...` command, one error boundary, and the demo."""

__all__: list[str] = []
