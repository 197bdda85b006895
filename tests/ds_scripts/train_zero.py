"""Train tiny models under real DeepSpeed ZeRO on CPU ranks and save checkpoints plus references.

Run with ``python -m torch.distributed.run --nproc_per_node W train_zero.py OUT [VARIANT ...]``
(tests/interop/test_deepspeed.py does). For each variant it builds a small model, runs
``deepspeed.initialize`` (gloo, CPU accelerator), trains two steps, calls
``engine.save_checkpoint(OUT/VARIANT)`` on every rank, then writes what DeepSpeed itself says the
checkpoint holds, for the tests to compare against (rank 0 writes, every rank gathers):

* ``OUT/VARIANT.ref_fp32.safetensors``: ``get_fp32_state_dict_from_zero_checkpoint`` (cloned, so
  tied weights can be stored; frozen parameters in their stored dtype, as DeepSpeed returns them);
* ``OUT/VARIANT.ref_optim.safetensors``: per trainable parameter (by name) ``<name>/fp32``,
  ``<name>/exp_avg``, ``<name>/exp_avg_sq`` from ``deepspeed.utils.safe_get_full_*``, plus the
  inner optimizer's ``step`` as ``__step__``;
* ``OUT/VARIANT.ref.json``: param groups (hyper-parameters and parameter names), tied weights,
  world size, the model kind.

Variants are ``<model>_<precision>_z<stage>``: model ``tiny`` (odd sizes, a frozen layer, a tied
weight, buffers, two param groups) or ``llama`` (a tiny LlamaConfig model built offline, tied
embeddings; its config.json is written next to ``latest``, as the HF Trainer leaves it), precision
``fp32`` or ``bf16`` (DeepSpeed's CPU accelerator refuses fp16), stage 1, 2 or 3. Plus
``tiny_fp16synth_z3``, an fp16-style copy of ``tiny_bf16_z3`` (see :func:`synthesize_fp16`; list it
after that one). ZeRO-1/2 runs also record frozen parameters as ``<name>/frozen`` (DeepSpeed's
consolidation drops them when bf16 is on).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
if "GLOO_SOCKET_IFNAME" not in os.environ and os.path.exists("/sys/class/net/lo"):
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

VOCAB = 37


class Tiny(nn.Module):
    """Odd sizes, a frozen layer, a tied weight, a scalar parameter, persistent and non-persistent buffers."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 13)
        self.l1 = nn.Linear(13, 29)
        self.norm = nn.LayerNorm(29)
        self.l2 = nn.Linear(29, 17)
        self.frozen = nn.Linear(17, 11)
        self.l3 = nn.Linear(11, 13)
        self.temperature = nn.Parameter(torch.tensor([1.25]))  # DeepSpeed cannot broadcast 0-dim parameters
        self.head = nn.Linear(13, VOCAB, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.frozen.requires_grad_(False)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 13))
        self.register_buffer("counts", torch.arange(5, dtype=torch.int64))
        self.register_buffer("scratch", torch.ones(3), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) * self.scale.to(self.embed.weight.dtype)
        h = torch.relu(self.norm(self.l1(h)))
        h = torch.tanh(self.frozen(self.l2(h)))
        h = self.l3(h) * self.temperature
        return self.head(h)


def param_groups(model: nn.Module) -> list[dict]:
    decay, no_decay = [], []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim <= 1 else decay).append(p)
    return [
        {"params": decay, "weight_decay": 0.1},
        {"params": no_decay, "weight_decay": 0.0, "lr": 3e-3},
    ]


def build(kind: str) -> tuple[nn.Module, dict]:
    torch.manual_seed(1234)
    if kind == "tiny":
        return Tiny(), {}
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=24,
        intermediate_size=41,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config)
    return model, config.to_dict()


def logits_of(model: nn.Module, out: object) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out  # type: ignore[return-value]


def run_variant(out: Path, variant: str) -> None:
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    kind, precision, stage = variant.split("_")
    rank, world = dist.get_rank(), dist.get_world_size()
    model, hf_config = build(kind)
    config: dict = {
        "train_micro_batch_size_per_gpu": 2,
        "steps_per_print": 10**9,
        "zero_optimization": {"stage": int(stage[1:]), "stage3_param_persistence_threshold": 0, "sub_group_size": 200},
        "zero_allow_untested_optimizer": True,
    }
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    if precision == "fp16":
        config["fp16"] = {"enabled": True, "initial_scale_power": 8}
    names = {id(p): n for n, p in model.named_parameters()}
    groups = param_groups(model)
    group_names = [[names[id(p)] for p in g["params"]] for g in groups]
    optimizer = torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.99), eps=1e-6)
    # saved in model_states
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5) if kind == "tiny" else None
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config, lr_scheduler=scheduler)
    gen = torch.Generator().manual_seed(99 + rank)
    for _ in range(2):
        tokens = torch.randint(0, VOCAB, (2, 7), generator=gen)
        logits = logits_of(engine.module, engine(tokens)).float()
        loss = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        engine.backward(loss)
        engine.step()
    folder = out / variant
    engine.save_checkpoint(str(folder))

    # What DeepSpeed holds, gathered by its own helpers (collective: every rank calls them).
    if hasattr(engine.optimizer, "_lazy_init_hp_params_optimizer_state"):
        # ZeRO-1/2 link each parameter to its optimizer state once, at the first step, before AdamW has created any:
        # link again.
        engine.optimizer._hp_optimizer_states_linked = False
        engine.optimizer._lazy_init_hp_params_optimizer_state()
    ref: dict[str, torch.Tensor] = {}
    for name, p in engine.module.named_parameters():
        if not p.requires_grad:
            if int(stage[1:]) < 3:  # whole on every rank under ZeRO-1/2
                ref[f"{name}/frozen"] = p.detach().cpu().clone()
            continue
        ref[f"{name}/fp32"] = safe_get_full_fp32_param(p).detach().cpu().clone()
        for key in ("exp_avg", "exp_avg_sq"):
            ref[f"{name}/{key}"] = safe_get_full_optimizer_state(p, key).detach().cpu().clone()
    inner = engine.optimizer.optimizer if hasattr(engine.optimizer, "optimizer") else engine.optimizer
    steps = {float(s["step"]) for s in inner.state.values() if "step" in s}
    dist.barrier()
    if rank == 0:
        from safetensors.torch import save_file

        if hf_config:  # as the HF Trainer leaves it: config.json next to `latest`
            (folder / "config.json").write_text(json.dumps(hf_config, indent=2, default=str))
        assert len(steps) == 1, steps
        ref["__step__"] = torch.tensor(steps.pop())
        save_file({k: v.contiguous() for k, v in ref.items()}, str(out / f"{variant}.ref_optim.safetensors"))
        full = get_fp32_state_dict_from_zero_checkpoint(str(folder))
        save_file(
            {k: v.detach().clone().contiguous() for k, v in full.items()}, str(out / f"{variant}.ref_fp32.safetensors")
        )
        hyper = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        meta = {
            "variant": variant,
            "world_size": world,
            "kind": kind,
            "precision": precision,
            "stage": int(stage[1:]),
            "param_groups": [dict(h, params=n) for h, n in zip(hyper, group_names)],
            "state_dict_keys": list(full.keys()),
            "dtypes": {k: str(v.dtype).removeprefix("torch.") for k, v in full.items()},
            "hf_config": hf_config,
            "lr_scheduler": scheduler.state_dict() if scheduler is not None else None,
        }
        (out / f"{variant}.ref.json").write_text(json.dumps(meta, indent=1, default=str))
    dist.barrier()


def synthesize_fp16(out: Path, source: str = "tiny_bf16_z3", variant: str = "tiny_fp16synth_z3") -> None:
    """An fp16-style checkpoint made from a bf16 one (DeepSpeed's CPU accelerator cannot train in fp16).

    What differs from bf16 on disk: the optimizer files are named without the ``bf16_`` prefix, the
    loss scaler is a ``DynamicLossScaler`` (it pickles ``torch.float16`` too), and the model files
    hold fp16 tensors (frozen fragments included). Written with DeepSpeed's own classes; the
    reference is again DeepSpeed's ``get_fp32_state_dict_from_zero_checkpoint``.
    """
    import shutil

    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from safetensors.torch import save_file

    src, dst = out / source, out / variant
    shutil.copytree(src, dst)
    tag = (dst / "latest").read_text().strip()
    for path in sorted((dst / tag).iterdir()):
        state = torch.load(path, weights_only=False)
        path.unlink()
        if path.name.startswith("bf16_"):
            scaler = DynamicLossScaler(2.0**8, 1000, 1.0, 2, False, dtype=torch.float16)
            state["optimizer_state_dict"]["loss_scaler"] = scaler
            state["optimizer_state_dict"]["dynamic_loss_scale"] = True
            path = path.with_name(path.name.removeprefix("bf16_"))
        else:
            for key in ("module", "frozen_param_fragments"):
                state[key] = type(state[key])(
                    (k, v.half() if v.dtype == torch.bfloat16 else v) for k, v in state[key].items()
                )
        torch.save(state, path)
    full = get_fp32_state_dict_from_zero_checkpoint(str(dst))
    save_file(
        {k: v.detach().clone().contiguous() for k, v in full.items()}, str(out / f"{variant}.ref_fp32.safetensors")
    )
    shutil.copy(out / f"{source}.ref_optim.safetensors", out / f"{variant}.ref_optim.safetensors")
    meta = json.loads((out / f"{source}.ref.json").read_text())
    meta.update(
        variant=variant,
        precision="fp16",
        state_dict_keys=list(full),
        dtypes={k: str(v.dtype).removeprefix("torch.") for k, v in full.items()},
    )
    (out / f"{variant}.ref.json").write_text(json.dumps(meta, indent=1, default=str))


def main() -> None:
    out = Path(sys.argv[1])
    variants = sys.argv[2:] or ["tiny_fp32_z3", "tiny_bf16_z3"]
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    torch.set_num_threads(1)
    for variant in variants:
        if variant == "tiny_fp16synth_z3":
            if dist.get_rank() == 0:
                synthesize_fp16(out)
        else:
            run_variant(out, variant)
    dist.barrier()
    from teardown import end_job  # a sibling when run as a script (test modules import this one)

    end_job()


if __name__ == "__main__":
    main()
