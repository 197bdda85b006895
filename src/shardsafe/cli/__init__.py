"""Every `shardsafe ...` command, one error boundary, and the demo."""
