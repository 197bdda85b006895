"""Lightning benchmark: `python benchmarks/bench_lightning.py [--quick] [--runs N]` (`make bench-lightning`).

Save and resume time of ``ShardsafeModelParallelStrategy`` against Lightning's own
``ModelParallelStrategy`` (DCP items + ``meta.pt``), same model, same run, on 2 CPU ranks (gloo) that
Lightning's launcher starts: an MLP of 8 x Linear(2048, 2048) (134 MB of fp32 parameters) sharded
with FSDP2, trained one step (AdamW state made: 403 MB in all). Per run and strategy (the order
alternating from run to run): ``trainer.save_checkpoint`` (fsync on for shardsafe; DCP does not
fsync), then, after ``sync; echo 3 > /proc/sys/vm/drop_caches`` (when this process may; reported),
``trainer.strategy.load_checkpoint`` of that checkpoint into the live model and optimizer, as
``trainer.fit(ckpt_path=...)`` does. The shardsafe strategy runs twice, the second time with
``async_save=True``: its save time is what the training loop waits for (describe + copy into host
buffers), "committed" adds ``strategy.wait_for_save()``. Times are the slowest rank's, medians over the
runs; rank 0 prints a Markdown table.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


def _drop_caches() -> bool:
    subprocess.run(["sync"], check=False)
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def _module(width: int, depth: int) -> Any:
    import lightning.pytorch as L
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    class Mlp(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.layers = nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])

        def configure_model(self) -> None:
            if isinstance(self.layers[0].weight, DTensor):
                return
            mesh = self.device_mesh["data_parallel"]
            for layer in self.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(self.layers, mesh=mesh)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.layers(batch).pow(2).mean()

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    return Mlp()


def _timed(fn: Any) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    mine = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    return float(mine)


KINDS = ("lightning", "shardsafe", "async")


def _one(kind: str, root: str, width: int, depth: int) -> tuple[float, float, float, bool]:
    import lightning.pytorch as L
    from lightning.pytorch.strategies import ModelParallelStrategy

    from shardsafe.integrations.lightning import ShardsafeModelParallelStrategy

    mesh = {"data_parallel_size": 2, "tensor_parallel_size": 1, "process_group_backend": "gloo"}
    if kind == "lightning":
        strategy = ModelParallelStrategy(**mesh)
    else:
        strategy = ShardsafeModelParallelStrategy(**mesh, async_save=kind == "async")
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    data = torch.utils.data.DataLoader(torch.randn(16, width), batch_size=4)
    trainer.fit(_module(width, depth), train_dataloaders=data)
    path = os.path.join(root, f"{kind}.ckpt")
    save = _timed(lambda: trainer.save_checkpoint(path))  # async: what the training loop waits for
    committed = save + (_timed(trainer.strategy.wait_for_save) if kind == "async" else 0.0)
    cold = _drop_caches() if dist.get_rank() == 0 else True
    flags = torch.tensor([int(cold)])
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)
    load = _timed(lambda: trainer.strategy.load_checkpoint(path))
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
    return save, committed, load, bool(flags)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="small model, 1 run")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    width, depth, runs = (256, 2, 1) if args.quick else (2048, 8, args.runs)
    root = os.environ.setdefault("BENCH_LIGHTNING_DIR", tempfile.mkdtemp(prefix="bench-lightning-"))
    times: dict[str, dict[str, list[float]]] = {k: {"save": [], "committed": [], "load": []} for k in KINDS}
    cold_all = True
    for run in range(runs):
        order = list(KINDS[run % len(KINDS) :] + KINDS[: run % len(KINDS)])  # each kind first in turn
        for kind in order:
            save, committed, load, cold = _one(kind, root, width, depth)
            times[kind]["save"].append(save)
            times[kind]["committed"].append(committed)
            times[kind]["load"].append(load)
            cold_all = cold_all and cold
    if dist.get_rank() != 0:
        return
    med = {k: {m: statistics.median(v) for m, v in d.items()} for k, d in times.items()}
    mb = depth * (width * width + width) * 4 * 3 / 1e6
    print(f"\n## Lightning (2 ranks, FSDP2, {mb:.0f} MB of params + AdamW state, medians of {runs} runs)\n")
    print(f"Loads from a {'cold' if cold_all else 'WARM (drop_caches not permitted)'} page cache.\n")
    print("| | Lightning ModelParallelStrategy | ShardsafeModelParallelStrategy | speed-up | async_save=True |")
    print("|---|---|---|---|---|")
    rows = (
        ("save", "trainer.save_checkpoint (the training loop waits)"),
        ("committed", "save until committed"),
        ("load", "resume (strategy.load_checkpoint)"),
    )
    for m, label in rows:
        a, b, c = med["lightning"][m], med["shardsafe"][m], med["async"][m]
        print(f"| {label} | {a:.2f} s | {b:.2f} s | {a / b:.2f}x | {c:.2f} s ({a / c:.2f}x) |")
    print("\nAll runs (s):", {k: {m: [round(x, 3) for x in v] for m, v in d.items()} for k, d in times.items()})
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
