"""The model-folder guard: real tiny transformers models pass, everything that is not the model is refused.

Every folder here is written by transformers' own ``save_pretrained`` from a tiny config (no
network), then damaged the way real failures damage it: the ZeRO-3 dummy (config.json next to a
16-byte ``model.safetensors`` holding no tensors), a partial save, the wrong shapes, an index that
lies, a header safetensors would refuse. The architecture check is run with transformers (names
and shapes of the model built on the meta device) and, in a subprocess where transformers cannot be
imported, by the parameter count the config implies.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from shardsafe.errors import ModelFolderError
from shardsafe.hf.guard import INDEX_FILE, NO_TENSORS, SINGLE_FILE, check_model_folder
from shardsafe.hf.param_count import config_parameter_count
from shardsafe.hf.weights_file import open_with_safetensors

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_VERBOSITY"] = "error"

LLAMA = dict(
    vocab_size=64,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=2,
)
SEED_MESSAGE = f"{SINGLE_FILE} {NO_TENSORS}"


def llama(tie: bool, **extra: Any) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**LLAMA, tie_word_embeddings=tie, **extra))


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Folders written by transformers' save_pretrained (tiny models, CPU, a second or two in all)."""
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        MixtralConfig,
        MixtralForCausalLM,
        PegasusConfig,
        PegasusForConditionalGeneration,
    )

    root = tmp_path_factory.mktemp("saved")
    out: dict[str, Path] = {}
    for tie in (True, False):
        model = llama(tie)
        model.save_pretrained(root / f"llama-tie={tie}")
        model.save_pretrained(root / f"llama-sharded-tie={tie}", max_shard_size="10KB")
        model.model.save_pretrained(root / f"llama-base-tie={tie}")  # LlamaModel: names without "model."
        out |= {
            f"llama-tie={tie}": root / f"llama-tie={tie}",
            f"llama-sharded-tie={tie}": root / f"llama-sharded-tie={tie}",
        }
        out[f"llama-base-tie={tie}"] = root / f"llama-base-tie={tie}"
    GPT2LMHeadModel(
        GPT2Config(n_embd=16, n_layer=2, n_head=2, vocab_size=64, n_positions=32, bos_token_id=0, eos_token_id=0)
    ).save_pretrained(root / "gpt2")
    pegasus = PegasusConfig(
        vocab_size=64, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=32,
    )  # fmt: skip
    PegasusForConditionalGeneration(pegasus).save_pretrained(root / "pegasus")  # four names tied to one embedding
    mixtral = MixtralConfig(**LLAMA, num_local_experts=4, num_experts_per_tok=2)
    # fused experts, saved in the per-expert checkpoint layout
    MixtralForCausalLM(mixtral).save_pretrained(root / "mixtral")
    return out | {name: root / name for name in ("gpt2", "pegasus", "mixtral")}


def variant(src: Path, dst: Path, edit: Any = None, config: Any = None) -> Path:
    """A copy of the single-file folder ``src`` with its tensors (and config) edited."""
    shutil.copytree(src, dst)
    if edit is not None:
        tensors = load_file(dst / SINGLE_FILE)
        save_file(edit(tensors) or tensors, str(dst / SINGLE_FILE), metadata={"format": "pt"})
    if config is not None:
        data = json.loads((dst / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps(config(data) or data))
    return dst


def refused(folder: Path, *fragments: str) -> str:
    with pytest.raises(ModelFolderError) as info:
        check_model_folder(folder)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, message
    return message


# ----------------------------------------------------------------------------- the seed failure


def test_the_zero3_dummy_is_refused_in_the_words_of_the_seed_failure(saved: dict[str, Path], tmp_path: Path) -> None:
    dummy = tmp_path / "dummy"
    dummy.mkdir()
    shutil.copy(saved["llama-tie=False"] / "config.json", dummy)
    save_file({}, str(dummy / SINGLE_FILE))  # what a ZeRO-3 save without gathering leaves: an empty state dict
    assert (dummy / SINGLE_FILE).stat().st_size == 16
    message = refused(dummy, f"{dummy / SINGLE_FILE} {NO_TENSORS}")
    assert "holds no tensors: looks like a ZeRO-3 save without gathered weights" in message and "16 bytes" in message

    # the same file as one shard of a sharded folder, and without a config: refused before anything else is looked at
    sharded = tmp_path / "sharded"
    shutil.copytree(saved["llama-sharded-tie=False"], sharded)
    first = sorted(sharded.glob("model-*.safetensors"))[0]
    save_file({}, str(first))
    refused(sharded, f"{first} {NO_TENSORS}")
    (dummy / "config.json").unlink()
    refused(dummy, SEED_MESSAGE)


# ----------------------------------------------------------------------------- what passes


def test_models_transformers_saved_pass_with_names_and_shapes_checked(saved: dict[str, Path]) -> None:
    expected = {
        "llama-tie=True": "names and shapes of LlamaForCausalLM",
        "llama-tie=False": "names and shapes of LlamaForCausalLM",
        "llama-sharded-tie=True": "names and shapes of LlamaForCausalLM",
        "llama-sharded-tie=False": "names and shapes of LlamaForCausalLM",
        "llama-base-tie=True": "names and shapes of LlamaModel",
        "gpt2": "names and shapes of GPT2LMHeadModel",
        "pegasus": "names and shapes of PegasusForConditionalGeneration",
        "mixtral": "names and shapes of MixtralForCausalLM (in its checkpoint layout)",
    }
    for name, how in expected.items():
        summary = check_model_folder(saved[name])
        assert summary.architecture == how, (name, summary)
        assert summary.tensors == len({k for f in summary.files for k in load_file(saved[name] / f)})
    assert check_model_folder(saved["llama-sharded-tie=False"]).kind == "sharded-safetensors"
    assert check_model_folder(saved["llama-tie=True"]).tensors == 20, (
        "the tied lm_head is not in the file, and need not be"
    )


def test_what_from_pretrained_forgives_is_forgiven(saved: dict[str, Path], tmp_path: Path) -> None:
    def add(**tensors: torch.Tensor) -> Any:
        return lambda t: t | {k.replace("__", "."): v for k, v in tensors.items()}

    cases = {
        # a tied alias written out anyway
        "tied alias kept": variant(saved["llama-tie=True"], tmp_path / "a", add(lm_head__weight=torch.zeros(64, 16))),
        # old persistent buffers transformers ignores at load (rotary inv_freq; GPT-2's causal mask)
        "old rotary buffer": variant(
            saved["llama-tie=False"],
            tmp_path / "b",
            add(model__layers__0__self_attn__rotary_emb__inv_freq=torch.zeros(4)),
        ),
        "non-persistent buffer": variant(
            saved["llama-tie=False"], tmp_path / "c", add(model__rotary_emb__inv_freq=torch.zeros(4))
        ),
        "gpt2 mask buffer": variant(
            saved["gpt2"], tmp_path / "d", add(transformer__h__0__attn__bias=torch.ones(1, 1, 32, 32))
        ),
        # _keys_to_ignore_on_load_missing
        "pegasus without final_logits_bias": variant(
            saved["pegasus"], tmp_path / "e", lambda t: {k: v for k, v in t.items() if k != "final_logits_bias"}
        ),
        # the base model's files under a config naming the model with a head whose lm_head is tied
        "base files, tied head config": variant(
            saved["llama-base-tie=True"], tmp_path / "f", config=lambda c: c | {"architectures": ["LlamaForCausalLM"]}
        ),
        # no architecture recorded: the base model is compared, the head is not
        "no architectures": variant(
            saved["llama-tie=False"], tmp_path / "g", config=lambda c: c.pop("architectures") and None
        ),
    }
    for what, folder in cases.items():
        assert check_model_folder(folder).architecture.startswith("names and shapes of "), what


def test_weights_that_are_not_the_model_are_refused(saved: dict[str, Path], tmp_path: Path) -> None:
    def drop(fragment: str) -> Any:
        return lambda t: {k: v for k, v in t.items() if fragment not in k}

    arch = "do not match the LlamaForCausalLM architecture in config.json"
    partial = variant(saved["llama-tie=False"], tmp_path / "partial", drop("layers.1."))
    refused(partial, arch, "9 missing ('model.layers.1.input_layernorm.weight', ", ", ...)")
    untied_without_head = variant(saved["llama-tie=False"], tmp_path / "head", drop("lm_head"))
    refused(untied_without_head, arch, "1 missing ('lm_head.weight')")

    def reshape(t: dict[str, torch.Tensor]) -> None:
        t["model.norm.weight"] = torch.ones(17)
        t["model.layers.0.mlp.up_proj.weight"] = t["model.layers.0.mlp.up_proj.weight"].T.contiguous()
        t["model.extra.weight"] = torch.ones(2)

    message = refused(variant(saved["llama-tie=False"], tmp_path / "shapes", reshape), arch)
    assert "1 unexpected ('model.extra.weight')" in message and "2 of another shape (" in message, message
    assert "'model.norm.weight': [17] in the files, [16] in the model" in message, message

    # a config that says more layers than the files hold (what a save of the wrong model, or a truncated one, looks
    # like)
    more_layers = variant(saved["llama-tie=True"], tmp_path / "layers", config=lambda c: c | {"num_hidden_layers": 3})
    refused(more_layers, "9 missing ('model.layers.2.")
    # a head model's files under a config naming the base model: the head is unexpected
    refused(
        variant(saved["llama-tie=False"], tmp_path / "base", config=lambda c: c | {"architectures": ["LlamaModel"]}),
        "1 unexpected ('lm_head.weight')",
    )
    # the base model's files under an untied head config: the head is missing (from_pretrained would initialise it
    # randomly)
    refused(
        variant(
            saved["llama-base-tie=False"],
            tmp_path / "nohead",
            config=lambda c: c | {"architectures": ["LlamaForCausalLM"]},
        ),
        "1 missing ('lm_head.weight')",
    )
    # a converted model (Mixtral) missing an expert, and GPT-2 missing a block
    refused(
        variant(saved["mixtral"], tmp_path / "mixtral", drop("experts.3.")),
        "MixtralForCausalLM",
        "6 missing ('model.layers.0.block_sparse_moe.experts.3.",
    )
    refused(variant(saved["gpt2"], tmp_path / "gpt2", drop("h.1.")), "GPT2LMHeadModel", "12 missing")


def test_an_architecture_the_guard_cannot_know_is_skipped_with_a_note(
    saved: dict[str, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="shardsafe.hf.guard")
    notes = {
        "custom class": ({"architectures": ["MyOwnModel"]}, "'MyOwnModel', which is not a transformers model class"),
        "quantized": (
            {"quantization_config": {"quant_method": "gptq", "bits": 4}},
            "quantized weights (config.json has a quantization_config)",
        ),
        "unknown model type": (
            {"model_type": "no-such-type", "architectures": None, "auto_map": {"AutoModel": "x.Y"}},
            "names no architecture and no model type transformers knows",
        ),
    }
    for i, (what, (change, note)) in enumerate(notes.items()):
        caplog.clear()
        folder = variant(saved["llama-tie=False"], tmp_path / str(i), config=lambda c, change=change: c | change)
        summary = check_model_folder(folder)
        assert summary.architecture.startswith("skipped: ") and note in summary.architecture, (
            what,
            summary.architecture,
        )
        assert any(note in r.getMessage() and str(folder) in r.getMessage() for r in caplog.records), what
    # a config this transformers cannot build, of an architecture whose count is known: the count is compared
    unbuildable = variant(
        saved["llama-tie=False"], tmp_path / "unbuildable", config=lambda c: c | {"hidden_act": "no-such-activation"}
    )
    how = check_model_folder(unbuildable).architecture
    assert (
        how.startswith("parameter count of LlamaForCausalLM (transformers ")
        and "cannot build the model from config.json" in how
    ), how
    no_config = variant(saved["llama-tie=False"], tmp_path / "noconfig")
    (no_config / "config.json").unlink()
    assert check_model_folder(no_config).architecture == "skipped: no config.json"
    (no_config / "config.json").write_text("[1, 2]")
    refused(no_config, "config.json: not a JSON object")


# ----------------------------------------------------------------------------- without transformers

NO_TRANSFORMERS = """
import json, sys
sys.modules["transformers"] = None  # `import transformers` now raises ImportError
from shardsafe.errors import ModelFolderError
from shardsafe.hf.guard import check_model_folder
out = {}
for folder in sys.argv[1:]:
    try:
        out[folder] = ["ok", check_model_folder(folder).architecture]
    except ModelFolderError as exc:
        out[folder] = ["refused", str(exc)]
print("RESULT " + json.dumps(out))
"""


def test_without_transformers_the_parameter_count_is_compared(saved: dict[str, Path], tmp_path: Path) -> None:
    partial = variant(
        saved["llama-tie=False"], tmp_path / "partial", lambda t: {k: v for k, v in t.items() if "layers.1." not in k}
    )
    tied_kept = variant(
        saved["llama-tie=True"], tmp_path / "kept", lambda t: t | {"lm_head.weight": torch.zeros(64, 16)}
    )
    gpt2_mask = variant(
        saved["gpt2"], tmp_path / "mask", lambda t: t | {"transformer.h.0.attn.bias": torch.ones(1, 1, 32, 32)}
    )
    folders = [
        saved["llama-tie=True"],
        saved["llama-sharded-tie=False"],
        tied_kept,
        saved["gpt2"],
        gpt2_mask,
        saved["pegasus"],
        partial,
    ]
    proc = subprocess.run(
        [sys.executable, "-c", NO_TRANSFORMERS, *map(str, folders)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    got = json.loads(lines[-1][len("RESULT ") :])
    note = "(transformers is not installed)"
    expected = [
        (saved["llama-tie=True"], "LlamaForCausalLM"),
        (saved["llama-sharded-tie=False"], "LlamaForCausalLM"),
        (tied_kept, "LlamaForCausalLM"),
        (saved["gpt2"], "GPT2LMHeadModel"),
        (gpt2_mask, "GPT2LMHeadModel"),
    ]
    for folder, architecture in expected:
        assert got[str(folder)] == ["ok", f"parameter count of {architecture} {note}"], got[str(folder)]
    assert got[str(saved["pegasus"])][0] == "ok" and got[str(saved["pegasus"])][1].startswith(
        "skipped: transformers is not installed; no parameter"
    )
    status, message = got[str(partial)]
    assert (
        status == "refused"
        and "the weights hold 4,656 parameters, the LlamaForCausalLM architecture in config.json has 7,248" in message
    ), message


def test_parameter_formulas_match_the_real_models() -> None:
    import transformers

    configs = [
        transformers.LlamaConfig(**LLAMA, tie_word_embeddings=True),
        transformers.LlamaConfig(
            **(LLAMA | {"num_key_value_heads": 1}), attention_bias=True, mlp_bias=True, head_dim=4
        ),
        transformers.MistralConfig(**(LLAMA | {"num_key_value_heads": 1})),
        transformers.Qwen2Config(**LLAMA),
        transformers.Qwen3Config(**LLAMA, head_dim=12, tie_word_embeddings=True),
        transformers.GPT2Config(n_embd=16, n_layer=3, n_head=2, vocab_size=50, n_positions=20, n_inner=24),
    ]
    checked = 0
    for config in configs:
        for cls in (transformers.AutoModelForCausalLM, transformers.AutoModel):
            with torch.device("meta"):
                model = cls.from_config(config)
            state = model.state_dict()
            real = sum(p.numel() for p in model.parameters()) + sum(
                b.numel() for n, b in model.named_buffers() if n in state
            )
            count = config_parameter_count(
                json.loads(config.to_json_string()) | {"architectures": [type(model).__name__]}
            )
            assert not isinstance(count, str), count
            assert count.parameters == real, (type(model).__name__, count.parameters, real)
            checked += 1
    assert checked == 12


# ----------------------------------------------------------------------------- indexes


def edit_index(folder: Path, change: Any) -> None:
    index = json.loads((folder / INDEX_FILE).read_text())
    change(index)
    (folder / INDEX_FILE).write_text(json.dumps(index))


def test_an_index_that_disagrees_with_its_files_is_refused(saved: dict[str, Path], tmp_path: Path) -> None:
    src = saved["llama-sharded-tie=False"]
    index = json.loads((src / INDEX_FILE).read_text())
    total = index["metadata"]["total_size"]
    files = sorted(set(index["weight_map"].values()))
    name, file = next(
        (n, f) for n, f in sorted(index["weight_map"].items()) if list(index["weight_map"].values()).count(f) > 1
    )
    other = next(f for f in files if f != file)

    def case(tag: str, change: Any) -> Path:
        folder = tmp_path / tag
        shutil.copytree(src, folder)
        edit_index(folder, change)
        return folder

    refused(
        case("bigger", lambda i: i["metadata"].update(total_size=total + 4)),
        f"hold {total} bytes of tensors",
        f"total_size {total + 4}",
    )
    refused(case("smaller", lambda i: i["metadata"].update(total_size=total - 4)), f"total_size {total - 4}")
    refused(case("not-int", lambda i: i["metadata"].update(total_size="24896")), "total_size str")
    refused(
        case("no-file", lambda i: i["weight_map"].update({name: "model-00009-of-00009.safetensors"})),
        "weights file is missing",
    )
    refused(
        case("wrong-file", lambda i: i["weight_map"].update({name: other})),
        f"{other}: lacks 1 tensors its index maps to it",
        f"{file}: holds 1 tensors",
    )
    refused(
        case("unlisted", lambda i: i["weight_map"].pop(name)),
        f"{file}: holds 1 tensors {INDEX_FILE} does not map to it",
    )
    refused(case("escape", lambda i: i["weight_map"].update({name: "../outside.safetensors"})), "outside.safetensors")
    refused(case("empty", lambda i: i.update(weight_map={})), "has no weight_map entries")
    metadata_free = case("no-metadata", lambda i: i.pop("metadata"))
    assert check_model_folder(metadata_free).tensors == 21, "total_size is optional"


# ----------------------------------------------------------------------------- files safetensors cannot open


def raw_file(header: bytes, data: bytes, pad: bool = True) -> bytes:
    body = header + (b" " * (-len(header) % 8) if pad else b"")
    return struct.pack("<Q", len(body)) + body + data


def entry(name: str, begin: int, end: int, dtype: str = "F32") -> bytes:
    count = (end - begin) // 4 if dtype == "F32" else end - begin
    return f'"{name}":{{"dtype":"{dtype}","shape":[{count}],"data_offsets":[{begin},{end}]}}'.encode()


def header(*entries: bytes) -> bytes:
    return b"{" + b",".join(entries) + b"}"


HOSTILE = {
    "a tensor named __metadata__": (
        raw_file(header(entry("__metadata__", 0, 4), entry("a", 4, 8)), bytes(8)),
        "__metadata__ entry is a tensor",
    ),
    "__metadata__ of numbers": (
        raw_file(header(b'"__metadata__":{"x":1}', entry("a", 0, 4)), bytes(4)),
        "__metadata__ entry is not a map of strings",
    ),
    "a lone surrogate": (raw_file(header(entry("a\\udc80", 0, 4)), bytes(4)), "is not valid UTF-8"),
    "invalid UTF-8 bytes": (raw_file(header(entry("a", 0, 4).replace(b'"a"', b'"a\xff"')), bytes(4)), "not valid JSON"),
    "overlapping tensors": (
        raw_file(header(entry("a", 0, 4), entry("b", 0, 4)), bytes(4)),
        "overlaps another tensor's",
    ),
    "a gap": (raw_file(header(entry("a", 0, 4), entry("b", 8, 12)), bytes(12)), "4 bytes before tensor 'b'"),
    "trailing bytes": (raw_file(header(entry("a", 0, 4)), bytes(12)), "8 bytes after the last tensor"),
    "a duplicate name": (raw_file(header(entry("a", 0, 4), entry("a", 4, 8)), bytes(8)), "duplicate JSON key"),
    "a header past the end": (struct.pack("<Q", 1000) + b"{}", "not a safetensors file"),
    "7 bytes": (b"\x08\x00\x00\x00\x00\x00\x00", "not a safetensors file"),
    "a JSON list": (raw_file(b"[1,2]", b""), "header is not a JSON object"),
    "an unknown dtype": (raw_file(header(entry("a", 0, 4, dtype="Q9")), bytes(4)), "unknown dtype"),
    "a short tensor": (
        raw_file(b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}}', bytes(4)),
        "do not fit its shape",
    ),
    "0 bytes": (b"", "0 bytes"),
}


def safetensors_opens(path: Path) -> bool:
    try:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                f.get_tensor(name)
        return True
    except Exception:
        return False


def test_files_safetensors_cannot_open_are_refused(tmp_path: Path) -> None:
    folder = tmp_path / "m"
    folder.mkdir()
    path = folder / SINGLE_FILE
    for what, (data, fragment) in HOSTILE.items():
        path.write_bytes(data)
        assert not safetensors_opens(path), f"{what}: safetensors opens it, the case tests nothing"
        message = refused(folder, fragment)
        assert str(path) in message, (what, message)
    # what safetensors accepts, the guard accepts: an unpadded header, a tensor at an unaligned offset
    for data in (
        raw_file(header(entry("a", 0, 4)), bytes(4), pad=False),
        raw_file(header(entry("u", 0, 1, "U8"), entry("a", 1, 5)), bytes(5)),
    ):
        path.write_bytes(data)
        assert safetensors_opens(path) and check_model_folder(folder).tensors >= 1


def test_whatever_safetensors_refuses_the_guard_refuses(tmp_path: Path) -> None:
    """Random byte changes to a valid file's header: every file safetensors cannot open is refused too."""
    folder = tmp_path / "m"
    folder.mkdir()
    path = folder / SINGLE_FILE
    save_file(
        {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(3, dtype=torch.bfloat16), "i": torch.arange(2)},
        str(path),
        metadata={"format": "pt"},
    )
    valid = path.read_bytes()
    header_end = 8 + int.from_bytes(valid[:8], "little")
    gen = torch.Generator().manual_seed(1)
    unopenable = 0
    for _ in range(400):
        data = bytearray(valid)
        for _ in range(int(torch.randint(1, 4, (1,), generator=gen))):
            position = int(torch.randint(0, header_end, (1,), generator=gen))
            data[position] = int(torch.randint(0, 256, (1,), generator=gen))
        path.write_bytes(bytes(data))
        if not safetensors_opens(path):
            unopenable += 1
            with pytest.raises(ModelFolderError):
                check_model_folder(folder)
    assert unopenable > 100, "the mutations must produce many files safetensors refuses"


def test_open_with_safetensors_does_not_echo_the_header(tmp_path: Path) -> None:
    path = tmp_path / SINGLE_FILE
    path.write_bytes(raw_file(header(entry("a", 0, 4, dtype="SECRET_TOKEN_hunter2")), bytes(4)))
    with pytest.raises(ModelFolderError) as info:
        open_with_safetensors(path)
    message = str(info.value)
    assert (
        "safetensors cannot open it (SafetensorError: Error while deserializing header: invalid JSON in header)"
        in message
    ), message
    assert "hunter2" not in message


# ----------------------------------------------------------------------------- save_pretrained runs the guard


def test_save_pretrained_refuses_weights_that_do_not_fit_the_config(tmp_path: Path) -> None:
    """A model whose config says something its tensors are not: nothing is published, nothing is pushed."""
    import shardsafe

    model = llama(tie=False)
    assert shardsafe.save_pretrained(model, tmp_path / "good", dtype=None).is_dir()
    assert check_model_folder(tmp_path / "good").architecture == "names and shapes of LlamaForCausalLM"
    model.config.num_hidden_layers = 3  # the config now promises a layer the model does not have
    with pytest.raises(ModelFolderError, match=r"9 missing \('model.layers.2."):
        shardsafe.save_pretrained(model, tmp_path / "bad", push_to=f"file://{tmp_path}/pushed")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["good"], "no folder, no temporary, no push"
