"""Commands that move data: import, export, export-diff, import-diff, volume sparsify.

The command opens what the user named (with the user's rights), then hands the
open files to whoever holds the pool: this process, or the server, over its
control socket (admin/jobs.py). Summaries go to stdout (--json for scripts);
when stdout carries the data (DEST -), the summary goes to stderr instead.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import select
import stat
import sys
from collections.abc import Callable, Iterator
from typing import Any

from thinblock.admin.access import Admin, LocalAdmin, SharedAdmin, open_admin, wait_s
from thinblock.admin.jobs import close_fds
from thinblock.errors import ThinblockError
from thinblock.formats.rbd import IMAGE_V2
from thinblock.frontends.cli.common import UsageError, emit, size_arg
from thinblock.frontends.cli.dest import Destination, mode_arg, open_destination
from thinblock.frontends.cli.progress import progress_bar, wanted
from thinblock.frontends.cli.signals import Interrupted, job_signals
from thinblock.sizes import format_size
from thinblock.transfer.images import QCOW2_MAGIC, is_nbd_uri
from thinblock.transfer.qcow2 import backing_chain

Add = Callable[..., argparse.ArgumentParser]


def _job(args: argparse.Namespace, label: str, verb: str, fds: list[int], **job_args: Any) -> Any:
    """Run a job verb on the pool, with a bar for it (and for recovery at open)."""
    show = wanted(args)
    handed = False
    try:
        # SIGTERM and SIGHUP cancel the job as Ctrl-C does (signals.py): the job
        # unwinds, then the pool closes and its control socket goes.
        with (
            job_signals() as signals,
            progress_bar("recovering free space", show) as recovering,
            progress_bar(label, show) as bar,
            open_admin(args.pool, progress=signals.checked(recovering)) as found,
            _job_admin(found, verb, job_args) as admin,
        ):
            handed = True  # the job owns the files from here on, and closes them
            try:
                if isinstance(admin, LocalAdmin):  # the job runs here: signals wait for its safe points
                    return admin.job(verb, fds, signals.checked(bar), check=signals.check, **job_args)
                signals.go_asynchronous()  # a server runs it: this process only waits on a socket
                return admin.job(verb, fds, bar, **job_args)
            finally:
                signals.defer()
    except Interrupted as exc:
        print(f"thinblock: {label} cancelled by {exc}", file=sys.stderr)
        raise
    finally:
        if not handed:
            close_fds(fds)


@contextlib.contextmanager
def _job_admin(admin: Admin, verb: str, job_args: dict[str, Any]) -> Iterator[Admin]:
    """On a pool served per volume, where the job runs: at its volume's server, or here."""
    if isinstance(admin, SharedAdmin):
        with admin.for_job(verb, job_args) as chosen:
            yield chosen
    else:
        yield admin


def _summary(args: argparse.Namespace, data: Any, human: Callable[[Any], str], *, to_stderr: bool = False) -> None:
    if to_stderr:
        print(human(data), file=sys.stderr)
    else:
        emit(args, data, human)


def _secs(result: dict[str, Any]) -> str:
    return f"in {result['seconds']:.1f} s"


# ----- import / export --------------------------------------------------------------


def cmd_import(args: argparse.Namespace) -> None:
    source = args.source
    fds: list[int] = []
    if source == "-":
        if args.format == "qcow2":
            raise UsageError("a qcow2 image cannot be read from a stream: give its file name")
        kind, fds = "rbd" if args.format == "rbd" else "stream", [os.dup(sys.stdin.fileno())]
        shown = "standard input"
    elif is_nbd_uri(source):
        if args.format not in ("auto", "raw"):
            raise UsageError("an NBD source is read as it is served: --format applies to files")
        kind, shown = "nbd", source
    else:
        fd, fifo = _open_source(source)  # a named pipe is read as a stream, as - is
        if fifo and args.format == "qcow2":
            os.close(fd)
            raise UsageError("a qcow2 image cannot be read from a stream: give its file name")
        fmt = args.format
        if fmt == "auto" and not fifo:
            head = os.pread(fd, len(IMAGE_V2), 0)
            fmt = "qcow2" if head[:4] == QCOW2_MAGIC else "rbd" if head == IMAGE_V2 else "raw"
        kind, fds = ("qcow2" if fmt == "qcow2" else "rbd" if fmt == "rbd" else "stream" if fifo else "file"), [fd]
        shown = args.source
    backing: list[str] = []
    if args.allow_backing:
        if kind != "qcow2":
            close_fds(fds)
            raise UsageError("--allow-backing is for a qcow2 image file")
        try:
            chain = backing_chain(fds[0], source)
        except ThinblockError:
            close_fds(fds)
            raise
        fds += [fd for _, _, fd in chain[1:]]
        backing = [f"{fmt}:{path}" for path, fmt, _ in chain[1:]]
        if backing:  # said before any of them is read
            files = ", ".join(f"{path} ({fmt})" for path, fmt, _ in chain[1:])
            print(f"import: --allow-backing: {source} reads its backing chain: {files}", file=sys.stderr)
    if args.size is not None and kind != "stream":
        close_fds(fds)
        raise UsageError("--size is for a stream (-): a file or NBD export has its own size")
    result = _job(
        args,
        "import",
        "import",
        fds,
        name=args.volume,
        source_kind=kind,
        source=source if kind != "stream" else "-",
        size_bytes=args.size,
        force=args.force,
        max_size_bytes=args.max_size,
        backing=backing,
    )

    def human(r: dict[str, Any]) -> str:
        made = "created" if r["created"] else "into the existing"
        snaps = f", snapshots {', '.join(r['snapshots'])}" if r.get("snapshots") else ""
        return (
            f"imported {shown} into {r['volume']} ({made} {format_size(r['size_bytes'])} volume{snaps}):"
            f" {format_size(r['read_bytes'])} read, {format_size(r['written_bytes'])} written,"
            f" {format_size(r['zero_bytes_skipped'])} of zeros skipped, {_secs(r)}"
        )

    _summary(args, result, human)


def _open_source(path: str) -> tuple[int, bool]:
    """(fd, whether it is a named pipe) of a file to read. A FIFO is opened without
    blocking (a blocking open waits for a writer forever) and then waited on for a
    writer for at most --wait seconds, with a sentence if none comes."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        raise UsageError(f"cannot open {path}: {exc.strerror}") from None
    mode = os.fstat(fd).st_mode
    if stat.S_ISDIR(mode):
        os.close(fd)
        raise UsageError(f"{path} is a directory, not an image to import (the source comes first: SOURCE POOL VOLUME)")
    if not stat.S_ISFIFO(mode):
        os.set_blocking(fd, True)
        return fd, False
    budget = wait_s()
    # Until a writer opens it, a FIFO polls as nothing at all (no POLLIN, no POLLHUP).
    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLHUP)
    if not poller.poll(int(budget * 1000)):
        os.close(fd)
        raise UsageError(f"nothing writes to the named pipe {path}: waited {budget:g} s (--wait) for a writer")
    os.set_blocking(fd, True)
    return fd, True


def _stdout(args: argparse.Namespace, command: str, what: str) -> list[int]:
    """Standard output as the job's destination, when it can be one."""
    if args.json:
        raise UsageError(f"{command} to - writes {what} to stdout: --json has nowhere to go")
    if sys.stdout.isatty():
        raise UsageError(f"refusing to write {what} to a terminal: redirect stdout or give a file")
    fd = os.dup(sys.stdout.fileno())
    # From here the job's copy is the only one: when the job closes it, the reader
    # sees the end (| import-diff - on the same pool runs its job in this process,
    # which then waits for it). Anything this command prints goes to stderr.
    sys.stdout.flush()
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, sys.stdout.fileno())
    os.close(null)
    return [fd]


@contextlib.contextmanager
def _into_place(dest: Destination | None) -> Iterator[None]:
    """The job writes dest; on success it is put in place, on any failure undone."""
    try:
        yield
    except BaseException:
        if dest is not None:
            dest.discard()
        raise
    if dest is not None:
        dest.commit()


def cmd_export(args: argparse.Namespace) -> None:
    dest, opened = args.dest, None
    to_stdout = dest == "-"
    if args.mode is not None and (to_stdout or is_nbd_uri(dest)):
        raise UsageError("--mode applies to a file DEST")
    if args.no_snapshots and args.format != "rbd":
        raise UsageError("--no-snapshots is for --format rbd: a raw image holds no snapshots")
    fmt_args = {"snapshots": False} if args.no_snapshots else {}
    if to_stdout:
        kind, fds = "stream", _stdout(args, "export", "a disk image")
    elif is_nbd_uri(dest):
        kind, fds = "nbd", []
    else:
        opened = open_destination(dest, force=args.force, mode=args.mode)
        kind, fds = "file", [opened.fd]
    with _into_place(opened):
        result = _job(
            args, "export", "export", fds, name=args.name, dest_kind=kind, dest=dest, format=args.format, **fmt_args
        )
    _left_out(result.get("left_out", []))

    def human(r: dict[str, Any]) -> str:
        snaps = f", with snapshots {', '.join(r['snapshots'])}" if r.get("snapshots") else ""
        return (
            f"exported {r['name']} to {dest} ({r['format']}{snaps}): {format_size(r['written_bytes'])} of data"
            f" in {format_size(r['size_bytes'])}, {_secs(r)}"
        )

    _summary(args, result, human, to_stderr=to_stdout)


def _left_out(left_out: list[dict[str, str]]) -> None:
    """Say on stderr which snapshots an rbd-format export did not carry, and why."""
    by_why: dict[str, list[str]] = {}
    for entry in left_out:
        by_why.setdefault(entry["why"], []).append(entry["name"])
    for why, names in by_why.items():
        print(f"export: left out of the rbd stream: {', '.join(names)} ({why})", file=sys.stderr)


# ----- rbd diffs --------------------------------------------------------------------


def cmd_export_diff(args: argparse.Namespace) -> None:
    dest, opened = args.file, None
    to_stdout = dest == "-"
    if args.mode is not None and to_stdout:
        raise UsageError("--mode applies to a file FILE")
    if to_stdout:
        fds = _stdout(args, "export-diff", "a diff")
    else:
        opened = open_destination(dest, force=args.force, mode=args.mode)
        fds = [opened.fd]
    with _into_place(opened):
        result = _job(
            args,
            "export-diff",
            "export_diff",
            fds,
            name=args.name,
            dest=dest,
            from_snap=args.from_snap,
            version=args.export_format,
        )

    def human(r: dict[str, Any]) -> str:
        span = f"{r['from_snap'] or '(empty)'} -> {r['to_snap'] or r['name']}"
        return (
            f"wrote rbd diff v{r['version']} of {r['name']} ({span}) to {dest}: {format_size(r['data_bytes'])}"
            f" of data, {format_size(r['zero_bytes'])} zeroed, {format_size(r['stream_bytes'])} stream, {_secs(r)}"
        )

    _summary(args, result, human, to_stderr=to_stdout)


def cmd_import_diff(args: argparse.Namespace) -> None:
    if args.file == "-":
        fds = [os.dup(sys.stdin.fileno())]
    else:
        fds = [_open_source(args.file)[0]]
    result = _job(
        args,
        "import-diff",
        "import_diff",
        fds,
        name=args.volume,
        source=args.file,
        force=args.force,
        allow_resize=args.allow_resize,
        max_size_bytes=args.max_size,
    )

    def human(r: dict[str, Any]) -> str:
        snap = f", created snapshot {r['to_snap']}" if r["to_snap"] else ""
        base = f" from {r['from_snap']}" if r["from_snap"] else ""
        return (
            f"applied the diff to {r['volume']}{base}{snap}: {format_size(r['written_bytes'])} written,"
            f" {format_size(r['zeroed_bytes'])} zeroed, {_secs(r)}"
        )

    _summary(args, result, human)


# ----- sparsify -----------------------------------------------------------------------


def cmd_sparsify(args: argparse.Namespace) -> None:
    result = _job(args, "sparsify", "volume_sparsify", [], name=args.name)

    def human(r: dict[str, Any]) -> str:
        return (
            f"sparsified {r['volume']}: {format_size(r['freed_bytes'])} returned to the pool"
            f" ({format_size(r['unmapped_bytes'])} of zero blocks unmapped, {format_size(r['zeroed_bytes'])}"
            f" kept provisioned as ZEROED, {format_size(r['shared_zero_bytes'])} shared with snapshots or clones"
            f" left as they are; {format_size(r['data_bytes'])} examined), {_secs(r)}"
        )

    _summary(args, result, human)


# ----- the parser -----------------------------------------------------------------------


def _job_options(p: argparse.ArgumentParser, *, json_ok: bool = True) -> None:
    p.add_argument("--no-progress", action="store_true", help="no progress bar, even on a terminal")
    if json_ok:
        p.add_argument("--json", action="store_true", help="machine-readable summary on stdout")


def _mode_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--mode",
        type=mode_arg,
        metavar="OCTAL",
        help="the file's mode (default 600: an export holds the volume's bytes); never written through a symlink",
    )


def register(sub: Any, vol_sub: Any, add: Add) -> None:
    p = add(sub, "import", cmd_import, "copy a raw or qcow2 image, an NBD export or a stream into a volume", pool=False)
    p.add_argument("source", metavar="SOURCE", help="a file (raw or qcow2), an NBD URI (nbd://, nbd+unix://), or -")
    p.add_argument("pool", metavar="POOL")
    p.add_argument("volume", metavar="VOLUME", help="created with the source's size unless it exists with that size")
    p.add_argument(
        "--format",
        choices=("auto", "raw", "qcow2", "rbd"),
        default="auto",
        help="SOURCE's format: auto (a file's first bytes say), raw, qcow2, or rbd (an 'rbd image v2' stream)",
    )
    p.add_argument("--size", type=size_arg, help="the volume's size when SOURCE is - and the volume is new")
    p.add_argument(
        "--max-size",
        type=size_arg,
        metavar="SIZE",
        help="refuse a source whose (virtual) size is beyond SIZE, before anything is read (default: the"
        " largest volume, 8E)",
    )
    p.add_argument(
        "--allow-backing",
        action="store_true",
        help="let a qcow2 image read its backing chain of local files (named before the import starts);"
        " by default an image with a backing file is refused",
    )
    p.add_argument(
        "-f",
        "--force",
        action="store_true",
        help="overwrite a volume that holds data; import a qcow2 image that qemu-img check finds damaged",
    )
    _job_options(p)

    p = add(sub, "export", cmd_export, "copy a volume or snapshot to a sparse raw file, an NBD export or a stream")
    p.add_argument("name", metavar="VOLUME|SNAPSHOT")
    p.add_argument("dest", metavar="DEST", help="a file (holes stay holes), an NBD URI, or - (stdout)")
    p.add_argument(
        "--format",
        choices=("raw", "rbd"),
        default="raw",
        help="raw, or rbd's 'rbd image v2' stream (rbd import --export-format 2), which carries the volume's snapshots",
    )
    p.add_argument(
        "--no-snapshots",
        action="store_true",
        help="with --format rbd: write the volume (or snapshot) alone, without its snapshots",
    )
    p.add_argument("-f", "--force", action="store_true", help="overwrite DEST if it exists")
    _mode_option(p)
    _job_options(p)

    p = add(sub, "export-diff", cmd_export_diff, "write what changed since a snapshot as an rbd diff (v1 or v2)")
    p.add_argument("name", metavar="VOLUME|SNAPSHOT", help="the diff ends here (a volume: as it is now)")
    p.add_argument("file", metavar="FILE|-")
    p.add_argument("--from-snap", metavar="SNAPSHOT", help="the diff starts here (default: an empty image)")
    p.add_argument("--export-format", type=int, choices=(1, 2), default=1, help="rbd diff v1 (default) or v2")
    p.add_argument("-f", "--force", action="store_true", help="overwrite FILE if it exists")
    _mode_option(p)
    _job_options(p)

    p = add(sub, "import-diff", cmd_import_diff, "apply an rbd diff to a volume, all or nothing", pool=False)
    p.add_argument("file", metavar="FILE|-")
    p.add_argument("pool", metavar="POOL")
    p.add_argument("volume", metavar="VOLUME")
    p.add_argument(
        "-f", "--force", action="store_true", help="apply even if the volume changed since the diff's from-snapshot"
    )
    p.add_argument(
        "--allow-resize",
        action="store_true",
        help="let the diff's size record resize the volume (as rbd import-diff does); by default a diff of"
        " another size is refused",
    )
    p.add_argument(
        "--max-size",
        type=size_arg,
        metavar="SIZE",
        help="with --allow-resize, refuse a diff that would make the volume larger than SIZE (default: 8E)",
    )
    _job_options(p)

    p = add(vol_sub, "sparsify", cmd_sparsify, "give back the space of blocks that hold only zeros (online)")
    p.add_argument("name", metavar="VOLUME")
    _job_options(p)
