"""Resuming from what torchtitan's DCP manager wrote: its ``step-<N>`` DCP folders, read in place.

torchtitan's ``CheckpointManager`` saves the model flattened to the top level (``layers.0...weight``),
the optimizers as ``OptimizersContainer.state_dict()`` gives them (``optimizer`` holding
``state.<fqn>.<key>`` and ``param_groups.<fqn>.<key>``), and ``lr_scheduler``, ``train_state`` and
``dataloader`` as values. This module describes such a folder as the shardsafe state tree of
:mod:`.state` (``model``, ``optimizer``, ``lr_scheduler``, ``train_state``) and loads it with the phases
of any shardsafe load (:func:`shardsafe.api.load.load_from`: checks, agreement, atomicity,
resharding onto this run's layout), reading the ``.distcp`` items in place through the restricted
DCP reader of :mod:`shardsafe.interop`.

Not loaded: ``dataloader`` (torchtitan pickles the loader's state into it, and shardsafe never
unpickles checkpoint data; the data starts from its beginning, and a warning says so) and ``rng``
(the DCP manager saves none).
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shardsafe.api.load import load_from
from shardsafe.core.format import Manifest
from shardsafe.core.values import TENSOR_REF, check_state_tree
from shardsafe.errors import FormatError
from shardsafe.integrations.torchtitan.state import MODEL, OPTIMIZER
from shardsafe.interop.dcp_convert import dcp_state_tree
from shardsafe.interop.dcp_metadata import METADATA_NAME, is_dcp_folder
from shardsafe.interop.dcp_reader import DcpCheckpoint, DcpChunkReader, dcp_manifest
from shardsafe.state.base import param_names

__all__ = ["dcp_manager_steps", "load_dcp_manager_folder"]

log = logging.getLogger(__name__)

_DCP_STEP = re.compile(r"^step-(0|[1-9][0-9]*)$", re.ASCII)  # as torchtitan writes them: no 01, no other digits


def dcp_manager_steps(folder: str) -> dict[int, Path]:
    """The DCP manager's committed ``step-<N>`` folders under ``folder`` (local paths), by step."""
    root = Path(folder)
    if "://" in folder or not root.is_dir():
        return {}
    found = {}
    for child in root.iterdir():
        match = _DCP_STEP.match(child.name)
        if match and not child.is_symlink() and is_dcp_folder(child):
            found[int(match.group(1))] = child
    return found


def _is_tensor_ref(encoded: Any) -> bool:
    return isinstance(encoded, dict) and set(encoded) == {TENSOR_REF}


def _renamed(encoded: Any, key: str, renames: dict[str, str]) -> Any:
    """A tensor reference moved to the key shardsafe's adapter reads it by (recorded in ``renames``)."""
    if _is_tensor_ref(encoded):
        renames[encoded[TENSOR_REF]] = key
        return {TENSOR_REF: key}
    return encoded


def _optimizer_entry(
    flat: Any, model: nn.Module, optimizer: torch.optim.Optimizer, where: str, renames: dict[str, str]
) -> dict[str, Any]:
    """torchtitan's flat ``state.<fqn>.<key>`` / ``param_groups.<fqn>.<key>`` optimizer dict as shardsafe's
    optimizer entry (state keyed by FQN, the live optimizer's groups with their saved hyper-parameters)."""
    if not isinstance(flat, dict):
        raise FormatError(f"{where}: 'optimizer' is not a flat state dict")
    names = param_names(model)
    state: dict[str, Any] = {}
    groups = []
    for group in optimizer.param_groups:
        fqns = [names[id(p)] for p in group["params"]]
        for fqn in fqns:
            prefix = f"state.{fqn}."
            entries = {
                k[len(prefix) :]: _renamed(v, f"{OPTIMIZER}/state/{fqn}/{k[len(prefix) :]}", renames)
                for k, v in flat.items()
                if k.startswith(prefix)
            }
            if entries:
                state[fqn] = entries
        prefix = f"param_groups.{fqns[0]}." if fqns else ""
        saved = {k[len(prefix) :]: v for k, v in flat.items() if prefix and k.startswith(prefix)}
        if "param_names" in group:
            saved["param_names"] = fqns
        groups.append({**saved, "params": fqns})
    return {"kind": "optimizer", "state": {"state": state, "param_groups": groups}}


def torchtitan_tree(
    tree: dict[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer | None, where: str
) -> tuple[dict[str, Any], dict[str, str]]:
    """The state tree of a DCP manager's folder (as :func:`~shardsafe.interop.dcp_convert.dcp_state_tree`
    describes it) regrouped as :mod:`.state` names it, and the tensor keys it renamed (old -> new)."""
    renames: dict[str, str] = {}
    out: dict[str, Any] = {MODEL: {"kind": "module", "state": {}}}
    for name, entry in tree.items():
        encoded = entry.get("state")
        if _is_tensor_ref(encoded):  # a flattened model tensor
            out[MODEL]["state"][name] = _renamed(encoded, f"{MODEL}/{name}", renames)
        elif name == OPTIMIZER:
            if optimizer is not None:
                out[OPTIMIZER] = _optimizer_entry(encoded, model, optimizer, where, renames)
        elif name in ("lr_scheduler", "train_state"):
            out[name] = {"kind": "stateful", "state": encoded}
        else:
            out[name] = entry
    return out, renames


def load_dcp_manager_folder(
    folder: Path,
    state: dict[str, Any],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    process_group: Any = None,
) -> None:
    """Load the DCP manager's checkpoint ``folder`` into ``state`` (collective), resharded, strictly for
    what is loaded: the entries of ``state`` it can fill (its ``dataloader`` and ``rng`` are left as they are)."""
    skipped = sorted(k for k in ("dataloader", "rng") if k in state)
    if "dataloader" in skipped:
        log.warning(
            "shardsafe: %s: the DCP manager pickles the dataloader's state, which shardsafe does not unpickle; "
            "the data starts from its beginning",
            folder,
        )
    loadable = {k: v for k, v in state.items() if k not in skipped}

    def opened() -> tuple[Manifest, dict[str, Any]]:
        with DcpCheckpoint(folder, key="") as ckpt:
            meta = ckpt.meta  # the dataloader's pickled items are never read, not even by the restricted loader
            for key in [k for k in meta.values if meta.paths[k][:1] == ("dataloader",)]:
                del meta.values[key]
            keys, tree = dcp_state_tree(ckpt)
            where = str(folder / METADATA_NAME)
            regrouped, renames = torchtitan_tree(tree, model, optimizer, where)
            manifest = dcp_manifest(ckpt.meta, {fqn: renames.get(key, key) for fqn, key in keys.items()})
        check_state_tree(regrouped, where, manifest)
        return manifest, regrouped

    load_from(
        loadable,
        opened,
        lambda manifest: DcpChunkReader(Path(folder), manifest, True),
        process_group,
        True,
        True,
        True,
    )
