"""Files written whole or not at all: the atomic write that checkpoints (``vgraph.io``) and
drawings (``vgraph.render``) share. A base module: it imports nothing of vgraph."""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from collections.abc import Callable
from typing import Any, BinaryIO


def _create_temp(directory: str, base: str) -> tuple[int, str]:
    """Create a new empty file next to the target. Mode 0o666 minus the umask, like any new file
    (``tempfile.mkstemp`` would make it 0o600). Its name holds our process id, so that a later
    save can tell a temporary file of a killed save from one being written right now."""
    for _ in range(100):
        tmp = os.path.join(directory, f".{base}.{os.getpid()}-{secrets.token_hex(6)}.tmp")
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666), tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"could not create a temporary file in {directory!r}")


def _pid_alive(pid: int) -> bool:
    if os.name != "posix":  # os.kill(pid, 0) is not a probe on Windows
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # exists, but is another user's
    return True


def _remove_stale_temps(directory: str, base: str) -> None:
    """Remove temporary files that a killed save of the same target left behind: those whose
    writer process no longer exists. A save in progress (another live process) is left alone."""
    prefix = f".{base}."
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        if not (name.startswith(prefix) and name.endswith(".tmp")):
            continue
        tag = name[len(prefix) : -len(".tmp")]
        pid_text, dash, token = tag.partition("-")
        if dash and pid_text.isdigit() and len(token) == 12:
            pid = int(pid_text)
            if pid == os.getpid() or _pid_alive(pid):
                continue
        elif not (len(tag) == 12 and all(c in "0123456789abcdef" for c in tag)):
            continue  # not a name we make (vgraph 0.1 made ".<base>.<12 hex>.tmp")
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(directory, name))


def _fsync_dir(directory: str) -> None:
    """Make the rename durable (POSIX); a no-op where directories cannot be opened."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _naming(error: OSError, path: str, what: str) -> OSError:
    """``error`` (raised while writing the temporary file or renaming it) as the same kind of
    OSError, with the same errno, naming ``path`` (``what`` it is) and saying it was not replaced."""
    reason = error.strerror or str(error) or type(error).__name__
    text = f"{reason}: cannot write the {what} (nothing was replaced; a previous file is intact)"
    if error.errno is None:  # not from the OS (it would have one); a filename would print "[Errno None]"
        return type(error)(f"{text}: {path!r}")
    return OSError(error.errno, text, path)  # OSError picks the subclass of the errno (ENOSPC: OSError)


def write_atomically(path: str, write: Callable[[BinaryIO], Any], what: str = "file") -> None:
    """Write a file at ``path`` whole or not at all: ``write(f)`` fills a new temporary file next
    to it, which is synced and renamed over ``path`` once complete (keeping an existing file's
    permissions). A failure, or an interruption, leaves no partial file and an earlier file
    intact; temporary files of a killed writer of the same target are removed on the next write.
    ``what`` names the file in messages (a checkpoint, a drawing).

    Raises:
        PermissionError: ``path`` exists and is read-only, or the directory is not writable.
        IsADirectoryError: ``path`` is a directory. OSError: other I/O failures (the same
            errno, with ``filename`` = ``path``).
    """
    directory = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise IsADirectoryError(errno.EISDIR, f"Is a directory, not a {what} file", path)
    try:
        mode: int | None = stat.S_IMODE(os.stat(path).st_mode)  # keep an existing file's permissions
    except OSError:
        mode = None
    if mode is not None and not os.access(path, os.W_OK):
        # np.save / torch.save open the file for writing and fail; replacing it by a rename would
        # silently overwrite a file its owner protected.
        raise PermissionError(errno.EACCES, f"Permission denied: the {what} is read-only, not replaced", path)
    _remove_stale_temps(directory, os.path.basename(path))
    try:
        fd, tmp = _create_temp(directory, os.path.basename(path))
    except PermissionError as e:
        raise PermissionError(
            errno.EACCES, "Permission denied: cannot create a file in the directory", path
        ) from e
    except FileNotFoundError as e:
        raise FileNotFoundError(errno.ENOENT, f"No such directory to save the {what} in", path) from e
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise _naming(e, path, what) from e
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(directory)
