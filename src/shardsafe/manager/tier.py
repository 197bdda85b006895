"""The local tier: every ``local_every`` steps a checkpoint in each node's own folder, restored when newer than the
root's.

One local step is one ordinary shardsafe checkpoint (same format, block hashes, ``state.json``
with the data position, RNG and schedulers), written by the same collective write path as a
persistent one (:func:`~shardsafe.api.save.write_checkpoint`), but spread over the nodes: each
node has its own folder ``node_dir(local_dir, node) / <root name>-<root digest>`` (a tmpfs by
default, :data:`~shardsafe.manager.nodes.DEFAULT_LOCAL_DIR`), and holds

* the shard files (and indexes) of its own ranks, each written by its rank, and
* its own copy of the shared files, ``state.json`` and ``manifest.json``.

Who writes what (:class:`NodeCommit`): each node's leader (its lowest rank) creates the hidden
temporary step folder in its node's folder, every rank writes its own files into its node's; the
coordinator (rank 0, the leader of its node) builds and checks the manifest as always, commits its
own node's folder, and then sends the two shared files' bytes to the other leaders (one
broadcast), which write their copies and publish their folders by the same rename. Each node's
folder is committed atomically; the *step* exists in the tier when the union of the node folders
holding the same manifest (equal bytes: the same save) has every file that manifest names.

With ``replicas=R`` each node's files are then also sent (over the tier's own gloo group, point to
point) to the next ``R`` nodes (in the order of their lowest ranks, a ring) and written into their
step folders next to their own files, so a node whose folder is lost can be restored from its
peers' copies. The i-th rank of one node sends to (and receives from) the i-th rank of another
(any rank of a node reads and writes its node's folder), so the transfers between two nodes run
as one stream per pair of ranks, not one between their leaders. A file travels as its mapped pages
(:class:`~shardsafe.storage.local.MappedFile`): the group reads the sender's file pages and writes
the receiver's new file's pages (reserved first), with no copy through a buffer on either side.

Restore (:meth:`LocalTier.restore`): every leader reports the steps its folder holds and which of
their files are present (received files are renamed into place whole), the ranks pick the newest
step newer than the persistent root's newest whose files the nodes hold between them, and each
node lacking them is sent the small files every load reads (state file, indexes, the manifest
last) by a node holding them. Every rank then loads from its own node's folder
(:func:`~shardsafe.api.load.load_lacking`), told which shard files that folder lacks: what it
needs of those is read, verified, by a rank whose folder holds them and sent straight into the
load over the process group, so a lost node's share goes from its peers' replica pages into its
ranks' tensors, never through files of its own. Damage found (a missing file, a hash mismatch,
wherever it is read) means the persistent root is used instead.

Retention: a node's folder holds the newest step saved everywhere and the one being written; the
older ones are removed once a new step is complete (replicas included), except that the newest of
them becomes the folder's *spare* (:data:`SPARE_NAME`): the next save writes each shard file and
receives each replica over its namesake there (:func:`~shardsafe.storage.local.create_or_recycle`)
instead of into new pages. On a tmpfs a new file's pages are allocated and zeroed as they are
first written and freed again when its step is removed, which cost more CPU than the copy itself
(BENCHMARKS.md, "Local tier"); so a node's folder holds two steps' worth of memory between saves,
the peak it reaches during every save anyway. Before each save the ranks check
(``shutil.disk_usage``, the spare counted as free) that every node's folder has room for its
share; if one has not, the local save is skipped with a warning. :meth:`LocalTier.close` removes
the folders.

Whose folders: the default ``local_dir`` is in ``/dev/shm``, which every user of the host can
write. A folder there that another user made (or can write) could hold a planted step, manifest
and hashes included, newer than the root's, which a restore would load. So each leader makes its
node's folder and the root's folder in it readable and writable by this user only, and uses them
only while they are still so (:func:`_check_own`): a node folder of another user, a symlink, or
one that others may write makes the local save fail and the restore use the root, saying why.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import stat
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from shardsafe.api.checkpoint import write_checkpoint
from shardsafe.core.comm import Comm
from shardsafe.core.faults import crash_point
from shardsafe.core.format import MANIFEST_NAME, MAX_JSON_BYTES, Manifest, parse_manifest
from shardsafe.core.integrity import hash_bytes
from shardsafe.errors import CheckpointNotFoundError, FormatError, IntegrityError, SaveError, ShardsafeError
from shardsafe.manager.naming import STEP_NAMING, step_name
from shardsafe.manager.nodes import DEFAULT_LOCAL_DIR, NodeMap, gather_nodes, node_dir
from shardsafe.protocol.commit import LocalCommit
from shardsafe.protocol.temppath import TemporaryPath, hidden_sibling, is_hidden_temp, retire_folder
from shardsafe.state.registry import SaveView
from shardsafe.storage.local import MappedFile, fsync_dir, read_small_file, remove_tree, write_small_file
from shardsafe.storage.safetensors import write_tensor_file

__all__ = ["DEFAULT_LOCAL_DIR", "LocalTier", "NodeCommit", "check_own_folders", "tier_folder_name"]

log = logging.getLogger("shardsafe")

PIECE_BYTES = 64 << 20  # one point-to-point message of a file being sent
# in a node's tier folder: the files of the step retired last, written over by the next save (see the module doc)
SPARE_NAME = ".shardsafe-spare"
MARGIN_BYTES = 16 << 20  # headroom a node's folder keeps beyond what a save or restore writes there
# a rank's load of its node's folder of a step, given the shard files that folder lacks -> the bytes other ranks sent it
LoadLacking = Callable[[Path, frozenset[str]], int]
_DAMAGE = (IntegrityError, FormatError, CheckpointNotFoundError)  # a tier step that does not load: use the root


def tier_folder_name(root: str) -> str:
    """The folder of one root's local steps inside a node's ``local_dir``: ``<last part>-<digest>``,
    so two jobs on one host with different roots never share one (one root has one writer: the lease)."""
    tail = root.rstrip("/").rsplit("/", 1)[-1] or "root"
    tail = "".join(c if c.isalnum() or c in "._-" else "_" for c in tail).lstrip(".")[:64] or "root"
    return f"{tail}-{hashlib.blake2b(root.encode(), digest_size=6).hexdigest()}"


class NodeCommit(LocalCommit):
    """A :class:`LocalCommit` into this rank's own node's hidden step folder (its leader owns it).

    The coordinator commits its node's folder as any checkpoint and keeps the shared files' bytes
    (:attr:`shared`); every other leader then commits its copy with :meth:`commit_copy`. A shard
    file is written over its namesake in the node's ``spare`` folder (:data:`SPARE_NAME`) when
    there is one, not into new pages."""

    shared: tuple[str, bytes, bytes] | None = None  # (state file name, state bytes, manifest bytes), coordinator

    def __init__(self, temp: TemporaryPath, spare: Path | None = None) -> None:
        super().__init__(temp)
        self.spare = spare

    def write_shard(
        self, name: str, prefix: bytes, tensors: Iterable[torch.Tensor], block_size: int, rank: int
    ) -> tuple[int, list[list[str]]]:
        recycled = None if self.spare is None else self.spare / name
        return write_tensor_file(self.tmp / name, prefix, tensors, block_size, self.fsync, rank, recycled)

    def commit(self, state_bytes: bytes, manifest: Manifest, rank: int) -> None:
        data = manifest.to_bytes()
        super().commit(state_bytes, manifest, rank)
        self.shared = (manifest.state_file, state_bytes, data)

    def commit_copy(self, state_name: str, state_bytes: bytes, manifest_bytes: bytes) -> None:
        """A non-coordinator leader: the shared files into this node's folder, then its publish."""
        write_small_file(self.tmp / state_name, state_bytes, self.fsync)
        write_small_file(self.tmp / MANIFEST_NAME, manifest_bytes, self.fsync)
        self.temp.publish()


@dataclass(frozen=True)
class Move:
    """One file sent whole from one rank to another (group ranks of the tier's comm)."""

    name: str
    size: int
    src: int
    dst: int


@dataclass(frozen=True)
class Held:
    """What one node's folder holds of one step (its leader's report)."""

    digest: str  # of the manifest's bytes: equal digests, same save
    needed: dict[str, int]  # every file the manifest names (with manifest.json), and its size
    present: frozenset[str]  # those of them in the folder (after a restore there, maybe only the small files)
    shards: frozenset[str] = frozenset()  # the shard files among ``needed`` (the rest: state file, indexes, manifest)


def _raise_if_any(comm: Comm, problem: BaseException | None, what: str) -> None:
    """Collective: if any rank reports a problem, every rank raises the same SaveError."""
    _gather_or_raise(comm, None, problem, what)


def _gather_or_raise(comm: Comm, value: Any, problem: BaseException | None, what: str) -> list[Any]:
    """Collective: every rank's ``value``, in the same ``all_gather`` that tells whether any rank met a
    problem; if one did, every rank raises the same SaveError (one round instead of two)."""
    mine = None if problem is None else f"rank {comm.rank}: {type(problem).__name__}: {problem}"
    gathered = comm.all_gather((value, mine))
    bad = [m for _, m in gathered if m is not None]
    if bad:
        raise SaveError(f"{what}: " + "; ".join(bad)) from problem
    return [v for v, _ in gathered]


def _check_own(folder: Path, shared_parent: bool = False) -> None:
    """Raise PermissionError unless ``folder`` is a folder (not a symlink) of this user that no other
    user may write. ``shared_parent`` (a node's folder, which holds the roots' folders): a folder of
    the superuser with the sticky bit (``/dev/shm`` itself, as ``local_dir``) is accepted too, as the
    other users cannot move or remove what this user made in it."""
    info = os.lstat(folder)
    if not stat.S_ISDIR(info.st_mode):
        raise PermissionError(f"{folder} is not a folder (a symlink or a file put in its place?)")
    mine = info.st_uid == os.geteuid()
    if shared_parent and not mine and info.st_uid == 0 and info.st_mode & stat.S_ISVTX:
        return
    if not mine:
        raise PermissionError(
            f"{folder} belongs to user id {info.st_uid}, not this process's {os.geteuid()}: another "
            "user's folder, or one made to capture this job's state; set local_dir to a folder of your own "
            "(with {user} in it, as the default has)"
        )
    if info.st_mode & 0o022:
        raise PermissionError(
            f"other users may write {folder} (mode {stat.S_IMODE(info.st_mode):o}) and so plant a step "
            "in it; `chmod go-w` it or set local_dir to a folder only you can write"
        )


def check_own_folders(folder: Path) -> None:
    """A root's tier folder and its node's folder (its parent), checked by :func:`_check_own`
    before anything in them is read, written or removed (PermissionError)."""
    _check_own(folder.parent, shared_parent=True)
    _check_own(folder)


def _needed(manifest: Manifest, manifest_bytes: bytes) -> dict[str, int]:
    out = {name: entry.size for name, entry in manifest.files.items()}
    out.update({e.index.file: e.index.size for e in manifest.files.values() if e.index is not None})
    out[manifest.state_file] = manifest.state_size
    out[MANIFEST_NAME] = len(manifest_bytes)
    return out


def _written_by(manifest: Manifest, rank: int) -> list[str]:
    """The files rank ``rank`` wrote (its shard and its index)."""
    out = []
    for name, entry in sorted(manifest.files.items()):
        if entry.rank == rank:
            out.append(name)
            if entry.index is not None:
                out.append(entry.index.file)
    return out


class LocalTier:
    """The local tier of one :class:`~shardsafe.CheckpointManager` (see the module docstring).

    ``comm``: the tier's own gloo communicator (a side group: its collectives and file transfers
    never queue behind the training's). Collective methods: :meth:`save`, :meth:`restore`."""

    def __init__(
        self,
        root: str,
        comm: Comm,
        every: int,
        local_dir: str | os.PathLike[str] = DEFAULT_LOCAL_DIR,
        replicas: int = 0,
        fsync: bool = True,
    ) -> None:
        self.comm = comm
        self.every = every
        self.replicas = replicas
        self.fsync = fsync
        self.nodes: NodeMap = gather_nodes(comm)
        self.folder = node_dir(local_dir, self.nodes.node) / tier_folder_name(root)
        self.errors: list[str] = []  # local saves that failed or were skipped (logged, never raised)
        self.saved: int | None = None  # the newest step this run saved into the tier everywhere
        self.received: dict[str, int] = {}  # bytes sent to each node by the last restore's gathering
        if replicas and len(self.nodes.nodes) <= replicas and comm.is_coordinator:
            log.warning(
                "shardsafe: local tier: replicas=%d needs more than %d node(s); each node keeps only its own files",
                replicas,
                len(self.nodes.nodes),
            )

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def step_folder(self, step: int) -> Path:
        return self.folder / step_name(step)

    def _own_folders(self, create: bool) -> bool:
        """Leader: this node's folder and the root's folder in it, made if missing (``create``; only this
        user may enter them) and checked (:func:`_check_own`; PermissionError). False when the root's
        folder does not exist (and was not to be made)."""
        node_folder = self.folder.parent
        if create:
            node_folder.parent.mkdir(parents=True, exist_ok=True)
            for folder in (node_folder, self.folder):
                try:
                    folder.mkdir(mode=0o700)
                except FileExistsError:
                    pass
        elif not self.folder.exists():
            return False
        check_own_folders(self.folder)
        return True

    # ------------------------------------------------------------------ save

    def save(
        self, step: int, view: SaveView, metadata: dict[str, Any], written: Callable[[], None] | None = None
    ) -> bool:
        """Collective: the described (and, from the manager, staged) ``view`` as ``step`` in every
        node's folder (and its replicas); the manager's tier thread runs it, every collective on the
        tier's own group. ``written`` is called once every node's folder is committed, before the
        replicas are sent: from then on ``view``'s tensors are no longer read. Returns True when the
        step is complete in the tier. A failure to write (or too little space) is logged and kept in
        :attr:`errors`, not raised."""
        if not self._room_for(step, view):
            return False
        try:
            target = self._prepare(step)
            try:
                write_checkpoint(
                    self.step_folder(step),
                    view,
                    self.comm,
                    overwrite=True,
                    metadata=metadata,
                    fsync=self.fsync,
                    target=target,
                )
                manifest_bytes = self._publish_copies(target)
            except BaseException:
                target.abort()
                raise
            if written is not None:
                written()
            if self.replicas:
                self._replicate(step, manifest_bytes)
            self._prune(keep=step)
        except ShardsafeError as exc:  # every rank raised the same error (each step is agreed)
            self._failed(f"step {step}: local save failed: {exc}")
            return False
        self.saved = step
        return True

    def _failed(self, message: str) -> None:
        self.errors.append(message)
        if self.comm.is_coordinator:
            log.warning("shardsafe: local tier %s: %s (the persistent root is unaffected)", self.folder, message)

    def _room_for(self, step: int, view: SaveView) -> bool:
        """Collective: whether every node's folder has room for its ranks' files (and the replicas it keeps)."""
        # an upper bound of this rank's file
        need = sum(c.tensor.numel() * c.tensor.element_size() for c in view.chunks)
        free = None
        if self.nodes.is_leader:
            try:
                free = self._free_bytes()
            except OSError as exc:  # cannot tell: treated as no room (every rank must still reach the gather)
                log.warning("shardsafe: local tier %s: free space unknown: %s", self.folder, exc)
                free = 0
        reports = self.comm.all_gather((need, free))
        short = []
        for node, ranks in self.nodes.ranks_of.items():
            share = sum(reports[r][0] for r in ranks)
            held = share + sum(self._peer_share(node, reports)) + MARGIN_BYTES
            free_there = reports[ranks[0]][1]
            if free_there is not None and free_there < held:
                short.append(f"node {node}: {free_there} bytes free, {held} needed")
        if short:
            self._failed(f"step {step}: local save skipped, too little space: " + "; ".join(short))
            return False
        return True

    def _peer_share(self, node: str, reports: list[tuple[int, int | None]]) -> Iterable[int]:
        """The bytes of the nodes whose replicas ``node`` keeps."""
        for peer in self._replica_sources(node):
            yield sum(reports[r][0] for r in self.nodes.ranks_of[peer])

    def _replica_sources(self, node: str) -> list[str]:
        """The nodes whose files ``node`` keeps a copy of (the ``replicas`` nodes before it in the ring)."""
        order = list(self.nodes.nodes)
        i, n = order.index(node), len(order)
        return [order[(i - j) % n] for j in range(1, min(self.replicas, n - 1) + 1)]

    def _replica_targets(self, node: str) -> list[str]:
        order = list(self.nodes.nodes)
        i, n = order.index(node), len(order)
        return [order[(i + j) % n] for j in range(1, min(self.replicas, n - 1) + 1)]

    def _free_bytes(self) -> int:
        """Leader: the room for a save in this node's folder: its file system's free bytes and the spare's."""
        probe = self.folder
        while not probe.exists() and probe != probe.parent:
            probe = probe.parent
        folder = self._spare_folder()
        spare = sum(f.lstat().st_size for f in folder.iterdir() if f.is_file() and not f.is_symlink()) if folder else 0
        return shutil.disk_usage(probe).free + spare

    @property
    def _spare(self) -> Path:
        return self.folder / SPARE_NAME

    def _spare_folder(self) -> Path | None:
        """The spare, if it is a folder (never through a symlink put in its place: its files are moved and
        written over)."""
        try:
            return self._spare if stat.S_ISDIR(os.lstat(self._spare).st_mode) else None
        except OSError:
            return None

    def _prepare(self, step: int) -> NodeCommit:
        """Collective: each leader creates its node's hidden step folder; every rank gets a handle on its node's."""
        final = self.step_folder(step)
        temp: TemporaryPath | None = None
        problem: BaseException | None = None
        if self.nodes.is_leader:
            try:
                self._own_folders(create=True)
                self._remove_leftovers()
                temp = TemporaryPath.create(final, fsync=self.fsync)
            except Exception as exc:  # shared below
                problem = exc
        try:
            names = _gather_or_raise(
                self.comm,
                str(temp.path) if temp is not None else None,
                problem,
                "local tier: cannot create the step folder",
            )
        except SaveError:
            if temp is not None:
                temp.remove()
            raise
        mine = names[self.nodes.leader()]
        return NodeCommit(
            temp if temp is not None else TemporaryPath.attach(Path(mine), final, owner=False, fsync=self.fsync),
            self._spare_folder(),
        )

    def _remove_leftovers(self) -> None:
        """Leader, before a save: hidden folders an interrupted save or restore of this tier left."""
        if self.folder.is_dir():
            for entry in self.folder.iterdir():
                if is_hidden_temp(entry.name):
                    remove_tree(entry)

    def _publish_copies(self, target: NodeCommit) -> bytes:
        """Collective, after the coordinator's commit: the other leaders write and publish their copies.
        Returns the manifest's bytes (every rank)."""
        shared = self.comm.broadcast(target.shared)
        assert shared is not None  # the coordinator committed, so it holds the shared files' bytes
        problem = None
        if self.nodes.is_leader and not self.comm.is_coordinator:
            try:
                crash_point("tier:before-copy", self.comm.rank)
                target.commit_copy(*shared)
            except Exception as exc:
                problem = exc
        _raise_if_any(self.comm, problem, "local tier: a node could not commit its copy")
        return bytes(shared[2])

    def _replicate(self, step: int, manifest_bytes: bytes) -> None:
        """Collective: each rank's files to the next ``replicas`` nodes (the i-th rank's to their i-th ranks:
        :meth:`_partner`)."""
        manifest = parse_manifest(manifest_bytes, "the local step's manifest")
        sizes = _needed(manifest, manifest_bytes)
        moves = []
        for node, ranks in self.nodes.ranks_of.items():
            for peer in self._replica_targets(node):
                for i, r in enumerate(ranks):
                    to = self._partner(peer, i)
                    moves += [Move(name, sizes[name], r, to) for name in _written_by(manifest, r)]
        folder = self.step_folder(step)
        problem = self._transfer(moves, lambda name: folder / name, lambda name: folder / name)
        _raise_if_any(self.comm, problem, f"local tier: replicas of step {step}")

    def _prune(self, keep: int) -> None:
        """Collective: every leader removes its other steps (``keep`` is complete everywhere now); the
        newest of them becomes the spare, what the last save left of the one before is removed."""
        problem = None
        if self.nodes.is_leader:
            try:
                older = [step for step in self._steps() if step != keep]
                if older and self._spare_folder() is not None:
                    remove_tree(self._spare)
                elif older and os.path.lexists(self._spare):
                    self._spare.unlink()  # not ours: nothing is written through it
                for step in older[:-1]:
                    retire_folder(self.step_folder(step), self.fsync)
                if older:
                    os.rename(self.step_folder(older[-1]), self._spare)
            except Exception as exc:
                problem = exc
        _raise_if_any(self.comm, problem, "local tier: removing older steps")

    def _steps(self) -> list[int]:
        """Steps with a folder in this node's tier folder (committed or not), ascending."""
        if not self.folder.is_dir():
            return []
        return sorted(s for s in (STEP_NAMING.parse(p.name) for p in self.folder.iterdir()) if s is not None)

    # ------------------------------------------------------------------ transfer

    def _partner(self, node: str, index: int) -> int:
        """The rank of ``node`` that sends or receives a node's ``index``-th file: its ranks in turn.

        Any rank of a node reads and writes that node's folder, so the files between two nodes go
        as parallel streams, one per pair of ranks (the i-th rank of one node with the i-th of the
        other), instead of one stream between the leaders that every other transfer waits behind."""
        ranks = self.nodes.ranks_of[node]
        return ranks[index % len(ranks)]

    def _transfer(
        self, moves: list[Move], source: Callable[[str], Path], dest: Callable[[str], Path]
    ) -> BaseException | None:
        """Every rank, in the same order: send the moves it is the source of, receive those it is the
        destination of (blocking point-to-point; in one global order no pair waits on a third).
        A received file lands under a hidden name and is renamed into place only when whole and
        its sender read it without error; a sender that fails still sends its bytes' worth (and
        the flag), so no receiver waits forever. Returns this rank's first problem."""
        problem: BaseException | None = None
        for move in moves:
            if move.src == move.dst:
                continue
            if self.comm.rank == move.src:
                problem = self._send(move, source(move.name)) or problem
            elif self.comm.rank == move.dst:
                problem = self._receive(move, dest(move.name)) or problem
        return problem

    def _send(self, move: Move, path: Path) -> BaseException | None:
        """Source of ``move``: its byte ranges straight from the file's pages (mapped), then the flag."""
        problem: BaseException | None = None
        source: MappedFile | None = None
        try:
            source = MappedFile.for_reading(path, move.size)
        except Exception as exc:
            problem = exc
        try:
            # a file that cannot be read sends zeros (and the flag says so), never stale bytes
            for piece in _messages(source, move.size):
                dist.send(piece, group=self.comm.group, group_dst=move.dst)
            flag = torch.tensor([0 if problem is None else 1], dtype=torch.uint8)
            dist.send(flag, group=self.comm.group, group_dst=move.dst)
        finally:
            if source is not None:
                source.close()
        return problem

    def _receive(self, move: Move, path: Path) -> BaseException | None:
        """Destination of ``move``: its bytes straight into a new file's pages (mapped, reserved
        first) under a hidden name, renamed into place when whole and its sender read it without
        error."""
        problem: BaseException | None = None
        tmp = hidden_sibling(path)
        target: MappedFile | None = None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            # received over its namesake in the spare (a replica the step before sent here)
            folder = self._spare_folder()
            spare = folder / move.name if folder is not None else None
            target = MappedFile.for_writing(tmp, move.size, ((0, move.size),), recycled=spare)
        except Exception as exc:
            problem = exc
        try:
            for piece in _messages(target, move.size):
                dist.recv(piece, group=self.comm.group, group_src=move.src)
            flag = torch.zeros(1, dtype=torch.uint8)
            dist.recv(flag, group=self.comm.group, group_src=move.src)
            if flag.item() and problem is None:
                problem = SaveError(f"rank {move.src} could not read {move.name} to send it")
            if target is not None:
                if problem is None and self.fsync:
                    target.sync()
                target.close()
                target = None
            if problem is None:
                os.replace(tmp, path)
                if self.fsync:
                    fsync_dir(path.parent)
        except Exception as exc:
            problem = problem or exc
        finally:
            if target is not None:
                target.close()
            if problem is not None:
                tmp.unlink(missing_ok=True)
        return problem

    # ------------------------------------------------------------------ restore

    def _held(self) -> dict[int, Held]:
        """Leader: what this node's folder holds of each committed step (PermissionError: the folder is
        not this user's alone, see :func:`_check_own`)."""
        out: dict[int, Held] = {}
        if not self._own_folders(create=False):
            return out
        for step in self._steps():
            folder = self.step_folder(step)
            try:
                data = read_small_file(folder / MANIFEST_NAME, MAX_JSON_BYTES)
                manifest = parse_manifest(data, str(folder / MANIFEST_NAME))
            except FileNotFoundError:  # not committed here (or its removal was cut short)
                continue
            except (OSError, ShardsafeError) as exc:  # a damaged manifest: said, so the fallback has a reason
                log.warning("shardsafe: local tier: step %d of this node is passed over: %s", step, exc)
                continue
            needed = _needed(manifest, data)
            present = frozenset(name for name, size in needed.items() if _size_of(folder / name) == size)
            out[step] = Held(hash_bytes(data), needed, present, frozenset(manifest.files))
        return out

    def _choose(
        self, reports: list[tuple[dict[int, Held], int] | None], newer_than: int | None
    ) -> tuple[int | None, str, list[str]]:
        """The newest step newer than ``newer_than`` whose files the nodes hold between them (every
        rank decides alike from the leaders' reports): (step or None, its manifest digest, why
        newer steps were passed over)."""
        held = {self.nodes.node_of[r]: rep[0] for r, rep in enumerate(reports) if rep is not None}
        steps = sorted({s for h in held.values() for s in h if newer_than is None or s > newer_than}, reverse=True)
        passed: list[str] = []
        for step in steps:
            for digest in sorted({h[step].digest for h in held.values() if step in h}):
                copies = [h[step] for h in held.values() if step in h and h[step].digest == digest]
                have = frozenset().union(*(c.present for c in copies))
                missing = sorted(set(copies[0].needed) - have)
                if not missing:
                    return step, digest, passed
                more = " ..." if len(missing) > 3 else ""
                passed.append(
                    f"step {step}: no node holds {', '.join(missing[:3])}{more} as its manifest records it "
                    "(missing, or of another size)"
                )
        return None, "", passed

    def restore(self, newer_than: int | None, load: LoadLacking) -> int | None:
        """Collective: load the newest complete step of the tier newer than ``newer_than`` (the
        root's newest committed step) with ``load(folder, lacking)`` (this rank's node's folder of
        it, and the shard files that folder lacks, which the load receives from ranks holding them:
        :func:`~shardsafe.api.load.load_lacking`). None, with the reason logged, when there is none
        or it does not load: the caller then restores from the root. What ``load`` raises for a
        state that does not fit the step (not the tier's fault) is raised."""
        report = None
        if self.nodes.is_leader:
            try:
                report = (self._held(), self._free_bytes())
            # this node's folder cannot be read: it holds nothing (every rank must reach the gather)
            except OSError as exc:
                log.warning("shardsafe: local tier %s cannot be read: %s", self.folder, exc)
                report = ({}, 0)
        reports = self.comm.all_gather(report)
        step, digest, passed = self._choose(reports, newer_than)
        root = "the root's newest (none)" if newer_than is None else f"the root's newest (step {newer_than})"
        if passed and self.comm.is_coordinator:
            log.warning("shardsafe: local tier: passed over %s", "; ".join(passed))
        if step is None:
            if self.comm.is_coordinator:
                log.info("shardsafe: local tier holds no complete step newer than %s; restoring from the root", root)
            return None
        try:
            lacking = self._complete(step, digest, reports)
        except SaveError as exc:
            if self.comm.is_coordinator:
                log.warning(
                    "shardsafe: local tier: step %d could not be gathered onto every node (%s); restoring from the "
                    "root",
                    step,
                    exc,
                )
            return None
        try:
            received = load(self.step_folder(step), lacking)
        except _DAMAGE as exc:
            if self.comm.is_coordinator:
                log.warning("shardsafe: local tier: step %d does not load (%s); restoring from the root", step, exc)
            return None
        for rank, count in enumerate(self.comm.all_gather(received)):
            self.received[self.nodes.node_of[rank]] += count
        if self.comm.is_coordinator:
            log.info(
                "shardsafe: restored step %d from the local tier (newer than %s); sent to each node: %s",
                step,
                root,
                ", ".join(f"{n}: {b} bytes" for n, b in self.received.items()),
            )
        return step

    def _complete(self, step: int, digest: str, reports: list[tuple[dict[int, Held], int] | None]) -> frozenset[str]:
        """Collective: every node's folder gets the small files every load of ``step`` reads (the
        state file, the indexes, the manifest last), from a node holding them; returns the shard
        files this rank's node's folder lacks (its ranks' load receives what it reads of them from
        ranks holding them). A node that held no copy of this save gets a new folder, published
        when they are in; it then holds a part of the step, which :meth:`_held` reports file by
        file, never as the whole step."""
        held: dict[str, Held | None] = {}
        free: dict[str, int] = {}
        for r, rep in enumerate(reports):
            if rep is not None:
                h = rep[0].get(step)
                held[self.nodes.node_of[r]] = h if h is not None and h.digest == digest else None
                free[self.nodes.node_of[r]] = rep[1]
        first = next(h for h in held.values() if h is not None)
        needed, shards = first.needed, first.shards
        mine = held[self.nodes.node]
        lacking = shards - mine.present if mine is not None else shards
        self.received = dict.fromkeys(self.nodes.nodes, 0)
        # the manifest last: it commits a new folder
        small = sorted((n for n in needed if n not in shards), key=lambda name: (name == MANIFEST_NAME, name))
        moves = self._moves(step, small, held, free, needed)
        if not moves:
            return lacking  # every node holds the small files (its own and replicas): nothing to send
        temp: TemporaryPath | None = None
        problem: BaseException | None = None
        if self.nodes.is_leader and mine is None and any(self.nodes.node_of[m.dst] == self.nodes.node for m in moves):
            try:  # no copy of this save here (none, or another save of the step): a new folder, published whole
                self._own_folders(create=True)
                temp = TemporaryPath.create(self.step_folder(step), fsync=self.fsync)
            except Exception as exc:
                problem = exc
        try:
            paths = _gather_or_raise(
                self.comm, str(temp.path) if temp is not None else None, problem, f"local tier: preparing step {step}"
            )
            here = self.step_folder(step)
            leader_temp = paths[self.nodes.leader()]
            into = Path(leader_temp) if leader_temp is not None else here
            problem = self._transfer(moves, lambda name: here / name, lambda name: into / name)
            # every rank's receives are done (any rank of a node writes into its leader's folder) before it is published
            _raise_if_any(self.comm, problem, f"local tier: gathering step {step}")
            self.received = _bytes_to(self.nodes, moves)
            if temp is not None:
                try:
                    temp.publish()
                except Exception as exc:
                    problem = exc
            _raise_if_any(self.comm, problem, f"local tier: publishing step {step}")
        finally:
            if temp is not None:
                temp.remove()
        return lacking

    def _moves(
        self, step: int, names: list[str], held: dict[str, Held | None], free: dict[str, int], needed: dict[str, int]
    ) -> list[Move]:
        """The moves that give each node the files of ``names`` it lacks, each from a node holding
        it (spread over the holders), in one global order; SaveError (on every rank alike) when a
        node's folder has too little room for them (``free``: measured at the leaders' reports)."""
        moves: list[Move] = []
        short = []
        for i, node in enumerate(self.nodes.nodes):
            h = held[node]
            lacking = [name for name in names if h is None or name not in h.present]
            here: list[Move] = []
            for j, name in enumerate(lacking):
                holders = [n for n, hn in held.items() if hn is not None and name in hn.present]
                source = holders[(i + j) % len(holders)]
                here.append(Move(name, needed[name], self._partner(source, j), self._partner(node, j)))
            if here and sum(m.size for m in here) + MARGIN_BYTES > free[node]:
                short.append(f"node {node}: {free[node]} bytes free")
            moves += here
        if short:
            raise SaveError(f"step {step}: too little space: " + "; ".join(short))
        return moves

    # ------------------------------------------------------------------ close

    def close(self, root_newest: int | None) -> None:
        """Leaders: remove this node's tier folder (warning when it held a step newer than the root's newest)."""
        if not self.nodes.is_leader:
            return
        try:
            if not self._own_folders(create=False):
                return
        except OSError as exc:  # not this user's alone: nothing in it is removed (it may lead anywhere)
            log.warning("shardsafe: closing: local tier %s left as it is: %s", self.folder, exc)
            return
        newer = [s for s in self._steps() if root_newest is None or s > root_newest]
        if newer and self.comm.is_coordinator:
            log.warning(
                "shardsafe: closing: local step %d is discarded; the persistent root's newest is %s (save(..., "
                "force=True) before closing keeps it)",
                newer[-1],
                root_newest,
            )
        remove_tree(self.folder)
        try:
            self.folder.parent.rmdir()  # the node's folder, when no other root's tier is in it
        except OSError:
            pass


def _bytes_to(nodes: NodeMap, moves: list[Move]) -> dict[str, int]:
    """The bytes ``moves`` send to each node."""
    out = dict.fromkeys(nodes.nodes, 0)
    for m in moves:
        out[nodes.node_of[m.dst]] += m.size
    return out


def _messages(mapped: MappedFile | None, size: int) -> Iterator[torch.Tensor]:
    """The point-to-point messages of a file of ``size`` bytes, in order, at most
    :data:`PIECE_BYTES` each: views of the ``mapped`` file (its pages mapped in just before each is
    sent or received), or, where the file could not be opened, the front of one zeroed scratch
    buffer (sent as it is, or received and dropped: every message is still exchanged, so the peer
    never waits forever)."""
    scratch = torch.zeros(min(PIECE_BYTES, size) if mapped is None else 0, dtype=torch.uint8)
    for offset in range(0, size, PIECE_BYTES):
        stop = min(size, offset + PIECE_BYTES)
        if mapped is None:
            yield scratch[: stop - offset]
        else:
            mapped.populate(offset, stop)
            yield mapped.bytes[offset:stop]


def _size_of(path: Path) -> int | None:
    try:
        return os.stat(path).st_size
    except OSError:
        return None
