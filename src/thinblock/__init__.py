"""thinblock: thin-provisioned block storage in user space that treats zeros as free."""

from thinblock.core.mapping import BlockState
from thinblock.core.pool import Pool
from thinblock.core.volume import Volume
from thinblock.errors import (
    CorruptionError,
    NoSpaceError,
    NotSupportedError,
    OpError,
    RangeError,
    ReadOnlyError,
    ThinblockError,
)

__all__ = [
    "BlockState",
    "CorruptionError",
    "NoSpaceError",
    "NotSupportedError",
    "OpError",
    "Pool",
    "RangeError",
    "ReadOnlyError",
    "ThinblockError",
    "Volume",
]

__version__ = "0.1.0"
