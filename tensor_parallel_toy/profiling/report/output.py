"""Atomic output files: a reader (or a crash) never sees a half-written results file."""
import contextlib
import os
import tempfile


@contextlib.contextmanager
def atomic_path(path):
    """Yield a temporary path next to `path`; on success rename it over `path` (atomic on one
    file system), on failure remove it. The file gets the usual permissions (0666 & ~umask),
    not mkstemp's private 0600."""
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix="-" + os.path.basename(path))
    os.close(fd)
    try:
        yield tmp
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def write_text(path, text):
    with atomic_path(path) as tmp:
        with open(tmp, "w") as f:
            f.write(text)
