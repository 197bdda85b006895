"""torchtitan's Hugging Face paths, over shardsafe's own HF code: the initial load and the final save.

torchtitan's model names and lays out its weights its own way (``layers.0.attention.qkv_linear.wq``,
Q/K rows in its RoPE order); its ``sd_adapter`` converts a state dict to Hugging Face's (``to_hf``:
keys renamed, Q/K rows permuted) and back (``from_hf``). Both paths here apply the adapter to
whole-model state dicts exactly as torchtitan's DCP manager does, and leave the reading and writing to
shardsafe:

* initial load (``initial_load_in_hf``): ``to_hf`` of the model's own (sharded) state dict gives the
  Hugging Face names and, for each, a tensor laid out as the adapter's conversion lays it out
  (DTensors stay DTensors); :func:`~shardsafe.hf.load_pretrained` fills fresh tensors of that layout,
  each rank reading only its own rows of the safetensors files; ``from_hf`` turns them back into the
  model's names and the model loads them. Nothing of the model is written before every name, shape and
  byte range has been checked.
* final save (``last_save_in_hf``): the model-only shardsafe checkpoint of the last step is exported by
  :func:`~shardsafe.hf.export.export_hf` (one tensor at a time, verified reads) through
  :class:`AdaptedSource`, which applies ``to_hf`` to each whole tensor as it is read.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shardsafe.api.source import TensorInfo, find_config_files
from shardsafe.errors import ShardsafeError, StateMismatchError
from shardsafe.hf.export import export_hf
from shardsafe.hf.load_pretrained import load_pretrained
from shardsafe.interop.sources import open_source

__all__ = ["AdaptedSource", "TensorHolder", "export_hf_folder", "load_hf_weights"]

log = logging.getLogger(__name__)


class TensorHolder(nn.Module):
    """Named tensors held as an ``nn.Module`` (each a buffer at its dotted name).

    shardsafe's module paths (``load_pretrained``'s per-rank reads, a ``module`` entry of a checkpoint)
    take a module; this lets them take a state dict of another naming (the adapter's Hugging Face
    names) or another dtype (the export dtype) without a second copy of their code.
    """

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        super().__init__()
        for name, tensor in tensors.items():
            *path, leaf = name.split(".")
            owner: nn.Module = self
            for part in path:
                child = owner._modules.get(part)
                if child is None:
                    child = nn.Module()
                    owner.add_module(part, child)
                owner = child
            owner.register_buffer(leaf, tensor)


def _need_adapter(sd_adapter: Any, what: str) -> None:
    if sd_adapter is None or not callable(getattr(sd_adapter, "to_hf", None)):
        raise ValueError(
            f"{what} needs torchtitan's sd_adapter (the model's state dict adapter, with to_hf/from_hf); "
            "the Trainer passes it for models that have one"
        )


def load_hf_weights(model: nn.Module, folder: str, sd_adapter: Any, process_group: Any = None) -> dict[str, Any]:
    """Load a Hugging Face model folder into torchtitan's ``model`` (collective), through ``sd_adapter``.

    Each rank reads only the rows its (converted) tensors hold. A tensor the model needs and the
    folder lacks is an error before anything is written; tensors the adapter does not map (say,
    rotary ``inv_freq`` buffers) are skipped and returned, as torchtitan's DCP load skips them.
    """
    _need_adapter(sd_adapter, "checkpoint.initial_load_in_hf")
    native = model.state_dict()
    converted = sd_adapter.to_hf(dict(native))
    fresh = {name: torch.empty_like(tensor) for name, tensor in converted.items()}  # never the live parameters
    result = load_pretrained(TensorHolder(fresh), folder, process_group=process_group, strict=False)
    if result["missing_keys"]:
        raise StateMismatchError(
            f"{folder}: the Hugging Face folder lacks {len(result['missing_keys'])} tensor(s) the model needs "
            f"(through sd_adapter.to_hf): {result['missing_keys'][:10]}"
        )
    back = sd_adapter.from_hf(dict(fresh))
    missing, unexpected = sorted(native.keys() - back.keys()), sorted(back.keys() - native.keys())
    if missing or unexpected:
        raise StateMismatchError(
            f"{folder}: sd_adapter.from_hf gave another set of names than the model's state dict "
            f"(missing {missing[:10]}, unexpected {unexpected[:10]}); nothing was loaded"
        )
    model.load_state_dict(back, strict=True)
    return result


class AdaptedSource:
    """A :class:`~shardsafe.api.source.TensorSource` of a shardsafe checkpoint's model entry in Hugging
    Face names and layout: ``sd_adapter.to_hf`` applied to each whole tensor as it is read.

    The names and shapes are found before any byte is read by converting meta tensors. An adapter that
    combines several model tensors into one Hugging Face tensor cannot be applied one tensor at a time,
    and is refused here (before anything is written).
    """

    def __init__(self, checkpoint: Path, sd_adapter: Any, key: str = "model") -> None:
        self.source = open_source(checkpoint, key)
        self.folder = checkpoint
        self.sd_adapter = sd_adapter
        self.default_dtype: torch.dtype | None = None
        try:
            self._infos, self._of = self._plan(self.source.tensors())
        except Exception:
            self.source.close()
            raise
        self._pending: dict[str, torch.Tensor] = {}

    def _plan(self, stored: list[TensorInfo]) -> tuple[list[TensorInfo], dict[str, str]]:
        meta = {t.name: torch.empty(t.shape, dtype=t.dtype, device="meta") for t in stored}
        infos: list[TensorInfo] = []
        of: dict[str, str] = {}
        for name, tensor in meta.items():
            for hf_name, out in self.sd_adapter.to_hf({name: tensor}).items():
                if hf_name in of:
                    raise ShardsafeError(f"sd_adapter.to_hf maps both {of[hf_name]!r} and {name!r} to {hf_name!r}")
                of[hf_name] = name
                infos.append(TensorInfo(hf_name, out.dtype, tuple(out.shape)))
        together = set(self.sd_adapter.to_hf(dict(meta)))
        if together != set(of):
            raise ShardsafeError(
                "last_save_in_hf: sd_adapter.to_hf gives other tensors for the whole model than tensor by tensor "
                f"({sorted(together ^ set(of))[:10]}); shardsafe exports one tensor at a time. Save with "
                "last_save_in_hf=False and convert the model-only checkpoint with the adapter yourself"
            )
        return infos, of

    def tensors(self) -> list[TensorInfo]:
        return self._infos

    def read(self, name: str) -> torch.Tensor:
        if name not in self._pending:
            source_name = self._of[name]
            self._pending = dict(self.sd_adapter.to_hf({source_name: self.source.read(source_name)}))
        return self._pending.pop(name).contiguous()

    def config_files(self) -> dict[str, Path]:
        """``config.json`` / ``generation_config.json`` of the adapter's ``hf_assets_path``, where it has them."""
        assets = getattr(self.sd_adapter, "hf_assets_path", None)
        return find_config_files(Path(assets)) if assets else {}

    def close(self) -> None:
        self._pending = {}
        self.source.close()


def export_hf_folder(checkpoint: Path, out: Path, sd_adapter: Any, dtype: torch.dtype) -> Path:
    """The model-only checkpoint ``checkpoint`` as a Hugging Face model folder ``out`` (one process), in
    ``dtype``, with ``config.json`` (and ``generation_config.json``) of the adapter's ``hf_assets_path``
    when it has them, so ``from_pretrained`` loads it as it is."""
    _need_adapter(sd_adapter, "checkpoint.last_save_in_hf")
    source = AdaptedSource(checkpoint, sd_adapter)
    try:
        if "config.json" not in source.config_files():
            log.warning(
                "shardsafe: %s gets no config.json (sd_adapter.hf_assets_path holds none); add the model's before "
                "from_pretrained",
                out,
            )
        return export_hf(source, out, dtype=dtype, progress=False, overwrite=True)
    finally:
        source.close()
