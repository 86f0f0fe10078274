"""What a rank says, for the launcher to report: its stderr in a file of its own, written by the
OS as it comes (so a rank's last words before an abort are kept, whatever captured the
launcher's output), the line of it that says why the rank ended, and a failed rank's traceback
and exit code in one line each (pool.py's WorkerError puts them in its first line)."""
import os
import re
import signal
import sys


def raised(traceback_text):
    """A worker's traceback in one line: its exception's first line, and its last one where
    the message runs over several (an NCCL error names the failed CUDA call there)."""
    lines = traceback_text.rstrip().splitlines()
    frames = [i for i, line in enumerate(lines) if line.startswith("  File ")]
    start = frames[-1] + 1 if frames else 0
    text = [line.strip() for line in lines[start:] if line.strip() and not line[0].isspace()]
    if not text:
        return lines[-1].strip() if lines else "(no traceback)"
    return text[0] if len(text) == 1 else f"{text[0]} ... {text[-1]}"


_SIGNAL_MEANING = {
    "SIGABRT": "an abort, as NCCL's watchdog aborts a rank whose collective failed or timed out",
    "SIGKILL": "the out-of-memory killer's signal, unless someone else sent it",
    "SIGSEGV": "a crash in native code",
}


def exit_meaning(code):
    """A worker's exit code in words: a negative one is the signal that ended it."""
    if code is None or code >= 0:
        return f"exit code {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    meaning = _SIGNAL_MEANING.get(name)
    return f"exit code {code}, {name}" + (f": {meaning}" if meaning else "")


# A folder for the ranks' own stderr, one file per rank (see `WorkerPool`).
RANK_LOGS_ENV = "TENSOR_PARALLEL_TOY_RANK_LOGS"


def rank_log(folder, rank, world_size):
    """A new file for this rank's stderr: rank<r>-of-<n>.log, or -2, -3, ... where an earlier
    pool of that size (one that failed, say, or another process's) has its own."""
    for k in range(1, 1000):
        path = os.path.join(folder, f"rank{rank}-of-{world_size}{f'-{k}' if k > 1 else ''}.log")
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            return path
        except FileExistsError:
            continue
    raise RuntimeError(f"no free name for rank {rank}'s stderr in {folder}")


def stderr_to(path):
    """This process's stderr (file descriptor 2, so C++'s and NCCL's errors too) into `path`,
    written by the OS as it comes: what a rank says just before it dies is there. Its stdout
    (a profile's progress lines) stays where it was."""
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o666)
    os.dup2(fd, 2)
    os.close(fd)


# Lines of a native stack trace say where, not why (NCCL's watchdog prints two or three).
_FRAMES = re.compile(r"^\s*(frame #\d+:|Exception raised from )")
_CAUSE = re.compile(r"Watchdog caught|what\(\):|NCCL WARN|Error|error")


def last_lines(path, most=6):
    """The last lines of a rank's stderr file that are neither empty nor stack frames ([] if
    there is none)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - (1 << 16)))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return []
    return [line.rstrip() for line in text.splitlines()
            if line.strip() and not _FRAMES.match(line)][-most:]


def last_words(path):
    """The line of a rank's stderr that best says why it ended: the last naming a cause (NCCL's
    watchdog, a C++ exception's what(), an NCCL warning, an error), else its last line."""
    lines = last_lines(path, most=200)
    causes = [line for line in lines if _CAUSE.search(line)]
    return (causes or lines or [None])[-1]


def remove_if_empty(logs):
    """A rank that said nothing leaves no file, and a folder of none is removed."""
    for path in filter(None, logs):
        try:
            if os.path.getsize(path) == 0:
                os.remove(path)
            os.rmdir(os.path.dirname(path))
        except OSError:  # not empty, or gone
            pass
