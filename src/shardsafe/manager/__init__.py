"""Training-run checkpoints: step folders, catalog, retention, garbage collection, CheckpointManager."""
