"""A load that fails on bad *non-tensor* state leaves everything exactly as it was.

test_atomic_load.py damages tensor bytes; here the tensors are intact and what is wrong is the
rest of ``state.json``, crafted as an attacker (or a bug) would write it, with the manifest
vouching for it: optimizer param groups (count, members, hyper-parameter types), optimizer state
entries, a scheduler's state, a user object whose ``load_state_dict`` raises after changing
itself, RNG states, JSON values. Every case must raise before anything observable changed: the
model's tensors, the optimizer's state and groups, the scheduler, the user objects, the global
python/torch/numpy RNGs and the plain values are compared bit for bit before and after. One
case runs on 2 FSDP2 ranks where only rank 1's object refuses: both ranks must restore.
"""

from __future__ import annotations

import copy
import json
import random
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import shardsafe
from dist_utils import make_model, make_optimizer, run_ranks, shard, train, typed
from reliability import record
from shardsafe.core.integrity import hash_bytes
from shardsafe.errors import FormatError, ShardsafeError, StateMismatchError


class Counter:
    """A user object with state_dict/load_state_dict."""

    def __init__(self, count: int = 0) -> None:
        self.count, self.history = count, [count]

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count, "history": list(self.history)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.count, self.history = state["count"], list(state["history"])


class Guarded(Counter):
    """Changes itself, then refuses a negative count (validation inside load_state_dict, done late).
    With ``only_rank`` set, only that rank refuses."""

    def __init__(self, count: int = 0, only_rank: int | None = None) -> None:
        super().__init__(count)
        self.only_rank = only_rank

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.history = list(state["history"])  # half applied ...
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        if state["count"] < 0 and self.only_rank in (None, rank):
            raise ValueError(f"count must not be negative, got {state['count']}")
        self.count = state["count"]


def _state(model: Any, seed: int, only_rank: int | None = None) -> dict[str, Any]:
    optimizer = make_optimizer(model)
    return {
        "model": model,
        "optim": optimizer,
        "sched": torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5),
        "rng": shardsafe.RNGState(),
        "counter": Counter(seed),
        "guard": Guarded(seed, only_rank),
        "extra": {"note": f"seed {seed}", "t": torch.arange(3) + seed},
    }


def _train(state: dict[str, Any], seed: int, rank: int = 0) -> None:
    train(state["model"], state["optim"], steps=2, rank=rank, seed=seed)
    state["sched"].step()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed + 100)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("atomic-state") / "ckpt"
    state = _state(make_model(3), 3)
    _train(state, 3)
    state["counter"].count = state["guard"].count = 30
    state["sched"].step()  # one step further than the states loaded into
    shardsafe.save(path, state)
    return path


def everything(state: dict[str, Any]) -> dict[str, Any]:
    """Every observable part of the state (full tensors, deep copies, types kept), and the global RNGs."""
    from dist_utils import full_model_state, full_optimizer_state

    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)  # type: ignore[misc]
    parts = {
        "model": full_model_state(state["model"]),
        "optim": full_optimizer_state(state["model"], state["optim"]),
        "sched": copy.deepcopy(state["sched"].state_dict()),
        "counter": state["counter"].state_dict(),
        "guard": state["guard"].state_dict(),
        "extra": copy.deepcopy(state["extra"]),
        "rng": [random.getstate(), torch.get_rng_state(), [kind, keys.tolist(), pos, has_gauss, cached]],
    }
    return {k: typed(v) for k, v in parts.items()}


# ----------------------------------------------------------------------------- crafted state.json
# Each edits the state tree in place and returns (error class, regex the message must match, strict).


def _group(tree: dict[str, Any], i: int = 0) -> dict[str, Any]:
    return tree["optim"]["state"]["param_groups"][i]


def _first_param_state(tree: dict[str, Any]) -> dict[str, Any]:
    entries = tree["optim"]["state"]["state"]
    return entries[sorted(entries)[0]]


def optim_lr_is_a_string(tree: dict[str, Any]) -> Any:
    _group(tree)["lr"] = "fast"
    return StateMismatchError, r"param group 0 'lr' is a str in the checkpoint", True


def optim_betas_one_element(tree: dict[str, Any]) -> Any:
    _group(tree)["betas"] = {"__tuple__": [0.9]}
    return StateMismatchError, r"'betas' has 1 elements", True


def optim_weight_decay_a_list(tree: dict[str, Any]) -> Any:
    _group(tree)["weight_decay"] = [0.1]
    return StateMismatchError, r"'weight_decay' is a sequence", True


def optim_extra_group(tree: dict[str, Any]) -> Any:
    tree["optim"]["state"]["param_groups"].append(dict(_group(tree), params=[]))
    return StateMismatchError, "parameter groups differ", True


def optim_params_reordered(tree: dict[str, Any]) -> Any:
    _group(tree)["params"].reverse()
    return StateMismatchError, "parameter groups differ", True


def optim_groups_not_a_list(tree: dict[str, Any]) -> Any:
    tree["optim"]["state"]["param_groups"] = {"0": _group(tree)}
    return FormatError, "param_groups", True


def optim_group_params_not_names(tree: dict[str, Any]) -> Any:
    _group(tree)["params"] = [0, 1]
    return FormatError, "list of parameter names", True


def optim_state_for_unknown_parameter(tree: dict[str, Any]) -> Any:
    tree["optim"]["state"]["state"]["no.such.weight"] = {"lr_scale": 2.0}
    return StateMismatchError, "not a parameter of this optimizer", True


def optim_state_refers_to_a_model_tensor(tree: dict[str, Any]) -> Any:
    _first_param_state(tree)["exp_avg"] = {"__tensor__": "model/layers.0.weight"}
    return FormatError, "refers to tensor 'model/layers.0.weight'", False


def optim_step_is_a_string(tree: dict[str, Any]) -> Any:
    _first_param_state(tree)["step"] = "three"
    return StateMismatchError, r"state 'step' of .* is a str in the checkpoint, a tensor here", True


def optim_state_entry_not_an_object(tree: dict[str, Any]) -> Any:
    entries = tree["optim"]["state"]["state"]
    entries[sorted(entries)[0]] = [1, 2]
    return FormatError, "not an object", True


def sched_last_epoch_a_string(tree: dict[str, Any]) -> Any:
    tree["sched"]["state"]["last_epoch"] = "ten"
    return StateMismatchError, r"'sched': state\['last_epoch'\] is a str", True


def sched_state_a_list_raises_in_load_state_dict(tree: dict[str, Any]) -> Any:
    """Not compared with strict=False: the scheduler's own load_state_dict raises (dict.update of a list)."""
    tree["sched"]["state"] = [1, 2, 3]
    return StateMismatchError, "rank 0: (TypeError|ValueError)", False


def guard_raises_after_changing_itself(tree: dict[str, Any]) -> Any:
    """counter (before guard in the dict) is applied first and must be restored too."""
    tree["guard"]["state"]["count"] = -5
    return StateMismatchError, "count must not be negative", True


def counter_history_a_number(tree: dict[str, Any]) -> Any:
    tree["counter"]["state"]["history"] = 5
    return StateMismatchError, r"'counter': state\['history'\] is a number", True


def rng_torch_state_wrong_tensor(tree: dict[str, Any]) -> Any:
    tree["rng"]["ranks"][0]["torch"] = {"__tensor__": "extra/t"}  # an int64 tensor of 3 elements
    return FormatError, "torch RNG state", True


def rng_python_state_too_short(tree: dict[str, Any]) -> Any:
    tree["rng"]["ranks"][0]["python"] = {"__tuple__": [3, {"__tuple__": [1, 2, 3]}, None]}
    return FormatError, "python RNG state", True


def rng_numpy_keys_too_short(tree: dict[str, Any]) -> Any:
    tree["rng"]["ranks"][0]["numpy"]["keys"] = {"__tensor__": "extra/t"}  # 3 keys, not 624
    return FormatError, "numpy RNG state", True


def rng_missing_torch(tree: dict[str, Any]) -> Any:
    del tree["rng"]["ranks"][0]["torch"]
    return FormatError, "needs 'python' and 'torch'", True


def rng_no_ranks(tree: dict[str, Any]) -> Any:
    tree["rng"]["ranks"] = []
    return FormatError, "no per-rank entries", True


def value_bad_dtype_tag(tree: dict[str, Any]) -> Any:
    tree["extra"]["state"]["note"] = {"__dtype__": "float128"}
    return FormatError, "unknown dtype", True


def value_unlisted_tensor(tree: dict[str, Any]) -> Any:
    tree["extra"]["state"]["t"] = {"__tensor__": "extra/nowhere"}
    return FormatError, "does not list", True


def sched_saved_as_a_value(tree: dict[str, Any]) -> Any:
    tree["sched"]["kind"] = "value"
    return StateMismatchError, "saved as value, loading into a stateful", True


def entry_without_kind(tree: dict[str, Any]) -> Any:
    del tree["counter"]["kind"]
    return FormatError, "has no kind", True


CASES: dict[str, Callable[[dict[str, Any]], Any]] = {f.__name__: f for f in [
    optim_lr_is_a_string, optim_betas_one_element, optim_weight_decay_a_list, optim_extra_group,
    optim_params_reordered, optim_groups_not_a_list, optim_group_params_not_names,
    optim_state_for_unknown_parameter, optim_state_refers_to_a_model_tensor, optim_step_is_a_string,
    optim_state_entry_not_an_object, sched_last_epoch_a_string, sched_state_a_list_raises_in_load_state_dict,
    guard_raises_after_changing_itself, counter_history_a_number, rng_torch_state_wrong_tensor,
    rng_python_state_too_short, rng_numpy_keys_too_short, rng_missing_torch, rng_no_ranks, value_bad_dtype_tag,
    value_unlisted_tensor, sched_saved_as_a_value, entry_without_kind,
]}  # fmt: skip


def craft(source: Path, dest: Path, edit: Callable[[dict[str, Any]], Any]) -> Any:
    """A copy of ``source`` whose state.json is edited, and whose manifest vouches for it (size, hash)."""
    shutil.copytree(source, dest)
    tree = json.loads((dest / "state.json").read_text())
    outcome = edit(tree)
    data = json.dumps(tree).encode()
    (dest / "state.json").write_bytes(data)
    manifest = json.loads((dest / "manifest.json").read_text())
    manifest["state"].update(size=len(data), hash=hash_bytes(data))
    (dest / "manifest.json").write_text(json.dumps(manifest))
    return outcome


def load_and_compare(
    rank: int, world_size: int, path: str, strict: bool, only_rank: int | None = None, fresh: bool = False
) -> dict[str, Any]:
    model = make_model(11)
    if world_size > 1:
        shard(model, world_size)
    state = _state(model, 11, only_rank)
    if not fresh:
        _train(state, 11, rank)
    before = everything(state)
    error = None
    try:
        shardsafe.load(path, state, strict=strict)
    except ShardsafeError as exc:
        error = (type(exc).__name__, str(exc))
    return {"error": error, "unchanged": everything(state) == before, "fresh": not state["optim"].state}


def test_the_comparison_sees_a_load(saved: Path) -> None:
    """The control: the intact checkpoint loads, and every compared part changes (so a half-applied
    load could not pass for an untouched state)."""
    state = _state(make_model(11), 11)
    _train(state, 11)
    before = everything(state)
    shardsafe.load(saved, state)
    after = everything(state)
    assert [k for k in before if before[k] != after[k]] == list(before)


@pytest.mark.parametrize("name", list(CASES))
def test_bad_state_changes_nothing(saved: Path, tmp_path: Path, name: str) -> None:
    cls, pattern, strict = craft(saved, tmp_path / "crafted", CASES[name])
    report = load_and_compare(0, 1, str(tmp_path / "crafted"), strict)
    assert report["error"] is not None, f"{name}: the crafted checkpoint loaded"
    assert report["error"][0] == cls.__name__ and re.search(pattern, report["error"][1]), f"{name}: {report['error']}"
    assert report["unchanged"], f"{name}: the failed load changed the state"
    try:  # verify checks the files and the tree's structure, not the fit: it passes or refuses alike
        shardsafe.verify(tmp_path / "crafted")
    except ShardsafeError as exc:
        assert type(exc) is cls and re.search(pattern, str(exc)), f"{name}: verify: {exc!r}"
    record("atomic load: crafted non-tensor state (everything bit-identical after)", faults=1, checked=1)


@pytest.mark.parametrize(
    "name", ["guard_raises_after_changing_itself", "optim_lr_is_a_string", "rng_torch_state_wrong_tensor"]
)
def test_bad_state_leaves_a_fresh_optimizer_fresh(saved: Path, tmp_path: Path, name: str) -> None:
    cls, _, strict = craft(saved, tmp_path / "crafted", CASES[name])
    report = load_and_compare(0, 1, str(tmp_path / "crafted"), strict, fresh=True)
    assert report["error"] is not None and report["error"][0] == cls.__name__, report["error"]
    assert report["unchanged"] and report["fresh"], report
    record("atomic load: crafted non-tensor state (everything bit-identical after)", faults=1, checked=1)


def test_one_rank_refusing_restores_every_rank(saved: Path, tmp_path: Path) -> None:
    """Only rank 1's object raises in load_state_dict; rank 0 had loaded its objects already. Both
    ranks raise, and both are back where they were (FSDP2-sharded model and optimizer included)."""
    craft(saved, tmp_path / "crafted", guard_raises_after_changing_itself)
    reports = run_ranks(load_and_compare, 2, str(tmp_path / "crafted"), True, 1, work_dir=tmp_path)
    for rank, report in enumerate(reports):
        assert report["error"] is not None and report["error"][0] == "StateMismatchError", (
            f"rank {rank}: {report['error']}"
        )
        assert "count must not be negative" in report["error"][1], report["error"]
        assert report["unchanged"], f"rank {rank}: the failed load changed the state"
    record("atomic load: crafted non-tensor state (everything bit-identical after)", faults=1, checked=2)
