"""The end of a DeepSpeed job script, once its results are written and every rank passed the last barrier."""

from __future__ import annotations

import os
import sys

import torch.distributed as dist


def end_job() -> None:
    """Destroy the process group, then leave without the interpreter's teardown: there, native threads of
    DeepSpeed and gloo have aborted a finished rank now and then ("terminate called without an active
    exception", exit -6) after its results were written, failing a test whose job had succeeded."""
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
