"""The small GPT and the data the demo trains on (no downloads, no randomness outside torch's RNG).

Kept apart from the launcher so the single-process evaluation builds exactly the model the ranks
trained, from the same code, and so the model can be read on its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPTConfig", "TinyGPT", "evaluate", "lm_loss", "sample_batch", "split_corpus"]

# Byte-level text: learnable structure (words, spaces, punctuation) without a tokenizer or a
# download. The last part is held out for the evaluation after training.
CORPUS = """\
A checkpoint is a promise made to the future. It says: if everything stops now, this is where we
were, and this is enough to carry on. Training a large model takes days or weeks, and over that
time machines fail, jobs are preempted, and networks drop packets. A run that cannot recover from
an interruption must start again from the beginning, and a run that recovers from a damaged or
half written checkpoint is worse, because it carries on from a state that never existed.

So a good checkpoint is written carefully. Every rank writes only its own part, into its own file,
and nothing is visible until every part is complete. The coordinator writes the manifest last, and
the manifest is the mark of a finished save: a folder without one is ignored. If the power goes
out halfway through, the previous checkpoint is still there, whole and untouched, and the partial
one is simply garbage to be swept away later.

A good checkpoint can also be read in a different shape from the one it was written in. A model
trained on many ranks may be evaluated on one, or continued on twice as many. The stored pieces
describe where they sit in each full tensor, so a reader can take exactly the bytes it needs and
nothing more. Each block of bytes carries a hash, and a reader checks the blocks it touches, so a
flipped bit on a disk is found at once instead of weeks later as a mysterious loss spike.

The garden behind the old house was planted long before anyone now living could remember. In
spring the apple trees flowered all at once, white and pink against the grey stone wall, and the
bees came from the hives at the end of the lane. In summer the beans climbed their poles and the
tomatoes ripened slowly in the heat. In autumn the leaves turned and fell, and the paths filled
with them, and the children ran through the piles and scattered them again. In winter the garden
slept under frost, and the birds came to the table by the window for seeds and crumbs.

The keeper of the lighthouse kept a log. Every evening he wrote the time the lamp was lit, the
direction of the wind, the state of the sea and the ships that passed. When the storm came in the
night and the lamp went out, he relit it and wrote that down too, with the time and the reason.
Years later, reading the log, one could follow every night of his watch: the calm ones, the wild
ones, and the one night when the supply boat could not come and he rationed the oil by the hour.

Rivers carry water from the hills to the sea, and with it sand, silt and stones. Where the river
slows, it drops what it carries, and over centuries builds plains and deltas. Where it runs fast,
it cuts deep into the rock. The shape of a valley is the record of a long conversation between
water and stone, written slowly, and read by anyone who walks along the banks and looks.

A recipe for bread needs only flour, water, salt and yeast, and time. Mix the flour and water and
let them rest; add the salt and the yeast; knead until the dough is smooth and springs back when
pressed. Let it rise until it has doubled, shape it gently, let it rise again, and bake it in a
hot oven until the crust is brown and the loaf sounds hollow when tapped underneath.

Good tools explain themselves when something goes wrong. They name the file, the tensor and the
block that failed, say what was expected and what was found, and suggest what to do next. They
never leave a user staring at a traceback from deep inside a library, wondering which of a
thousand files is damaged, or whether it is safe to start again from the last saved step.
"""

HELD_OUT_FRACTION = 0.15


@dataclass(frozen=True)
class GPTConfig:
    """Sizes of the demo model: ~0.4M parameters, about 0.1-0.2 s per step on one CPU thread."""

    vocab_size: int = 256  # bytes
    seq_len: int = 64
    d_model: int = 128
    n_heads: int = 4
    n_layers: int = 2
    mlp_ratio: int = 4


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: the unit FSDP2 shards (one all-gather per block)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model),
            nn.GELU(),
            nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """Token + positional embeddings, pre-LN blocks, final LayerNorm, LM head tied to the embedding.

    The head reuses ``tok_emb.weight`` through ``F.linear`` rather than a second module, so the
    tied weight is one parameter with one name, saved once.
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.apply(_init_weights)
        # With the head tied to it, a token embedding larger than the usual 0.02 lets the model get
        # past the unigram plateau within the few dozen steps the demo can afford.
        nn.init.normal_(self.tok_emb.weight, std=0.05)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(positions)
        for block in self.blocks:
            x = block(x)
        return F.linear(self.ln_f(x), self.tok_emb.weight)


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def corpus_bytes() -> torch.Tensor:
    """The corpus as a 1-D int64 tensor of byte values."""
    return torch.tensor(list(CORPUS.encode()), dtype=torch.int64)


def split_corpus() -> tuple[torch.Tensor, torch.Tensor]:
    """(training bytes, held-out bytes): the held-out tail is never trained on."""
    data = corpus_bytes()
    cut = int(len(data) * (1 - HELD_OUT_FRACTION))
    return data[:cut], data[cut:]


def sample_batch(data: torch.Tensor, batch_size: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows drawn with torch's global RNG, so ``RNGState`` makes the order resumable."""
    starts = torch.randint(0, len(data) - seq_len - 1, (batch_size,))
    windows = torch.stack([data[s : s + seq_len + 1] for s in starts.tolist()])
    return windows[:, :-1], windows[:, 1:]


def held_out_batch(data: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every non-overlapping window of the held-out bytes: a fixed evaluation set."""
    n = (len(data) - 1) // seq_len
    x = data[: n * seq_len].view(n, seq_len)
    y = data[1 : n * seq_len + 1].view(n, seq_len)
    return x, y


def lm_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


@torch.no_grad()
def evaluate(model: nn.Module, data: torch.Tensor, seq_len: int) -> float:
    """Mean next-byte loss on the held-out windows (works on a plain or an FSDP2 module)."""
    x, y = held_out_batch(data, seq_len)
    was_training = model.training
    model.eval()
    loss = lm_loss(model, x, y).item()
    model.train(was_training)
    return loss
