"""Writer process for the crash test: random operations on a pool until killed.

Every operation is logged before it starts (B) and after it returns (A, or N
for ENOSPC, which changes nothing); flushes are logged as FB/FA. The log is
written with os.write to an O_APPEND file, so it survives SIGKILL.
"""

from __future__ import annotations

import os
import random
import sys

from thinblock import NoSpaceError, Pool


def main(pool_path: str, log_path: str, seed: int, first_id: int) -> None:
    rng = random.Random(seed)
    log = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def say(line: str) -> None:
        os.write(log, (line + "\n").encode())

    pool = Pool.open(pool_path)
    names = sorted(pool.volumes)
    say("READY")
    op_id = first_id
    while True:
        op_id += 1
        r = rng.random()
        if r < 0.08:
            say("FB")
            pool.flush()
            say("FA")
            continue
        vi = rng.randrange(len(names))
        vol = pool.volume(names[vi])
        offset = rng.randrange(vol.size_bytes)
        length = rng.randint(1, min(vol.size_bytes - offset, 20000))
        if rng.random() < 0.5:
            offset, length = offset // 4096 * 4096, max(4096, length // 4096 * 4096)
            length = min(length, vol.size_bytes - offset)
        kind = "W" if r < 0.75 else ("T" if r < 0.85 else ("Z" if r < 0.93 else "P"))
        # Odd values belong to volume 0, even ones to volume 1: foreign data shows.
        value = (op_id % 120) * 2 + 1 + vi
        say(f"B {op_id} {names[vi]} {offset} {length} {kind} {value}")
        try:
            if kind == "W":
                vol.write(offset, bytes([value]) * length)
            elif kind == "T":
                vol.trim(offset, length)
            elif kind == "Z":
                vol.write_zeroes(offset, length, no_hole=rng.random() < 0.5)
            else:
                vol.provision(offset, length)
        except NoSpaceError:
            say(f"N {op_id}")
            continue
        say(f"A {op_id}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
