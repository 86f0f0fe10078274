"""What gpu-check finds on a machine before it starts a rank: whether CUDA starts (and if not,
whether torch is a CPU build or CUDA failed, and which torch wheel the driver runs), and each
GPU's compute mode (one that admits a single process cannot host two ranks).

The driver and compute mode come from `nvidia-smi`, which ships with NVIDIA's driver; where it is
missing they are reported as unknown, never guessed.
"""
import os
import subprocess

# torch 2.13.0's CUDA builds, newest first: (oldest Linux driver branch that runs it, the CUDA
# generation, how to install it). A CUDA 13 build needs driver >= 580.65.06 and a CUDA 12 build
# >= 525.60.13 (NVIDIA's CUDA toolkit release notes, the minor version compatibility table);
# PyPI's torch is the CUDA 13 build, download.pytorch.org carries the CUDA 12 ones.
WHEELS = [
    (580, "13", "pip install torch==2.13.0"),
    (525, "12", "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cu126"),
]


def _nvidia_smi(*query):
    """nvidia-smi's CSV answer to `--query-gpu=...`, one list per GPU, or None where it is
    missing or fails."""
    try:
        done = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(query)}",
                               "--format=csv,noheader"], capture_output=True, text=True,
                              timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        return None
    return [[field.strip() for field in line.split(",")] for line in done.stdout.splitlines()
            if line.strip()]


def driver_version():
    """The NVIDIA driver's version string (e.g. '580.95.05'), or None where it is unknown."""
    rows = _nvidia_smi("driver_version")
    return rows[0][0] if rows else None


def wheel_for(driver):
    """(CUDA generation, install command) of the torch build that `driver` runs, or None for a
    driver too old for any (or an unknown one)."""
    try:
        branch = int(str(driver).split(".")[0])
    except ValueError:
        return None
    return next(((cuda, command) for oldest, cuda, command in WHEELS if branch >= oldest), None)


def wheel_advice(driver):
    """One phrase: which torch build this machine's driver runs, and the command."""
    if driver is None:
        ranges = [f"{oldest} or newer" if i == 0 else f"{oldest} to {WHEELS[i - 1][0] - 1}"
                  for i, (oldest, _, _) in enumerate(WHEELS)]
        return "the driver unknown (no nvidia-smi): " + "; ".join(
            f"driver {span}, the CUDA {cuda} build: `{command}`"
            for span, (_, cuda, command) in zip(ranges, WHEELS))
    fits = wheel_for(driver)
    if fits is None:
        return (f"driver {driver} is older than any torch 2.13 build supports (>= "
                f"{WHEELS[-1][0]}): update the driver")
    return f"driver {driver} runs the CUDA {fits[0]} build: `{fits[1]}`"


def cuda_problem(torch=None, driver=None):
    """None where CUDA starts and sees a GPU; otherwise one line saying what is wrong: torch is a
    CPU build, or CUDA failed to start (with torch's reason), or it sees no GPU, and which torch
    build this machine's driver runs. `driver` defaults to nvidia-smi's answer."""
    if torch is None:
        import torch
    driver = driver or driver_version()
    if torch.version.cuda is None:
        return (f"no CUDA here: torch {torch.__version__} is a CPU build; on a machine with "
                f"NVIDIA GPUs install a CUDA build ({wheel_advice(driver)}); the same steps on "
                f"CPU: `gpu-check --rehearse`")
    build = f"torch {torch.__version__} (a CUDA {torch.version.cuda} build)"
    try:
        torch.cuda.init()
        count = torch.cuda.device_count()
    except Exception as e:  # torch raises RuntimeError, or AssertionError, with the reason
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        return f"CUDA failed to start: {build} says: {reason}; {wheel_advice(driver)}"
    if count == 0:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        return (f"no CUDA GPU here: {build} sees none" +
                (f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""))
    return None


def build_line(torch, driver):
    """torch's build and whether the driver fits it, for the summary."""
    if torch.version.cuda is None:
        return f"torch {torch.__version__} (CPU build)"
    fits = wheel_for(driver) if driver else None
    major = torch.version.cuda.split(".")[0]
    verdict = ("driver unknown" if driver is None else
               f"driver {driver}, which runs it" if fits and int(fits[0]) >= int(major) else
               f"driver {driver}: {wheel_advice(driver)}")
    return f"torch {torch.__version__} (CUDA {torch.version.cuda} build; {verdict})"


def single_process_gpus():
    """{GPU index: compute mode} of the GPUs whose compute mode admits one process at most
    (Exclusive_Process) or none (Prohibited); {} where all admit several, or where nvidia-smi
    cannot tell."""
    rows = _nvidia_smi("index", "compute_mode") or []
    return {int(index): mode for index, mode in rows
            if mode.replace(" ", "_").lower() in ("exclusive_process", "prohibited")}
