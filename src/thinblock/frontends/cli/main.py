"""`thinblock` command line. Every command is a thin wrapper around a library
call; errors are printed as one sentence, never a traceback. Exit status: 0 done,
1 the command ran and failed, 2 the command line was wrong (argparse's usage
convention), 141 standard output was closed early (as if killed by SIGPIPE).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

from thinblock import __version__
from thinblock.admin.access import open_admin
from thinblock.admin.idle_grants import ask_back_idle_grants, give_back_idle_grants
from thinblock.backends import locate
from thinblock.core.owner import ATTACH_PURPOSE, SERVE_PURPOSE
from thinblock.core.pool import DEFAULT_BLOCK_SIZE, Pool
from thinblock.core.pool_settings import follow_pool
from thinblock.core.space_policy import parse_autogrow, parse_low_water, parse_when_full
from thinblock.errors import LeasesLost, OpError, OutputClosed, PoolBusyError, ThinblockError, UncleanCloseError
from thinblock.frontends.cli import config, maps, transfer
from thinblock.frontends.cli.common import UsageError, admin_call
from thinblock.frontends.cli.common import emit as _emit
from thinblock.frontends.cli.common import size_arg as _size
from thinblock.frontends.cli.examples import epilog
from thinblock.frontends.cli.progress import progress_bar, wanted
from thinblock.listen import check_socket_path, listening_addresses, wait_for_socket_path
from thinblock.logsetup import add_log_options, configure_from, log_arguments
from thinblock.runtime import NBD_SOCKET, require_socket_room, socket_path_problem
from thinblock.sizes import format_size, parse_size
from thinblock.steps import timed
from thinblock.tools.check import check_data_store, check_generation, check_metadata, check_privacy

if TYPE_CHECKING:
    from thinblock.frontends.cli.workers import WorkerSpec

DEFAULT_POOL = os.environ.get("THINBLOCK_POOL", os.path.join("var", "default-pool"))


EXIT_FAILED, EXIT_USAGE, EXIT_PIPE = 1, 2, 128 + 13


class _Parser(argparse.ArgumentParser):
    """argparse, with usage errors as one thinblock sentence (exit 2)."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        if "required: COMMAND" in message:
            message = f"a command is required: {self.prog} --help lists them"
        self.exit(EXIT_USAGE, f"thinblock: error: {self.prog}: {message}\n")


def _given(args: argparse.Namespace, *names: str) -> dict[str, Any]:
    """The options among names that were given on the command line (settings to change)."""
    return {name: getattr(args, name) for name in names if getattr(args, name) is not None}


def _reserve_arg(text: str) -> str | int:
    if text in ("full", "none"):
        return text
    return _size(text)


def _human_status(status: dict[str, Any]) -> str:
    lines = [
        f"size {format_size(status['size_bytes'])}, block size {format_size(status['block_size'])}, "
        f"used {format_size(status['used_bytes'])}, free {format_size(status['free_bytes'])}, "
        f"reserved {format_size(status['reserved_bytes'])}, "
        f"virtual {format_size(status['virtual_bytes'])} in {status['volume_count']} volume(s)",
        f"when full: {status['when_full']}; low-water mark: "
        + (f"{status['low_water_percent']:g}%" if status["low_water_percent"] is not None else "none")
        + (
            f"; autogrow {format_size(status['autogrow']['step_bytes'])} up to {format_size(status['autogrow']['max_bytes'])}"
            if status["autogrow"]
            else ""
        ),
    ]
    host = status.get("host_free_bytes")
    lines.append(
        (
            _human_ceph(status)
            if "ceph_pool" in status
            else "host: raw device"
            if host is None
            else f"host: {format_size(host)} free below the pool"
        )
        + f", metadata slack {format_size(status['metadata_slack_bytes'])}"
        + (f"; COMMITS FAILING: {status['commit_failure']}" if status.get("commit_failure") else "")
    )
    if status.get("granted_bytes"):  # only once owners per volume hold grants
        lines.append(
            f"granted to volume owners: {format_size(status['granted_bytes'])},"
            f" {format_size(status['granted_unused_bytes'])} of it unused"
        )
    if status["volume_count"] or status["snapshot_count"]:
        lines.append(
            f"{status['volume_count']} volume(s) and {status['snapshot_count']} snapshot(s) map"
            f" {format_size(status['mapped_bytes'])} ({format_size(status['data_bytes'])} data,"
            f" {format_size(status['provisioned_bytes'])} provisioned): 'thinblock volume list' shows each"
        )
    return "\n".join(lines)


def _human_ceph(status: dict[str, Any]) -> str:
    def size(key: str) -> str:
        return "?" if status.get(key) is None else format_size(status[key])

    quota = status.get("ceph_pool_quota_bytes")
    objects = "?" if status.get("ceph_pool_objects") is None else status["ceph_pool_objects"]
    return (
        f"Ceph pool {status['ceph_pool']}: {size('ceph_pool_stored_bytes')} stored in {objects} object(s),"
        f" quota {format_size(quota) if quota else 'none'};"
        f" cluster {size('ceph_cluster_avail_bytes')} free of {size('ceph_cluster_bytes')}"
        + (f" (some figures unavailable: {status['ceph_error']})" if status.get("ceph_error") else "")
        + "; provisioned space is set aside in the pool only (RADOS reserves nothing)"
    )


def _human_volumes(volumes: list[dict[str, Any]]) -> str:
    rows = [("NAME", "KIND", "ORIGIN", "SIZE", "MAPPED", "EXCLUSIVE", "SHARED", "PROVISIONED", "RESERVE")]
    for v in volumes:
        reserve = v["reserve"]
        rows.append(
            (
                v["name"],
                v["kind"],
                v["origin"] or "-",
                format_size(v["size_bytes"]),
                format_size(v["mapped_bytes"]),
                format_size(v["exclusive_bytes"]),
                format_size(v["shared_bytes"]),
                format_size(v["provisioned_bytes"]),
                reserve if isinstance(reserve, str) else format_size(reserve) if reserve else "-",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows)


# ----- commands ------------------------------------------------------------------------


def _warn(warnings: list[str]) -> None:
    for warning in warnings:
        print(f"thinblock: warning: {warning}", file=sys.stderr)


def cmd_pool_create(args: argparse.Namespace) -> None:
    with Pool.create(
        args.pool, args.size, block_size=args.block_size, data_path=args.data, object_size=args.object_size
    ) as pool:
        status = pool.status()
        _warn(pool.warnings)
    print(
        f"created pool {args.pool}: {format_size(status['size_bytes'])}, block size {format_size(status['block_size'])}"
    )


def cmd_pool_status(args: argparse.Namespace) -> None:
    status = admin_call(args.pool, "status")
    _emit(args, status, _human_status)
    if not args.json and sys.stdout.isatty():  # a picture for people, not for scripts
        from thinblock.frontends.cli.pictures import colour_wanted, space_bar

        print(space_bar(status, 40, colour_wanted(sys.stdout)))


def cmd_pool_grow(args: argparse.Namespace) -> None:
    _warn(admin_call(args.pool, "pool_grow", size_bytes=args.size)["warnings"])
    print(f"pool {args.pool} is now {format_size(args.size)}")


def _checked(parse: Callable[[str], object]) -> Callable[[str], str]:
    """An argparse type that checks a setting's form with the rule the pool applies
    (exit 2 for a malformed one, like a malformed size) and hands on its text."""

    def check(text: str) -> str:
        try:
            parse(text)
        except ThinblockError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return text

    return check


def cmd_pool_set(args: argparse.Namespace) -> None:
    changes = _given(args, "when_full", "low_water", "on_low_water", "autogrow")
    settings = admin_call(args.pool, "pool_set", **changes)
    _emit(args, settings, _human_settings)


def _human_settings(settings: dict[str, Any]) -> str:
    def show(key: str, value: Any) -> str:
        if value is None:
            return "none"
        if key == "autogrow":
            return f"{format_size(value['step_bytes'])} steps up to {format_size(value['max_bytes'])}"
        return f"{value:g}%" if key == "low_water_percent" else str(value)

    return "\n".join(f"{k}: {show(k, v)}" for k, v in settings.items())


def cmd_pool_check(args: argparse.Namespace) -> int:
    meta = locate(args.pool).open_meta(readonly=True)
    try:
        # The walk takes many reads; a server may commit between them (a RADOS pool's
        # omap is read page by page). Problems count only if no commit came between.
        for _attempt in range(5):
            before = meta.superblock().get("transaction_id")
            generation, owner_problems = check_generation(args.pool, meta)
            # One sentence once: a damaged superblock is what several checks trip on.
            problems = list(dict.fromkeys(check_metadata(meta) + check_data_store(args.pool, meta) + owner_problems))
            if not problems or meta.superblock().get("transaction_id") == before:
                break
        warnings = check_privacy(args.pool, meta)
    finally:
        meta.close()
    _warn(warnings)
    if args.json:
        out = {"ok": not problems, "problems": problems, "warnings": warnings, "generation": generation}
        print(json.dumps(out, indent=2))
    else:
        data_gen = generation["data_store"]
        print(f"generation: metadata {generation['metadata']}, data store {'none' if data_gen is None else data_gen}")
        if problems:
            print(f"pool {args.pool} has {len(problems)} problem(s):")
            for problem in problems:
                print(f"  - {problem}")
        else:
            print(f"pool {args.pool}: metadata is consistent")
    if problems:
        print(f"thinblock: error: pool check found {len(problems)} problem(s)", file=sys.stderr)
        return 1
    return 0


def cmd_pool_dump(args: argparse.Namespace) -> None:
    from thinblock.frontends.cli.dest import open_destination
    from thinblock.tools.dump import format_text

    output = args.output
    # Even with --force: a dump written into a pool's directory could replace one of its files.
    inside = output and os.path.isdir(args.pool) and os.path.realpath(args.pool)
    if inside and os.path.realpath(os.path.dirname(os.path.abspath(output))) == inside:
        raise UsageError(f"{output} is inside pool {args.pool}'s directory: write the dump somewhere else")
    # Checked before the dump is taken: a refused destination costs nothing.
    dest = open_destination(output, force=args.force, mode=None) if output else None
    fd_open = dest is not None
    try:
        dump = admin_call(args.pool, "pool_dump")
        text = json.dumps(dump, indent=1) + "\n" if args.json else format_text(dump)
        if dest is None:
            sys.stdout.write(text)
            return
        fd_open = False
        with os.fdopen(dest.fd, "w") as f:  # a new file, renamed over FILE once complete
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        dest.commit()
    except BaseException:
        if dest is not None:
            if fd_open:
                os.close(dest.fd)
            dest.discard()
        raise


def cmd_pool_restore(args: argparse.Namespace) -> None:
    from thinblock.tools.dump import read_dump, restore

    dump = read_dump(args.file)
    with progress_bar("restore: punching free space", wanted(args)) as bar:
        result = restore(args.pool, dump, bar)
    print(f"restored {result['volumes']} volume(s) into {args.pool}; {format_size(result['used_bytes'])} in use")
    for what in result.get("dropped") or []:  # a rollback: what restore did not trust
        print(f"thinblock: restore: {what}", file=sys.stderr)
    if result["backup"]:
        print(f"the old metadata is kept in {result['backup']}")


def cmd_pool_repair(args: argparse.Namespace) -> int:
    from thinblock.frontends.cli.signals import job_signals
    from thinblock.tools.dump import repair

    # SIGTERM and SIGHUP stop repair as Ctrl-C does: cleanly, at its next progress
    # report (cli/signals.py), not where it stands.
    with job_signals() as signals, progress_bar("repair: reading mappings", wanted(args), unit=" pages") as bar:
        result = repair(args.pool, signals.checked(bar), accept_rollback=args.accept_rollback)
        # A signal taken once the writing began let it finish: it is raised after this.
        if args.json:
            print(json.dumps(result, indent=2))
        else:
            print(f"repaired {args.pool}: rebuilt refcounts and free space for {result['volumes']} volume(s)")
            print(f"the old metadata is kept in {result['backup']}")
            for sentence in result["lost"]:
                print(f"  lost: {sentence}")
            if not result["lost"]:
                print("every mapping was saved")
    return 0


def cmd_pool_remove(args: argparse.Namespace) -> int:
    from thinblock.frontends.fuse.attach import forget_pool
    from thinblock.tools.remove import remove_pool

    result = remove_pool(args.pool, confirmed=args.yes)
    if result["removed"]:
        forget_pool(args.pool)  # a dead FUSE daemon's runtime folder, if one was left
    _emit(args, result, _human_pool_removal)
    if not result["removed"]:
        holding = [v["name"] for v in result["volumes"] if v["data_bytes"]]
        print(
            f"thinblock: error: pool {args.pool} holds {format_size(result['data_bytes'])} of data in"
            f" {len(holding)} volume(s) ({', '.join(holding[:5])}{', ...' if len(holding) > 5 else ''}):"
            " nothing was deleted; pass --yes to delete it",
            file=sys.stderr,
        )
        return EXIT_FAILED
    return 0


def _human_pool_removal(r: dict[str, Any]) -> str:
    verb = "removed" if r["removed"] else "would remove"
    lines = [f"{verb} pool {r['pool']} ({format_size(r['size_bytes'])}) with {len(r['volumes'])} volume(s):"]
    for v in r["volumes"]:
        lines.append(
            f"  {v['kind']} {v['name']}: {format_size(v['size_bytes'])}, {format_size(v['data_bytes'])} of data"
        )
    for item in r["deletes"]:
        held = "" if item["bytes"] is None else f" ({format_size(item['bytes'])} on disk)"
        lines.append(f"  {item['kind']} {item['name']}{held}")
    lines += [f"  kept: {sentence}" for sentence in r["kept"]]
    return "\n".join(lines)


def cmd_volume_create(args: argparse.Namespace) -> None:
    admin_call(args.pool, "volume_create", name=args.name, size_bytes=args.size, detect_zeroes=args.detect_zeroes)
    print(f"created volume {args.name}: {format_size(args.size)}")


def cmd_volume_list(args: argparse.Namespace) -> None:
    _emit(args, admin_call(args.pool, "volume_list"), _human_volumes)


def _human_removal(r: dict[str, Any]) -> str:
    lines = [f"removed {r['kind']} {r['name']}; {format_size(r['freed_bytes'])} returned to the pool"]
    if r["dependents"]:
        names = ", ".join(f"{d['name']} ({d['kind']})" for d in r["dependents"])
        lines.append(f"its dependents keep all their data and now have no origin: {names}")
    return "\n".join(lines)


def cmd_volume_remove(args: argparse.Namespace) -> None:
    _emit(args, admin_call(args.pool, "volume_remove", name=args.name, kind="volume"), _human_removal)


def cmd_volume_resize(args: argparse.Namespace) -> None:
    result = admin_call(
        args.pool, "volume_resize", name=args.name, size_bytes=args.size, allow_shrink=args.allow_shrink
    )
    print(f"volume {args.name} is now {format_size(args.size)}")
    _warn((result or {}).get("warnings", []))  # an attached device that did not follow: losetup -c


def _rename(args: argparse.Namespace, kind: str) -> None:
    info = admin_call(args.pool, "volume_rename", name=args.name, new_name=args.new_name, kind=kind)
    _emit(
        args,
        info,
        lambda i: "\n".join(
            [f"renamed {kind} {i['old_name']} to {i['name']}"]
            + [f"renamed snapshot {s['old_name']} to {s['name']}" for s in i.get("snapshots", [])]
        ),
    )


def cmd_volume_rename(args: argparse.Namespace) -> None:
    _rename(args, "volume")


def cmd_snapshot_rename(args: argparse.Namespace) -> None:
    _rename(args, "snapshot")


def cmd_volume_set(args: argparse.Namespace) -> None:
    changes = _given(args, "detect_zeroes", "reserve", "low_water", "on_low_water")
    if not changes:
        raise UsageError("nothing to change: give --detect-zeroes, --reserve, --low-water or --on-low-water")
    info = admin_call(args.pool, "volume_set", name=args.name, **changes)
    _emit(args, info, lambda i: f"volume {i['name']} updated")


def cmd_volume_clone(args: argparse.Namespace) -> None:
    admin_call(args.pool, "volume_clone", snapshot=args.snapshot, name=args.name)
    print(f"cloned snapshot {args.snapshot} as volume {args.name}")


def cmd_volume_rollback(args: argparse.Namespace) -> None:
    admin_call(args.pool, "volume_rollback", name=args.name, snapshot=args.snapshot)
    print(f"volume {args.name} rolled back to snapshot {args.snapshot}")


def cmd_snapshot_create(args: argparse.Namespace) -> None:
    source, name = args.volume, args.name
    if name is None:
        # rbd's form: VOLUME@SNAP names the snapshot "VOLUME@SNAP", taken of VOLUME.
        source, at, snap = args.volume.rpartition("@")
        if not at or not source or not snap:
            raise UsageError("snapshot create needs VOLUME SNAPSHOT, or VOLUME@SNAP")
        name = args.volume
    info = admin_call(args.pool, "snapshot_create", volume=source, name=name)
    _emit(args, info, lambda i: f"created snapshot {i['name']} of {source}")


def cmd_snapshot_list(args: argparse.Namespace) -> None:
    _emit(args, admin_call(args.pool, "volume_list", kind="snapshot"), _human_volumes)


def cmd_snapshot_remove(args: argparse.Namespace) -> None:
    _emit(args, admin_call(args.pool, "volume_remove", name=args.name, kind="snapshot"), _human_removal)


def cmd_delta(args: argparse.Namespace) -> None:
    delta = admin_call(args.pool, "delta", source=args.source, target=args.target)

    def human(d: dict[str, Any]) -> str:
        lines = [f"{r['offset']} {r['length']} {'zero' if r['zero'] else 'data'}" for r in d["ranges"]]
        lines.append(
            f"# {d['from']} -> {d['to']}: {len(d['ranges'])} range(s), {format_size(d['changed_bytes'])} changed"
            f" ({format_size(d['zero_bytes'])} of it now zero)"
        )
        return "\n".join(lines)

    _emit(args, delta, human)


def cmd_quickstart(args: argparse.Namespace) -> None:
    """The embedded default: a pool in local files with one volume, created if missing."""
    if not locate(args.pool).exists():
        Pool.create(args.pool, args.size, block_size=DEFAULT_BLOCK_SIZE).close()
        print(f"created pool {args.pool} ({format_size(args.size)})")
    with open_admin(args.pool) as admin:
        if not any(v["name"] == args.volume for v in admin.call("volume_list")):
            admin.call("volume_create", name=args.volume, size_bytes=args.volume_size)
            print(f"created volume {args.volume} ({format_size(args.volume_size)})")
        shown = {**admin.call("status"), "volumes": admin.call("volume_list")}
        _emit(args, shown, lambda s: _human_status(s) + "\n" + _human_volumes(s["volumes"]))


def cmd_serve(args: argparse.Namespace) -> None:
    """Serve every volume over NBD until SIGINT/SIGTERM, then commit and stop; SIGHUP
    reloads the --tls-authz file. Under systemd: readiness and stopping go to
    $NOTIFY_SOCKET, and sockets passed by socket activation are served instead of
    --socket/--listen (thinblock/systemd.py)."""
    import logging
    import signal
    import socket
    import ssl
    import time

    from thinblock import systemd
    from thinblock.admin.control import ControlServer
    from thinblock.frontends.fuse.host import MountHost
    from thinblock.frontends.nbd.authz import Authz
    from thinblock.frontends.nbd.server import Limits, NBDServer, TLSConfig, export_uris, parse_listen

    started = time.monotonic()
    if args.pool is None:
        raise UsageError('serve needs POOL: on the command line, or pool = "..." in the --config file')
    handler = configure_from(args)
    log = logging.getLogger("thinblock.serve")
    # A worker of serve --workers (cli/workers.py) serves its supervisor's sockets.
    spec: WorkerSpec | None = getattr(args, "worker_spec", None)
    if spec is not None:
        from thinblock.logsetup import WorkerTag

        handler.addFilter(WorkerTag(spec.index))
    activated = spec.listeners if spec is not None else systemd.listen_fds()
    if spec is None and activated and (args.socket or args.listen):
        for sock, _name in activated:
            sock.close()
        raise UsageError(
            "the service manager passed listening sockets (socket activation): serve them without --socket or --listen"
        )
    try:
        tcp = parse_listen(args.listen) if args.listen else None
    except ValueError as exc:
        raise ThinblockError(str(exc)) from None
    if bool(args.tls_cert) != bool(args.tls_key):
        raise UsageError("--tls-cert and --tls-key go together")
    if args.tls_psk:
        # nbdkit's --tls-psk needs TLS-PSK key exchange, which Python's ssl module only
        # offers from 3.13 (SSLContext.set_psk_server_callback); Debian 12 has 3.11.
        if not hasattr(ssl.SSLContext, "set_psk_server_callback"):
            raise ThinblockError(
                "--tls-psk is not available: this Python's ssl module has no TLS-PSK support"
                " (it comes with Python 3.13); use --tls-cert/--tls-key with --tls-ca and --tls-authz"
            )
        raise ThinblockError("--tls-psk is not implemented yet: use client certificates and --tls-authz")
    if args.tls_authz and not args.tls_ca:
        raise UsageError("--tls-authz needs --tls-ca: it names client certificates, which only a CA makes required")
    if tcp and not args.tls_cert and not args.insecure:
        raise UsageError(
            f"TCP without TLS lets anyone who can reach {tcp[0]}:{tcp[1]} read and write every volume:"
            " give --tls-cert and --tls-key (and --tls-ca), or --insecure to serve it anyway"
        )
    activated_tcp = [sock for sock, _name in activated if sock.family != socket.AF_UNIX]
    if activated_tcp and not args.tls_cert and not args.insecure:
        where = systemd.describe(activated_tcp[0])
        raise UsageError(
            f"the {where} passed by socket activation has no TLS: anyone who can reach it could read and write"
            " every volume; give --tls-cert and --tls-key (and --tls-ca), or --insecure to serve it anyway"
        )
    tls = TLSConfig(args.tls_cert, args.tls_key, args.tls_ca) if args.tls_cert else None
    authz = Authz.load(args.tls_authz) if args.tls_authz else None
    socket_mode = _octal_mode(args.socket_mode)
    socket_gid = _group_id(args.socket_group) if args.socket_group else None
    counts = (
        args.max_connections,
        args.max_negotiating_per_address,
        args.max_connections_per_address,
        args.max_connections_per_identity,
    )
    if min(counts) < 1 or min(args.handshake_timeout, args.idle_timeout, args.payload_timeout) <= 0:
        raise UsageError("the --max-* limits must be at least 1, and the timeouts more than 0 seconds")
    limits = Limits(
        args.max_connections,
        args.handshake_timeout,
        min(args.handshake_timeout, args.idle_timeout),
        max_negotiating_per_address=args.max_negotiating_per_address,
        max_connections_per_address=args.max_connections_per_address,
        max_connections_per_identity=args.max_connections_per_identity,
        payload_idle_s=args.payload_timeout,
    )
    location = locate(args.pool)
    volumes: list[str] | None = getattr(args, "volumes", None)
    # Servers per volume share the pool's directory: each needs its own socket.
    default_socket = f"nbd.{volumes[0]}.sock" if volumes else NBD_SOCKET
    socket_path = os.path.abspath(args.socket or os.path.join(location.runtime_dir(), default_socket))
    if problem := socket_path_problem(socket_path):  # said before the pool is opened, in one sentence
        raise ThinblockError(
            f"cannot serve on the unix socket {socket_path}: it is {problem}; give --socket a shorter path"
        )
    if (runtime := location.runtime_path()) is not None:
        require_socket_room(runtime, location.shorter_runtime_path)
    if spec is None and volumes and location.fences_per_process and args.workers < len(set(volumes)):
        # A blocklist entry fences a whole Ceph client, so each volume gets a worker
        # with a client of its own: a takeover that fences one fences nothing else.
        log.info(
            "pool %s: %d volumes, one worker process each (fencing one owner must not reach the others)",
            args.pool,
            len(set(volumes)),
        )
        args.workers = len(set(volumes))
    if args.takeover and not activated:
        # Checked before anything is taken: a taker that then could not listen would
        # leave the volume served by nobody.
        _check_takeover_socket(location, socket_path, volumes or [], waits=spec is None and args.workers == 1)
    # Beside servers per volume on a Ceph pool, the volumes nobody holds are served a
    # worker process each, as with --volume (cli/workers.py: a spare claims the next).
    beside = spec is None and not volumes and location.fences_per_process and location.served_per_volume()
    if spec is None and (args.workers > 1 or beside):
        if args.metrics:
            raise UsageError(
                "--metrics is not available with several worker processes yet (--workers, or a Ceph pool served"
                " per volume): each worker keeps its own figures"
            )
        _serve_with_workers(args, location, socket_path, (socket_mode, socket_gid), tcp, activated, tls is not None)
        return
    signals = _SignalQueue(signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    # A refused second server is told the pid that was started, the group's, for a worker.
    purpose = SERVE_PURPOSE if spec is None else f"{SERVE_PURPOSE} worker {spec.index} of pid {spec.group}"
    systemd.notify(f"STATUS=opening pool {args.pool}")
    claims = False
    try:
        if volumes and args.takeover:
            from thinblock.admin.handover import take_over

            take_over(location, volumes)
        with progress_bar("recovering free space", sys.stderr.isatty()) as bar:
            try:
                pool = Pool.open(
                    args.pool,
                    purpose=purpose,
                    takeover=args.takeover and not volumes,
                    progress=bar,
                    volumes=volumes,
                )
            except PoolBusyError:
                if volumes is not None or not location.served_per_volume():
                    raise
                # Servers per volume share the pool: this one serves every volume none holds,
                # also one made or let go later (claimed when a client asks, as workers do).
                from thinblock.admin.handover import volumes_to_serve

                pool = Pool.open(args.pool, purpose=purpose, volumes=volumes_to_serve(location))
                claims = True
    except PoolBusyError as exc:
        if "fuse-daemon" in str(exc):
            raise PoolBusyError(
                f"{exc}: detach its devices first (serve, then attach: the server hosts the attached devices)"
            ) from None
        raise
    log.info("pool %s open after %.3f s", args.pool, time.monotonic() - started)
    with pool:
        try:
            server = NBDServer(pool, read_only=args.read_only, tls=tls, authz=authz, limits=limits)
        except (OSError, ValueError) as exc:
            raise ThinblockError(f"cannot load TLS certificate/key: {exc}") from None
        handoffs = None
        if spec is not None:  # a worker: exports of its siblings are handed to them
            from thinblock.frontends.nbd.workers import GroupCatalog, Handoffs, WorkerGroup

            group = WorkerGroup(spec.group, spec.handoff_dir)
            server.catalog = GroupCatalog(
                pool, read_only=args.read_only, group=group, claims=spec.claims, one_each=spec.one_each
            )
            handoffs = Handoffs(server, group)
        elif claims:  # a group of one: no sibling to route to, volumes nobody holds to claim
            from thinblock.frontends.nbd.workers import GroupCatalog, WorkerGroup

            alone = WorkerGroup(os.getpid(), "")
            server.catalog = GroupCatalog(pool, read_only=args.read_only, group=alone, claims=True)
        if (tcp or activated_tcp) and tls is None:
            logging.getLogger("thinblock.nbd").warning(
                "serving TCP without TLS (--insecure): anyone who can reach it can read and write every volume"
            )
        where = f"unix socket {socket_path}"
        bound = None
        unix_path: str | None = socket_path
        try:
            if activated:
                for sock, name in activated:
                    if spec is None:
                        log.info("serving %s passed by socket activation (%s)", systemd.describe(sock), name)
                    server.listen_socket(sock, shared=spec is not None)
                unix_path, bound = listening_addresses([sock for sock, _name in activated])
            else:
                if args.takeover:  # the owner it took from may still be stopping, on this path
                    wait_for_socket_path(socket_path, TAKEOVER_SOCKET_WAIT_S)
                server.listen_unix(socket_path, mode=socket_mode, gid=socket_gid)
                if tcp:
                    where = f"TCP {tcp[0]}:{tcp[1]}"
                    bound = (tcp[0], server.listen_tcp(*tcp))
            host = MountHost(pool)
            handed_all: list[str] = []  # filled when it stops itself, having handed everything over
            lost: list[str] = []  # volumes whose lease another took (Ceph): it stops serving then
            lost_why: list[str] = []

            def lease_lost(what: str, name: str, why: str) -> None:
                """Stop serving: the lease of `what` (a volume, or the whole pool) is another's."""
                log.error(
                    "%s: its lease is lost (%s); another server holds it now: closing its clients and stopping,"
                    " committing nothing more",
                    what,
                    why,
                )
                lost.append(name)
                lost_why.append(why)
                os.kill(os.getpid(), signal.SIGTERM)

            if pool.owner is not None:

                def volume_lost(vid: int, why: str) -> None:
                    vol = pool.volume_by_id(vid)
                    name = vol.row.name if vol is not None else f"#{vid}"
                    lease_lost(f"volume {name}", name, why)

                pool.meta.watch_leases(volume_lost)
            pool.watch_ownership_lost(lambda why: lease_lost(f"pool {args.pool}", "every volume", why))
            where = f"the control socket of pool {args.pool}"
            watches = None
            if pool.owner is None:
                control = ControlServer(pool, {"fuse_mount": host.mount})
            else:  # an owner per volume hosts the mounts of its own volumes (fuse/host.py)

                def release(name: str) -> dict[str, object]:
                    host.refuse_release(name)
                    vid = pool.volume(name, kind="volume").row.id
                    closed = pool.give_up(name, server.hang_up_volume)
                    if spec is not None:  # the siblings leave it to its taker too
                        from thinblock.frontends.nbd.workers import handed_over_mark

                        try:
                            with open(handed_over_mark(spec.handoff_dir, vid), "w"):
                                pass
                        except OSError as exc:
                            log.warning("cannot tell the other workers volume %s was handed over: %s", name, exc)
                    if volumes and spec is None and pool.owner is not None and not pool.owner.leases():
                        # A server of the volumes it was told (--volume) that has handed
                        # them all over serves nothing: it stops, and its socket (which the
                        # taker may want: nbd.VOLUME.sock) goes with it.
                        log.info("every volume it served was handed over: stopping")
                        handed_all.append(name)
                        control.after_reply(lambda: os.kill(os.getpid(), signal.SIGTERM))
                    return {"name": name, "clients_closed": closed}

                control = ControlServer(pool, {**_owner_verbs(pool, release), "fuse_mount": host.mount})
                if pool.location.remote_owners:  # commands on other hosts reach it by watch/notify
                    from thinblock.admin.notify import VolumeWatches

                    watches = VolumeWatches(pool, control)
        except OSError as exc:
            server.close()
            raise ThinblockError(f"cannot listen on {where}: {exc.strerror or exc}") from None
        metrics = None
        why = "an error"  # what stops the server, for the log: a signal's name once one came
        # Everything from here on runs in try/finally: whatever ends it (a signal, a
        # print to a closed stdout, a failing reload), the sockets close, connections
        # drain and the final commit runs, in that order, before the pool closes.
        try:
            if args.metrics:
                from thinblock.frontends.metrics import MetricsServer

                try:
                    metrics = MetricsServer(pool, server, *args.metrics)
                except OSError as exc:
                    mhost, mport = args.metrics
                    shown_host = f"[{mhost}]" if ":" in mhost else mhost
                    raise ThinblockError(
                        f"cannot serve metrics on {shown_host}:{mport}: {exc.strerror or exc}"
                    ) from None
                logging.getLogger("thinblock.metrics").info("metrics on %s", metrics.url)
                print(f"metrics {metrics.url}", flush=True)
            served = sorted(name for name, vol in pool.volumes.items() if pool.serves(vol))
            status = f"serving {len(served)} volume(s) of {args.pool}"
            log.info("ready after %.3f s: %s", time.monotonic() - started, status)
            if spec is not None:
                spec.report("ready")  # the supervisor prints the exports and tells systemd
            else:
                for uri in export_uris(served, socket_path=unix_path, tcp=bound, tls=tls is not None):
                    print(f"export {uri}", flush=True)
                print(f"ready: {status}", flush=True)
                systemd.notify("READY=1", f"MAINPID={os.getpid()}", f"STATUS={status}")
            while (signum := signals.next()) == signal.SIGHUP:
                systemd.notify("RELOADING=1", "STATUS=reloading --tls-authz")
                server.reload_authz()
                systemd.notify("READY=1", f"STATUS={status}")
            why = (
                f"the loss of the lease of {', '.join(lost)}"
                if lost
                else "its last volume handed over"
                if handed_all
                else signal.Signals(signum).name
            )
            systemd.notify("STOPPING=1", "STATUS=stopping: finishing requests and committing")
            print("stopping: finishing requests and committing", flush=True)
        finally:
            if why == "an error":
                systemd.notify("STOPPING=1", "STATUS=stopping after an error: finishing requests and committing")
            with timed(log, f"stopping on {why}") as step:
                if watches is not None:
                    # A lost lease: the cluster may be out of reach, or this client fenced;
                    # its watches are left to lapse rather than waited on.
                    watches.close(abandon=bool(lost))
                control.close()
                # Writes held by the wait policy fail first, through the FUSE mounts too:
                # a writer held there keeps its loop device, and so the mount, busy.
                pool.cancel_waits()
                host.close()
                step.mark("FUSE mounts and control socket closed")
                if handoffs is not None:
                    handoffs.close()
                server.close()
                step.mark("connections drained")
                if metrics is not None:
                    metrics.close()
                try:
                    pool.close()
                except UncleanCloseError as exc:
                    if not lost:
                        raise
                    # Its lease is another's: what it did not commit is that owner's to
                    # recover, as after a crash; the loss is what this server reports.
                    log.warning("%s", exc)
                step.mark("final commit done, pool closed")
    if lost:
        raise LeasesLost(
            f"stopped serving {', '.join(lost)}: its lease was lost ({'; '.join(dict.fromkeys(lost_why))});"
            " another server holds it now"
        )
    print("stopped", flush=True)


TAKEOVER_SOCKET_WAIT_S = 10.0  # how long a taker waits for the owner it took from to leave its socket


def _check_takeover_socket(location: Any, socket_path: str, taken: list[str], *, waits: bool) -> None:
    """Refuse a takeover whose socket path another server listens on (before anything
    is taken), unless that server is the owner of the volumes taken and of nothing
    else: it stops once it has handed them over, and its path is free then (waits: a
    server that binds after the takeover waits for that)."""
    import errno

    from thinblock.admin.handover import volumes_held_by
    from thinblock.listen import listener_pid

    try:
        check_socket_path(socket_path)
        return
    except FileExistsError as exc:
        problem = exc.strerror
        pid = listener_pid(socket_path) if exc.errno == errno.EADDRINUSE else None
    if pid is not None and waits:
        held = volumes_held_by(location, pid)
        if held and set(held) <= set(taken):
            return  # it stops once they are handed over (cmd_serve waits for the path)
        if held:
            problem = (
                f"the server of pid {pid} listens on it, and keeps serving {', '.join(sorted(set(held) - set(taken)))}"
            )
    raise ThinblockError(
        f"cannot serve on the unix socket {socket_path}: {problem}; nothing was taken over: give --socket another path"
    )


def _owner_verbs(pool: Pool, release: Callable[[str], Any]) -> dict[str, Callable[..., Any]]:
    """What every process owning volumes of a pool served per volume answers on its
    control socket (serve, an attach's FUSE daemon), release being how it gives one up;
    and it asks the others for their idle grants before ENOSPC (admin/idle_grants.py)."""
    assert pool.owner is not None  # opened per volume
    pool.owner.ask_others = lambda: ask_back_idle_grants(pool)
    return {
        "volume_release": release,
        "pool_follow": lambda: follow_pool(pool),
        "grants_idle_back": lambda: give_back_idle_grants(pool),
        "open_clients": pool.open_clients,
    }


def _serve_with_workers(
    args: argparse.Namespace,
    location: Any,
    socket_path: str,
    socket_access: tuple[int, int | None],
    tcp: tuple[str, int] | None,
    activated: list[Any],
    tls: bool,
) -> None:
    """serve --workers N: this process listens and supervises (cli/workers.py); each
    worker runs cmd_serve on its share of the volumes and these sockets."""
    from thinblock.frontends.cli import workers
    from thinblock.frontends.nbd.server import export_uris

    signals = _SignalQueue(*workers.SUPERVISOR_SIGNALS)
    inode = None
    if activated:
        listeners = [sock for sock, _name in activated]
        unix_path, bound = listening_addresses(listeners)
    else:
        try:
            listeners = workers.listen(socket_path, *socket_access, tcp)
        except OSError as exc:
            raise ThinblockError(f"cannot listen on {socket_path}: {exc.strerror or exc}") from None
        unix_path, inode = socket_path, os.stat(socket_path).st_ino
        bound = (tcp[0], int(listeners[-1].getsockname()[1])) if tcp is not None else None

    def announce(names: list[str]) -> str:
        for uri in export_uris(names, socket_path=unix_path, tcp=bound, tls=tls):
            print(f"export {uri}", flush=True)
        return f"serving {len(names)} volume(s) of {args.pool}"

    def run_worker(spec: workers.WorkerSpec, names: list[str]) -> None:
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115  what a client reads comes from the supervisor
        spec.claims = not args.volumes  # the group serves every volume no other server holds
        args.worker_spec, args.volumes, args.takeover = spec, names, False
        cmd_serve(args)

    try:
        workers.supervise(args, location, listeners, announce, run_worker, signals.within)
    finally:
        if activated:
            for sock in listeners:
                sock.close()
        else:
            workers.close_listeners(listeners, unix_path, inode)
    print("stopped", flush=True)


class _SignalQueue:
    """Signals taken in order by the main thread: their numbers are written to a socket
    by the interpreter (signal.set_wakeup_fd), and the handler itself does nothing, so
    no lock is ever taken inside a handler (Event.set there can deadlock the thread
    it interrupts). Signals that come early (while the pool opens) wait their turn."""

    def __init__(self, *signums: int) -> None:
        import signal
        import socket

        self._read, write = socket.socketpair()
        write.setblocking(False)
        self._write = write  # kept open as long as the queue
        signal.set_wakeup_fd(write.fileno(), warn_on_full_buffer=False)
        for signum in signums:
            signal.signal(signum, lambda *_: None)
        self._pending = bytearray()

    def next(self) -> int:
        """The next signal's number, waiting as long as it takes."""
        signum = self.within(None)
        assert signum is not None
        return signum

    def within(self, timeout: float | None) -> int | None:
        """The next signal's number; None if none came within timeout seconds (0 or less:
        none waiting now; a timeout of 0 would make the socket non-blocking)."""
        self._read.settimeout(None if timeout is None else max(timeout, 0.001))
        while not self._pending:
            try:
                self._pending += self._read.recv(64)
            except TimeoutError:
                return None
        return self._pending.pop(0)


def _metrics_address(text: str) -> tuple[str, int]:
    from thinblock.frontends.metrics import parse_address

    try:
        return parse_address(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _workers_arg(text: str) -> int:
    from thinblock.frontends.cli.workers import parse_workers

    return parse_workers(text)


def _octal_mode(text: str) -> int:
    try:
        mode = int(text, 8)
    except ValueError:
        raise UsageError(f"invalid --socket-mode {text!r}: an octal mode such as 0660") from None
    if not 0 <= mode <= 0o777 or mode & 0o111:
        raise UsageError(f"invalid --socket-mode {text!r}: read/write bits only, such as 0600 or 0660")
    if mode & 0o006:
        raise UsageError(f"--socket-mode {text}: a socket others may use lets every local user read every volume")
    return mode


def _group_id(name: str) -> int:
    import grp

    try:
        return int(name) if name.isdigit() else grp.getgrnam(name).gr_gid
    except KeyError:
        raise UsageError(f"invalid --socket-group {name!r}: no such group") from None


def cmd_fuse_daemon(args: argparse.Namespace) -> None:
    """Internal: serve a pool's volumes as files at MOUNTPOINT until unmounted."""
    import logging

    from thinblock.admin.control import ControlServer
    from thinblock.frontends.fuse.fs import mount

    configure_from(args)
    # With --volume (a pool served per volume, fuse/attach.py): the owner of just that
    # volume, holding its lease until unmounted, showing only --show.
    volumes = [args.volume] if args.volume else None
    with Pool.open(args.pool, purpose=f"{ATTACH_PURPOSE} (attach)", volumes=volumes) as pool:
        logging.getLogger("thinblock.fuse").info("serving %s at %s", args.pool, args.mountpoint)
        verbs: dict[str, Callable[..., Any]] = {}
        if volumes is not None:

            def release(name: str) -> None:
                raise ThinblockError(
                    f"volume {name} is attached (thinblock attach): detach it first ('thinblock detach POOL"
                    f" {args.show or name}'), then serve it"
                )

            verbs = _owner_verbs(pool, release)
        control = ControlServer(pool, verbs)
        try:
            mount(pool, args.mountpoint, only=args.show or args.volume)
        finally:
            control.close()
    logging.getLogger("thinblock.fuse").info("unmounted; pool committed and closed")


def cmd_attach(args: argparse.Namespace) -> None:
    from thinblock.frontends.fuse.attach import attach, list_attached

    if args.list:
        rows = [a.__dict__ for a in list_attached()]
        if args.pool:  # that pool's devices (of that volume), as losetup -j FILE
            backend = locate(args.pool)
            backend.open_meta(readonly=True).close()  # one sentence for a missing pool
            rows = [a for a in rows if a["pool"] == backend.key() and args.name in (None, a["volume"])]
        if args.json:
            print(json.dumps(rows, indent=2))
        else:
            for a in rows:
                state = "" if a["state"] == "attached" else f"  ({a['state']}: I/O fails; detach cleans up)"
                print(f"{a['device']}  {a['pool']}  {a['volume']}{state}")
        return
    if not args.pool or not args.name:
        raise UsageError("attach needs POOL and NAME (or --list)")
    print(attach(args.pool, args.name, log_args=log_arguments(args)))


def cmd_detach(args: argparse.Namespace) -> None:
    from thinblock.frontends.fuse.attach import detach, detach_volume

    if args.volume is None:
        if os.path.isdir(args.device) or ":" in args.device:  # a pool (a directory, rados:...)
            raise UsageError(f"detach {args.device} needs the VOLUME too, or give a loop device such as /dev/loop3")
        detach(args.device)
        print(f"detached {args.device}")
        return
    for device in detach_volume(args.device, args.volume):
        print(f"detached {device} ({args.device} {args.volume})")


def cmd_completion(args: argparse.Namespace) -> None:
    from thinblock.frontends.cli.docgen import completion

    sys.stdout.write(completion(build_parser(), args.shell))


def cmd_manpage(args: argparse.Namespace) -> None:
    from thinblock.frontends.cli.docgen import manpage

    sys.stdout.write(manpage(build_parser()))


def cmd_mkfs(args: argparse.Namespace) -> None:
    from thinblock.frontends.fuse.mkfs import format_volume

    result = format_volume(args.pool, args.name, args.type, args.extra, force=args.force)
    if args.json:
        print(json.dumps(result, indent=2))
        return
    hint = (
        "known zero: passing -E assume_storage_prezeroed=1"
        if result["prezeroed_hint"]
        else (
            "known zero (mkfs.xfs has no prezeroed hint)"
            if result["storage_was_zero"]
            else "holds data: formatting normally (--force)"
        )
    )
    print(f"{args.name}: {hint}")
    used = result["pool_bytes_used"]  # negative when the format discarded more than it wrote
    change = f"pool space used {format_size(used)}" if used >= 0 else f"pool space freed {format_size(-used)}"
    print(
        f"{' '.join(result['command'])}: {result['seconds']:.2f} s, {change}; the volume maps "
        f"{format_size(result['volume_mapped_bytes'])} ({result['percent_of_volume']:.3f}% of it)"
    )


# ----- parser --------------------------------------------------------------------------


def _wait_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid --wait {text!r}: seconds, such as 30 or 0") from None
    if not 0 <= value <= 86400:
        raise argparse.ArgumentTypeError(f"invalid --wait {text!r}: from 0 to 86400 seconds")
    return value


def _common_options(p: argparse.ArgumentParser, default: Any) -> None:
    p.add_argument(
        "--wait",
        type=_wait_seconds,
        metavar="SECONDS",
        default=default,
        help="how long to wait while another command holds the pool (default 60)",
    )
    p.add_argument(
        "--ceph-conf", metavar="PATH", default=default, help="Ceph configuration for rados: pools (default $CEPH_CONF)"
    )
    p.add_argument(
        "--ceph-id", metavar="NAME", default=default, help="Ceph client id for rados: pools (default $CEPH_ID or admin)"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="thinblock", description="Thin-provisioned block storage that treats zeros as free.")
    _common_options(parser, default=None)
    parser.add_argument("--version", action="version", version=f"thinblock {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=_Parser)

    def add(group: Any, name: str, func: Callable[..., Any], help_text: str, pool: bool = True) -> _Parser:
        p: _Parser = group.add_parser(name, help=help_text, description=help_text)
        # Its examples (cli/examples.py) close its --help, kept as written.
        p.epilog = epilog(p.prog.removeprefix(parser.prog + " "))
        p.formatter_class = argparse.RawDescriptionHelpFormatter
        p.set_defaults(func=func)
        if pool:
            p.add_argument("pool", metavar="POOL", help="pool directory, or rados:CEPHPOOL/NAME")
        _common_options(p, default=argparse.SUPPRESS)  # given here or before the command
        return p

    pool_p = sub.add_parser("pool", help="create, inspect, grow and check pools", description="Pool commands.")
    pool_sub = pool_p.add_subparsers(dest="pool_command", metavar="COMMAND", required=True, parser_class=_Parser)
    p = add(pool_sub, "create", cmd_pool_create, "create a pool in a directory")
    p.add_argument("--size", type=_size, help="pool size, e.g. 10G (default with --data: the device size)")
    p.add_argument("--block-size", type=_size, default=DEFAULT_BLOCK_SIZE, help="block size, 4K..16M (default 64K)")
    p.add_argument("--data", metavar="PATH", help="keep block data on this raw device or file instead of POOL/data")
    p.add_argument(
        "--object-size", type=_size, help="rados: pools: size of the RADOS objects holding data (default 4M)"
    )
    p = add(pool_sub, "status", cmd_pool_status, "show pool space and totals over its volumes")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p = add(pool_sub, "grow", cmd_pool_grow, "grow the pool's data store")
    p.add_argument("--size", type=_size, required=True, help="new pool size, e.g. 20G")
    p = add(pool_sub, "check", cmd_pool_check, "verify the committed metadata; exit 1 on any problem")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p = add(pool_sub, "set", cmd_pool_set, "change the out-of-space policy")
    p.add_argument(
        "--when-full",
        type=_checked(parse_when_full),
        metavar="error|wait:SECONDS",
        help="fail at once, or hold writes until space",
    )
    p.add_argument(
        "--low-water",
        type=_checked(parse_low_water),
        metavar="PERCENT|none",
        help="warn when unreserved free space falls below this",
    )
    p.add_argument("--on-low-water", metavar="COMMAND", help="shell command run at each low-water crossing")
    p.add_argument(
        "--autogrow",
        type=_checked(lambda text: text in ("none", "off") or parse_autogrow(text)),
        metavar="STEP:MAX|none",
        help="grow by STEP at the mark or when full, up to MAX",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p = add(pool_sub, "dump", cmd_pool_dump, "write the metadata in a neutral, versioned text (or JSON) form")
    p.add_argument("--json", action="store_true", help="JSON instead of the line-oriented text")
    p.add_argument("-o", "--output", metavar="FILE", help="write to FILE instead of standard output")
    p.add_argument("-f", "--force", action="store_true", help="overwrite FILE if it exists")
    p = add(pool_sub, "restore", cmd_pool_restore, "rebuild the metadata from a dump (pool must not be in use)")
    p.add_argument("file", metavar="FILE", help="a file written by 'pool dump' (text or --json)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar, even on a terminal")
    p = add(pool_sub, "remove", cmd_pool_remove, "delete a pool and every volume in it (not while served or attached)")
    p.add_argument("--yes", action="store_true", help="delete it even though volumes hold data (say what goes first)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p = add(pool_sub, "repair", cmd_pool_repair, "rebuild refcounts and free space from the readable mappings")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument(
        "--accept-rollback",
        action="store_true",
        help="accept metadata older than the data store: mappings of blocks given out after its generation"
        " are dropped (read as zeros) and every free block is punched",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar, even on a terminal")

    vol_p = sub.add_parser("volume", help="create, list, remove and resize volumes", description="Volume commands.")
    vol_sub = vol_p.add_subparsers(dest="volume_command", metavar="COMMAND", required=True, parser_class=_Parser)
    p = add(vol_sub, "create", cmd_volume_create, "create a thin volume")
    p.add_argument("name", metavar="NAME")
    p.add_argument("--size", type=_size, required=True, help="virtual size, e.g. 100G (may exceed the pool)")
    p.add_argument(
        "--detect-zeroes", choices=("off", "on", "unmap"), default="on", help="zero-write handling (default on)"
    )
    p = add(vol_sub, "list", cmd_volume_list, "list volumes and snapshots with exclusive and shared space")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p = add(vol_sub, "remove", cmd_volume_remove, "remove a volume; its space returns to the pool")
    p.add_argument("name", metavar="NAME")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p = add(vol_sub, "resize", cmd_volume_resize, "grow or shrink a volume (shrinking discards the cut-off part)")
    p.add_argument("name", metavar="NAME")
    p.add_argument("--size", type=_size, required=True, help="new virtual size")
    p.add_argument(
        "--allow-shrink", action="store_true", help="allow a smaller size (refused while clients have it open)"
    )
    p = add(vol_sub, "rename", cmd_volume_rename, "rename a volume (refused while clients have it open)")
    p.add_argument("name", metavar="OLD", help="its name now")
    p.add_argument("new_name", metavar="NEW", help="the name it takes")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p = add(vol_sub, "set", cmd_volume_set, "change a volume's settings")
    p.add_argument("name", metavar="NAME")
    p.add_argument("--detect-zeroes", choices=("off", "on", "unmap"), help="zero-write handling")
    p.add_argument("--reserve", type=_reserve_arg, metavar="SIZE|full|none", help="space set aside for this volume")
    p.add_argument(
        "--low-water",
        type=_checked(parse_low_water),
        metavar="PERCENT|none",
        help="warn when its unmapped share falls below this",
    )
    p.add_argument("--on-low-water", metavar="COMMAND", help="command for its low-water mark (default: the pool's)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p = add(vol_sub, "clone", cmd_volume_clone, "a writable volume sharing a snapshot's blocks")
    p.add_argument("snapshot", metavar="SNAPSHOT")
    p.add_argument("name", metavar="NEWVOLUME")
    p = add(vol_sub, "rollback", cmd_volume_rollback, "make a volume's contents a snapshot's again")
    p.add_argument("name", metavar="VOLUME")
    p.add_argument("snapshot", metavar="SNAPSHOT")

    maps.register(vol_sub, add)
    transfer.register(sub, vol_sub, add)

    snap_p = sub.add_parser("snapshot", help="create, list and remove snapshots", description="Snapshot commands.")
    snap_sub = snap_p.add_subparsers(dest="snapshot_command", metavar="COMMAND", required=True, parser_class=_Parser)
    p = add(snap_sub, "create", cmd_snapshot_create, "take a read-only snapshot (instant; blocks are shared)")
    p.add_argument("volume", metavar="VOLUME", help="a volume or a snapshot; or VOLUME@SNAP, rbd's form")
    p.add_argument("name", metavar="SNAPSHOT", nargs="?", help="the snapshot's name (default with VOLUME@SNAP: that)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p = add(snap_sub, "list", cmd_snapshot_list, "list snapshots")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p = add(snap_sub, "rename", cmd_snapshot_rename, "rename a snapshot (refused while clients have it open)")
    p.add_argument("name", metavar="OLD", help="its name now")
    p.add_argument("new_name", metavar="NEW", help="the name it takes")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p = add(snap_sub, "remove", cmd_snapshot_remove, "remove a snapshot; space returns when nothing shares it")
    p.add_argument("name", metavar="SNAPSHOT")
    p.add_argument("--json", action="store_true", help="machine-readable output")

    p = add(sub, "delta", cmd_delta, "byte ranges that differ between two volumes/snapshots (metadata only)")
    p.add_argument("source", metavar="FROM")
    p.add_argument("target", metavar="TO")
    p.add_argument("--json", action="store_true", help="machine-readable output")

    p = add(sub, "serve", cmd_serve, "serve every volume of the pool over NBD", pool=False)
    p.add_argument(
        "pool", metavar="POOL", nargs="?", help="pool directory, or rados:CEPHPOOL/NAME (or pool in --config)"
    )
    p.add_argument(
        "--config", metavar="FILE", help="TOML file of these options (max-connections = 64); the command line wins"
    )
    add_log_options(p)
    p.add_argument("--socket", metavar="PATH", help="unix socket path (default POOL/nbd.sock)")
    p.add_argument("--listen", metavar="[HOST:]PORT", help="also listen on TCP (host defaults to 127.0.0.1)")
    p.add_argument("--read-only", action="store_true", help="export every volume read-only")
    p.add_argument("--tls-cert", metavar="FILE", help="server certificate (PEM); makes TLS mandatory")
    p.add_argument("--tls-key", metavar="FILE", help="server private key (PEM)")
    p.add_argument("--tls-ca", metavar="FILE", help="CA for client certificates (then they are required)")
    p.add_argument(
        "--tls-authz",
        metavar="FILE",
        help="client certificates allowed in: lines NAME rw|ro EXPORTS|* (see docs/security.md); re-read on SIGHUP",
    )
    p.add_argument("--tls-psk", metavar="FILE", help="unavailable: Python 3.11's ssl has no TLS-PSK (docs/security.md)")
    p.add_argument(
        "--insecure", action="store_true", help="allow TCP without TLS (anyone reaching it has every volume)"
    )
    p.add_argument("--socket-mode", default="0600", metavar="MODE", help="unix socket mode (default 0600: owner only)")
    p.add_argument("--socket-group", metavar="GROUP", help="unix socket group, e.g. kvm (with --socket-mode 0660)")
    p.add_argument("--max-connections", type=int, default=256, metavar="N", help="clients at once (default 256)")
    p.add_argument(
        "--max-negotiating-per-address",
        type=int,
        default=16,
        metavar="N",
        help="connections one TCP address may have still negotiating (default 16)",
    )
    p.add_argument(
        "--max-connections-per-address",
        type=int,
        default=64,
        metavar="N",
        help="connections one TCP address may hold (default 64; unix-socket peers are not counted per address)",
    )
    p.add_argument(
        "--max-connections-per-identity",
        type=int,
        default=64,
        metavar="N",
        help="connections one TLS client certificate (its subject) may hold (default 64)",
    )
    p.add_argument(
        "--handshake-timeout", type=float, default=30.0, metavar="S", help="seconds to negotiate (default 30)"
    )
    p.add_argument(
        "--idle-timeout", type=float, default=10.0, metavar="S", help="silence allowed while negotiating (default 10)"
    )
    p.add_argument(
        "--payload-timeout",
        type=float,
        default=20.0,
        metavar="S",
        help="silence allowed in a write's payload while other clients wait for memory (default 20)",
    )
    p.add_argument(
        "--takeover",
        action="store_true",
        help="rados: pools: fence off the live holder and serve (see docs/ceph.md); with --volume: have those"
        " volumes handed over by the server that owns them",
    )
    p.add_argument(
        "--volume",
        action="append",
        dest="volumes",
        metavar="NAME",
        help="own and serve just this volume (repeat for more), sharing the pool with other such servers"
        " (directory pools; see docs/architecture.md#backends-and-ownership)",
    )
    p.add_argument(
        "--workers",
        type=_workers_arg,
        default=1,
        metavar="N|auto",
        help="serve with N worker processes behind one socket, the volumes dealt out among them (auto: one per"
        " core; default 1: one process owning the whole pool, as qemu-nbd serves). On a Ceph pool, a worker per"
        " volume whatever N, and a spare that claims the next",
    )
    p.add_argument(
        "--metrics",
        type=_metrics_address,
        metavar="[HOST:]PORT",
        help="serve Prometheus metrics on http://HOST:PORT/metrics (host defaults to 127.0.0.1; no authentication:"
        " see docs/monitoring.md)",
    )

    p = add(sub, "attach", cmd_attach, "attach a volume as a kernel block device (FUSE file + loop)", pool=False)
    p.add_argument("pool", metavar="POOL", nargs="?", help="pool directory")
    p.add_argument("name", metavar="NAME", nargs="?", help="volume name")
    p.add_argument("--list", action="store_true", help="show what is attached (of POOL, or of its volume NAME)")
    p.add_argument("--json", action="store_true", help="machine-readable output (with --list)")
    add_log_options(p)  # for the FUSE daemon it starts
    p = add(sub, "detach", cmd_detach, "detach a loop device (then the FUSE daemon when unused)", pool=False)
    p.add_argument("device", metavar="DEVICE|POOL", help="/dev/loopN printed by attach, or the pool of VOLUME")
    p.add_argument("volume", metavar="VOLUME", nargs="?", help="with POOL: detach the device attach made for it")
    p = add(
        sub,
        "mkfs",
        cmd_mkfs,
        "format a volume; skips zeroing when the pool knows it is zero (extra mkfs arguments after --)",
    )
    p.add_argument("name", metavar="NAME")
    p.add_argument("-t", "--type", default="ext4", choices=("ext4", "xfs"), help="filesystem (default ext4)")
    p.add_argument("-f", "--force", action="store_true", help="format even a volume that holds data (destroys it)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p = add(sub, "fuse-daemon", cmd_fuse_daemon, "internal: the FUSE daemon started by attach")
    p.add_argument("mountpoint", metavar="MOUNTPOINT")
    p.add_argument("--volume", help="own just this volume (a pool served per volume)")
    p.add_argument("--show", help="with --volume: the one volume or snapshot of it to show")
    add_log_options(p)

    p = add(
        sub, "quickstart", cmd_quickstart, "create the default pool and volume if missing and show them", pool=False
    )
    p.add_argument("--pool", default=DEFAULT_POOL, help=f"pool directory (default {DEFAULT_POOL})")
    p.add_argument("--size", type=_size, default=parse_size("16G"), help="pool size if created (default 16G)")
    p.add_argument("--volume", default="disk0", help="volume name (default disk0)")
    p.add_argument("--volume-size", type=_size, default=parse_size("64G"), help="volume size if created (default 64G)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p = add(sub, "completion", cmd_completion, "print the shell completion script for bash or zsh", pool=False)
    p.add_argument("shell", choices=("bash", "zsh"), help="the shell the script is for")
    add(sub, "manpage", cmd_manpage, "print the thinblock(1) man page (roff), built from this help", pool=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        try:
            return _run(list(sys.argv[1:] if argv is None else argv))
        finally:
            # As the program (not a caller passing argv, which may use its connections on):
            # its Ceph connections end with its command.
            cluster = sys.modules.get("thinblock.ceph.cluster")  # loaded only by rados: pools
            if cluster is not None and argv is None:
                cluster.disconnect_all()
    except (BrokenPipeError, OutputClosed):
        # The reader went away (| head -1), of what this process printed or of a job's
        # stream (written here or by the server running the job): stop quietly, as
        # tools killed by SIGPIPE do. Later flushes (at exit) must not fail again, so
        # stdout goes to /dev/null.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_PIPE


def _runs_a_program(argv: list[str]) -> bool:
    """Whether the command is mkfs, which passes the arguments after "--" to mkfs.TYPE:
    its first word naming a command is the command (options' values never do here)."""
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    return next((word for word in argv if word in commands), None) == "mkfs"


def _run(argv: list[str]) -> int:
    # For mkfs, everything after "--" belongs to the program it runs; for every other
    # command "--" only ends the options, and what follows is checked like the rest.
    extra: list[str] = []
    if "--" in argv and _runs_a_program(argv[: argv.index("--")]):
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1 :]
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # --help, --version, usage errors: flushed here, inside main's guard
        sys.stdout.flush()
        return int(exc.code or 0) if not isinstance(exc.code, str) else EXIT_USAGE
    if getattr(args, "config", None):
        # The file's settings become the command's defaults; parsing again lets the
        # command line win (frontends/cli/config.py).
        try:
            parser = build_parser()
            config.apply(parser, config.subparser(parser, args.command), args.config)
            args = parser.parse_args(argv)
        except UsageError as exc:
            print(f"thinblock: error: {exc}", file=sys.stderr)
            return EXIT_USAGE
        except SystemExit as exc:
            sys.stdout.flush()
            return int(exc.code or 0) if not isinstance(exc.code, str) else EXIT_USAGE
    args.extra = extra
    # librados reads these; the FUSE daemon that attach starts inherits them.
    if args.ceph_conf:
        os.environ["CEPH_CONF"] = os.path.abspath(args.ceph_conf)
    if args.ceph_id:
        os.environ["CEPH_ID"] = args.ceph_id
    if args.wait is not None:
        os.environ["THINBLOCK_WAIT_S"] = str(args.wait)
    try:
        result = args.func(args)
        sys.stdout.flush()
    except OutputClosed:
        raise  # main's quiet 141
    except (ThinblockError, OpError) as exc:
        print(f"thinblock: error: {exc.strerror if isinstance(exc, OpError) else exc}", file=sys.stderr)
        return EXIT_USAGE if isinstance(exc, UsageError) else EXIT_FAILED
    except KeyboardInterrupt as exc:  # Ctrl-C; a job's SIGTERM or SIGHUP too (cli/signals.py)
        return 128 + getattr(exc, "signum", 2)
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
