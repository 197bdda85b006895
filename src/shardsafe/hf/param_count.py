"""How many parameters a config implies, for the architectures whose count is a simple formula.

The guard's fallback when transformers is not installed (it cannot build the model to compare
names and shapes): a weights folder must hold exactly as many elements as its ``config.json``
implies. Covered: Llama, Mistral, Qwen2 and Qwen3 (dense decoder-only, their ``...ForCausalLM``
and base ``...Model`` classes) and GPT-2 (``GPT2LMHeadModel`` / ``GPT2Model``); every formula is
checked against the real model's count in the tests. Anything else is skipped with a logged note.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from shardsafe.core.format import numel

__all__ = ["config_parameter_count"]


@dataclass(frozen=True)
class ParameterCount:
    architecture: str
    parameters: int  # tied weights counted once
    tied_extra: int = 0  # elements of the tied aliases, present when a writer kept them
    not_counted: tuple[str, ...] = ()  # name suffixes of old buffers some files carry, left out of the comparison

    def agrees(self, found: dict[str, tuple[int, ...]]) -> bool:
        total = sum(numel(s) for n, s in found.items() if not n.endswith(self.not_counted))
        return total in (self.parameters, self.parameters + self.tied_extra)


def _int(config: dict[str, Any], key: str, default: int | None = None) -> int:
    value = config.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(key)
    return value


def _llama_like(config: dict[str, Any], *, qkv_bias: bool, qk_norm: bool, head: bool) -> tuple[int, int]:
    hidden, vocab, layers = _int(config, "hidden_size"), _int(config, "vocab_size"), _int(config, "num_hidden_layers")
    heads = _int(config, "num_attention_heads")
    kv_heads = _int(config, "num_key_value_heads") if config.get("num_key_value_heads") is not None else heads
    head_dim = _int(config, "head_dim") if config.get("head_dim") is not None else hidden // heads
    inter = _int(config, "intermediate_size")
    attention_bias = bool(config.get("attention_bias", False))
    mlp_bias = bool(config.get("mlp_bias", False))
    q, kv = heads * head_dim, kv_heads * head_dim
    attention = hidden * q + 2 * hidden * kv + q * hidden
    if qkv_bias or attention_bias:
        attention += q + 2 * kv
    if attention_bias:
        attention += hidden
    if qk_norm:
        attention += 2 * head_dim
    mlp = 3 * hidden * inter + ((2 * inter + hidden) if mlp_bias else 0)
    body = vocab * hidden + layers * (attention + mlp + 2 * hidden) + hidden
    embedding = vocab * hidden
    if not head:
        return body, 0
    tied = bool(config.get("tie_word_embeddings", False))
    return (body, embedding) if tied else (body + embedding, 0)


def _gpt2(config: dict[str, Any], *, head: bool) -> tuple[int, int]:
    n, vocab = _int(config, "n_embd", 768), _int(config, "vocab_size", 50257)
    positions, layers = _int(config, "n_positions", 1024), _int(config, "n_layer", 12)
    inner = _int(config, "n_inner") if config.get("n_inner") is not None else 4 * n
    block = 2 * n + (n * 3 * n + 3 * n) + (n * n + n) + 2 * n + (n * inner + inner) + (inner * n + n)
    body = vocab * n + positions * n + layers * block + 2 * n
    if not head:
        return body, 0
    tied = bool(config.get("tie_word_embeddings", True))
    return (body, vocab * n) if tied else (body + vocab * n, 0)


_FORMULAS: dict[str, Callable[[dict[str, Any]], tuple[int, int]]] = {
    "GPT2LMHeadModel": functools.partial(_gpt2, head=True),
    "GPT2Model": functools.partial(_gpt2, head=False),
}
for _family, _qkv_bias, _qk_norm in (
    ("Llama", False, False),
    ("Mistral", False, False),
    ("Qwen2", True, False),
    ("Qwen3", False, True),
):
    _FORMULAS[f"{_family}ForCausalLM"] = functools.partial(_llama_like, qkv_bias=_qkv_bias, qk_norm=_qk_norm, head=True)
    _FORMULAS[f"{_family}Model"] = functools.partial(_llama_like, qkv_bias=_qkv_bias, qk_norm=_qk_norm, head=False)
_GPT2_BUFFERS = (".attn.bias", ".attn.masked_bias")  # causal-mask buffers older GPT-2 files carry


def config_parameter_count(config: dict[str, Any]) -> ParameterCount | str:
    """The count ``config`` (a parsed config.json) implies for its first architecture, or a note why there is none."""
    architectures = config.get("architectures")
    name = (
        architectures[0]
        if isinstance(architectures, list) and architectures and isinstance(architectures[0], str)
        else None
    )
    if name is None:
        return "config.json records no architecture"
    formula = _FORMULAS.get(name)
    if formula is None:
        return f"no parameter-count formula for {name[:60]!r}"
    try:
        parameters, tied_extra = formula(config)
    except (ValueError, TypeError, ZeroDivisionError) as exc:
        return f"config.json lacks a usable {str(exc)[:40]!r} for {name}"
    return ParameterCount(name, parameters, tied_extra, _GPT2_BUFFERS if name.startswith("GPT2") else ())
