"""How a step's checkpoint folder is named, and how a folder name is read back as a step.

The manager names its folders ``step-0000000100`` (ten digits, so lexical order is numeric order);
the Hugging Face Trainer names its own ``checkpoint-100``. Both are a prefix and a step: one
:class:`StepNaming` describes either, so the catalog and retention work on both without copies.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["STEP_NAMING", "STEP_RE", "StepNaming", "step_name"]

STEP_DIGITS = 10
STEP_RE = re.compile(r"^step-(\d+)$")


@dataclass(frozen=True)
class StepNaming:
    """Folder names ``<prefix><step>``, the step zero-padded to ``digits`` (0: no padding).

    :meth:`parse` accepts only the canonical name of a step (``name(parse(n)) == n``): a folder
    ``step-5`` next to ``step-0000000005`` is not a second name for step 5, it is not a step
    folder at all (reading it as step 5 would then open the other folder).
    """

    prefix: str
    digits: int = 0

    def name(self, step: int) -> str:
        if step < 0:
            raise ValueError(f"a step is a non-negative integer, not {step}")
        return f"{self.prefix}{step:0{self.digits}d}"

    def parse(self, name: str) -> int | None:
        """The step ``name`` is the folder of, or None if it is not one of these names."""
        if not name.startswith(self.prefix):
            return None
        digits = name[len(self.prefix) :]
        if not digits or not digits.isascii() or not digits.isdigit():
            return None
        step = int(digits)
        return step if self.name(step) == name else None


STEP_NAMING = StepNaming("step-", STEP_DIGITS)  # the CheckpointManager's folders


def step_name(step: int) -> str:
    """The manager's folder name of ``step``: ``step-0000000100``."""
    return STEP_NAMING.name(step)
