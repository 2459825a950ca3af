"""Pool-wide figures kept as volumes change, so `pool status` never visits volumes.

The pool adds a volume's row here when it appears and takes it out when it goes
(Pool.tallied brackets every change of a row's size, kind, name or counters as
a whole); the I/O path moves the block counters by the same deltas it applies
to the row (Volume._count_states). Staging volumes (snapshot.stage) stay out
until they are published under a real name, as they stay out of listings.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from thinblock.meta.base import VolumeRow


@dataclass
class Totals:
    """Sums over the visible volumes and snapshots."""

    volumes: int = 0
    snapshots: int = 0
    virtual_bytes: int = 0  # the sizes of the volumes (snapshots are not writable space)
    data_blocks: int = 0
    zeroed_blocks: int = 0
    pinned_blocks: int = 0

    def add(self, row: VolumeRow, sign: int) -> None:
        """Count row in (sign 1) or out (sign -1)."""
        if row.kind == "snapshot":
            self.snapshots += sign
        else:
            self.volumes += sign
            self.virtual_bytes += sign * row.size_bytes
        self.data_blocks += sign * row.data_blocks
        self.zeroed_blocks += sign * row.zeroed_blocks
        self.pinned_blocks += sign * row.pinned_blocks

    @classmethod
    def of(cls, rows: Iterable[VolumeRow]) -> Totals:
        """The totals recomputed from rows (tests and checks compare the kept ones with this)."""
        totals = cls()
        for row in rows:
            totals.add(row, 1)
        return totals

    def figures(self, block_size: int) -> dict[str, Any]:
        """What pool status shows of them, in bytes."""
        return {
            "volume_count": self.volumes,
            "snapshot_count": self.snapshots,
            "virtual_bytes": self.virtual_bytes,
            # Blocks shared by several volumes count once for each of them, like thin_ls.
            "mapped_bytes": (self.data_blocks + self.zeroed_blocks) * block_size,
            "data_bytes": self.data_blocks * block_size,
            "zeroed_bytes": self.zeroed_blocks * block_size,
            "provisioned_bytes": self.pinned_blocks * block_size,
        }
