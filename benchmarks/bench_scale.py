"""Metadata at scale, simulated: `python benchmarks/bench_scale.py [--quick] [--runs N] [--md BENCHMARKS.md]`.

One process, pure functions, no tensor data: W = 64, 1,024 and 16,384 ranks x 2,000 tensors in an
FSDP2 layout (2-D weights split on dim 0 with rows that do not divide evenly, and small 1-D
norms/biases, also Shard(0)). For shardsafe it measures, with the code a save and a load run:

* what one rank does before the gather: classify its chunks and digest the layout;
* the coordinator: decide the plan from the W digests, build the manifest from the W per-rank
  results (each: file, index size + hash, no chunk list), validate it with the load's parser and
  serialize it;
* one rank's load: parse the manifest and plan the reads of the box it owns, reading (from memory)
  and validating the index it needs.

Side by side, DCP's metadata for the same layout, built with DCP's own classes: W SavePlans of
WriteItems through ``DefaultSavePlanner.create_global_plan`` (plus the storage records its
FileSystemWriter adds), pickled; the read side unpickles it and runs
``create_read_items_for_chunk_list`` for one rank. DCP holds O(tensors x ranks) objects: it is
measured up to the largest world size in ``--dcp-max`` and the trend reported beyond.
"""

from __future__ import annotations

import argparse
import gc
import io
import pickle
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import load_average, write_section  # noqa: E402

from shardsafe._version import __version__  # noqa: E402
from shardsafe.api.save import RankResult, tensor_entries  # noqa: E402
from shardsafe.core.format import (  # noqa: E402
    INDEX_PATTERN,
    SHARD_PATTERN,
    STATE_NAME,
    ChunkEntry,
    FileEntry,
    IndexRef,
    parse_manifest,
)
from shardsafe.core.gcpause import gc_paused  # noqa: E402
from shardsafe.core.index import build_index  # noqa: E402
from shardsafe.core.integrity import hash_bytes  # noqa: E402
from shardsafe.core.layout import LocalLayout, RuleHeld, describe_layout, stage_rules  # noqa: E402
from shardsafe.core.plan import LocalChunk, assign_writers  # noqa: E402
from shardsafe.core.rule import LayoutRule, Placement, spread_writers  # noqa: E402
from shardsafe.protocol.commit import new_manifest  # noqa: E402
from shardsafe.protocol.transfer import ChunkReader  # noqa: E402

SECTION = "## Scale (metadata, simulated)"
REAL_SECTION = "## Scale (real processes)"
REAL_WORLDS = (4, 8, 16)
TENSORS = 2000
WORLDS = (64, 1024, 16384)


def layout(n: int = TENSORS) -> list[tuple[str, tuple[int, ...]]]:
    """(key, global shape) of an FSDP2 model's state: per layer a weight (uneven rows) and two 1-D norms/biases."""
    out = []
    i = 0
    while len(out) < n:
        rows = 4096 + 37 * (i % 29) + 3  # never a multiple of the world sizes
        out.append((f"model/layers.{i}.weight", (rows, 64)))
        out.append((f"model/layers.{i}.bias", (rows,)))
        out.append((f"model/layers.{i}.norm.weight", (1024 + i % 7,)))
        i += 1
    return out[:n]


def local_box(shape: tuple[int, ...], rank: int, world: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Rank ``rank``'s ``torch.chunk`` part of dim 0 (empty past the end of an uneven split)."""
    size = -(-shape[0] // world)
    start, stop = min(rank * size, shape[0]), min((rank + 1) * size, shape[0])
    return (start, *([0] * (len(shape) - 1))), (stop - start, *shape[1:])


def rank_chunks(tensors: list[tuple[str, tuple[int, ...]]], rank: int, world: int) -> list[LocalChunk]:
    """The rank's FSDP2 chunks as the state adapters describe them (meta tensors: no data)."""
    out = []
    for key, shape in tensors:
        offsets, local = local_box(shape, rank, world)
        out.append(LocalChunk(key, torch.empty(local, dtype=torch.float32, device="meta"), shape, offsets))
    return out


def rank_index(tensors: list[tuple[str, tuple[int, ...]]], rank: int, world: int) -> tuple[bytes, int]:
    """The index bytes rank ``rank`` would write, and the size of its shard."""
    pos, entries = 4096, []
    for key, shape in tensors:
        offsets, local = local_box(shape, rank, world)
        nbytes = 4 * int(torch.Size(local).numel())
        if nbytes:
            entries.append(
                (
                    key,
                    ChunkEntry(
                        offsets, local, SHARD_PATTERN.format(rank=rank), pos, pos + nbytes, ("0123456789abcdef",)
                    ),
                )
            )
            pos += nbytes
    return build_index(rank, SHARD_PATTERN.format(rank=rank), entries), pos


@dataclass
class Sample:
    rank_describe: float
    coordinator: float
    manifest_bytes: int
    load_plan: float
    reads: int


def shardsafe_once(tensors: list[tuple[str, tuple[int, ...]]], world: int) -> Sample:
    reader_rank = world // 2 + 1
    index_data, shard_size = rank_index(tensors, reader_rank, world)
    gc.collect()
    # one rank, before the gather
    t0 = time.perf_counter()
    mine = describe_layout(rank_chunks(tensors, 0, world), 0, world)
    rank_describe = time.perf_counter() - t0
    # what the coordinator receives: W digests (equal), W results without chunk lists
    digests = [(mine.digest, []) for _ in range(world)]
    results = [
        RankResult(
            (SHARD_PATTERN.format(rank=r), shard_size),
            IndexRef(
                INDEX_PATTERN.format(rank=r),
                len(index_data),
                hash_bytes(index_data) if r == reader_rank else f"{r:016x}",
            ),
        )
        for r in range(world)
    ]
    t0 = time.perf_counter()
    assert len({d for d, _ in digests}) == 1
    assign_writers([specs for _, specs in digests])
    data = coordinator_manifest(world, results, mine)
    coordinator = time.perf_counter() - t0
    del results
    gc.collect()
    # one rank's load: parse, then plan the reads of its box, reading the one index it needs
    t0 = time.perf_counter()
    parsed = parse_manifest(data)
    reader = ChunkReader(Path("/nonexistent"), parsed)
    reader.files.source = MemorySource({INDEX_PATTERN.format(rank=reader_rank): index_data})  # type: ignore[assignment]
    reads = 0
    for key, shape in tensors:
        offsets, local = local_box(shape, reader_rank, world)
        reads += len(reader.plan(key, parsed.tensors[key], offsets, local))
    load_plan = time.perf_counter() - t0
    return Sample(rank_describe, coordinator, len(data), load_plan, reads)


def coordinator_manifest(world: int, results: list[RankResult], layout: LocalLayout) -> bytes:
    """What the coordinator does with the W per-rank results: build the manifest, check it with the
    load's parser, serialize it (the save's own functions)."""
    files = {r.file[0]: FileEntry(r.file[1], rank, r.index) for rank, r in enumerate(results) if r.file is not None}
    tensors = tensor_entries(results, layout, spread_writers(layout.rules()))
    manifest = new_manifest(world, files, b"{}", {}, __version__, tensors=tensors, state_file=STATE_NAME)
    data = manifest.to_bytes()
    parse_manifest(data, "the manifest about to be written")
    return data


class MemorySource:
    """The index files a load reads, from memory (the benchmark measures parsing and planning, not disk)."""

    def __init__(self, files: dict[str, bytes]) -> None:
        self.files = files

    def describe(self, checkpoint: str | None, file: str) -> str:
        return f"memory:{file}"

    def read_small(self, name: str, limit: int) -> bytes:
        return self.files[name][: limit + 1]

    def close(self) -> None:
        pass


# ----------------------------------------------------------------------------- N-D mesh

ND_SECTION = "## Scale on a 3-D mesh (metadata, simulated)"
ND_MESH = (8, 256, 8)  # (dp_replicate, dp_shard, tp): HSDP x tensor parallel, 16,384 ranks
_R, _TP_ROWS, _TP_COLS = Placement(None), Placement(0), Placement(1)
COLWISE = (_R, Placement(0, ND_MESH[2]), _TP_ROWS)  # FSDP2 over colwise TP: _StridedShard on dp_shard
ROWWISE = (_R, Placement(0), _TP_COLS)  # FSDP2 over rowwise TP
NORM = (_R, Placement(0), _R)  # FSDP2 only, replicated over tp


def nd_layout(n: int = TENSORS) -> list[tuple[str, tuple[int, ...], LayoutRule]]:
    """A Llama-3-8B-shaped model's parameters on ``ND_MESH`` the way torchtitan lays them out."""
    per_layer = [
        ("attention.wq.weight", (4096, 4096), COLWISE),
        ("attention.wk.weight", (1024, 4096), COLWISE),
        ("attention.wv.weight", (1024, 4096), COLWISE),
        ("attention.wo.weight", (4096, 4096), ROWWISE),
        ("feed_forward.w1.weight", (14336, 4096), COLWISE),
        ("feed_forward.w2.weight", (4096, 14336), ROWWISE),
        ("feed_forward.w3.weight", (14336, 4096), COLWISE),
        ("attention_norm.weight", (4096,), NORM),
        ("ffn_norm.weight", (4096,), NORM),
    ]
    out = []
    for i in range(-(-n // len(per_layer))):
        out += [
            (f"model/layers.{i}.{name}", shape, LayoutRule(ND_MESH, placements))
            for name, shape, placements in per_layer
        ]
    return out[:n]


def nd_chunks(tensors: list[tuple[str, tuple[int, ...], LayoutRule]], rank: int) -> list[LocalChunk]:
    """The rank's boxes of every tensor as the state adapters describe a DTensor (meta tensors: no data)."""
    out = []
    for key, shape, rule in tensors:
        for box in rule.boxes(shape, rule.part_of(rank)):
            out.append(
                LocalChunk(
                    key, torch.empty(box.shape, dtype=torch.bfloat16, device="meta"), shape, box.offsets, rule=rule
                )
            )
    return out


def nd_index(tensors: list[tuple[str, tuple[int, ...], LayoutRule]], rules: dict[str, LayoutRule], rank: int) -> bytes:
    """The index rank ``rank`` writes: the boxes of the parts it is the writer of."""
    pos, entries = 4096, []
    for key, shape, _ in tensors:
        rule = rules[key]
        part = rule.part_of(rank)
        if rule.writer_of(part) != rank:
            continue
        for box in rule.boxes(shape, part):
            nbytes = 2 * int(torch.Size(box.shape).numel())
            blocks = -(-nbytes // (1 << 20))
            entries.append(
                (
                    key,
                    ChunkEntry(
                        box.offsets,
                        box.shape,
                        SHARD_PATTERN.format(rank=rank),
                        pos,
                        pos + nbytes,
                        ("0123456789abcdef",) * blocks,
                    ),
                )
            )
            pos += nbytes
    return build_index(rank, SHARD_PATTERN.format(rank=rank), entries)


def nd_once(tensors: list[tuple[str, tuple[int, ...], LayoutRule]], world: int) -> Sample:
    """One rank's describe, the coordinator's manifest, one rank's parse + plan, on the 3-D mesh."""
    reader_rank = world // 2 + 1
    gc.collect()
    t0 = time.perf_counter()
    mine = describe_layout(nd_chunks(tensors, reader_rank), reader_rank, world)
    rank_describe = time.perf_counter() - t0
    rules = spread_writers(mine.rules())
    writers = sorted({rules[key].writer_of(rules[key].part_of(reader_rank)) for key, _, _ in tensors})
    indexes = {w: nd_index(tensors, rules, w) for w in writers}
    shard_size = 1 << 40
    results = [
        RankResult(
            (SHARD_PATTERN.format(rank=r), shard_size),
            IndexRef(INDEX_PATTERN.format(rank=r), len(indexes[r]), hash_bytes(indexes[r]))
            if r in indexes
            else IndexRef(INDEX_PATTERN.format(rank=r), 1000, f"{r:016x}"),
        )
        for r in range(world)
    ]
    t0 = time.perf_counter()
    with gc_paused():  # as save() runs (core/gcpause.py)
        data = coordinator_manifest(world, results, mine)
    coordinator = time.perf_counter() - t0
    del results
    gc.collect()
    t0 = time.perf_counter()
    with gc_paused():  # as load() runs
        parsed = parse_manifest(data)
        parse = time.perf_counter() - t0
        reader = ChunkReader(Path("/nonexistent"), parsed)
        reader.files.source = MemorySource({INDEX_PATTERN.format(rank=w): indexes[w] for w in writers})  # type: ignore[assignment]
        reads = 0
        for key, shape, rule in tensors:
            for box in rule.boxes(shape, rule.part_of(reader_rank)):
                reads += len(reader.plan(key, parsed.tensors[key], box.offsets, box.shape))
    load_plan = time.perf_counter() - t0
    print(f"    parse {secs(parse)}, plan {secs(load_plan - parse)} reading {len(writers)} indexes", flush=True)
    return Sample(rank_describe, coordinator, len(data), load_plan, reads)


def report_nd(samples: list[Sample], runs: int, command: str, elapsed: float) -> str:
    size, plan = median(samples, "manifest_bytes"), median(samples, "load_plan")
    ok = size <= 8e6 and plan <= 0.5
    world = 1
    for n in ND_MESH:
        world *= n
    return (
        "\n".join(
            [
                ND_SECTION,
                "",
                f"- **Command:** `{command}` (what `make bench-scale` runs); medians of {runs} runs; took "
                f"{elapsed:.0f} s; "
                f"load average at the end {load_average()}",
                f"- **Layout:** {TENSORS:,} tensors of a Llama-3-8B-shaped model (per layer wq/wk/wv/w1/w3 colwise: "
                f"`(Replicate, _StridedShard(0, sf={ND_MESH[2]}), Shard(0))`; wo/w2 rowwise: `(Replicate, Shard(0), "
                "Shard(1))`; two "
                f"norms `(Replicate, Shard(0), Replicate)`) on a `(dp_replicate={ND_MESH[0]}, dp_shard={ND_MESH[1]}, "
                f"tp={ND_MESH[2]})` "
                f"mesh: {world:,} ranks. No data, only metadata; one process, the code a save and a load run.",
                "- **Measured:** one rank's describe (its boxes checked against each tensor's rule, digested); the "
                "coordinator's "
                "manifest from the W per-rank results, validated by the load's parser; one rank's parse of that "
                "manifest and the "
                "plan of the reads of its own boxes, reading and validating (from memory) the indexes of the writers "
                "of its parts.",
                "",
                "| ranks | manifest | coordinator | one rank's parse + plan | one rank's describe | reads planned | "
                "target |",
                "|---|---|---|---|---|---|---|",
                f"| {world:,} | {mb(size)} | {secs(median(samples, 'coordinator'))} | {secs(plan)} | "
                f"{secs(median(samples, 'rank_describe'))} "
                f"| {samples[0].reads:,} | manifest <= 8 MB, parse + plan <= 0.5 s: {'met' if ok else 'MISSED'} |",
                "",
                "The manifest's `tensors` section holds one rule per tensor (mesh + placements + writer, ~120 bytes); "
                "the rest is the "
                "`files` list, one entry per rank. Listing the chunks instead (format 2's fallback for N-D layouts) "
                "would take "
                f"{world // ND_MESH[0]:,} chunks per tensor.",
            ]
        )
        + "\n"
    )


# ----------------------------------------------------------------------------- pipeline stages

PP_SECTION = "## Scale on a pipeline mesh (metadata, simulated)"
PP_MESH = (8, 256, 8)  # (pp, dp_shard, tp): 8 stages, each FSDP2 x TP on its slice world_mesh["dp_shard", "tp"]


def pp_layout(n: int = TENSORS) -> list[tuple[str, tuple[int, ...], LayoutRule, int]]:
    """:func:`nd_layout`'s model split into ``PP_MESH[0]`` stages by layer (torchtitan's split: full
    names): (key, shape, the rule a stage's rank describes, stage). A stage's rank describes its
    tensors with ``Replicate`` on pp (its mesh is a slice without that dim): the save's merge makes it
    ``["at", stage]``."""
    tensors = nd_layout(n)
    layers = int(tensors[-1][0].split(".")[1]) + 1
    stages = PP_MESH[0]
    return [
        (key, shape, LayoutRule(PP_MESH, rule.placements), int(key.split(".")[1]) * stages // layers)
        for key, shape, rule in tensors
    ]


def pp_once(tensors: list[tuple[str, tuple[int, ...], LayoutRule, int]], world: int) -> Sample:
    """One rank's describe, the coordinator's merge of every rank's rule-described tensors and its
    manifest, one rank's parse + plan of its stage's boxes."""
    per_stage = world // PP_MESH[0]
    reader_rank = world // 2 + 1
    stage_of = reader_rank // per_stage
    own = [(k, s, r) for k, s, r, stage in tensors if stage == stage_of]
    gc.collect()
    t0 = time.perf_counter()
    describe_layout(nd_chunks(own, reader_rank), reader_rank, world)
    rank_describe = time.perf_counter() - t0
    # what the coordinator gathers: every rank's layout digest, the keys it lists (none here) and its
    # rule-described tensors (equal within a stage: stage_rules reads one list per digest)
    held: list[list[RuleHeld]] = [
        [RuleHeld(k, "torch.bfloat16", s, r) for k, s, r, stage in tensors if stage == st] for st in range(PP_MESH[0])
    ]
    digests = [f"stage{st}" for st in range(PP_MESH[0])]  # a stage's ranks' layout digests are equal
    gathered: list[tuple[str, list[str], list[RuleHeld]]] = [
        (digests[r // per_stage], [], held[r // per_stage]) for r in range(world)
    ]
    t0 = time.perf_counter()
    with gc_paused():
        stage = stage_rules(gathered)
    merge = time.perf_counter() - t0
    del gathered
    rules = {k: t[3] for k, t in stage.items()}
    assert len(rules) == len(tensors) and all(r.at_dims == (0,) for r in rules.values())
    writers = sorted({rules[key].writer_of(rules[key].part_of(reader_rank)) for key, _, _ in own})
    indexes = {w: nd_index(own, rules, w) for w in writers}
    results = [
        RankResult(
            (SHARD_PATTERN.format(rank=r), 1 << 40),
            IndexRef(INDEX_PATTERN.format(rank=r), len(indexes[r]), hash_bytes(indexes[r]))
            if r in indexes
            else IndexRef(INDEX_PATTERN.format(rank=r), 1000, f"{r:016x}"),
        )
        for r in range(world)
    ]
    t0 = time.perf_counter()
    with gc_paused():
        files = {r.file[0]: FileEntry(r.file[1], rank, r.index) for rank, r in enumerate(results) if r.file is not None}
        made = new_manifest(
            world,
            files,
            b"{}",
            {},
            __version__,
            tensors=tensor_entries(results, None, rules, stage),
            state_file=STATE_NAME,
        )
        data = made.to_bytes()
        parse_manifest(data, "the manifest about to be written")
    coordinator = time.perf_counter() - t0 + merge
    del results
    gc.collect()
    t0 = time.perf_counter()
    with gc_paused():
        parsed = parse_manifest(data)
        parse = time.perf_counter() - t0
        reader = ChunkReader(Path("/nonexistent"), parsed)
        reader.files.source = MemorySource({INDEX_PATTERN.format(rank=w): indexes[w] for w in writers})  # type: ignore[assignment]
        reads = 0
        for key, shape, _ in own:
            rule = parsed.tensors[key].rule
            assert rule is not None and rule.holds(reader_rank)
            for box in rule.boxes(shape, rule.part_of(reader_rank)):
                reads += len(reader.plan(key, parsed.tensors[key], box.offsets, box.shape))
    load_plan = time.perf_counter() - t0
    print(
        f"    merge {secs(merge)}, parse {secs(parse)}, plan {secs(load_plan - parse)} reading {len(writers)} indexes",
        flush=True,
    )
    return Sample(rank_describe, coordinator, len(data), load_plan, reads)


def report_pp(samples: list[Sample], runs: int, command: str, elapsed: float) -> str:
    size, plan = median(samples, "manifest_bytes"), median(samples, "load_plan")
    ok = size <= 8e6 and plan <= 0.5
    world = PP_MESH[0] * PP_MESH[1] * PP_MESH[2]
    return (
        "\n".join(
            [
                PP_SECTION,
                "",
                f"- **Command:** `{command}`; medians of {runs} runs; took {elapsed:.0f} s; load average at the end "
                f"{load_average()}",
                f"- **Layout:** the model above split by layer into {PP_MESH[0]} pipeline stages on a "
                f"`(pp={PP_MESH[0]}, dp_shard={PP_MESH[1]}, tp={PP_MESH[2]})` world mesh ({world:,} ranks), "
                "each stage FSDP2 x TP on its "
                'slice `world_mesh["dp_shard", "tp"]` (torchtitan\'s split): a stage\'s tensors exist only on its '
                f'{world // PP_MESH[0]:,} ranks, stored as rules with `["at", stage]` on pp.',
                "- **Measured:** one rank's describe; the coordinator's merge of the W ranks' rule-described tensors "
                "(core/layout.stage_rules) and its manifest, validated by the load's parser; one rank's parse of that "
                "manifest and the plan of the reads of its own boxes (its stage's tensors), reading and validating "
                "(from memory) the indexes of the writers of its parts.",
                "",
                "| ranks | manifest | coordinator (merge + manifest) | one rank's parse + plan | one rank's describe | "
                "reads planned | target |",
                "|---|---|---|---|---|---|---|",
                f"| {world:,} | {mb(size)} | {secs(median(samples, 'coordinator'))} | {secs(plan)} | "
                f"{secs(median(samples, 'rank_describe'))} "
                f"| {samples[0].reads:,} | manifest <= 8 MB, parse + plan <= 0.5 s: {'met' if ok else 'MISSED'} |",
                "",
                f"Listed chunks (before format 4) would take {world // PP_MESH[0]:,} chunks per tensor.",
            ]
        )
        + "\n"
    )


# ----------------------------------------------------------------------------- DCP


def dcp_once(tensors: list[tuple[str, tuple[int, ...]]], world: int) -> Sample:
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    props = TensorProperties(dtype=torch.float32)
    gc.collect()
    t0 = time.perf_counter()
    plans = []
    for rank in range(world):
        items = []
        for key, shape in tensors:
            offsets, local = local_box(shape, rank, world)
            if not local[0]:
                continue
            chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(local))
            data = TensorWriteData(chunk=chunk, properties=props, size=torch.Size(shape))
            items.append(
                WriteItem(index=MetadataIndex(key, torch.Size(offsets)), type=WriteItemType.SHARD, tensor_data=data)
            )
        # planner_data: the flattening map create_local_plan sets (none here)
        plans.append(SavePlan(items, planner_data={}))
    rank_describe = (time.perf_counter() - t0) / world  # one rank's plan
    t0 = time.perf_counter()
    planner = DefaultSavePlanner()
    global_plan, metadata = planner.create_global_plan(plans)
    storage = {}
    for rank, plan in enumerate(global_plan):  # what FileSystemWriter.finish adds: where each item lies
        pos = 0
        for item in plan.items:
            assert item.tensor_data is not None
            length = 4 * int(item.tensor_data.chunk.sizes.numel())
            storage[item.index] = _StorageInfo(f"__{rank}_0.distcp", pos, length)
            pos += length
    metadata.storage_data = storage
    buffer = io.BytesIO()
    pickle.dump(metadata, buffer)
    data = buffer.getvalue()
    coordinator = time.perf_counter() - t0
    del plans, global_plan, metadata, storage, planner
    gc.collect()
    reader_rank = world // 2 + 1
    t0 = time.perf_counter()
    md = pickle.loads(data)
    reads = 0
    for key, shape in tensors:
        offsets, local = local_box(shape, reader_rank, world)
        mine = [ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(local))]
        reads += len(create_read_items_for_chunk_list(key, md.state_dict_metadata[key], mine))
    load_plan = time.perf_counter() - t0
    del md
    gc.collect()
    return Sample(rank_describe, coordinator, len(data), load_plan, reads)


# ----------------------------------------------------------------------------- report


def median(samples: list[Sample], field: str) -> float:
    return statistics.median(getattr(s, field) for s in samples)


def measure(
    fn: Callable[..., Sample], tensors: list[tuple[str, tuple[int, ...]]], world: int, runs: int
) -> list[Sample]:
    out = []
    for _ in range(runs):
        out.append(fn(tensors, world))
        print(f"  {fn.__name__} W={world}: {out[-1]}", flush=True)
    return out


def mb(n: float) -> str:
    return f"{n / 1e6:.2f} MB"


def secs(t: float) -> str:
    return f"{t * 1000:.0f} ms" if t < 1 else f"{t:.2f} s"


def report(
    results: dict[int, dict[str, list[Sample]]], runs: int, command: str, elapsed: float, dcp_max: int, big_runs: int
) -> str:
    commit = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    lines = [
        SECTION,
        "",
        f"- **Command:** `{command}` (what `make bench-scale` runs); medians of {runs} runs per cell (DCP above 256 "
        "ranks: "
        f"{min(runs, big_runs)} run, its planning takes minutes there); took {elapsed / 60:.1f} min",
        f"- **Date:** {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; shardsafe {__version__} at {commit}; torch "
        f"{torch.__version__}; "
        f"Python {platform.python_version()}; load average at the end {load_average()}",
        f"- **Layout:** {TENSORS} tensors in an FSDP2 layout (per layer a `[4099..5135, 64]` weight and a bias of as "
        "many rows, "
        "and a `[1024..1030]` norm weight; all `Shard(0)`, uneven); no data, only metadata. One process.",
        "- **shardsafe:** one rank classifies + digests its chunks; the coordinator decides the plan from W digests, "
        "builds the "
        "manifest from W per-rank results (file, index size + hash), validates it with the load's parser and "
        "serializes it; one "
        "rank parses the manifest and plans the reads of its box, reading and validating (from memory) the index it "
        "needs.",
        "- **DCP:** the same layout as W `SavePlan`s of `WriteItem`s through `DefaultSavePlanner.create_global_plan`, "
        "plus the "
        "`_StorageInfo` records its `FileSystemWriter` adds, pickled (the `.metadata` file); the read side unpickles "
        "it and runs "
        "`create_read_items_for_chunk_list` for one rank.",
        "",
        "| ranks | metadata: shardsafe | DCP | coordinator: shardsafe | DCP "
        "| one rank's load plan: shardsafe | DCP | one rank's save describe: shardsafe | DCP | target |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for world, by in sorted(results.items()):
        ss, dc = by["shardsafe"], by.get("dcp")

        def d(f: str, fmt: Callable[[float], str], dc: list[Sample] | None = dc) -> str:
            return fmt(median(dc, f)) if dc else "not run"

        target = "manifest <= 8 MB, parse + plan <= 0.5 s" if world == 16384 else ""
        lines.append(
            f"| {world:,} | {mb(median(ss, 'manifest_bytes'))} | {d('manifest_bytes', mb)} | "
            f"{secs(median(ss, 'coordinator'))} | "
            f"{d('coordinator', secs)} | {secs(median(ss, 'load_plan'))} | {d('load_plan', secs)} | "
            f"{secs(median(ss, 'rank_describe'))} | "
            f"{d('rank_describe', secs)} | {target} |"
        )
    big = results.get(16384, {}).get("shardsafe")
    if big:
        size, plan = median(big, "manifest_bytes"), median(big, "load_plan")
        ok = size <= 8e6 and plan <= 0.5
        lines += [
            "",
            f"At 16,384 ranks: manifest {mb(size)}, one rank's parse + plan {secs(plan)}: targets "
            f"{'met' if ok else 'MISSED'}.",
        ]
    measured = sorted(w for w, by in results.items() if "dcp" in by)
    if len(measured) >= 2:
        a, b = measured[-2], measured[-1]
        growth = median(results[b]["dcp"], "manifest_bytes") / median(results[a]["dcp"], "manifest_bytes")
        lines += [
            "",
            f"DCP was run up to {dcp_max:,} ranks: it holds one `WriteItem` / `ChunkStorageMetadata` / `_StorageInfo` "
            "per tensor per rank "
            f"({TENSORS:,} x W objects; 32.8 M at 16,384 ranks, beyond this machine's memory in this form). Its "
            "metadata grew "
            f"{growth:.1f}x from {a:,} to {b:,} ranks ({b // a}x the ranks): linear in W, so about "
            f"{mb(median(results[b]['dcp'], 'manifest_bytes') * 16384 / b)} at 16,384. shardsafe's manifest grows only "
            "by its "
            "`files` list (one entry per rank, ~150 bytes); its `tensors` section is the same at every world size.",
        ]
    return "\n".join(lines) + "\n"


def run_real(worlds: tuple[int, ...], runs: int, layers: int) -> dict[int, dict[str, Any]]:
    """``worker_scale.py`` under torch.distributed.run for each world size (gloo, CPU, this machine)."""
    import json
    import os
    import tempfile

    out: dict[int, dict[str, Any]] = {}
    for world in worlds:
        with tempfile.TemporaryDirectory(prefix="bench-scale-") as tmp:  # /tmp: the same disk as the repository here
            result = Path(tmp) / "result.json"
            worker = str(Path(__file__).resolve().parent / "worker_scale.py")
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}", worker,
                   "--layers", str(layers), "--runs", str(runs), "--root", tmp, "--out", str(result)]  # fmt: skip
            env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=f"{REPO / 'src'}:{Path(__file__).resolve().parent}")
            start = time.perf_counter()
            subprocess.run(cmd, check=True, env=env)
            out[world] = json.loads(result.read_text())
            print(f"  real W={world}: {out[world]} ({time.perf_counter() - start:.0f} s)", flush=True)
    return out


def report_real(results: dict[int, dict[str, Any]], runs: int, command: str, elapsed: float) -> str:
    lines = [
        REAL_SECTION,
        "",
        f"- **Command:** `{command}` (what `make bench-scale` runs after the simulation); {runs} rounds, alternating "
        "order, medians; "
        f"took {elapsed / 60:.1f} min; load average at the end {load_average()}",
        "- **Setup:** W gloo processes on this 2-core machine, FSDP2 (`fully_shard` per layer) of Linear(64, 64) "
        "layers + AdamW "
        f"after one step: {next(iter(results.values()))['tensors'] if results else '?'} tensors; page cache dropped "
        "(`sync; echo 3 > /proc/sys/vm/drop_caches`) before every load, for both; DCP via `get_state_dict` / "
        "`set_state_dict`.",
        "",
        "| ranks | save: shardsafe | DCP | shardsafe is | load: shardsafe | DCP | shardsafe is | target (16 ranks) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for world, r in sorted(results.items()):
        res = r["results"]
        ss, ds = statistics.median(res["save"]["shardsafe"]), statistics.median(res["save"]["dcp"])
        sl, dl = statistics.median(res["load"]["shardsafe"]), statistics.median(res["load"]["dcp"])
        target = "save >= 2x, load >= 2x DCP" if world == 16 else ""
        lines.append(
            f"| {world} | {secs(ss)} | {secs(ds)} | {ds / ss:.2f}x | {secs(sl)} | {secs(dl)} | {dl / sl:.2f}x | "
            f"{target} |"
        )
    if 16 in results:
        res = results[16]["results"]
        save = statistics.median(res["save"]["dcp"]) / statistics.median(res["save"]["shardsafe"])
        load = statistics.median(res["load"]["dcp"]) / statistics.median(res["load"]["shardsafe"])
        verdict = {True: "met", False: "MISSED"}
        lines += [
            "",
            f"At 16 ranks: save {save:.2f}x DCP ({verdict[save >= 2]}), load {load:.2f}x DCP ({verdict[load >= 2]}).",
        ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke test: 64 and 1,024 ranks, 1 run, BENCHMARKS.md untouched unless --md",
    )
    parser.add_argument("--runs", type=int, default=None, help="runs per measurement (default 3; 1 with --quick)")
    parser.add_argument(
        "--dcp-max",
        type=int,
        default=1024,
        help="largest world size DCP is built for (its metadata is O(T x W) objects)",
    )
    parser.add_argument(
        "--dcp-big-runs", type=int, default=1, help="runs of DCP above 256 ranks (about 3 min each at 1,024 on 2 cores)"
    )
    parser.add_argument("--md", type=Path, default=None)
    parser.add_argument("--real-only", action="store_true", help="only the real 4 / 8 / 16-process runs")
    parser.add_argument("--simulated-only", action="store_true", help="only the simulation")
    parser.add_argument("--nd-only", action="store_true", help="only the 3-D mesh simulation")
    parser.add_argument(
        "--layers", type=int, default=250, help="Linear(64, 64) layers of the real runs (4 tensors each)"
    )
    args = parser.parse_args()
    runs = args.runs if args.runs is not None else (1 if args.quick else 3)
    worlds = WORLDS[:2] if args.quick else WORLDS
    md = args.md if args.md is not None else (None if args.quick else REPO / "BENCHMARKS.md")
    tensors = layout()
    command = (
        "python benchmarks/bench_scale.py"
        + (" --quick" if args.quick else "")
        + (f" --runs {runs}" if runs != (1 if args.quick else 3) else "")
        + (" --nd-only" if args.nd_only else "")
    )
    if not args.real_only:
        start = time.perf_counter()
        nd = measure(nd_once, nd_layout(), 16384, runs)  # type: ignore[arg-type]
        text = report_nd(nd, runs, command, time.perf_counter() - start)
        print(text)
        if md is not None:
            write_section(md, ND_SECTION, text)
            print(f"wrote the {ND_SECTION!r} section of {md}")
        start = time.perf_counter()
        pp = measure(pp_once, pp_layout(), 16384, runs)  # type: ignore[arg-type]
        text = report_pp(pp, runs, command, time.perf_counter() - start)
        print(text)
        if md is not None:
            write_section(md, PP_SECTION, text)
            print(f"wrote the {PP_SECTION!r} section of {md}")
    if args.nd_only:
        return
    if not args.real_only:
        start = time.perf_counter()
        results: dict[int, dict[str, list[Sample]]] = {}
        for world in worlds:
            results[world] = {"shardsafe": measure(shardsafe_once, tensors, world, runs)}
            if world <= args.dcp_max:
                results[world]["dcp"] = measure(
                    dcp_once, tensors, world, runs if world <= 256 else min(runs, args.dcp_big_runs)
                )
        text = report(results, runs, command, time.perf_counter() - start, args.dcp_max, args.dcp_big_runs)
        print(text)
        if md is not None:
            write_section(md, SECTION, text)
            print(f"wrote the {SECTION!r} section of {md}")
    if not args.simulated_only:
        start = time.perf_counter()
        real = run_real(REAL_WORLDS[:1] if args.quick else REAL_WORLDS, runs, args.layers)
        text = report_real(real, runs, command + " --real-only", time.perf_counter() - start)
        print(text)
        if md is not None:
            write_section(md, REAL_SECTION, text)
            print(f"wrote the {REAL_SECTION!r} section of {md}")


if __name__ == "__main__":
    main()
