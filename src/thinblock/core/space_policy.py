"""What the pool does as it runs out of space: the out-of-space policy.

* when_full: `error` fails a request that needs space at once (ENOSPC);
  `wait:SECONDS` holds it until the pool grows or space is freed, or the time
  runs out (dm-thin's error_if_no_space / no_space_timeout).
* low-water marks, for the pool (unreserved free space) and per volume (its
  unmapped share): crossing one logs a warning and runs a command with the
  figures in its environment, once; the mark re-arms when space is back above
  it (qemu's write threshold fires only once).
* autogrow STEP:MAX: grow the data store by STEP when the pool's mark is
  crossed, or when a request would otherwise fail, up to MAX (LVM's
  thin_pool_autoextend).

Settings live in the superblock; the pool calls `check()` after allocating and
after each commit, with its lock held.
"""

from __future__ import annotations

import logging
import os
import subprocess
import threading
import time
from typing import TYPE_CHECKING, Any

from thinblock.errors import ThinblockError
from thinblock.sizes import format_size, parse_size

if TYPE_CHECKING:
    from thinblock.core.pool import Pool
    from thinblock.core.volume import Volume

log = logging.getLogger("thinblock.space")
POOL_KEY = ""
HOST_KEY = "\0host"  # not a volume name


def parse_when_full(text: str) -> float | None:
    """`error` -> None; `wait:SECONDS` -> seconds."""
    if text == "error":
        return None
    kind, _, seconds = text.partition(":")
    try:
        value = float(seconds)
    except ValueError:
        value = -1.0
    if kind != "wait" or not value > 0:
        raise ThinblockError(f"invalid --when-full {text!r}: use error or wait:SECONDS (e.g. wait:60)")
    return value


def parse_autogrow(text: str) -> tuple[int, int]:
    """`STEP:MAX` with sizes such as 1G:64G."""
    step, sep, maximum = text.partition(":")
    if not sep:
        raise ThinblockError(f"invalid --autogrow {text!r}: use STEP:MAX, e.g. 1G:64G")
    return parse_size(step), parse_size(maximum)


def check_autogrow(step_bytes: int, block_size: int) -> None:
    if step_bytes % block_size or step_bytes <= 0:
        raise ThinblockError(f"autogrow step must be a positive multiple of the block size ({format_size(block_size)})")


def parse_percent(text: str) -> float:
    try:
        value = float(text.rstrip("%"))
    except ValueError:
        value = -1.0
    if not 0 < value < 100:
        raise ThinblockError(f"invalid low-water mark {text!r}: a percentage between 0 and 100")
    return value


def parse_low_water(value: object) -> float | None:
    """A low-water setting: none/off (or None), else a percentage."""
    return None if value in (None, "none", "off") else parse_percent(str(value))


class SpacePolicy:
    def __init__(self, pool: Pool, superblock: dict[str, Any]) -> None:
        self.pool = pool
        self.when_full = "error"
        self.low_water: float | None = None
        self.on_low_water: str | None = None
        self.autogrow: tuple[int, int] | None = None
        self._fired: set[str] = set()  # marks crossed and not yet re-armed (POOL_KEY or a volume name)
        self.follow(superblock)
        self._checking = False
        self.fired_count = 0

    # ----- settings ---------------------------------------------------------------

    def follow(self, superblock: dict[str, Any]) -> None:
        """The settings as stored (at open; and, for an owner per volume, whenever a
        pool-level step may have changed them: core/pool_settings.py). A pool mark
        whose settings changed is armed again."""
        autogrow = superblock.get("autogrow")
        stored = (
            str(superblock.get("when_full") or "error"),
            superblock.get("low_water"),
            superblock.get("on_low_water"),
            (int(autogrow[0]), int(autogrow[1])) if autogrow else None,
        )
        if stored != (self.when_full, self.low_water, self.on_low_water, self.autogrow):
            self.when_full, self.low_water, self.on_low_water, self.autogrow = stored
            self._fired.discard(POOL_KEY)

    def settings(self) -> dict[str, Any]:
        return {
            "when_full": self.when_full,
            "low_water_percent": self.low_water,
            "on_low_water": self.on_low_water,
            "autogrow": None
            if self.autogrow is None
            else {"step_bytes": self.autogrow[0], "max_bytes": self.autogrow[1]},
        }

    def to_superblock(self) -> dict[str, object]:
        return {
            "when_full": self.when_full,
            "low_water": self.low_water,
            "on_low_water": self.on_low_water,
            "autogrow": list(self.autogrow) if self.autogrow else None,
        }

    def update(self, changes: dict[str, Any]) -> None:
        """Apply validated settings (keys as in to_superblock; autogrow as text or None)."""
        if "when_full" in changes:
            parse_when_full(changes["when_full"])
        autogrow = self.autogrow
        if "autogrow" in changes:
            text = changes["autogrow"]
            autogrow = None if text in (None, "none", "off") else parse_autogrow(text)
            if autogrow is not None:
                check_autogrow(autogrow[0], self.pool.block_size)
                size = self.pool.space_figures()["size_bytes"]
                if autogrow[1] <= size:
                    raise ThinblockError(
                        f"autogrow up to {format_size(autogrow[1])} would never grow pool {self.pool.path}, which is"
                        f" {format_size(size)} already: give a larger MAX (or none)"
                    )
        low_water = parse_low_water(changes["low_water"]) if "low_water" in changes else self.low_water
        # Validated everything: now apply.
        self.when_full = changes.get("when_full", self.when_full)
        self.autogrow = autogrow
        self.low_water = low_water
        if "on_low_water" in changes:
            self.on_low_water = changes["on_low_water"] or None
        self._fired.discard(POOL_KEY)

    def full_deadline(self) -> float | None:
        """When a request held by the wait policy gives up (None: the error policy)."""
        seconds = parse_when_full(self.when_full)
        return None if seconds is None else time.monotonic() + seconds

    # ----- low water and autogrow -------------------------------------------------

    def rearm(self, vol: Volume) -> None:
        self._fired.discard(vol.name)

    def check(self, vol: Volume | None = None) -> None:
        """Fire marks that were crossed, re-arm those that are clear again (pool lock held)."""
        if self._checking:
            return
        self._checking = True
        try:
            if self.low_water is not None:
                figures = self.pool.space_figures()
                percent = 100.0 * figures["available_bytes"] / figures["size_bytes"]
                self._crossing(POOL_KEY, percent, self.low_water, figures, self.on_low_water)
                self._check_host(figures)
            vols = [vol] if vol is not None else list(self.pool.volumes.values())
            for v in vols:
                row = v.row
                if row.low_water is None or v.removed:
                    continue
                mapped = (row.data_blocks + row.zeroed_blocks) * self.pool.block_size
                unmapped = max(0, row.size_bytes - mapped)
                vfig = {"size_bytes": row.size_bytes, "mapped_bytes": mapped, "unmapped_bytes": unmapped}
                percent = 100.0 * unmapped / row.size_bytes
                self._crossing(v.name, percent, row.low_water, vfig, row.on_low_water or self.on_low_water)
        finally:
            self._checking = False

    def _check_host(self, figures: dict[str, int]) -> None:
        """The pool's mark watches the host too: its free space, as a share of the pool's
        size, falling below the same percentage fires a `host-low-water` event (a sparse
        pool can run out of host disk long before it is full itself)."""
        host_free = self.pool.host.host_free_bytes()
        if host_free is None or self.low_water is None:
            return
        percent = 100.0 * host_free / figures["size_bytes"]
        self._crossing(HOST_KEY, percent, self.low_water, {**figures, "host_free_bytes": host_free}, self.on_low_water)

    def _crossing(self, key: str, percent: float, mark: float, figures: dict[str, int], command: str | None) -> None:
        if percent >= mark:
            self._fired.discard(key)
            return
        if key in self._fired:
            return
        self._fired.add(key)
        self.fired_count += 1
        what = {POOL_KEY: f"pool {self.pool.path}", HOST_KEY: f"the host filesystem under pool {self.pool.path}"}.get(
            key, f"volume {key}"
        )
        log.warning("%s is below its low-water mark: %.1f%% free, mark %.1f%%", what, percent, mark)
        if key == POOL_KEY and self.autogrow is not None:
            self.autogrow_for(1)
        if command:
            env = {f"THINBLOCK_{k.upper()}": str(v) for k, v in figures.items()}
            env.update(
                THINBLOCK_EVENT="host-low-water" if key == HOST_KEY else "low-water",
                THINBLOCK_POOL=os.path.abspath(self.pool.path),
                THINBLOCK_VOLUME="" if key == HOST_KEY else key,
                THINBLOCK_FREE_PERCENT=f"{percent:.2f}",
                THINBLOCK_LOW_WATER_PERCENT=f"{mark:g}",
            )
            threading.Thread(target=_run_hook, args=(command, {**os.environ, **env}), daemon=True).start()

    def autogrow_for(self, short_blocks: int) -> bool:
        """Grow by STEP (or enough STEPs for short_blocks) up to MAX; whether it grew."""
        if self.autogrow is None or short_blocks <= 0:
            return False
        pool = self.pool
        if pool.owner is not None:
            # An owner per volume grows in a pool-level step, which may not start under
            # the pool lock held here (core/pool_settings.py); a shortage is answered
            # by the grant step itself, so only a low-water crossing comes here.
            from thinblock.core.pool_settings import autogrow_soon  # it builds on this module

            autogrow_soon(pool, self.low_water if self.low_water is not None else 100.0)
            return False
        maximum = self.autogrow[1]
        new_size = autogrow_target(self.autogrow, pool.size_bytes, short_blocks, pool.block_size)
        if new_size <= pool.size_bytes:
            return False
        try:
            pool.grow(new_size, commit=False)
        except (OSError, ThinblockError) as exc:
            log.error("autogrow of pool %s to %s failed: %s", pool.path, format_size(new_size), exc)
            return False
        log.warning("pool %s autogrown to %s (max %s)", pool.path, format_size(new_size), format_size(maximum))
        return True


def autogrow_target(autogrow: tuple[int, int], size_bytes: int, short_blocks: int, block_size: int) -> int:
    """The size autogrow (STEP, MAX) grows a pool of size_bytes to when short_blocks are
    missing: enough STEPs for them, MAX (in whole blocks) at most. The one rule, for the
    whole pool's owner and for owners per volume (core/pool_settings.py)."""
    step, maximum = autogrow
    return min(maximum - maximum % block_size, size_bytes + -(-short_blocks * block_size // step) * step)


def _run_hook(command: str, env: dict[str, str]) -> None:
    try:
        done = subprocess.run(command, shell=True, env=env, check=False, timeout=600)
        if done.returncode:
            log.error("low-water command %r exited with status %d", command, done.returncode)
    except (OSError, subprocess.SubprocessError) as exc:
        log.error("low-water command %r failed: %s", command, exc)
