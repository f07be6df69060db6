"""One-line errors for the command-line tools (``mmcache``, ``mmtrain``).

A user error (the project's own ``ValueError`` subclasses, and operating-system errors a user
can fix) is printed as one ``Error: ...`` line that says what to do, and the command exits 1;
anything else keeps its traceback. ``--debug`` or ``MMCACHE_DEBUG=1`` shows them all
(docs/design/store.md, "User errors").
"""

from __future__ import annotations

import errno
import os
import tempfile
from typing import Any

import click

from .secrets import redact

DEBUG_ENV = "MMCACHE_DEBUG"
PROJECT_PACKAGES = frozenset({"mmcache"})

_OS_HINTS = {
    errno.ENOSPC: "the disk is full: free some space or choose a location on another disk",
    errno.EDQUOT: "the disk quota is used up: free some space or choose another location",
    errno.EROFS: "the file system is read-only: choose a writable location",
    errno.EACCES: "permission denied: choose a location you can write to (or fix its permissions)",
    errno.EPERM: "operation not permitted: choose a location you can write to (or fix its permissions)",
    errno.ENOTDIR: "a file is in the way where a folder is needed: choose another path",
    errno.EEXIST: "a file is in the way where a folder is needed: choose another path",
    errno.EISDIR: "this is a folder where a file is needed: choose another path",
    errno.ENOENT: "if it belongs to a feature store, that store is damaged: run `mmcache verify` on it",
    errno.ENAMETOOLONG: "the path is too long: choose a shorter one",
    errno.EMFILE: "too many open files: raise the limit (ulimit -n)",
}


def debug_requested(ctx: click.Context | None = None) -> bool:
    if os.environ.get(DEBUG_ENV, "").strip().lower() in ("1", "true", "yes", "on"):
        return True
    while ctx is not None:
        if ctx.params.get("debug"):
            return True
        ctx = ctx.parent
    return False


def user_message(exc: BaseException) -> str | None:
    """The one line to show for a user error, or None when ``exc`` is a bug (show its traceback)."""
    if isinstance(exc, ValueError) and type(exc).__module__.split(".")[0] in PROJECT_PACKAGES:
        return redact(exc)
    if isinstance(exc, OSError) and exc.errno in _OS_HINTS:
        where = next((str(name) for name in (exc.filename, exc.filename2) if name), None)
        what = exc.strerror or os.strerror(exc.errno)
        return redact(f"{where}: {what}; {_OS_HINTS[exc.errno]}" if where else f"{what}; {_OS_HINTS[exc.errno]}")
    return None


class UserErrorGroup(click.Group):
    """A click group whose commands report user errors in one line (see the module doc)."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (click.ClickException, click.exceptions.Exit, click.exceptions.Abort):
            raise
        except Exception as exc:
            message = None if debug_requested(ctx) else user_message(exc)
            if message is None:
                raise
            raise click.ClickException(message) from None


debug_option = click.option(
    "--debug", is_flag=True, default=False, is_eager=True,
    help=f"Show the full traceback of an error (also: {DEBUG_ENV}=1).",
)


def check_output_location(path: str, option: str) -> None:
    """Fail fast, before minutes of start-up, when a local output cannot be created: it is a
    file, a file is in the way, or the nearest existing folder is not writable."""
    if "://" in path and not path.startswith("file://"):
        return
    target = os.path.abspath(os.path.expanduser(path.removeprefix("file://")))
    if os.path.exists(target) and not os.path.isdir(target):
        raise click.ClickException(f"{option} {path}: is a file, not a folder; choose a folder (new or existing)")
    existing = target
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise click.ClickException(f"{option} {path}: {existing} is a file, so no folder can be made there; choose another path")
    probe = target if os.path.isdir(target) else existing
    if not os.access(probe, os.W_OK | os.X_OK):
        why = "a read-only file system" if os.statvfs(probe).f_flag & os.ST_RDONLY else "permission denied"
        raise click.ClickException(f"{option} {path}: {probe} is not writable ({why}); choose a location you can write to")
    # What access() allows, a file system may still refuse (/proc, /sys: root may "write" there,
    # yet nothing can be made): a folder made and removed at once tells.
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".mmcache-probe-", dir=probe))
    except OSError as exc:
        raise click.ClickException(f"{option} {path}: nothing can be created in {probe} ({exc.strerror}: a virtual file system?); "
                                   "choose a location you can write to") from None
