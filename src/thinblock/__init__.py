"""thinblock: thin-provisioned block storage in user space that treats zeros as free."""

from thinblock.errors import (
    CorruptionError,
    NoSpaceError,
    NotSupportedError,
    OpError,
    RangeError,
    ReadOnlyError,
    ThinblockError,
)
from thinblock.mapping import BlockState
from thinblock.pool import Pool
from thinblock.volume import Volume

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
