"""Real ``transformers.Trainer`` runs on CPU ranks (gloo), plain and ``ShardsafeTrainer``, for
tests/integrations/test_trainer.py.

Run with ``python -m torch.distributed.run --nproc_per_node 2 run_trainer.py OUT SCENARIO [SCENARIO ...]``.
Each scenario trains a tiny GPT-2 (built offline from a config; dropout on, so resuming needs the
RNG state) on a tiny synthetic dataset and rank 0 writes what the test compares into ``OUT/SCENARIO/``:
``result.json`` (losses per step, folder listings, best checkpoint, errors) and ``*.safetensors``
(final weights). Scenarios run in the order given and may use earlier ones' folders.

DDP (``TrainingArguments(use_cpu=True)``): ``plain``, ``main`` (then ``save_model`` into
``output_dir`` next to the checkpoints, sharded and single-file), ``resume_mid`` (from main's
checkpoint-2, mid-epoch), ``resume_last`` (``resume_from_checkpoint=True`` on a copy of main's
checkpoints 2 and 4 whose checkpoint-4 lost its trainer_state.json; an epoch boundary),
``rotation1`` / ``rotation2`` (``save_total_limit`` 1 / 2, ``load_best_model_at_end``, checkpoint-2
best), ``push`` (``push_to_hub`` every save and at the end; needs ``HF_ENDPOINT``).

DeepSpeed ZeRO-3 (``use_cpu=True`` plus a DeepSpeed config dict: on CPU it is what selects DeepSpeed;
bf16): ``z3_plain``, ``z3_main`` (checkpoints when the engine adapter is ready; ``save_model`` with
``stage3_gather_16bit_weights_on_model_save`` true, and DeepSpeed's own ``save_16bit_model``),
``z3_resume`` (from z3_main's checkpoint-2), ``z3_nogather`` (the flag false).

Data order across world sizes (tests/integrations/test_trainer_data_order.py; 24 samples whose first
token is their index, global batch 6, 10 steps, checkpoints every 3): ``order2`` (2 ranks x 3,
uninterrupted), then ``order3`` (3 ranks x 2) and ``order1`` (1 rank x 3 x 2 accumulation steps), both
resumed from order2's checkpoint-6; ``order1`` also records a resume with a global batch
of 3 and that an iterable dataset keeps the Trainer's sampler. Each rank writes ``taken.rank<r>.json``:
``[step, [sample indices]]`` per micro-batch it trained on. The same under ZeRO-3
(same test file): ``z3_order2`` (2 ranks x 3, uninterrupted, the
engine's whole state written as ``state6.safetensors`` / ``state6.json`` right after checkpoint-6 is
saved), ``z3_order3`` (3 ranks x 2, resumed from z3_order2's checkpoint-6, the engine's state as loaded
written as ``loaded.*`` before step 7 trains).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import traceback
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
if "GLOO_SOCKET_IFNAME" not in os.environ and os.path.exists("/sys/class/net/lo"):
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments  # noqa: E402

from shardsafe.integrations.transformers import ShardsafeTrainer  # noqa: E402
from shardsafe.manager.lease import LEASE_DIR  # noqa: E402

STEPS = 6  # 4 steps per epoch (16 samples, 2 ranks x 2): 6 steps cross an epoch boundary
SEQ = 8
VOCAB = 64
Z3_CONFIG: dict[str, Any] = {
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "train_batch_size": "auto",
    "gradient_clipping": "auto",
    "bf16": {"enabled": "auto"},
    "zero_optimization": {
        "stage": 3,
        "stage3_param_persistence_threshold": 0,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
}


class Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __init__(self, n: int = 16, seed: int = 7) -> None:
        self.x = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.x[i], "labels": self.x[i]}


def model() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=16, bos_token_id=0, eos_token_id=0
    )
    return GPT2LMHeadModel(config)  # dropout 0.1 (default): the RNG state matters


def arguments(output_dir: Path, **overrides: Any) -> TrainingArguments:
    values: dict[str, Any] = {
        "max_steps": STEPS,
        "per_device_train_batch_size": 2,
        "learning_rate": 1e-2,
        "save_strategy": "steps",
        "save_steps": 2,
        "logging_steps": 1,
        "report_to": [],
        "use_cpu": True,
        "seed": 1,
        "disable_tqdm": True,
        "dataloader_num_workers": 0,
        "log_level": "warning",
    }
    values.update(overrides)
    return TrainingArguments(str(output_dir), **values)


def losses(trainer: Trainer) -> dict[str, float]:
    return {str(h["step"]): h["loss"] for h in trainer.state.log_history if "loss" in h}


def ddp_weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone().contiguous() for k, v in trainer.model.state_dict().items()}  # type: ignore[union-attr]


def z3_weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    """The engine's 16-bit weights (DeepSpeed's consolidation) and fp32 master weights, whole (collective)."""
    from deepspeed.utils import safe_get_full_fp32_param

    engine = trainer.model_wrapped
    out: dict[str, torch.Tensor] = {}
    full16 = engine._zero3_consolidated_16bit_state_dict()
    if full16 is not None:
        out.update({f"w16/{k}": v.detach().clone().contiguous() for k, v in full16.items()})
    for name, p in engine.module.named_parameters():
        out[f"w32/{name}"] = safe_get_full_fp32_param(p).detach().cpu().clone().contiguous()
    return out


def z3_state(trainer: Trainer) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The engine's whole training state (collective): ``z3_weights`` plus the fp32 Adam moments, and its counters."""
    from deepspeed.utils import safe_get_full_optimizer_state

    engine = trainer.model_wrapped
    tensors = z3_weights(trainer)
    for name, p in engine.module.named_parameters():
        for key in ("exp_avg", "exp_avg_sq"):
            tensors[f"{key}/{name}"] = safe_get_full_optimizer_state(p, key).detach().cpu().clone().contiguous()
    inner = engine.optimizer.optimizer
    counters = {
        "adam_steps": sorted({float(s["step"]) for s in inner.state.values() if "step" in s}),
        "groups": [{k: v for k, v in g.items() if k != "params"} for g in inner.param_groups],
        "engine": {c: getattr(engine, c) for c in ("global_steps", "global_samples", "skipped_steps")},
        "scheduler": {k: trainer.lr_scheduler.state_dict()[k] for k in ("last_epoch", "_last_lr")},  # type: ignore[union-attr]
    }
    return tensors, counters


def listing(folder: Path) -> list[str]:
    # the run's lease folder aside
    return sorted(p.name for p in folder.iterdir() if p.name != LEASE_DIR) if folder.is_dir() else []


class Run:
    """One scenario's folder and results (written by rank 0)."""

    def __init__(self, out: Path, name: str) -> None:
        self.dir = out / name
        self.rank = dist.get_rank()
        self.result: dict[str, Any] = {}
        if self.rank == 0:
            self.dir.mkdir(parents=True, exist_ok=True)
        dist.barrier()

    def weights(self, name: str, tensors: dict[str, torch.Tensor]) -> None:
        if self.rank == 0:
            save_file(tensors, str(self.dir / f"{name}.safetensors"))

    def finish(self) -> None:
        if self.rank == 0:
            (self.dir / "result.json").write_text(json.dumps(self.result, indent=1, default=str))
        dist.barrier()


def make(cls: type[Trainer], args: TrainingArguments, **kwargs: Any) -> Trainer:
    return cls(model=model(), args=args, train_dataset=Tokens(), **kwargs)


# ----------------------------------------------------------------------------- DDP


def plain(out: Path) -> None:
    run = Run(out, "plain")
    trainer = make(Trainer, arguments(run.dir / "train"))
    trainer.train()
    run.result["losses"] = losses(trainer)
    run.weights("final", ddp_weights(trainer))
    run.finish()


def main_run(out: Path) -> None:
    run = Run(out, "main")
    root = run.dir / "train"
    trainer = make(ShardsafeTrainer, arguments(root))
    trainer.train()
    run.result["losses"] = losses(trainer)
    run.weights("final", ddp_weights(trainer))
    run.result["after_train"] = listing(root)
    trainer.max_shard_size = "20KB"  # type: ignore[attr-defined]
    trainer.save_model()  # into output_dir, next to the checkpoints: sharded
    run.result["after_sharded_save"] = listing(root)
    trainer.max_shard_size = "50GB"  # type: ignore[attr-defined]
    trainer.save_model()  # the single file replaces the index and the shards
    trainer.save_model(str(run.dir / "saved_again"))  # a new folder
    run.result["after_single_save"] = listing(root)
    run.result["checkpoint_2"] = listing(root / "checkpoint-2")
    run.finish()


def resume_mid(out: Path) -> None:
    run = Run(out, "resume_mid")
    trainer = make(ShardsafeTrainer, arguments(run.dir / "train"))
    trainer.train(resume_from_checkpoint=str(out / "main" / "train" / "checkpoint-2"))
    run.result["losses"] = losses(trainer)
    run.weights("final", ddp_weights(trainer))
    run.finish()


def resume_last(out: Path) -> None:
    run = Run(out, "resume_last")
    root = run.dir / "train"
    if run.rank == 0:
        for step in (2, 4):
            shutil.copytree(out / "main" / "train" / f"checkpoint-{step}", root / f"checkpoint-{step}")
        (root / "checkpoint-4" / "trainer_state.json").unlink()  # as a crash right after the commit leaves it
    dist.barrier()
    trainer = make(ShardsafeTrainer, arguments(root))
    trainer.train(resume_from_checkpoint=True)
    run.result["losses"] = losses(trainer)
    run.result["regenerated"] = (root / "checkpoint-4" / "trainer_state.json").is_file()
    run.weights("final", ddp_weights(trainer))
    run.finish()


def rotation(out: Path, limit: int) -> None:
    run = Run(out, f"rotation{limit}")
    root = run.dir / "train"
    args = arguments(
        root,
        max_steps=STEPS + 2 * (limit - 1),
        eval_strategy="steps",
        eval_steps=2,
        save_total_limit=limit,
        load_best_model_at_end=True,
        metric_for_best_model="score",
        greater_is_better=True,
    )
    holder: dict[str, Trainer] = {}

    def score(_: Any) -> dict[str, float]:  # checkpoint-2 is the best
        return {"score": 1.0 if holder["trainer"].state.global_step == 2 else 0.0}

    trainer = make(ShardsafeTrainer, args, eval_dataset=Tokens(8, seed=3), compute_metrics=score)
    holder["trainer"] = trainer
    seen: list[list[str]] = []

    from transformers import TrainerCallback

    class Watch(TrainerCallback):
        def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            seen.append(listing(root))

    trainer.add_callback(Watch())
    trainer.train()
    run.result["after_each_save"] = seen
    run.result["final"] = listing(root)
    run.result["best"] = trainer.state.best_model_checkpoint
    run.weights("final", ddp_weights(trainer))
    run.finish()


def model_only(out: Path) -> None:
    run = Run(out, "model_only")
    root = run.dir / "train"
    trainer = make(ShardsafeTrainer, arguments(root, max_steps=2, save_only_model=True))
    trainer.train()
    run.weights("final", ddp_weights(trainer))
    run.result["checkpoint_2"] = listing(root / "checkpoint-2")
    run.finish()


def push_run(out: Path) -> None:
    run = Run(out, "push")
    args = arguments(
        run.dir / "train", max_steps=4, push_to_hub=True, hub_model_id="owner/trained", hub_strategy="every_save"
    )
    trainer = make(ShardsafeTrainer, args)
    trainer.train()
    run.result["url"] = trainer.push_to_hub()
    run.weights("final", ddp_weights(trainer))
    run.finish()


# ----------------------------------------------------------------------------- DeepSpeed ZeRO-3


def z3_arguments(output_dir: Path, gather: bool = True, **overrides: Any) -> TrainingArguments:
    config = json.loads(json.dumps(Z3_CONFIG))
    config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = gather
    values: dict[str, Any] = {"deepspeed": config, "bf16": True}
    values.update(overrides)
    return arguments(output_dir, **values)


def z3_plain(out: Path) -> None:
    run = Run(out, "z3_plain")
    trainer = make(Trainer, z3_arguments(run.dir / "train", save_strategy="no"))
    trainer.train()
    run.result["losses"] = losses(trainer)
    run.weights("final", z3_weights(trainer))
    run.finish()


def z3_main(out: Path) -> None:
    run = Run(out, "z3_main")
    root = run.dir / "train"
    trainer = make(ShardsafeTrainer, z3_arguments(root))
    trainer.train()
    run.result["losses"] = losses(trainer)
    run.weights("final", z3_weights(trainer))
    trainer.save_model()  # gathered 16-bit weights, into output_dir next to the checkpoints
    trainer.model_wrapped.save_16bit_model(str(run.dir / "ds16"))  # DeepSpeed's own, for comparison (a pickle)
    if run.rank == 0:
        ds16 = torch.load(run.dir / "ds16" / "pytorch_model.bin", weights_only=True)
        run.weights("ds16", {k: v.clone().contiguous() for k, v in ds16.items()})
    run.result["after_save"] = listing(root)
    run.finish()


def z3_resume(out: Path) -> None:
    run = Run(out, "z3_resume")
    trainer = make(ShardsafeTrainer, z3_arguments(run.dir / "train"))
    trainer.train(resume_from_checkpoint=str(out / "z3_main" / "train" / "checkpoint-2"))
    run.result["losses"] = losses(trainer)
    run.weights("final", z3_weights(trainer))
    run.finish()


def z3_nogather(out: Path) -> None:
    run = Run(out, "z3_nogather")
    root = run.dir / "train"
    trainer = make(ShardsafeTrainer, z3_arguments(root, gather=False, max_steps=2, save_strategy="no"))
    trainer.train()
    run.weights("final", z3_weights(trainer))
    trainer.save_model()
    run.result["after_save"] = listing(root)
    run.result["checkpoint_dir"] = listing(root / "checkpoint")
    run.finish()


# ----------------------------------------------------------------------------- data order across world sizes

ORDER_SAMPLES = 24  # 4 steps per epoch at a global batch of 6
ORDER_STEPS = 10  # 2.5 epochs


class Indexed(Tokens):
    """Row i's first token is i, so the batch a rank trains on tells which samples it took."""

    def __init__(self) -> None:
        super().__init__(ORDER_SAMPLES, seed=11)
        self.x[:, 0] = torch.arange(ORDER_SAMPLES)


class Recording(ShardsafeTrainer):
    """Records, per micro-batch, the optimizer step it belongs to and the samples in it."""

    taken: list[Any]

    def training_step(self, model: Any, inputs: dict[str, Any], num_items_in_batch: Any = None) -> torch.Tensor:
        self.taken.append([self.state.global_step + 1, inputs["input_ids"][:, 0].tolist()])
        return super().training_step(model, inputs, num_items_in_batch)


def order_trainer(
    root: Path, per_device: int, accumulation: int, dataset: Any = None, zero3: bool = False
) -> Recording:
    make_args = z3_arguments if zero3 else arguments
    args = make_args(
        root,
        max_steps=ORDER_STEPS,
        save_steps=3,
        per_device_train_batch_size=per_device,
        gradient_accumulation_steps=accumulation,
    )
    trainer = Recording(model=model(), args=args, train_dataset=Indexed() if dataset is None else dataset)
    trainer.taken = []
    return trainer


def order_run(
    out: Path, name: str, per_device: int, accumulation: int, resume: str | None = None, callback: Any = None
) -> Run:
    run = Run(out, name)
    trainer = order_trainer(run.dir / "train", per_device, accumulation, zero3=name.startswith("z3"))
    if callback is not None:
        trainer.add_callback(callback(run, trainer))
    trainer.train(resume_from_checkpoint=resume)
    (run.dir / f"taken.rank{run.rank}.json").write_text(json.dumps(trainer.taken))
    run.result["losses"] = losses(trainer)
    run.result["sampler"] = type(trainer._data.sampler).__name__ if trainer._data is not None else None
    run.result["world_size"] = dist.get_world_size()
    return run


def order1(out: Path) -> None:
    checkpoint = str(out / "order2" / "train" / "checkpoint-6")
    # another global batch (3, not 6), accepted as the Trainer accepts it: the data goes on in samples
    other = order_trainer(out / "order1_other_batch", per_device=3, accumulation=1)
    try:
        other.train(resume_from_checkpoint=checkpoint)
        other_batch: Any = other.taken
    except Exception as exc:
        other_batch = f"{type(exc).__name__}: {exc}"

    class Stream(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
        def __iter__(self) -> Any:
            return iter(Indexed())

    streamed = order_trainer(out / "order1_stream", per_device=3, accumulation=1, dataset=Stream())
    streamed.get_train_dataloader()
    run = order_run(out, "order1", per_device=3, accumulation=2, resume=checkpoint)
    run.result["other_batch"] = other_batch
    run.result["iterable_keeps_the_trainers_sampler"] = streamed._data is None
    run.finish()


def z3_state_at(run: Run, trainer: Trainer, name: str) -> None:
    tensors, counters = z3_state(trainer)
    run.weights(name, tensors)
    if run.rank == 0:
        (run.dir / f"{name}.json").write_text(json.dumps(counters, indent=1, default=str))


def z3_order_callback(event: str, step: int | None) -> Any:
    """A callback writing the engine's whole state at ``event`` (``on_save`` of ``step``, or ``on_train_begin``: as
    loaded)."""
    from transformers import TrainerCallback

    class State(TrainerCallback):
        def __init__(self, run: Run, trainer: Trainer) -> None:
            self.run, self.trainer = run, trainer

        def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if event == "on_save" and state.global_step == step:
                z3_state_at(self.run, self.trainer, f"state{step}")

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if event == "on_train_begin":
                z3_state_at(self.run, self.trainer, "loaded")

    return State


SCENARIOS = {
    "plain": plain,
    "main": main_run,
    "resume_mid": resume_mid,
    "resume_last": resume_last,
    "rotation1": lambda out: rotation(out, 1),
    "rotation2": lambda out: rotation(out, 2),
    "push": push_run,
    "model_only": model_only,
    "z3_plain": z3_plain,
    "z3_main": z3_main,
    "z3_resume": z3_resume,
    "z3_nogather": z3_nogather,
    "order2": lambda out: order_run(out, "order2", per_device=3, accumulation=1).finish(),
    "order3": lambda out: order_run(
        out, "order3", per_device=2, accumulation=1, resume=str(out / "order2" / "train" / "checkpoint-6")
    ).finish(),
    "order1": order1,
    "z3_order2": lambda out: order_run(
        out, "z3_order2", per_device=3, accumulation=1, callback=z3_order_callback("on_save", 6)
    ).finish(),
    "z3_order3": lambda out: order_run(
        out,
        "z3_order3",
        per_device=2,
        accumulation=1,
        resume=str(out / "z3_order2" / "train" / "checkpoint-6"),
        callback=z3_order_callback("on_train_begin", None),
    ).finish(),
}


def main() -> None:
    out = Path(sys.argv[1])
    names = sys.argv[2:]
    if any(n.startswith("z3") for n in names):
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
    else:
        dist.init_process_group("gloo")
    torch.set_num_threads(1)
    for name in names:
        try:
            SCENARIOS[name](out)
        except Exception:
            (out / f"{name}.rank{dist.get_rank()}.error").write_text(traceback.format_exc())
            raise
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
