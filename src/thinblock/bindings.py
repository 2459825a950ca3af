"""The Python bindings that come only from Debian, loaded in one place.

libnbd's binding (`nbd`, package python3-libnbd) and librados' (`rados`, package
python3-rados) are not on PyPI: they are built with the C libraries and installed
into Debian's /usr/lib/python3/dist-packages. A thinblock installed with pip into
a virtualenv that does not see the system's packages has neither, and a feature
that needs one must say which package to install, in one sentence, instead of a
ModuleNotFoundError traceback. Every module that uses a binding asks for it here.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from thinblock.errors import ThinblockError

# module -> (the C library whose binding it is, the Debian package that brings it)
DEBIAN_BINDINGS: dict[str, tuple[str, str]] = {
    "nbd": ("libnbd", "python3-libnbd"),
    "rados": ("librados", "python3-rados"),
}

# What each feature is called in the sentence (plural: "... need ...").
NBD_URIS = "NBD sources and targets"
QCOW2_IMPORT = "qcow2 imports"
RADOS_POOLS = "rados: pools"


class MissingBinding(ThinblockError):
    """A Debian-only binding is not importable: the sentence says what to install (exit 1)."""


def require(module: str, *, feature: str) -> ModuleType:
    """The binding `module` (one of DEBIAN_BINDINGS), or MissingBinding naming the
    feature that needs it and the package to install."""
    library, package = DEBIAN_BINDINGS[module]
    try:
        return importlib.import_module(module)
    except ImportError:
        raise MissingBinding(
            f"{feature} need {library}'s Python binding: apt-get install {package}"
            " (and use a virtualenv made with --system-site-packages)"
        ) from None
