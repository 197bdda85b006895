"""shardsafe.load_pretrained into DeepSpeed ZeRO-3 models, on CPU ranks (gloo).

Run with ``python -m torch.distributed.run --nproc_per_node W load_pretrained.py OUT TIED_FP32 UNTIED_BF16 OTHER CASES``
(tests/hf/test_load_pretrained_zero3.py does; CASES: a comma-separated subset of the cases below, or ``all``).
The three folders were written by the test with ``save_pretrained``: a tied fp32 tiny Llama (one file), an
untied bf16 one (sharded, with an index) and one whose config does not fit the first (other MLP sizes, one
more layer). Models are built
from the folders' own ``config.json``. Every rank writes ``OUT/w<W>.rank<r>.pt``: whole tensors gathered
by DeepSpeed itself (``GatheredParameters``, ``safe_get_full_fp32_param``), losses, bytes read, errors.

Cases (``fp32`` partitions every parameter, ``bf16`` keeps DeepSpeed's default persistence threshold,
so every parameter of this tiny model is persistent: gathered by the first forward and kept):

* ``init``: a model built under ``deepspeed.zero.Init`` loads the tied folder (into ``ds_tensor``), then
  ``deepspeed.initialize`` makes the engine: its fp32 master is what it was given.
* ``fp32_module``: a fresh fp32 engine's ``engine.module`` loads the tied folder (into the optimizer's fp32
  master), then trains one step; ``reference``: an engine built from ``from_pretrained`` trains the same step.
* ``bf16_into_fp32``: an fp32 engine that has already stepped, passed itself, loads the bf16 folder.
* ``bf16_engine``: a bf16 engine that has stepped (its persistent parameters are gathered) loads the tied
  fp32 folder through ``engine.module``; a forward then gathers the new values.
* ``mismatch``: an engine built from the other folder's config is refused, its partitions unchanged.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
if "GLOO_SOCKET_IFNAME" not in os.environ and os.path.exists("/sys/class/net/lo"):
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

import shardsafe  # noqa: E402

CASES = ("init", "fp32_module", "bf16_into_fp32", "bf16_engine", "mismatch")
SMALL = ("bytes_read", "error", "unchanged", "gathered_before", "gathered_after_load")  # what ranks other than 0 return


def config(precision: str) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": 3, "sub_group_size": 300}  # several optimizer sub-groups
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


def build_model(folder: str, seed: int, precision: str = "fp32", *, zero_init: bool = False) -> nn.Module:
    import deepspeed
    from transformers import AutoConfig, LlamaForCausalLM

    torch.manual_seed(seed)  # other garbage on every rank and in every case: all of it must be overwritten
    model_config = AutoConfig.from_pretrained(folder)
    if not zero_init:
        return LlamaForCausalLM(model_config)
    with deepspeed.zero.Init(config_dict_or_path=config(precision)):
        return LlamaForCausalLM(model_config)


def engine_of(model: nn.Module, precision: str) -> Any:
    import deepspeed

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config(precision))
    return engine


def train(engine: Any, step: int) -> float:
    gen = torch.Generator().manual_seed(1000 * dist.get_rank() + step)
    vocab = engine.module.config.vocab_size
    tokens = torch.randint(0, vocab, (2, 9), generator=gen)
    loss = engine(input_ids=tokens, labels=tokens).loss
    engine.backward(loss)
    engine.step()
    return float(loss.item())


def weights(module: nn.Module) -> dict[str, torch.Tensor]:
    """The module's state dict, whole (collective): DeepSpeed gathers the partitions."""
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(module.parameters())):
        return {k: v.detach().clone() for k, v in module.state_dict().items()}


def masters(module: nn.Module) -> dict[str, torch.Tensor]:
    """The fp32 master weights, whole (collective), by parameter name (tied ones once)."""
    from deepspeed.utils import safe_get_full_fp32_param

    return {name: safe_get_full_fp32_param(p).detach().clone() for name, p in module.named_parameters()}


def partitions(engine: Any) -> list[torch.Tensor]:
    """This rank's raw partitions (16-bit and fp32 master), to see that a refused load wrote nothing."""
    opt = engine.optimizer
    return [t.detach().clone() for t in (*opt.fp16_partitioned_groups_flat, *opt.fp32_partitioned_groups_flat)]


def case_init(r: dict[str, Any], tied: str, rank: int) -> None:
    model = build_model(tied, seed=11 + rank, zero_init=True)
    result = shardsafe.load_pretrained(model, tied)
    r["init"] = {"bytes_read": result["bytes_read"], "tensors": result["tensors"]}
    engine = engine_of(model, "fp32")
    r["init"] |= {"weights": weights(engine.module), "masters": masters(engine.module)}


def case_fp32_module(r: dict[str, Any], tied: str, rank: int) -> None:
    from transformers import LlamaForCausalLM

    engine = engine_of(build_model(tied, seed=21 + rank), "fp32")
    result = shardsafe.load_pretrained(engine.module, tied)
    r["fp32_module"] = {
        "bytes_read": result["bytes_read"],
        "weights": weights(engine.module),
        "masters": masters(engine.module),
    }
    r["fp32_module"]["loss"] = [train(engine, 0), train(engine, 1)]
    r["fp32_module"]["after_step"] = masters(engine.module)
    del engine
    reference = engine_of(LlamaForCausalLM.from_pretrained(tied, dtype=torch.float32), "fp32")
    r["reference"] = {"loss": [train(reference, 0), train(reference, 1)], "after_step": masters(reference.module)}


def case_bf16_into_fp32(r: dict[str, Any], untied_bf16: str, rank: int) -> None:
    engine = engine_of(build_model(untied_bf16, seed=31 + rank), "fp32")
    train(engine, 0)  # mid-training: optimizer moments exist
    result = shardsafe.load_pretrained(engine, untied_bf16)
    r["bf16_into_fp32"] = {
        "bytes_read": result["bytes_read"],
        "weights": weights(engine.module),
        "masters": masters(engine.module),
    }


def case_bf16_engine(r: dict[str, Any], tied: str, rank: int) -> None:
    engine = engine_of(build_model(tied, seed=41 + rank), "bf16")
    train(engine, 0)
    r["bf16_engine"] = {"gathered_before": sum(p.ds_status.name == "AVAILABLE" for p in engine.module.parameters())}
    shardsafe.load_pretrained(engine.module, tied)
    r["bf16_engine"]["gathered_after_load"] = sum(p.ds_status.name == "AVAILABLE" for p in engine.module.parameters())
    with torch.no_grad():
        engine(input_ids=torch.zeros((1, 4), dtype=torch.long))  # gathers the persistent parameters again
    r["bf16_engine"] |= {"weights": weights(engine.module), "masters": masters(engine.module)}


def case_mismatch(r: dict[str, Any], tied: str, other: str, rank: int) -> None:
    engine = engine_of(build_model(other, seed=51 + rank), "fp32")
    before = partitions(engine)
    try:
        shardsafe.load_pretrained(engine, tied)
        r["mismatch"] = {"error": None}
    except shardsafe.ShardsafeError as exc:
        r["mismatch"] = {"error": (type(exc).__name__, str(exc))}
    r["mismatch"]["unchanged"] = all(torch.equal(a, b) for a, b in zip(before, partitions(engine)))


def main() -> None:
    out, tied, untied_bf16, other, cases = sys.argv[1:6]
    wanted = set(CASES if cases == "all" else cases.split(","))
    # DeepSpeed's Muon module decorates functions with torch.compile when deepspeed.initialize checks the
    # optimizer, which imports inductor (seconds per process). Nothing here compiles: make it the identity.
    torch.compile = lambda model=None, **kwargs: model if model is not None else (lambda fn: fn)  # type: ignore[assignment]
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    r: dict[str, Any] = {}

    if "init" in wanted:
        case_init(r, tied, rank)
    if "fp32_module" in wanted:
        case_fp32_module(r, tied, rank)
    if "bf16_into_fp32" in wanted:
        case_bf16_into_fp32(r, untied_bf16, rank)
    if "bf16_engine" in wanted:
        case_bf16_engine(r, tied, rank)
    if "mismatch" in wanted:
        case_mismatch(r, tied, other, rank)

    if rank != 0:  # whole tensors from rank 0 only; bytes and errors from every rank
        r = {case: {k: v for k, v in values.items() if k in SMALL} for case, values in r.items()}
    torch.save(r, Path(out) / f"w{world}.rank{rank}.pt")
    dist.barrier()
    from teardown import end_job  # a sibling when run as a script (tests import this module too)

    end_job()


if __name__ == "__main__":
    main()
