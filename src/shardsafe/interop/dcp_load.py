"""``shardsafe.load(dcp_folder, state)``: a DCP checkpoint loaded in place (resharded, any world size), with no copy on
disk.

Registered with :mod:`shardsafe.api.foreign` when the package is imported. The folder's checked
``.metadata`` (:mod:`~shardsafe.interop.dcp_metadata`) is described as a shardsafe manifest and
state tree, the same ones ``shardsafe convert`` would write (:func:`~shardsafe.interop.dcp_convert.dcp_state_tree`),
and :func:`shardsafe.api.load.load_from` runs every phase of an ordinary load over them, so the
checks, the agreement of the ranks, the atomicity and the resharding are the ones of any shardsafe
load. Only the bytes come from elsewhere: :class:`~shardsafe.interop.dcp_reader.DcpChunkReader`
reads each ``.distcp`` item in place.

A DCP tensor item is a ``torch.save`` archive of one contiguous chunk; its tensor's bytes are one
stored zip record. A rank that owns part of a chunk reads the item's zip directory and pickle
(small, restricted: :func:`~shardsafe.interop.unpickler.locate_tensor`), which must describe a
tensor of the metadata's dtype and sizes inside its record, and then ``preadv``s exactly the byte
ranges it owns straight into its tensors. With ``verify``, every record it reads from is also
checked whole against the CRC-32 the archive records (DCP writes no other hash), in the check pass
of an atomic load, so a damaged item is found before anything is written.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shardsafe.api.foreign import ForeignFormat, register_format
from shardsafe.api.load import load_from
from shardsafe.core.format import Manifest
from shardsafe.core.values import check_state_tree
from shardsafe.interop.dcp_convert import dcp_state_tree
from shardsafe.interop.dcp_metadata import METADATA_NAME, is_dcp_folder
from shardsafe.interop.dcp_reader import DcpCheckpoint, DcpChunkReader, dcp_manifest

__all__: list[str] = []


def load_dcp(
    folder: Path,
    state: dict[str, Any],
    *,
    process_group: Any = None,
    strict: bool = True,
    verify: bool = True,
    atomic: bool = True,
) -> dict[str, Any]:
    """Load the DCP folder into ``state`` like :func:`shardsafe.load` (collective), reading its items in place."""

    def opened() -> tuple[Manifest, dict[str, Any]]:
        with DcpCheckpoint(folder, key="") as ckpt:
            keys, tree = dcp_state_tree(ckpt)
            manifest = dcp_manifest(ckpt.meta, keys)
        check_state_tree(tree, f"{folder / METADATA_NAME}", manifest)
        return manifest, tree

    return load_from(
        state,
        opened,
        lambda manifest: DcpChunkReader(Path(folder), manifest, verify),
        process_group,
        strict,
        verify,
        atomic,
    ).metadata


register_format(
    ForeignFormat(
        "torch.distributed.checkpoint (DCP)",
        is_dcp_folder,
        "DCP records no hashes to verify: `shardsafe inspect` checks its metadata, `shardsafe convert SRC OUT` reads "
        "every item",
        load_dcp,
    )
)
