"""What a power cut can leave: crash states computed from the operation log of ``fusefs``.

ALICE's approach (Pillai et al., OSDI'14): the recording file system logs every operation; a cut
after the k-th operation keeps what was made durable before it and any subset of the rest that
the durability model allows; each such state is replayed into a fresh folder and checked.

The log is cut into *micro-operations*:

* ``ns``: one change of the namespace (create, mkdir, symlink, link, unlink, rmdir, rename; a
  rename, RENAME_EXCHANGE included, is one atomic micro-operation over both directories);
* ``trunc``: a truncate (a file's size set);
* ``data``: one file-system block (4 KiB, aligned) of one write: a write over several blocks can
  be torn at any block boundary.

Two models (``PROFILES``) say which of them a cut may drop:

``strict`` ("nothing is durable without fsync"; what POSIX promises):
  * a file's data and truncates are durable once ``fsync``/``fdatasync`` of that file returns;
  * a namespace change is durable once ``fsync`` of a directory it changes returns;
  * anything else is pending and may or may not survive, independently of everything else, in
    any combination (unsynced operations reordered freely; a torn write keeps any subset of its
    blocks, the others read as zeros inside the file's size, or are absent past it).

``ext4`` (ext4 ``data=ordered`` with delayed allocation, its default, as far as a checker needs):
  * namespace changes and truncates go through one journal: what survives of them is a *prefix*
    of their program order; any ``fsync`` or ``fsyncdir`` (of anything) commits the journal, so
    every one before it is durable;
  * a file's data is written back in its program order (block by block) independently of the
    journal: what survives of a file's unsynced data is a prefix of its block writes (ordered
    mode: an extended file never shows stale blocks; an unwritten tail is simply absent);
    ``fsync``/``fdatasync`` of the file makes all of it durable;
  * ``auto_da_alloc``: a rename that replaces an existing file forces the renamed file's data
    written before it out with the rename (if the rename survives, so does that data).

In both: a ``sync`` marker (a workload's way to say "long ago, all written back") makes
everything before it durable, and what is unreachable from the root after a cut is gone.
Applying a chosen subset in log order is what reordering can produce: operations on different
objects commute, and no file system reorders two changes of one directory entry.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote

BLOCK = 4096
PROFILES = ("ext4", "strict")
NS_OPS = {"create", "mkdir", "symlink", "link", "unlink", "rmdir", "rename"}


@dataclass(frozen=True)
class Micro:
    pos: int  # index of the log entry it comes from
    kind: str  # "ns", "trunc" or "data"
    ino: int  # the file (data, trunc); the inode named (ns)
    dirs: tuple[int, ...] = ()  # ns: the directories it changes
    off: int = 0  # data: file offset
    blob: int = 0  # data: offset in data.bin
    length: int = 0  # data: bytes


@dataclass
class Node:
    kind: str  # "f", "d", "l"
    data: bytearray = field(default_factory=bytearray)
    entries: dict[str, int] = field(default_factory=dict)
    target: str = ""


class OpLog:
    """One recorded run: the entries, their micro-operations, the markers, the written bytes."""

    def __init__(self, logdir: str | os.PathLike[str]) -> None:
        logdir = Path(logdir)
        self.entries: list[dict[str, Any]] = [
            json.loads(line) for line in (logdir / "ops.jsonl").read_text().splitlines() if line
        ]
        self.data = (logdir / "data.bin").read_bytes()
        self.micro: list[Micro] = []
        self.markers: list[tuple[int, str]] = []  # (position, text): the marker is entry `position`
        kinds: dict[int, str] = {0: "d"}
        self.replacing_renames: dict[int, int] = {}  # micro index of a rename that replaces a file -> the moved file
        for pos, e in enumerate(self.entries):
            op = e["op"]
            if op in NS_OPS:
                if op in ("create", "mkdir", "symlink"):
                    kinds[e["ino"]] = {"create": "f", "mkdir": "d", "symlink": "l"}[op]
                dirs = (e["sp"], e["dp"]) if op == "rename" else (e["parent"],)
                if op == "rename" and e["flags"] == 0 and e["replaced"] is not None and kinds.get(e["replaced"]) == "f":
                    self.replacing_renames[len(self.micro)] = e["ino"]
                self.micro.append(Micro(pos, "ns", e["ino"], tuple(dict.fromkeys(dirs))))
            elif op == "truncate":
                self.micro.append(Micro(pos, "trunc", e["ino"]))
            elif op == "write":
                off, blob, end = e["off"], e["blob"], e["off"] + e["len"]
                while off < end:
                    stop = min(end, (off // BLOCK + 1) * BLOCK)
                    self.micro.append(Micro(pos, "data", e["ino"], off=off, blob=blob, length=stop - off))
                    blob += stop - off
                    off = stop
            elif op == "marker":
                e["text"] = unquote(e["text"])
                self.markers.append((pos, e["text"]))
        self._forced: dict[str, list[float]] = {}

    def __len__(self) -> int:
        return len(self.entries)

    def marker_positions(self, prefix: str = "") -> list[tuple[int, str]]:
        return [(pos, text) for pos, text in self.markers if text.startswith(prefix)]

    def markers_before(self, cut: int) -> list[str]:
        return [text for pos, text in self.markers if pos < cut]

    # ------------------------------------------------------------------ durability

    def forced_at(self, profile: str) -> list[float]:
        """For each micro-operation, the log position of the barrier that made it durable (inf: none)."""
        if profile in self._forced:
            return self._forced[profile]
        forced = [float("inf")] * len(self.micro)
        by_pos: dict[int, list[int]] = defaultdict(list)
        for i, m in enumerate(self.micro):
            by_pos[m.pos].append(i)
        file_pending: dict[int, list[int]] = defaultdict(list)  # data (+ trunc in strict) per file
        dir_pending: dict[int, list[int]] = defaultdict(list)  # strict: ns per directory
        journal: list[int] = []  # ext4: ns + trunc, in order
        everything: list[int] = []
        for pos, e in enumerate(self.entries):
            for i in by_pos.get(pos, ()):
                m = self.micro[i]
                everything.append(i)
                if m.kind == "data" or (m.kind == "trunc" and profile == "strict"):
                    file_pending[m.ino].append(i)
                elif profile == "ext4":
                    journal.append(i)
                else:
                    for d in m.dirs:
                        dir_pending[d].append(i)
            op = e["op"]
            targets: list[int] = []
            if op == "fsync":
                targets = file_pending.pop(e["ino"], [])
                if profile == "ext4":
                    targets += journal
                    journal = []
            elif op == "fsyncdir":
                if profile == "ext4":
                    targets, journal = journal, []
                else:
                    targets = dir_pending.pop(e["ino"], [])
            elif op == "marker" and e["text"] == "sync":
                targets, everything = everything, []
                file_pending.clear()
                dir_pending.clear()
                journal = []
            for i in targets:
                if forced[i] == float("inf"):
                    forced[i] = pos
        self._forced[profile] = forced
        return forced

    # ------------------------------------------------------------------ crash states

    def crash_states(
        self, cut: int, profile: str, rng: random.Random, randoms: int
    ) -> Iterator[tuple[str, frozenset[int]]]:
        """(label, the pending micro-operations that survive) for the cut after ``cut`` log entries:
        drop all, keep all, and the structured and random subsets the profile allows."""
        forced = self.forced_at(profile)
        pending = [i for i, m in enumerate(self.micro) if m.pos < cut and forced[i] >= cut]
        seen: set[frozenset[int]] = set()

        def emit(label: str, chosen: set[int] | list[int]) -> Iterator[tuple[str, frozenset[int]]]:
            key = frozenset(chosen)
            if key not in seen:
                seen.add(key)
                yield label, key

        yield from emit("drop-all", [])
        yield from emit("keep-all", pending)
        if not pending:
            return
        meta = [
            i for i in pending if self.micro[i].kind != "data" and (profile == "ext4" or self.micro[i].kind == "ns")
        ]
        data = [i for i in pending if i not in set(meta)]
        yield from emit("meta-only", meta)
        yield from emit("data-only", data)
        if profile == "ext4":
            per_file: dict[int, list[int]] = defaultdict(list)
            for i in data:
                per_file[self.micro[i].ino].append(i)

            def ext4_state(meta_prefix: int, data_prefix: dict[int, int]) -> set[int]:
                prefix = dict(data_prefix)
                for i in meta[:meta_prefix]:  # auto_da_alloc: a replacing rename carries the renamed file's data
                    moved = self.replacing_renames.get(i)
                    if moved is not None:
                        before = sum(1 for j in per_file.get(moved, []) if j < i)
                        prefix[moved] = max(prefix.get(moved, 0), before)
                chosen = set(meta[:meta_prefix])
                for ino, blocks in per_file.items():
                    chosen.update(blocks[: prefix.get(ino, 0)])
                return chosen

            steps = sorted({round(j * len(meta) / 32) for j in range(33)}) if len(meta) > 32 else range(len(meta) + 1)
            for j in steps:
                yield from emit(f"journal-prefix-{j}", ext4_state(j, {}))
            for _ in range(randoms):
                yield from emit(
                    "random",
                    ext4_state(rng.randint(0, len(meta)), {ino: rng.randint(0, len(b)) for ino, b in per_file.items()}),
                )
            return
        ns = [i for i in meta if self.micro[i].kind == "ns"]
        for i in ns[-24:]:
            yield from emit("drop-one", [j for j in pending if j != i])
            yield from emit("keep-one", [i])
        for _ in range(randoms):
            yield from emit("random", [i for i in pending if rng.random() < 0.5])
            yield from emit("random-torn", meta + [i for i in data if rng.random() < 0.5])

    def replay(self, cut: int, profile: str, chosen: frozenset[int]) -> dict[int, Node]:
        """The file system after the cut: the durable micro-operations plus ``chosen``, in log order."""
        forced = self.forced_at(profile)
        nodes: dict[int, Node] = {0: Node("d")}

        def node(ino: int, kind: str) -> Node:
            n = nodes.get(ino)
            if n is None:
                n = nodes[ino] = Node(kind)
            return n

        for i, m in enumerate(self.micro):
            if m.pos >= cut:
                break
            if not (forced[i] < cut or i in chosen):
                continue
            e = self.entries[m.pos]
            if m.kind == "data":
                f = node(m.ino, "f")
                end = m.off + m.length
                if len(f.data) < end:
                    f.data.extend(bytes(end - len(f.data)))
                f.data[m.off : end] = self.data[m.blob : m.blob + m.length]
            elif m.kind == "trunc":
                f = node(m.ino, "f")
                size = e["size"]
                del f.data[size:]
                if len(f.data) < size:
                    f.data.extend(bytes(size - len(f.data)))
            else:
                op = e["op"]
                if op == "rename":
                    src, dst = node(e["sp"], "d").entries, node(e["dp"], "d").entries
                    if e["flags"] & 2:  # RENAME_EXCHANGE
                        src[e["sn"]], dst[e["dn"]] = e["replaced"], e["ino"]
                    else:
                        if src.get(e["sn"]) == e["ino"]:
                            del src[e["sn"]]
                        dst[e["dn"]] = e["ino"]
                elif op in ("unlink", "rmdir"):
                    entries = node(e["parent"], "d").entries
                    if entries.get(e["name"]) == e["ino"]:
                        del entries[e["name"]]
                else:
                    kind = {"create": "f", "mkdir": "d", "symlink": "l"}.get(op, "f")
                    target = node(e["ino"], kind)
                    if op == "symlink":
                        target.target = e["target"]
                    node(e["parent"], "d").entries[e["name"]] = e["ino"]
        return nodes


def walk(nodes: dict[int, Node]) -> Iterator[tuple[str, int, Node]]:
    """(relative path, inode, node) of everything reachable from the root, parents first."""
    stack: list[tuple[str, int]] = [("", 0)]
    seen_dirs = {0}
    while stack:
        path, ino = stack.pop()
        for name in sorted(nodes[ino].entries, reverse=True):
            child = nodes[ino].entries[name]
            if child not in nodes:
                continue
            n = nodes[child]
            sub = f"{path}/{name}" if path else name
            if n.kind == "d":
                if child in seen_dirs:
                    continue  # a directory reachable twice (a partial cross-directory rename): kept once
                seen_dirs.add(child)
                stack.append((sub, child))
            yield sub, child, n


def state_hash(nodes: dict[int, Node]) -> str:
    h = hashlib.sha256()
    for path, _, n in sorted(walk(nodes), key=lambda t: t[0]):
        h.update(f"{path}\0{n.kind}\0{n.target}\0{len(n.data)}\0".encode())
        if n.kind == "f":
            h.update(hashlib.sha256(n.data).digest())
    return h.hexdigest()


def materialise(nodes: dict[int, Node], dest: Path) -> None:
    """Write the state into the (new, empty) folder ``dest``; hard links stay hard links."""
    dest.mkdir(parents=True, exist_ok=True)
    first_path: dict[int, Path] = {}
    for path, ino, n in walk(nodes):
        target = dest / path
        if n.kind == "d":
            target.mkdir()
        elif n.kind == "l":
            os.symlink(n.target, target)
        elif ino in first_path:
            os.link(first_path[ino], target)
        else:
            target.write_bytes(n.data)
            first_path[ino] = target
