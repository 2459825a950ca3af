"""Writer process for the snapshot crash test: writes, snapshots, clones and
snapshot removals on a pool until killed.

The log (O_APPEND, survives SIGKILL) has one line per operation before it
starts (B ...) and after it returns (A); writes are deterministic from their
logged offset, length and value, so the test can rebuild every volume's bytes.
"""

from __future__ import annotations

import os
import random
import sys

from thinblock import NoSpaceError, Pool
from thinblock.core.snapshot import clone, create_snapshot


def main(pool_path: str, log_path: str, seed: int) -> None:
    rng = random.Random(seed)
    log = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def say(line: str) -> None:
        os.write(log, (line + "\n").encode())

    pool = Pool.open(pool_path)
    say("READY")
    n = 0
    while True:
        n += 1
        volumes = sorted(v.name for v in pool.volumes.values() if v.row.kind == "volume")
        snapshots = sorted(v.name for v in pool.volumes.values() if v.row.kind == "snapshot")
        r = rng.random()
        if r < 0.12:
            source = rng.choice(volumes)
            say(f"B snap {source} s{seed}-{n}")
            create_snapshot(pool, source, f"s{seed}-{n}")
        elif r < 0.16 and snapshots and len(volumes) < 4:
            source = rng.choice(snapshots)
            say(f"B clone {source} c{seed}-{n}")
            clone(pool, source, f"c{seed}-{n}")
        elif r < 0.3 and len(snapshots) > 3:
            victim = rng.choice(snapshots)
            say(f"B remove {victim}")
            pool.remove_volume(victim)
        else:
            name = rng.choice(volumes)
            vol = pool.volume(name)
            offset = rng.randrange(vol.size_bytes)
            length = rng.randint(1, min(vol.size_bytes - offset, 12000))
            value = rng.randrange(1, 256)
            say(f"B write {name} {offset} {length} {value}")
            try:
                vol.write(offset, bytes([value]) * length)
            except NoSpaceError:
                say("N")
                continue
        say("A")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
