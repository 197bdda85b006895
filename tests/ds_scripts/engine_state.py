"""A live DeepSpeed ZeRO-3 engine saved and loaded as a shardsafe state value, on CPU ranks (gloo).

Run with ``python -m torch.distributed.run --nproc_per_node W engine_state.py OUT PHASE``
(tests/interop/test_deepspeed_engine.py does). Every rank writes ``OUT/PHASE.rank<r>.pt`` with what it saw
(full tensors gathered by DeepSpeed's own helpers, losses, error messages); the test compares.

* ``save`` (W=2), for ``bf16``, ``fp32`` and ``bf16-offload``: engine A trains 2 steps, is saved by shardsafe
  (``OUT/ss_<precision>``, with its LR scheduler as a separate value) and by
  ``engine.save_checkpoint`` (``OUT/ds_<precision>``), then trains 2 more steps (the uninterrupted
  run). Engine B (fresh, other initial weights) loads ``ss_<precision>`` and trains the same 2 steps;
  engine C does the same from DeepSpeed's own checkpoint. bf16 only: a different model and a ZeRO-2
  engine are refused by ``shardsafe.load`` (the first leaves its engine untouched); a DynamicLossScaler
  (fp16's, which DeepSpeed's CPU accelerator cannot train with) survives a save/load.
* ``reshard`` (W=1 or W=3): a fresh engine loads each ``ss_<precision>`` saved by 2 ranks, is
  snapshotted, saved again (``OUT/ss_<precision>_w<W>``) and trains one step. The 3-rank launch then
  also loads ``ss_bf16_w1``, which the concurrent 1-rank launch saved (1 -> 3). A fresh engine also loads
  ``conv_<precision>`` (the test converted DeepSpeed's own 2-rank ``ds_<precision>`` with
  ``shardsafe convert --for-engine`` between the launches), is snapshotted and trains one step.

bf16 runs keep DeepSpeed's default persistence threshold (every parameter of this tiny model is
persistent: gathered once and kept); fp32 runs partition every parameter (threshold 0). Both use
``sub_group_size`` 200, so the optimizer has several sub-groups whose boundaries depend on W.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
if "GLOO_SOCKET_IFNAME" not in os.environ and os.path.exists("/sys/class/net/lo"):
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

import shardsafe  # noqa: E402
from ds_scripts.teardown import end_job  # noqa: E402
from ds_scripts.train_zero import VOCAB, Tiny, param_groups  # noqa: E402

PRECISIONS = ("bf16", "fp32", "bf16-offload")
SAVE_AT = 2
STEPS = 4


def config(precision: str, stage: int = 3) -> dict[str, Any]:
    """``bf16``, ``fp32`` or ``bf16-offload`` (optimizer and parameters offloaded to the CPU, with a
    torch optimizer: on this CPU-only machine that changes the code paths, not the devices)."""
    zero: dict[str, Any] = {"stage": stage, "sub_group_size": 200}
    if precision.endswith("-offload"):
        zero["offload_optimizer"] = {"device": "cpu"}
        zero["offload_param"] = {"device": "cpu"}
        precision = precision.removesuffix("-offload")
    if precision == "fp32":
        zero["stage3_param_persistence_threshold"] = 0
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 2,
        "steps_per_print": 10**9,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
    }
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def build(precision: str, seed: int, model: nn.Module | None = None, stage: int = 3) -> Any:
    import deepspeed

    torch.manual_seed(seed)
    model = model if model is not None else Tiny()
    optimizer = torch.optim.AdamW(param_groups(model), lr=1e-2, betas=(0.9, 0.99), eps=1e-6)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, config=config(precision, stage), lr_scheduler=scheduler
    )
    return engine


def train(engine: Any, steps: range) -> list[float]:
    """One step per global step number, on data that depends only on (rank, step)."""
    losses = []
    rank = dist.get_rank()
    for step in steps:
        gen = torch.Generator().manual_seed(1000 * rank + step)
        tokens = torch.randint(0, VOCAB, (2, 7), generator=gen)
        logits = engine(tokens).float()
        loss = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def snapshot(engine: Any) -> dict[str, Any]:
    """Everything the engine value covers, whole (collective): fp32 master and moments (DeepSpeed's
    safe_get_full_* helpers), gathered 16-bit parameters (trainable and frozen), buffers, step counts
    per sub-group, param-group hyper-parameters, loss scaler, counters."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    inner = engine.optimizer.optimizer
    tensors: dict[str, torch.Tensor] = {}
    for name, p in engine.module.named_parameters():
        if p.requires_grad:
            tensors[f"fp32/{name}"] = safe_get_full_fp32_param(p).detach().clone()
            if inner.state:
                for key in ("exp_avg", "exp_avg_sq"):
                    tensors[f"{key}/{name}"] = safe_get_full_optimizer_state(p, key).detach().clone()
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params):
        for name, p in engine.module.named_parameters():
            tensors[f"lp/{name}"] = p.data.detach().clone()
    for name, b in engine.module.named_buffers():
        tensors[f"buffer/{name}"] = b.detach().clone()
    steps = [
        s["step"].clone()
        for s in (inner.state.get(flat, {}) for flat in engine.optimizer.fp32_partitioned_groups_flat)
        if "step" in s
    ]
    return {
        "tensors": tensors,
        "steps": steps,
        "sub_groups": len(engine.optimizer.fp32_partitioned_groups_flat),
        "groups": [{k: v for k, v in g.items() if k != "params"} for g in inner.param_groups],
        "scaler": dict(vars(engine.optimizer.loss_scaler)),
        "counters": {c: getattr(engine, c) for c in ("global_steps", "global_samples", "skipped_steps", "micro_steps")},
        "scheduler": engine.lr_scheduler.state_dict(),
    }


def state_of(engine: Any, step: int) -> dict[str, Any]:
    return {"engine": engine, "sched": engine.lr_scheduler, "step": step}


def error_of(fn: Any, *args: Any) -> tuple[str, str] | None:
    try:
        fn(*args)
    except Exception as exc:
        return type(exc).__name__, str(exc)
    return None


def phase_save(out: Path) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for precision in PRECISIONS:
        r: dict[str, Any] = {}
        a = build(precision, seed=1234)
        r["losses_before"] = train(a, range(SAVE_AT))
        shardsafe.save(out / f"ss_{precision}", state_of(a, SAVE_AT), metadata={"precision": precision})
        a.save_checkpoint(str(out / f"ds_{precision}"))
        r["at_save"] = snapshot(a)
        r["losses_ref"] = train(a, range(SAVE_AT, STEPS))
        r["final_ref"] = snapshot(a)
        del a

        b = build(precision, seed=5678)
        state = state_of(b, -1)
        shardsafe.load(out / f"ss_{precision}", state)
        r["step_value"] = state["step"]
        r["after_load"] = snapshot(b)
        r["losses_ss"] = train(b, range(SAVE_AT, STEPS))
        r["final_ss"] = snapshot(b)

        c = build(precision, seed=5678)
        c.load_checkpoint(str(out / f"ds_{precision}"))
        r["after_ds_load"] = snapshot(c)
        r["losses_ds"] = train(c, range(SAVE_AT, STEPS))
        r["final_ds"] = snapshot(c)

        if precision == "bf16":
            from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

            # fp16's scaler state (the CPU accelerator cannot train in fp16): saved from b, loaded into c
            b.optimizer.loss_scaler = DynamicLossScaler(2.0**10, 500, 2.0, 3, True, dtype=torch.float16)
            b.optimizer.loss_scaler.cur_iter, b.optimizer.loss_scaler.last_overflow_iter = 17, 11
            b.optimizer.loss_scaler.cur_hysteresis = 1
            b.optimizer.dynamic_loss_scale = True
            shardsafe.save(out / "scaler", {"engine": b})
            c.optimizer.loss_scaler = DynamicLossScaler(1.0, 1000, 1.0, 2, False, dtype=torch.float16)
            shardsafe.load(out / "scaler", {"engine": c})
            r["scaler_saved"] = dict(vars(b.optimizer.loss_scaler))
            r["scaler_loaded"] = dict(vars(c.optimizer.loss_scaler))
            r["dynamic_loaded"] = c.optimizer.dynamic_loss_scale

            # A different model: refused before anything is modified.
            other = Tiny()
            other.l3 = nn.Linear(11, 15)
            other.extra = nn.Parameter(torch.zeros(3))
            d = build(precision, seed=42, model=other)
            r["mismatch_before"] = snapshot(d)
            r["mismatch_error"] = error_of(shardsafe.load, out / f"ss_{precision}", {"engine": d})
            r["mismatch_after"] = snapshot(d)
            r["mismatch_state_empty"] = not d.optimizer.optimizer.state
            # ZeRO-2: refused with a clear message.
            z2 = build(precision, seed=42, stage=2)
            r["zero2_error"] = error_of(shardsafe.load, out / f"ss_{precision}", {"engine": z2})
        result[precision] = r
    return result


def phase_reshard(out: Path) -> dict[str, Any]:
    world = dist.get_world_size()
    result: dict[str, Any] = {}
    for precision in PRECISIONS:
        e = build(precision, seed=99)
        state = state_of(e, -1)
        shardsafe.load(out / f"ss_{precision}", state)
        r: dict[str, Any] = {"step_value": state["step"], "after_load": snapshot(e)}
        shardsafe.save(out / f"ss_{precision}_w{world}", {"engine": e})
        r["losses"] = train(e, range(SAVE_AT, SAVE_AT + 1))
        r["after_step"] = snapshot(e)
        e = build(precision, seed=31)  # from DeepSpeed's own checkpoint, converted for an engine
        state = state_of(e, -1)
        shardsafe.load(out / f"conv_{precision}", state)
        r["conv_step_value"], r["conv_after_load"] = state["step"], snapshot(e)
        r["conv_losses"] = train(e, range(SAVE_AT, SAVE_AT + 1))
        r["conv_after_step"] = snapshot(e)
        result[precision] = r
    if world == 3:  # 1 -> 3 as well: what the concurrent 1-rank launch saved right after its own load
        ready = out / "ss_bf16_w1" / "manifest.json"  # shardsafe publishes a checkpoint whole (rename) or not at all
        deadline = time.monotonic() + 300
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        e = build("bf16", seed=7)
        shardsafe.load(out / "ss_bf16_w1", {"engine": e})
        result["from_w1"] = snapshot(e)
    return result


def _no_compile(model: Any = None, **kwargs: Any) -> Any:
    return model if model is not None else (lambda fn: fn)


def main() -> None:
    out, phase = Path(sys.argv[1]), sys.argv[2]
    # DeepSpeed's Muon module decorates functions with torch.compile when deepspeed.initialize checks
    # the optimizer, which imports inductor (~8 s per process on a small machine). Nothing here
    # compiles anything, so the decorator is made the identity it is in eager mode.
    torch.compile = _no_compile  # type: ignore[assignment]
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    torch.set_num_threads(1)
    result = phase_save(out) if phase == "save" else phase_reshard(out)
    torch.save(result, out / f"{phase}-w{dist.get_world_size()}.rank{dist.get_rank()}.pt")
    dist.barrier()
    end_job()


if __name__ == "__main__":
    main()
