"""What the torchtitan checkpoint manager hands to shardsafe: torchtitan's objects as shardsafe state values.

torchtitan's DCP manager flattens the model parts (``ModelWrapper``) and saves the optimizers through
``OptimizersContainer.state_dict()`` (a flat ``state.<fqn>.<key>`` dict). shardsafe instead saves
each object as it saves any state value, so it reshards on load:

* ``model``: the rank's model part (an FSDP2 / TP / plain ``nn.Module``; a pipeline stage holds its
  layers under their full names, so the stages of all ranks merge into one tree);
* ``optimizer`` (``optimizer_1``, ...): the torch optimizers inside the ``OptimizersContainer`` (the
  container is an ``Optimizer`` with no state of its own: its ``step`` calls theirs);
* ``lr_scheduler``: the ``LRSchedulersContainer`` (its ``state_dict``);
* ``dataloader``: :class:`DataPosition`, the ``StatefulDataLoader`` state of each data-parallel rank
  without torchtitan's ``pickle.dumps`` around it (a load never unpickles);
* ``rng``: :class:`~shardsafe.state.rng.RNGState`, every rank's generators (the DCP manager saves none);
* whatever else the Trainer passes in ``states`` (``train_state``: its step and tokens seen).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from shardsafe.errors import ShardsafeError
from shardsafe.state.rng import RNGState

__all__ = [
    "DATALOADER",
    "EXPORT_DTYPE",
    "LR_SCHEDULER",
    "MODEL",
    "OPTIMIZER",
    "RNG",
    "DataPosition",
    "model_part",
    "optimizer_entries",
    "training_state",
]

MODEL, OPTIMIZER, LR_SCHEDULER, DATALOADER, RNG = "model", "optimizer", "lr_scheduler", "dataloader", "rng"
EXPORT_DTYPE = "export_dtype"  # a final model-only checkpoint saved in another dtype notes it here


def model_part(model_parts: list[nn.Module]) -> nn.Module:
    """The rank's one model part. Several parts on a rank (an interleaved or looped pipeline schedule,
    with virtual stages) are refused: each would need its own name, and the names would then depend on
    the schedule, so the checkpoint would not load into another pipeline degree or one process."""
    if len(model_parts) != 1:
        raise ShardsafeError(
            f"torchtitan gave this rank {len(model_parts)} model parts (virtual pipeline stages); "
            "ShardsafeCheckpointManager saves one part per rank. Use a schedule with one stage per rank "
            "(parallelism.pipeline_parallel_schedule='1F1B' or 'GPipe'), or torchtitan's CheckpointManager"
        )
    return model_parts[0]


def optimizer_entries(optimizers: Any) -> dict[str, Any]:
    """The torch optimizers of an ``OptimizersContainer`` (or a plain optimizer), by state name.

    Each is saved as shardsafe saves an optimizer, its state keyed by the parameter names of ``model``.
    """
    inner = list(getattr(optimizers, "optimizers", [optimizers]))
    if not inner:
        raise ShardsafeError("torchtitan's OptimizersContainer holds no optimizer; nothing to checkpoint")
    return {OPTIMIZER if i == 0 else f"{OPTIMIZER}_{i}": o for i, o in enumerate(inner)}


class DataPosition:
    """The data position of a torchtitan ``ParallelAwareDataloader``, as a state value.

    torchtitan's ``state_dict`` pickles the ``StatefulDataLoader`` state under ``dp_rank_<r>`` (and
    ``load_state_dict`` unpickles it). Here the same state is saved unpickled:
    ``{"dp_world_size": N, "ranks": {"<r>": state}}``; every rank saves its own data-parallel rank's
    entry and the checkpoint holds the merge (ranks of one data-parallel group, TP or pipeline
    peers, hold the same position). A load restores each data-parallel rank's own position.

    An iterable dataset split by data-parallel rank (torchtitan's HF datasets) has no global
    position, so a different data-parallel degree is refused before anything is loaded, naming
    the remedy (``exclude_from_loading=["dataloader"]``), as torchtitan's own dataloader asserts.
    """

    def __init__(self, dataloader: Any) -> None:
        from torchdata.stateful_dataloader import StatefulDataLoader

        if not isinstance(dataloader, StatefulDataLoader):
            raise ShardsafeError(
                f"the dataloader is a {type(dataloader).__name__}, not a torchdata StatefulDataLoader "
                "(torchtitan's ParallelAwareDataloader); pass it in states under another name if it has a "
                "state_dict of plain values, or add 'dataloader' to checkpoint.exclude_from_loading"
            )
        self.dataloader = dataloader
        self._base = StatefulDataLoader
        self.dp_rank = int(getattr(dataloader, "dp_rank", 0))
        self.dp_world_size = int(getattr(dataloader, "dp_world_size", 1))

    def state_dict(self) -> dict[str, Any]:
        return {
            "dp_world_size": self.dp_world_size,
            "ranks": {str(self.dp_rank): self._base.state_dict(self.dataloader)},
        }

    def check_state_dict(self, state: Any) -> list[str]:
        """Problems with a saved position, before anything is loaded (shardsafe asks every value)."""
        if not isinstance(state, dict) or not isinstance(state.get("ranks"), dict):
            return ["a dataloader position needs 'dp_world_size' and 'ranks'"]
        saved = state.get("dp_world_size")
        if saved != self.dp_world_size:
            return [
                f"the data position was saved at data-parallel degree {saved}, this run has {self.dp_world_size}; "
                "an iterable dataset split by data-parallel rank cannot continue on another degree. Add "
                "'dataloader' to checkpoint.exclude_from_loading to start the data from its beginning"
            ]
        if str(self.dp_rank) not in state["ranks"]:
            return [f"the checkpoint holds no data position for data-parallel rank {self.dp_rank}"]
        return []

    def load_state_dict(self, state: dict[str, Any]) -> None:
        problems = self.check_state_dict(state)
        if problems:
            raise ShardsafeError(problems[0])
        self._base.load_state_dict(self.dataloader, state["ranks"][str(self.dp_rank)])


def training_state(
    model: nn.Module,
    optimizers: Any,
    lr_schedulers: Any,
    dataloader: Any,
    states: dict[str, Any],
) -> dict[str, Any]:
    """The full shardsafe state of one rank, in the names of torchtitan's DCP manager (plus ``rng``)."""
    clash = sorted({MODEL, LR_SCHEDULER, DATALOADER, RNG, OPTIMIZER, EXPORT_DTYPE} & set(states))
    if clash:
        raise ShardsafeError(f"states {clash} clash with the names the checkpoint manager gives torchtitan's objects")
    tree: dict[str, Any] = {MODEL: model, **optimizer_entries(optimizers)}
    if lr_schedulers is not None:
        tree[LR_SCHEDULER] = lr_schedulers
    if dataloader is not None:
        tree[DATALOADER] = DataPosition(dataloader)
    tree[RNG] = RNGState()
    tree.update(states)
    return tree
