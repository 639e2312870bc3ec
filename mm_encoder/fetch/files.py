"""file:// URLs: off unless the operator allows directories; the real path is checked (symlinks
and ``..`` cannot escape), then what was actually opened is checked again."""

from __future__ import annotations

import asyncio
import os
import stat

from yarl import URL

from ..core.errors import FetchError
from .policy import ALLOW_DIRS_ENV, Fetched, FetchPolicy, shorten, too_large

_CHUNK = 64 * 1024


async def read_file_url(url: str, policy: FetchPolicy) -> Fetched:
    """A file:// URL, only where its real path lies under one of `policy.allow_file_dirs`."""
    shown = shorten(url)
    if not policy.allow_file_dirs:
        raise FetchError(
            "forbidden_path",
            f"file:// URLs are disabled ({shown!r}); upload the bytes, or allow a directory ({ALLOW_DIRS_ENV})",
        )
    try:
        parsed = URL(url)
    except (ValueError, TypeError) as e:
        raise FetchError("bad_url", f"URL {shown!r} does not parse: {e}") from None
    if parsed.host not in (None, "", "localhost") or parsed.user is not None:
        raise FetchError("bad_url", f"file URL {shown!r} names a host; use file:///absolute/path")
    path = parsed.path
    if not path.startswith("/") or "\x00" in path:
        raise FetchError("bad_url", f"file URL {shown!r} needs an absolute path: file:///absolute/path")
    real = os.path.realpath(path)
    roots = [os.path.realpath(d) for d in policy.allow_file_dirs]
    if not any(_under(real, root) for root in roots):
        raise FetchError(
            "forbidden_path",
            # the resolved path is not echoed: it would disclose symlink targets to the user
            f"{path!r} resolves outside the allowed directories; move the file under one of them or allow "
            f"its directory ({ALLOW_DIRS_ENV})",
        )
    return await asyncio.to_thread(_read_file, real, roots, url, shown, policy.max_bytes)


def _read_file(real: str, roots: list[str], url: str, shown: str, cap: int) -> Fetched:
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(real, flags)
    except FileNotFoundError:
        raise FetchError("fetch_failed", f"no file at {real!r} ({shown!r}); check the path") from None
    except OSError as e:
        raise FetchError("forbidden_path", f"cannot open {real!r} ({shown!r}): {e.strerror}") from None
    try:
        # The path was checked before opening; re-check what was actually opened (a directory swapped
        # for a symlink in between would show here).
        opened = _fd_path(fd)
        if opened is not None and not any(_under(opened, root) for root in roots):
            raise FetchError("forbidden_path", f"{real!r} changed while opening; refused")
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise FetchError("forbidden_path", f"{real!r} is not a regular file; only regular files are read")
        if st.st_size > cap:
            raise FetchError("too_large", too_large(shown, f"{st.st_size} bytes", cap))
        chunks: list[bytes] = []
        total = 0
        while chunk := os.read(fd, min(_CHUNK * 16, cap + 1 - total)):
            chunks.append(chunk)
            total += len(chunk)
            if total > cap:
                raise FetchError("too_large", too_large(shown, f"more than {cap} bytes", cap))
    except OSError as e:
        raise FetchError("fetch_failed", f"reading {real!r} failed: {e.strerror}") from None
    finally:
        os.close(fd)
    return Fetched(b"".join(chunks), url, None, 0)


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def _fd_path(fd: int) -> str | None:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None
