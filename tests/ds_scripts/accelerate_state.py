"""``shardsafe.integrations.accelerate.save_state`` / ``load_state`` of an Accelerator running DeepSpeed
ZeRO-3 on CPU ranks (gloo), against ``Accelerator.save_state`` / ``load_state``.

Run with ``python -m torch.distributed.run --nproc_per_node W accelerate_state.py OUT PHASE``
(tests/integrations/test_accelerate_deepspeed.py does). Every rank writes ``OUT/PHASE-w<W>.rank<r>.pt``
with what it saw (losses; whole tensors gathered by DeepSpeed's own ``safe_get_full_*`` helpers;
scheduler, counters, sampler and registered object state; error messages); the test compares.

Each phase runs twice, once per scheduler kind (``SCHEDULERS``: a torch StepLR that Accelerate keeps out
of DeepSpeed, and DeepSpeed's WarmupLR that the engine steps), folders suffixed ``_<kind>``.

* ``save`` (W=2): run A trains ``SAVE_AT`` steps, is saved by shardsafe (``OUT/ss_<kind>``) and by
  Accelerate (``OUT/acc_<kind>``: ``engine.save_checkpoint`` plus Accelerate's pickles), then trains
  ``MORE`` steps (the uninterrupted reference).
* ``resume`` (W=2, a new launch: new process group, new engines with other initial weights and RNG):
  run B loads ``OUT/ss_<kind>`` with shardsafe and trains ``MORE`` steps; run C does the same from
  ``OUT/acc_<kind>`` with ``Accelerator.load_state``.
* ``reshard`` (W=1 or 3): a fresh run loads ``OUT/ss_<kind>``, is snapshotted, and trains one step;
  ``Accelerator.load_state`` of ``OUT/acc_torch`` is tried as well (its error is recorded).

Accelerate selects DeepSpeed only when its state is not created with ``cpu=True`` (``AcceleratorState``
checks ``ACCELERATE_USE_DEEPSPEED ... and not cpu``), so, as ``transformers.TrainingArguments(use_cpu=True)``
does, the process state is first created as ``PartialState(cpu=True)`` (gloo, CPU device) and the
``Accelerator`` with a ``DeepSpeedPlugin`` after it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
if "GLOO_SOCKET_IFNAME" not in os.environ and os.path.exists("/sys/class/net/lo"):
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

SAVE_AT, MORE, BATCH, SEED = 2, 2, 2, 0
SCHEDULERS = ("torch", "ds")
DS_CONFIG: dict[str, Any] = {
    "train_micro_batch_size_per_gpu": BATCH,
    "gradient_accumulation_steps": 1,
    "steps_per_print": 10**9,
    # every parameter partitioned (none persistent), several optimizer sub-groups whose boundaries move with W
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "sub_group_size": 100},
    "zero_allow_untested_optimizer": True,
    "zero_force_ds_cpu_optimizer": False,
}


class Net(nn.Module):
    """Odd sizes (uneven ZeRO-3 partitions at 2 and 3 ranks); dropout, so every rank's RNG matters."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 13)
        self.drop = nn.Dropout(0.3)
        self.b = nn.Linear(13, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.drop(torch.relu(self.a(x))))


class Counter:
    """An object registered with ``register_for_checkpointing``."""

    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.n = int(state["n"])


def setup(project: Path, init_seed: int, scheduler_kind: str) -> dict[str, Any]:
    """A prepared ZeRO-3 run: engine, its optimizer wrapper and scheduler; a ReshardableSampler and a
    counter registered for checkpointing; the torch RNG of each rank seeded apart.

    ``scheduler_kind`` ``"torch"``: a torch StepLR, which Accelerate keeps out of DeepSpeed (an
    ``AcceleratedScheduler``, stepped by the loop, once per process as Accelerate does); ``"ds"``:
    DeepSpeed's WarmupLR, which Accelerate hands to ``deepspeed.initialize`` (the engine steps it;
    the loop's ``DeepSpeedSchedulerWrapper.step`` does nothing)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import DeepSpeedPlugin, ProjectConfiguration
    from deepspeed.runtime.lr_schedules import WarmupLR

    from shardsafe.data import ReshardableSampler

    # Accelerate takes the plugins from the first Accelerator of a process only (a second one shares its
    # state); the first named is active. "zero2" is selected only for the refusal check in phase_reshard.
    zero2 = dict(DS_CONFIG, zero_optimization={"stage": 2})
    plugins = {"zero3": DeepSpeedPlugin(hf_ds_config=dict(DS_CONFIG)), "zero2": DeepSpeedPlugin(hf_ds_config=zero2)}
    plugin = None if AcceleratorState._shared_state else plugins
    accelerator = Accelerator(deepspeed_plugin=plugin, project_config=ProjectConfiguration(str(project)))
    torch.manual_seed(init_seed)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, betas=(0.9, 0.99))
    if scheduler_kind == "torch":
        scheduler: Any = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
    else:
        scheduler = WarmupLR(optimizer, warmup_min_lr=0.0, warmup_max_lr=0.05, warmup_num_steps=5, warmup_type="linear")
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    sampler = ReshardableSampler(range(64), seed=2)
    sampler.set_epoch(0)
    counter = Counter()
    accelerator.register_for_checkpointing(sampler, counter)
    torch.manual_seed(init_seed + 100 + accelerator.process_index)
    data = torch.randn(64, 9, generator=torch.Generator().manual_seed(1))
    return {
        "acc": accelerator,
        "model": model,
        "opt": optimizer,
        "sched": scheduler,
        "sampler": sampler,
        "counter": counter,
        "data": data,
    }


def train(s: dict[str, Any], steps: int) -> list[float]:
    """``steps`` optimizer steps; each rank's batch comes from the sampler's position, dropout from its RNG.
    One iterator per run, started at the first step (after a load: at the loaded position)."""
    it = s.setdefault("it", iter(s["sampler"]))
    losses = []
    for _ in range(steps):
        idx = torch.tensor([next(it) for _ in range(BATCH)])
        x, y = s["data"][idx, :8], s["data"][idx, 8:]
        loss = nn.functional.mse_loss(s["model"](x), y)
        s["acc"].backward(loss)  # DeepSpeed: engine.backward, then engine.step (optimizer and scheduler)
        s["opt"].step()  # no-ops under DeepSpeed, kept as in any Accelerate loop
        s["sched"].step()
        s["opt"].zero_grad()
        s["counter"].n += 1
        losses.append(loss.item())
    return losses


def snapshot(s: dict[str, Any]) -> dict[str, Any]:
    """Everything the checkpoint covers, whole (collective): fp32 master weights and moments, gathered
    parameters, step counts per sub-group, hyper-parameters, scheduler, counters, sampler, counter, RNG."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    engine = s["model"]
    inner = engine.optimizer.optimizer
    tensors: dict[str, torch.Tensor] = {}
    for name, p in engine.module.named_parameters():
        tensors[f"fp32/{name}"] = safe_get_full_fp32_param(p).detach().clone()
        if inner.state:
            for key in ("exp_avg", "exp_avg_sq"):
                tensors[f"{key}/{name}"] = safe_get_full_optimizer_state(p, key).detach().clone()
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        for name, p in engine.module.named_parameters():
            tensors[f"lp/{name}"] = p.data.detach().clone()
    flats = engine.optimizer.fp32_partitioned_groups_flat
    return {
        "tensors": tensors,
        "steps": [float(inner.state[f]["step"]) for f in flats if "step" in inner.state.get(f, {})],
        "sub_groups": len(flats),
        "groups": [{k: v for k, v in g.items() if k != "params"} for g in inner.param_groups],
        "scheduler": s["sched"].scheduler.state_dict(),
        "counters": {c: getattr(engine, c) for c in ("global_steps", "global_samples", "skipped_steps")},
        "sampler": s["sampler"].state_dict(),
        "counter": s["counter"].n,
        "rng": torch.get_rng_state(),
    }


def phase_save(out: Path) -> dict[str, Any]:
    from shardsafe.integrations import accelerate as ss

    result: dict[str, Any] = {}
    for kind in SCHEDULERS:
        a = setup(out / "project", SEED, kind)
        r: dict[str, Any] = {
            "distributed_type": str(a["acc"].distributed_type),
            "types": [type(a[k]).__name__ for k in ("model", "opt", "sched")],
        }
        r["losses_before"] = train(a, SAVE_AT)
        ss.save_state(a["acc"], out / f"ss_{kind}")
        a["acc"].save_state(str(out / f"acc_{kind}"))
        r["at_save"] = snapshot(a)
        r["losses_ref"] = train(a, MORE)
        r["final_ref"] = snapshot(a)
        result[kind] = r
    return result


def phase_resume(out: Path) -> dict[str, Any]:
    from shardsafe.integrations import accelerate as ss

    result: dict[str, Any] = {}
    for kind in SCHEDULERS:
        r: dict[str, Any] = {}
        for name in ("ss", "acc"):
            s = setup(out / "project", SEED + 7, kind)  # other initial weights, other RNG
            if name == "ss":
                ss.load_state(s["acc"], out / f"ss_{kind}")
            else:
                s["acc"].load_state(str(out / f"acc_{kind}"))
            r[f"after_load_{name}"] = snapshot(s)
            r[f"losses_{name}"] = train(s, MORE)
            r[f"final_{name}"] = snapshot(s)
        result[kind] = r
    return result


def error_of(fn: Any, *args: Any) -> tuple[str, str] | None:
    try:
        fn(*args)
    except Exception as exc:
        return type(exc).__name__, str(exc)
    return None


def phase_reshard(out: Path) -> dict[str, Any]:
    from shardsafe.integrations import accelerate as ss

    result: dict[str, Any] = {}
    for kind in SCHEDULERS:
        s = setup(out / "project", SEED + 11, kind)
        ss.load_state(s["acc"], out / f"ss_{kind}")
        r: dict[str, Any] = {"after_load": snapshot(s)}
        r["losses"] = train(s, 1)
        r["after_step"] = snapshot(s)
        result[kind] = r
    s = setup(out / "project", SEED + 13, "torch")
    result["accelerate_error"] = error_of(s["acc"].load_state, str(out / "acc_torch"))
    if dist.get_world_size() == 1:  # a ZeRO-2 engine (Accelerate's second plugin): refused with a clear error
        from accelerate.state import AcceleratorState
        from deepspeed.utils import safe_get_full_fp32_param

        AcceleratorState().select_deepspeed_plugin("zero2")
        z2 = setup(out / "project", SEED, "torch")
        result["zero2_stage"] = z2["model"].zero_optimization_stage()
        result["zero2_save_error"] = error_of(ss.save_state, z2["acc"], out / "ss_zero2")
        result["zero2_load_error"] = error_of(ss.load_state, z2["acc"], out / "ss_torch")
        result["zero2_folder_exists"] = (out / "ss_zero2").exists()
        train(z2, 1)
        z2["acc"].save_state(str(out / "acc_zero2"))  # what the error points to; the test converts it
        result["zero2_fp32"] = {
            n: safe_get_full_fp32_param(p).detach().clone() for n, p in z2["model"].module.named_parameters()
        }
        AcceleratorState().select_deepspeed_plugin("zero3")
    return result


def _no_compile(model: Any = None, **kwargs: Any) -> Any:
    return model if model is not None else (lambda fn: fn)


def main() -> None:
    out, phase = Path(sys.argv[1]), sys.argv[2]
    # As in engine_state.py: DeepSpeed's Muon module wraps functions in torch.compile at initialize,
    # importing inductor (seconds per process); nothing here compiles, so it is made the identity.
    torch.compile = _no_compile  # type: ignore[assignment]
    from accelerate import PartialState

    PartialState(cpu=True)  # gloo on the CPU; the Accelerator created later selects DeepSpeed (see above)
    torch.set_num_threads(1)
    result = {"save": phase_save, "resume": phase_resume, "reshard": phase_reshard}[phase](out)
    torch.save(result, out / f"{phase}-w{dist.get_world_size()}.rank{dist.get_rank()}.pt")
    dist.barrier()
    from teardown import end_job  # a sibling when run as a script (tests import this module too)

    end_job()


if __name__ == "__main__":
    main()
