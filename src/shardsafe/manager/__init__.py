"""Training-run checkpoints: one module per question.

``naming`` (what a step's folder is called), ``catalog`` (what a root holds, damaged checkpoints
included), ``retention`` (what to keep, and the deleter), ``gc`` (what interrupted saves left),
``staging`` (host buffers of async saves), ``manager`` (the CheckpointManager that uses them).
"""

__all__: list[str] = []
