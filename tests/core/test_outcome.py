"""core/comm.py: the one error encoding (:class:`Outcome`) keeps an error's class and message.

An error raised on one rank is encoded (:meth:`Outcome.failure`), travels as the object
collectives carry it (pickled), and is raised again on every rank (:meth:`Outcome.unwrap`):

* a :class:`~shardsafe.errors.ShardsafeError` subclass - every one in ``shardsafe.errors`` - comes
  back as the same class with the same message, for any message text;
* any other exception comes back as the caller's ``default`` class, its message naming the rank and
  the original type;
* ``Comm.on_coordinator`` and ``Comm.agree`` follow the same rule without a process group, and on
  two real gloo ranks (one launch: every class raised on one rank, the same error on both).
"""

from __future__ import annotations

import inspect
import pickle
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dist_utils import run_ranks
from shardsafe import errors
from shardsafe.core.comm import Comm, Outcome, get_comm
from shardsafe.errors import ShardsafeError

CLASSES = sorted(
    (
        c
        for _, c in inspect.getmembers(errors, inspect.isclass)
        if issubclass(c, ShardsafeError) and c.__module__ == errors.__name__
    ),
    key=lambda c: c.__name__,
)
OTHERS = [ValueError, KeyError, OSError, RuntimeError, TypeError, ZeroDivisionError]
messages = st.text(max_size=60)


def _raised(outcome: Outcome[object], default: type[ShardsafeError]) -> BaseException:
    with pytest.raises(ShardsafeError) as info:
        outcome.unwrap(default)
    return info.value


def test_every_error_class_is_covered() -> None:
    assert len(CLASSES) >= 10 and ShardsafeError in CLASSES and errors.PeerFailedError in CLASSES


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(CLASSES), messages, st.integers(0, 1 << 16), st.sampled_from(CLASSES))
def test_shardsafe_errors_keep_class_and_message(
    cls: type[ShardsafeError], message: str, rank: int, default: type[ShardsafeError]
) -> None:
    outcome = pickle.loads(pickle.dumps(Outcome.failure(cls(message), rank, default)))
    assert not outcome.ok and outcome.rank == rank
    raised = _raised(outcome, default)
    assert type(raised) is cls and str(raised) == message


@settings(max_examples=100, deadline=None)
@given(st.sampled_from(OTHERS), messages, st.integers(0, 1 << 16), st.sampled_from(CLASSES))
def test_other_errors_become_the_default(
    cls: type[Exception], message: str, rank: int, default: type[ShardsafeError]
) -> None:
    original = cls(message)
    outcome = pickle.loads(pickle.dumps(Outcome.failure(original, rank, default)))
    raised = _raised(outcome, default)
    assert type(raised) is default and str(raised) == f"rank {rank}: {cls.__name__}: {original}"


@settings(max_examples=50, deadline=None)
@given(st.integers() | st.text(max_size=10) | st.lists(st.integers(), max_size=5) | st.none())
def test_values_round_trip(value: object) -> None:
    outcome = pickle.loads(pickle.dumps(Outcome(value=value)))
    assert outcome.ok and outcome.unwrap() == value


def test_an_unknown_class_name_falls_back_to_the_default() -> None:
    """A name that is not a shardsafe error (a peer on another version, a forged record) is never looked up
    elsewhere."""
    for name in ("Exception", "SystemExit", "Comm", "no such class"):
        raised = _raised(Outcome(error=name, message="m", rank=1), errors.SaveError)
        assert type(raised) is errors.SaveError and str(raised) == "m"


@pytest.mark.parametrize("cls", CLASSES + OTHERS, ids=lambda c: c.__name__)
def test_single_process_collectives_follow_the_rule(cls: type[Exception]) -> None:
    comm = Comm(None, 0, 1)
    expected = cls if issubclass(cls, ShardsafeError) else errors.SaveError

    def fail() -> None:
        raise cls("boom")

    with pytest.raises(expected) as info:
        comm.on_coordinator(fail, default=errors.SaveError)
    assert type(info.value) is expected and isinstance(info.value.__cause__, cls)
    with pytest.raises(expected) as agreed:
        comm.agree(cls("boom"), default=errors.SaveError)
    assert type(agreed.value) is expected and str(agreed.value) == str(info.value)


def _every_class_on_two_ranks(rank: int, world_size: int) -> list[tuple[str, str, str, str]]:
    """For each class: raised on rank 1 in ``agree``, and on the coordinator in ``on_coordinator``; what this rank
    raised."""
    comm = get_comm()
    seen = []
    for cls in CLASSES + OTHERS:
        problem = cls(f"boom {cls.__name__}") if rank == 1 else None
        try:
            comm.agree(problem, default=errors.SaveError)
        except ShardsafeError as exc:
            agreed = (type(exc).__name__, str(exc))

        def fail(cls: type[Exception] = cls) -> None:
            raise cls(f"bang {cls.__name__}")

        try:
            comm.on_coordinator(fail, default=errors.SaveError)
        except ShardsafeError as exc:
            shared = (type(exc).__name__, str(exc))
        seen.append((*agreed, *shared))
    return seen


def test_two_gloo_ranks_raise_the_same_error(tmp_path: Path) -> None:
    by_rank = run_ranks(_every_class_on_two_ranks, 2, work_dir=tmp_path)
    for i, cls in enumerate(CLASSES + OTHERS):
        name = cls.__name__ if issubclass(cls, ShardsafeError) else "SaveError"
        sent = (
            f"boom {cls.__name__}"
            if issubclass(cls, ShardsafeError)
            else f"rank 1: {cls.__name__}: {cls(f'boom {cls.__name__}')}"
        )
        shared = (
            f"bang {cls.__name__}"
            if issubclass(cls, ShardsafeError)
            else f"rank 0: {cls.__name__}: {cls(f'bang {cls.__name__}')}"
        )
        assert by_rank[1][i] == (name, sent, name, shared)
        assert by_rank[0][i] == (name, f"(reported by rank 1) {sent}", name, shared)
