"""torchtitan's checkpointer seam: ``ShardsafeCheckpointManager`` against torchtitan's own DCP ``CheckpointManager``.

    .venv/bin/python benchmarks/bench_torchtitan.py --md BENCHMARKS.md      # make bench-torchtitan

One 4-rank gloo job (CPU) holds torchtitan's llama3 (test_torchtitan's recipe and CPU adaptations, at the size
given by ``--dim/--layers/--vocab``) laid out by torchtitan's own ``parallelize_llama`` on dp_shard=2 x tp=2, its
``OptimizersContainer`` (AdamW), ``LRSchedulersContainer`` and a ``ParallelAwareDataloader``; both managers are
built from their Config exactly as the Trainer builds its checkpointer (``config.build(dataloader=...,
model_parts=..., optimizers=..., lr_schedulers=..., states={"train_state": ...}, sd_adapter=None,
base_folder=...)``) and driven by the Trainer's calls: per step forward/backward, ``maybe_wait_for_staging()``,
``optimizers.step()``, ``save(step)``. Per round, each manager (the order alternating between rounds):

* ``async_mode="disabled"``: the time ``save`` takes (everything written; DCP does not fsync, shardsafe does);
* ``"async"`` and ``"async_with_pinned_mem"``: the time the training loop is **blocked** by a save: its
  ``save()`` call and the next step's ``maybe_wait_for_staging()`` (where the pinned-memory modes wait for
  the copy to finish).
* Four saves per manager, mode and round, each made after the previous one is written (as in a run whose
  interval is longer than a write): the first sets things up (DCP's planning caches and background thread,
  shardsafe's lease, writer thread and staging buffers) and is reported apart; the median of the other three
  is the round's steady state;
* resume: after ``sync; echo 3 > /proc/sys/vm/drop_caches`` (when permitted: reported), ``load(step)`` of the
  ``disabled`` checkpoint into the job's live objects, as a restarted Trainer's ``load`` does.

DCP's ``async_with_pinned_mem`` needs an accelerator (its ``DefaultStager`` asserts "Non-blocking copy requires
that the current accelerator is available"), so without one only shardsafe's is measured.

Times are the slowest rank's; medians over rounds. Each timed call starts after a barrier: without it, the ranks'
skew from the training step (the local optimizer step is uneven) would be charged to whichever manager's call has a
collective in it (shardsafe's save agrees across ranks before it returns; DCP's async save plans in its background
thread), although in a real step the next FSDP all-gather absorbs that skew anyway. ``--md`` writes (replaces)
only this script's section.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.utils.data import IterableDataset

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path[:0] = [str(HERE.parent / "tests" / "integrations"), str(HERE.parent / "tests")]
from common import drop_file_cache, free_port, load_average, was_busy, write_section  # noqa: E402

HEADING = "## torchtitan checkpoint managers (4 ranks, dp_shard=2 x tp=2)"
MODES = ("disabled", "async", "async_with_pinned_mem")
LIBS = ("dcp", "shardsafe")
STEADY_SAVES = 3  # per manager, mode and round, after the first; their median is the round's steady time


class RandomTokens(IterableDataset):
    """Token ids from a seeded generator, split by data-parallel rank; its state is the samples it gave."""

    def __init__(self, dp_rank: int, dp_size: int, vocab: int, seq: int) -> None:
        self.dp_rank, self.dp_size, self.vocab, self.seq, self.given = dp_rank, dp_size, vocab, seq, 0

    def __iter__(self) -> Any:
        while True:
            generator = torch.Generator().manual_seed(self.given * self.dp_size + self.dp_rank)
            self.given += 1
            tokens = torch.randint(0, self.vocab, (self.seq + 1,), generator=generator)
            yield {"input": tokens[:-1]}, tokens[1:]

    def state_dict(self) -> dict[str, int]:
        return {"given": self.given}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.given = state["given"]


class Step:
    """The Trainer's step and tokens seen (its ``state_dict``)."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step = state["step"]


def _slowest(seconds: float) -> float:
    value = torch.tensor([seconds])
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value)


class Job:
    """One rank's torchtitan training pieces, and the Trainer's loop around a checkpointer."""

    def __init__(self, args: argparse.Namespace, root: Path) -> None:
        import test_torchtitan as tt
        from torchtitan.components.dataloader import ParallelAwareDataloader
        from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer
        from torchtitan.components.optimizer.optimizer import ParamGroupConfig

        tt.DIM, tt.HEADS, tt.LAYERS, tt.VOCAB, tt.SEQ = args.dim, args.heads, args.layers, args.vocab, args.seq
        self.model, _, dp_mesh = tt.build("2d", 4, seed=0)
        self.dp_mesh = dp_mesh
        adamw = {"lr": 1e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
        self.optimizers = OptimizersContainer.Config(
            param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs=adamw)],
            implementation="for-loop",
        ).build(model_parts=[self.model])
        self.lr_schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(
            optimizers=self.optimizers, training_steps=10_000
        )
        dp_rank, dp_size = dp_mesh.get_local_rank(), dp_mesh.size()
        dataset = RandomTokens(dp_rank, dp_size, args.vocab, args.seq)
        self.dataloader = ParallelAwareDataloader(
            dataset, dp_rank=dp_rank, dp_world_size=dp_size, batch_size=args.batch
        )
        self.batches = iter(self.dataloader)
        self.train_state = Step()
        self.root = root
        self.forward_backward()
        self.optimizers.step()  # AdamW state exists before the first save

    def forward_backward(self) -> None:
        from torch.distributed.tensor import DTensor

        inputs, labels = next(self.batches)
        logits = self.model(inputs["input"])
        if isinstance(logits, DTensor):
            logits = logits.full_tensor()
        F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten()).backward()

    def checkpointer(self, lib: str, mode: str, folder: str) -> Any:
        from torchtitan.components.checkpointer import CheckpointManager

        from shardsafe.integrations.torchtitan import ShardsafeCheckpointManager

        cls = ShardsafeCheckpointManager if lib == "shardsafe" else CheckpointManager
        config = cls.Config(enable=True, folder=folder, interval=1, keep_latest_k=0, async_mode=mode)
        return config.build(
            dataloader=self.dataloader,
            model_parts=[self.model],
            optimizers=self.optimizers,
            lr_schedulers=self.lr_schedulers,
            states={"train_state": self.train_state},
            sd_adapter=None,
            base_folder=str(self.root),
        )

    def train_step(self, checkpointer: Any, save: bool) -> float:
        """One step of the Trainer's loop; the seconds the checkpointer blocked it (this rank). A step that does
        not save skips the ``save`` call (with a longer interval it returns False at once)."""
        self.train_state.step += 1
        self.forward_backward()
        dist.barrier()  # the ranks' skew from the step is not the checkpointer's (see the module docstring)
        start = time.perf_counter()
        checkpointer.maybe_wait_for_staging()
        blocked = time.perf_counter() - start
        self.optimizers.step()
        self.lr_schedulers.step()
        self.optimizers.zero_grad()
        if save:
            dist.barrier()
            start = time.perf_counter()
            checkpointer.save(self.train_state.step)
            blocked += time.perf_counter() - start
        return blocked

    def measure(self, lib: str, mode: str, folder: str) -> dict[str, float]:
        """This manager in this mode: 1 + ``STEADY_SAVES`` saves, each blocking its step (``save``) and the next
        one (``maybe_wait_for_staging``), each after the previous one is written, as with any long interval.
        Then (disabled) a cold resume of its last checkpoint."""
        dist.barrier()
        checkpointer = self.checkpointer(lib, mode, folder)
        times = []
        for i in range(1 + STEADY_SAVES):
            if i:
                checkpointer.maybe_wait_for_saving()
            blocked = self.train_step(checkpointer, True) + self.train_step(checkpointer, False)
            times.append(_slowest(blocked))
        checkpointer.maybe_wait_for_saving()
        out = {"first": times[0], "steady": statistics.median(times[1:])}
        if mode == "disabled":
            cold = torch.tensor([1.0])
            if dist.get_rank() == 0:  # the whole page cache as root; else this checkpoint's files (fadvise)
                cold[0] = float(drop_file_cache(self.root / folder) <= 0)
            dist.broadcast(cold, 0)
            start = time.perf_counter()
            checkpointer.load(step=self.train_state.step - 1)  # the last saving step (a step without save since)
            out["resume"] = _slowest(time.perf_counter() - start)
            out["cold"] = float(cold)
        checkpointer.close()
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(self.root / folder, ignore_errors=True)
        return out


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        job = Job(args, Path(args.dir))
        results: dict[str, Any] = {lib: {mode: [] for mode in MODES} for lib in LIBS}
        for round_ in range(args.rounds):
            for lib in LIBS if round_ % 2 == 0 else LIBS[::-1]:
                for mode in MODES:
                    if lib == "dcp" and mode == "async_with_pinned_mem" and not torch.accelerator.is_available():
                        continue  # DCP's DefaultStager asserts "Non-blocking copy requires ... accelerator"
                    results[lib][mode].append(job.measure(lib, mode, f"{lib}-{mode}-{round_}"))
        if rank == 0:
            out["results"] = results
            out["params"] = sum(p.numel() for p in job.model.parameters())  # a DTensor's numel is the whole one
    finally:
        dist.destroy_process_group()


def _median(runs: list[dict[str, float]], key: str) -> float | None:
    return statistics.median(r[key] for r in runs) if runs else None


METHOD = (
    "Blocked time of a save: its `save()` call plus the next step's `maybe_wait_for_staging()`; each steady save "
    "is made after the previous one is written (an interval longer than a write); each timed call starts after a "
    "barrier, so the ranks' skew from the training step is charged to neither manager."
)
ROWS = (  # label, mode, measurement
    ("save, `disabled`, steady", "disabled", "steady"),
    ("save, `disabled`, first save of the manager", "disabled", "first"),
    ("training blocked per save, `async`, steady", "async", "steady"),
    ("training blocked per save, `async_with_pinned_mem`, steady", "async_with_pinned_mem", "steady"),
    ("blocked, first `async` save", "async", "first"),
    ("blocked, first `async_with_pinned_mem` save", "async_with_pinned_mem", "first"),
    ("resume, `load`", "disabled", "resume"),
)


def _cell(value: float | None) -> str:
    return f"{value:.3f} s" if value is not None else "n/a (DCP's stager needs an accelerator)"


def _ratio(a: float | None, b: float | None) -> str:
    return f"{b / a:.2f}x" if a and b is not None else "-"


def _best_async(runs: dict[str, list[dict[str, float]]]) -> tuple[str, float]:
    """The async mode with the least steady blocked time (DCP's pinned-memory mode runs only with an accelerator)."""
    timed = {mode: _median(runs[mode], "steady") for mode in MODES[1:] if runs[mode]}
    mode = min(timed, key=lambda m: timed[m] or 0.0)
    return mode, timed[mode] or 0.0


def report(
    results: dict[str, Any], params: int, args: argparse.Namespace, load: str, seconds: float, before: str
) -> str:
    state_mb = params * 4 * 3 / 1e6  # fp32 weights + AdamW's two moments
    cold = all(r["cold"] for lib in LIBS for r in results[lib]["disabled"])
    lines = [
        HEADING,
        "",
        f"`make bench-torchtitan` (benchmarks/bench_torchtitan.py), {time.strftime('%Y-%m-%d', time.gmtime())}: "
        f"torchtitan's llama3 (dim {args.dim}, {args.layers} layers, vocab {args.vocab}: {params / 1e6:.1f} M "
        f"parameters, {state_mb:.0f} MB with AdamW's moments) on dp_shard=2 x tp=2 at 4 gloo ranks (CPU), "
        f"both managers built from their Config as the Trainer builds them, in the same job; medians of "
        f"{args.rounds} rounds, slowest rank; loads from a {'cold' if cold else 'WARM (drop_caches refused)'} "
        f"page cache. Load average (1/5/15 min) before: {before}, at the end: {load} (its own 4 ranks included); "
        f"the whole run took {seconds:.0f} s. " + METHOD,
        "",
        "| | torchtitan DCP CheckpointManager | ShardsafeCheckpointManager | shardsafe / DCP |",
        "|---|---|---|---|",
    ]
    for label, mode, key in ROWS:
        a, b = _median(results["dcp"][mode], key), _median(results["shardsafe"][mode], key)
        lines.append(f"| {label} | {_cell(a)} | {_cell(b)} | {_ratio(a, b)} |")
    best = {lib: _best_async(results[lib]) for lib in LIBS}
    lines.append(
        f"| training blocked per save, each manager's best async mode, steady | {best['dcp'][1]:.3f} s "
        f"(`{best['dcp'][0]}`) | {best['shardsafe'][1]:.3f} s (`{best['shardsafe'][0]}`) | "
        f"{_ratio(best['dcp'][1], best['shardsafe'][1])} |"
    )
    busy = was_busy(before)
    lines += [
        "",
        f"Machine: {os.cpu_count()} CPUs"
        + (
            f", **under load** (load average {before} when the run started, above {os.cpu_count()} CPUs: "
            "other jobs shared the cores and the disk, so treat the numbers as indicative; rerun on a quiet machine)."
            if busy
            else ", quiet when the run started (1-minute load average below the CPU count)."
        ),
        "",
        "Ratios are shardsafe's time over DCP's (below 1: shardsafe faster). Targets (issue 40): blocked time "
        "<= 0.7x, resume >= 1.5x faster (a ratio <= 0.67x).",
        "",
        "All rounds (steady / first / resume, s): "
        + "; ".join(
            f"{lib} {mode} "
            + ", ".join("/".join(f"{r[k]:.3f}" for k in ("steady", "first", "resume") if k in r) for r in runs)
            for lib in LIBS
            for mode, runs in results[lib].items()
            if runs
        ),
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--md", type=Path, help="write (replace) this script's section of this Markdown file")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--batch", type=int, default=1, help="samples per data-parallel rank and step")
    parser.add_argument("--dir", default=None, help="where the checkpoints go (default: a temporary folder)")
    args = parser.parse_args()
    args.dir = args.dir or tempfile.mkdtemp(prefix="bench-torchtitan-", dir=os.environ.get("BENCH_DIR"))
    start, before = time.perf_counter(), load_average()
    try:
        with mp.Manager() as manager:
            out = manager.dict()
            mp.spawn(_rank, (4, free_port(), args, out), nprocs=4)
            results, params = out["results"], out["params"]
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
    text = report(results, params, args, load_average(), time.perf_counter() - start, before)
    print(text)
    if args.md is not None:
        write_section(args.md, HEADING, text)


if __name__ == "__main__":
    main()
