"""Kernel block devices for volumes: a FUSE daemon per pool, a loop device per volume.

State lives where the kernel keeps it: the FUSE mount under RUNTIME_DIR (this
user's runtime tree, thinblock/runtime.py) and the loop devices' backing files
(losetup). `attach` starts the pool's daemon if
needed and binds a direct-I/O loop device to the volume's file; `detach`
removes the loop device first, then the FUSE mount once nothing uses it.

On a pool served per volume (serve --volume) each attached volume or snapshot
has a mount of its own (volume_dir_for): hosted by the server owning the volume
(over its control socket, `fuse_mount`), or, when nobody holds it, by a daemon
that opens the pool as the owner of just that volume and holds its lease until
detach. Either way the volume's bytes go through its one owner.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from thinblock.backends import locate
from thinblock.core.registry import base_row_id
from thinblock.errors import PoolBusyError, ThinblockError
from thinblock.meta.base import VolumeRow
from thinblock.paths import child_path
from thinblock.privacy import create_private_file
from thinblock.runtime import CONTROL_SOCKET, private_runtime_dir, release_runtime_dir, runtime_base

LOOP_CONTROL = "/dev/loop-control"  # losetup --find asks it for a free loop device
RUNTIME_DIR = Path(runtime_base())  # this user's; each pool's directory is checked as it is used


@dataclass
class Attachment:
    device: str
    pool: str
    volume: str
    daemon_pid: int
    daemon_alive: bool
    state: str  # "attached"; "daemon dead" or "mount gone": I/O fails, detach cleans up


def _pool_dir(pool: str) -> Path:
    return runtime_dir_for(locate(pool).key())


def runtime_dir_for(key: str) -> Path:
    """The runtime directory of the pool whose location key this is; its mount is `mnt`."""
    return RUNTIME_DIR / hashlib.sha1(key.encode()).hexdigest()[:12]


def volume_dir_for(key: str, name: str) -> Path:
    """The runtime directory of one volume or snapshot attached on a pool served per
    volume (its mount is `mnt`, showing that name only)."""
    return runtime_dir_for(f"{key}\0volume\0{name}")


def _base_name(rows: dict[str, VolumeRow], name: str) -> str:
    """The volume a snapshot was taken of (through snapshots of snapshots): its owner
    serves it. A snapshot whose chain ends at a removed volume stands for itself."""
    by_id = {row.id: row for row in rows.values()}
    base = base_row_id(rows[name], by_id)
    return by_id[base].name if base is not None else name


def _mounts() -> list[tuple[str, str]]:
    """(source, mount point) of everything mounted."""
    with open("/proc/mounts") as f:
        return [(fields[0], fields[1]) for fields in (line.split() for line in f)]


def is_mounted(path: Path | str) -> bool:
    target = os.path.realpath(path)
    return any(where == target for _source, where in _mounts())


def _alive(pid: int) -> bool:
    """The process runs (a zombie, killed but not yet reaped, is dead)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[-1].split()[0] not in ("Z", "X")


def _loops() -> list[tuple[str, str]]:
    """(device, backing file) for every loop device."""
    try:
        out = subprocess.run(["losetup", "--json", "--list"], capture_output=True, text=True, check=False).stdout
    except FileNotFoundError:
        raise ThinblockError("losetup is not on PATH: install util-linux, or add /usr/sbin to PATH") from None
    if not out.strip():
        return []
    return [(d["name"], d.get("back-file") or "") for d in json.loads(out)["loopdevices"]]


def _record(pdir: Path) -> dict[str, str]:
    """device -> volume for the loop devices attach bound on this pool's mount. Once the
    mount is gone (a daemon killed, a lazy unmount) a device's backing file reads
    "/NAME" and the kernel can no longer say which filesystem it was on; this record
    still can."""
    try:
        return dict(json.loads((pdir / "devices.json").read_text()))
    except (OSError, ValueError):
        return {}


def _write_record(pdir: Path, record: dict[str, str]) -> None:
    _write_private(pdir / "devices.json", record)


def _forget(pdir: Path, devices: list[str]) -> None:
    """Drop detached devices from the record."""
    _write_record(pdir, {d: v for d, v in _record(pdir).items() if d not in devices})


def _write_private(path: Path, value: object) -> None:
    """JSON at path, replaced atomically, 0600 like every runtime file."""
    tmp = path.with_name(path.name + ".tmp")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    with os.fdopen(create_private_file(str(tmp)), "w") as f:
        f.write(json.dumps(value))
    tmp.replace(path)


def backing_file(device: str) -> str:
    name = os.path.basename(os.path.realpath(device))
    try:
        return Path(f"/sys/block/{name}/loop/backing_file").read_text().strip()
    except OSError:
        raise ThinblockError(f"{device} is not an attached loop device") from None


def _daemon_info(pdir: Path) -> dict[str, object] | None:
    try:
        return dict(json.loads((pdir / "daemon.json").read_text()))
    except (OSError, ValueError):
        return None


def _served_by(pool: str) -> str | None:
    """The control socket of the server holding the pool, if a server holds it."""
    sock = os.path.join(locate(pool).runtime_dir(), CONTROL_SOCKET)
    if not os.path.exists(sock):
        return None
    return sock if locate(pool).is_owned() else None


def _start_daemon(pool: str, pdir: Path, log_args: list[str]) -> None:
    mnt = Path(private_runtime_dir(pdir.name, "mnt"))  # only the pool's owner may look inside
    sock = _served_by(pool)
    if sock is not None:
        # `thinblock serve` holds the pool: it mounts the volumes itself (fuse/host.py).
        _hosted_by(sock, pool, pdir, mnt)
        return
    _spawn_daemon(pool, pdir, mnt, log_args)


def _start_for_volume(pool: str, pdir: Path, name: str, base: str, log_args: list[str]) -> None:
    """A pool served per volume: the server owning base (the volume, or the one the
    snapshot name was taken of) mounts name itself; nobody holds it: a daemon owning
    just base does."""
    from thinblock.admin.control import owner_socket

    location = locate(pool)
    mnt = Path(private_runtime_dir(pdir.name, "mnt"))
    meta = location.open_meta(readonly=False)  # the lease probe needs the lease file
    try:
        row = next((r for r in meta.volumes() if r.name == base), None)
        holder = meta.volume_holder(row.id) if row is not None else None
    finally:
        meta.close()
    if holder is None:
        _spawn_daemon(pool, pdir, mnt, ["--volume", base, "--show", name, *log_args])
        return
    sock = owner_socket(location, holder)
    if sock is None or not os.path.exists(sock):
        raise PoolBusyError(f"volume {base} is served by {holder}, which offers no control socket here")
    _hosted_by(sock, pool, pdir, mnt)


def _hosted_by(sock: str, pool: str, pdir: Path, mnt: Path) -> None:
    from thinblock.admin.control import ControlClient

    client = ControlClient(sock)
    try:
        pid = int(client.call("fuse_mount", mountpoint=str(mnt))["pid"])
    finally:
        client.close()
    info = {"pid": pid, "pool": locate(pool).key(), "mnt": str(mnt), "hosted": True}
    _write_private(pdir / "daemon.json", info)


def _spawn_daemon(pool: str, pdir: Path, mnt: Path, args: list[str]) -> None:
    log = os.fdopen(create_private_file(str(pdir / "daemon.log"), exclusive=False), "ab")
    log.seek(0, os.SEEK_END)
    proc = subprocess.Popen(
        [sys.executable, "-m", "thinblock", "fuse-daemon", locate(pool).key(), str(mnt), *args],
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=log,
        start_new_session=True,  # outlives this command, as a daemon should
        env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)},
    )
    log.close()
    deadline = time.monotonic() + 30
    while not is_mounted(mnt):
        if proc.poll() is not None:
            tail = (pdir / "daemon.log").read_text(errors="replace").strip().splitlines()[-1:]
            raise ThinblockError(f"the FUSE daemon for {pool} exited: {tail[0] if tail else 'no output'}")
        if time.monotonic() > deadline:
            proc.kill()
            raise ThinblockError(f"the FUSE daemon for {pool} did not come up")
        time.sleep(0.05)
    info = {"pid": proc.pid, "pool": locate(pool).key(), "mnt": str(mnt)}
    _write_private(pdir / "daemon.json", info)


def require_loop_devices() -> None:
    """One sentence, before anything starts, for a user who cannot set up loop devices."""
    if not os.access(LOOP_CONTROL, os.R_OK | os.W_OK):
        raise ThinblockError(
            f"attaching a volume sets up a loop device, which needs root (or access to {LOOP_CONTROL}): run it as"
            " root, or serve the volume over NBD with 'thinblock serve' instead"
        )


def attach(pool: str, volume: str, *, log_args: list[str] | None = None) -> str:
    """The loop device for pool/volume, attaching it (and starting the daemon) if needed;
    log_args (--log-level, --log-file, --log-format) go to a daemon started here, whose
    log is otherwise daemon.log in the pool's runtime directory."""
    location = locate(pool)
    meta = location.open_meta(readonly=True)  # clear errors for a missing pool
    try:
        # Staging names too: child_path below refuses them (and hostile ones) in one sentence.
        rows = {row.name: row for row in meta.volumes()}
    finally:
        meta.close()
    if volume not in rows:
        raise ThinblockError(f"no volume {volume!r} in pool {pool}")
    kinds = {name: row.kind for name, row in rows.items()}
    require_loop_devices()
    per_volume = location.served_per_volume()
    pdir = volume_dir_for(location.key(), volume) if per_volume else _pool_dir(pool)
    private_runtime_dir(pdir.name)  # ours alone before anything in it is trusted
    backing = str(child_path(pdir / "mnt", volume))  # before anything starts: the name may be hostile
    info = _daemon_info(pdir)
    if info is None or not _alive(int(info["pid"])) or not is_mounted(pdir / "mnt"):  # type: ignore[call-overload]
        _cleanup_dead(pdir)
        if per_volume:
            _start_for_volume(pool, pdir, volume, _base_name(rows, volume), log_args or [])
        else:
            _start_daemon(pool, pdir, log_args or [])
    for device, back in _loops():
        if back == backing:
            return device
    deadline = time.monotonic() + 10
    while not os.path.exists(backing):  # a volume created a moment ago appears after a commit
        if time.monotonic() > deadline:
            raise ThinblockError(f"volume {volume!r} does not appear in the FUSE daemon of {pool}")
        time.sleep(0.1)
    read_only = ["--read-only"] if kinds[volume] == "snapshot" else []
    proc = subprocess.run(
        ["losetup", "--find", "--show", "--direct-io=on", *read_only, backing],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise ThinblockError(f"losetup failed: {proc.stderr.strip()}")
    device = proc.stdout.strip()
    _write_record(pdir, {**_record(pdir), device: volume})
    return device


def _cleanup_dead(pdir: Path) -> None:
    mnt = pdir / "mnt"
    if is_mounted(mnt):
        subprocess.run(["umount", "-l", str(mnt)], check=False, capture_output=True)
    with contextlib.suppress(FileNotFoundError):
        (pdir / "daemon.json").unlink()


def list_attached() -> list[Attachment]:
    """Every loop device bound to a thinblock volume, with its daemon's state: one whose
    daemon died or whose mount went away is listed too, so that it can be detached."""
    return [a for a, _pdir in _attachments()]


def _attachments() -> list[tuple[Attachment, Path]]:
    out = []
    loops = _loops()
    for info_file in sorted(RUNTIME_DIR.glob("*/daemon.json")):
        pdir = info_file.parent
        info = _daemon_info(pdir)
        if info is None:
            continue
        mnt = str(info["mnt"])
        pid = int(info["pid"])  # type: ignore[call-overload]
        alive = _alive(pid)
        mounted = is_mounted(mnt)
        record = _record(pdir)
        for device, back in loops:
            if back.startswith(mnt + "/"):
                volume, lost = back[len(mnt) + 1 :], not mounted
            elif device in record and back == "/" + record[device]:
                volume, lost = record[device], True  # the mount is gone, the device still holds its file
            else:
                continue
            state = "daemon dead" if not alive else "mount gone" if lost else "attached"
            out.append((Attachment(device, str(info["pool"]), volume, pid, alive, state), pdir))
    return out


def _openers(device: str) -> list[str]:
    """Who has the block device open: "pid N (COMMAND)" for each process with a file
    descriptor on it (as fuser shows), or "the kernel (...)" when something holds it
    exclusively without one (swap, md, device-mapper): an O_EXCL open then fails."""
    real = os.path.realpath(device)
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            fds = os.listdir(f"/proc/{entry.name}/fd")
        except OSError:
            continue  # gone, or not ours to see
        for fd in fds:
            try:
                if os.readlink(f"/proc/{entry.name}/fd/{fd}") == real:
                    comm = Path(f"/proc/{entry.name}/comm").read_text().strip()
                    found.append(f"pid {entry.name} ({comm})")
                    break
            except OSError:
                continue
    if not found:
        try:
            os.close(os.open(real, os.O_RDONLY | os.O_EXCL))
        except OSError as e:
            if e.errno == errno.EBUSY:
                holders: list[str] = []
                with contextlib.suppress(OSError):
                    holders = sorted(os.listdir(f"/sys/block/{os.path.basename(real)}/holders"))
                found.append(f"the kernel ({', '.join(holders) or 'swap, or an exclusive opener'})")
    return found


def _mounted_at(device: str) -> str | None:
    real = os.path.realpath(device)
    return next((where for source, where in _mounts() if os.path.realpath(source) == real), None)


def detach_volume(pool: str, volume: str) -> list[str]:
    """detach() of the loop device(s) attach bound to pool's volume (rbd unmap pool/img);
    returns them, or one sentence if the volume is not attached."""
    meta = locate(pool).open_meta(readonly=True)  # clear errors for a missing pool
    meta.close()
    pdirs = {_pool_dir(pool), volume_dir_for(locate(pool).key(), volume)}  # the whole pool's mount, or its own
    devices = [a.device for a, where in _attachments() if where in pdirs and a.volume == volume]
    if not devices:
        raise ThinblockError(
            f"volume {volume} of pool {pool} is not attached ('thinblock attach --list' shows what is)"
        )
    for device in devices:
        detach(device)
    return devices


def detach(device: str) -> None:
    """Remove the loop device, then the pool's FUSE mount when no loop device uses it
    (a dead daemon's leftovers too), and then its runtime folder."""
    if not os.path.exists(device):
        raise ThinblockError(f"{device} does not exist: give a loop device that attach printed, or POOL VOLUME")
    backing = backing_file(device)
    real = os.path.realpath(device)
    found = [(a.device, pdir) for a, pdir in _attachments() if os.path.realpath(a.device) == real]
    if not found:
        raise ThinblockError(f"{device} is not a thinblock device (backing file {backing})")
    found_device, pdir = found[0]
    where = _mounted_at(device)
    if where:
        raise ThinblockError(f"{device} is mounted at {where}: unmount it first")
    users = _openers(device)
    deadline = time.monotonic() + 2
    while users and time.monotonic() < deadline:  # udev's probe after a writer closes passes
        time.sleep(0.1)
        users = _openers(device)
    if users:
        # As rbd unmap and dmsetup remove (EBUSY): losetup --detach would only mark it
        # to go when closed, and the daemon would then outlive it, holding the pool.
        raise ThinblockError(f"cannot detach {device}: it is open by {', '.join(users)}: close it first")
    proc = subprocess.run(["losetup", "--detach", device], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise ThinblockError(f"losetup --detach {device} failed: {proc.stderr.strip()}")
    name = os.path.basename(os.path.realpath(device))
    deadline = time.monotonic() + 10
    while Path(f"/sys/block/{name}/loop/backing_file").exists() and time.monotonic() < deadline:
        time.sleep(0.05)  # the kernel lets go of the file once the last opener closes
    if Path(f"/sys/block/{name}/loop/backing_file").exists():  # opened again in between
        users = _openers(device)
        raise ThinblockError(
            f"{device} is still open{' by ' + ', '.join(users) if users else ''}: the kernel detaches it"
            " when it is closed; the pool's daemon stays until then"
        )
    _forget(pdir, [found_device])
    if any(pdir == other for _a, other in _attachments()):
        return  # another volume of this pool is still attached
    _stop_daemon(pdir)


def detach_all_under(mountpoint: str) -> list[str]:
    """Detach every loop device whose file is under mountpoint (a mount about to end).
    A device still open (a mounted filesystem) is released by the kernel when closed."""
    gone = []
    for device, back in _loops():
        if back.startswith(mountpoint.rstrip("/") + "/"):
            subprocess.run(["losetup", "--detach", device], capture_output=True, check=False)
            gone.append(device)
    pdir = Path(mountpoint).parent
    if gone and (pdir / "devices.json").exists():
        _forget(pdir, gone)
    return gone


def _stop_daemon(pdir: Path) -> None:
    info = _daemon_info(pdir)
    pid = int(info["pid"]) if info else 0  # type: ignore[call-overload]
    mnt = pdir / "mnt"
    if info and info.get("hosted"):
        # The server hosts the mount: unmount it, the server goes on.
        subprocess.run(["fusermount3", "-u", str(mnt)], capture_output=True, check=False)
        deadline = time.monotonic() + 30
        while is_mounted(mnt) and time.monotonic() < deadline:
            time.sleep(0.05)
    elif pid and _alive(pid):
        # Unmounting ends the daemon's FUSE loop; it then commits and closes the pool.
        if subprocess.run(["fusermount3", "-u", str(mnt)], capture_output=True, check=False).returncode != 0:
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 60
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
    _cleanup_dead(pdir)
    with contextlib.suppress(OSError):
        mnt.rmdir()
    if not is_mounted(mnt) and not (pid and not (info and info.get("hosted")) and _alive(pid)):
        # Its last user is gone: so is its folder (the daemon's log, the device record).
        shutil.rmtree(pdir, ignore_errors=True)


def forget_pool(pool: str) -> None:
    """A removed pool's runtime folder, if one was left (a FUSE daemon that died): gone,
    unless something is still mounted there."""
    pdir = _pool_dir(pool)
    if pdir.is_dir() and not is_mounted(pdir / "mnt"):
        shutil.rmtree(pdir, ignore_errors=True)


def release_pool_dir(pdir: Path, pid: int) -> None:
    """What the process pid (a server that hosted the pool's mount, or a FUSE daemon)
    leaves of the pool's runtime folder when it stops: its own daemon record, a device
    record with no device left, and then the mount point and the folder itself, each
    only when nothing else is in it (runtime.release_runtime_dir)."""
    info = _daemon_info(pdir)
    if info and info.get("pid") == pid:
        with contextlib.suppress(FileNotFoundError):
            (pdir / "daemon.json").unlink()
    if not _record(pdir):
        with contextlib.suppress(FileNotFoundError):
            (pdir / "devices.json").unlink()
    if not is_mounted(pdir / "mnt"):
        release_runtime_dir(str(pdir / "mnt"))
    release_runtime_dir(str(pdir))
