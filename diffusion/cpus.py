"""The CPUs this process may really use, and thread pools sized from them rather than from ``nproc``.

A shared machine, a CI runner or a Kubernetes pod gives a process fewer CPUs than the machine has:
an affinity mask (``taskset``, cpusets) and a cgroup CPU quota (``cpu.max`` in cgroup v2,
``cpu.cfs_quota_us`` in v1). :func:`usable_cpus` is the smaller of the two, in whole CPUs.

Why it matters (the profile is in BENCHMARKS.md, "Training beside other work"):
torch's intra-op pool is OpenMP (libgomp), whose idle threads *spin* at every barrier before they
sleep. Beside another busy process, the thread that finished its share spins on a core the other
thread needs, and the tiny UNet's step became >90% spinning in libgomp: 4 samples/s instead of
~250, at 3x the CPU time. ``OMP_WAIT_POLICY=PASSIVE`` makes waiting threads sleep at once.

:func:`configure_process` (every command, through :func:`diffusion.cli.run`, before torch loads) sets
that policy; :func:`size_torch` (where training loads torch) sizes torch's intra- and inter-op pools
to this rank's share of the usable CPUs; :func:`loader_workers` caps the loader's workers at that
share; Ray's local cluster gets :func:`usable_cpus` as ``num_cpus`` (:mod:`diffusion.cluster`).
A user's own ``OMP_WAIT_POLICY`` / ``OMP_NUM_THREADS`` win. ``DIFFUSION_CPUS=N`` says how many CPUs to
plan for (at most the machine's count: more is capped, with one line saying so); ``DIFFUSION_CPUS=off``
leaves every pool at its library's default (the old behaviour).
"""

from __future__ import annotations

import math
import os

ENV = "DIFFUSION_CPUS"
CHOICE = "DIFFUSION_OMP_WAIT"  # how configure_process chose the wait policy (for describe)
PRESSURE = "/proc/pressure/cpu"
BUSY_PRESSURE = 10.0  # % of the last 10 s in which some task waited for a CPU: the machine is busy
BUSY_LOAD = 0.5  # without pressure information: 1-minute load average per CPU
CGROUP_ROOT = "/sys/fs/cgroup"
PROC_CGROUP = "/proc/self/cgroup"


def _switched_off(name: str) -> bool:
    """Whether the variable ``name`` says off (``off``, ``0``, ``false`` or ``no``)."""
    return os.environ.get(name, "").strip().lower() in ("off", "0", "false", "no")


def enabled() -> bool:
    """False when ``DIFFUSION_CPUS=off`` (or 0): pools keep their libraries' defaults."""
    return not _switched_off(ENV)


def affinity_cpus() -> int:
    """CPUs in this process's affinity mask (``taskset``, cpusets); all of them where there is no mask."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def _quota(text: str, period_text: str | None = None) -> float | None:
    """CPUs of one cgroup's quota: v2's ``"QUOTA PERIOD"`` / ``"max PERIOD"``, or v1's quota and period
    (``-1``: none). None where there is no limit or the text is not a quota."""
    fields = text.split()
    if period_text is not None:
        fields = fields[:1] + period_text.split()[:1]
    if len(fields) < 2 or fields[0] in ("max", "-1"):
        return None
    try:
        quota, period = int(fields[0]), int(fields[1])
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _ancestors(path: str) -> list[str]:
    """``/a/b`` → ``["/a/b", "/a", "/"]``: a parent's quota limits its children too."""
    parts = [p for p in path.strip().split("/") if p]
    return ["/" + "/".join(parts[:i]) for i in range(len(parts), -1, -1)]


def cgroup_cpu_limit(root: str = CGROUP_ROOT, proc_cgroup: str = PROC_CGROUP) -> float | None:
    """The CPU quota of this process's cgroup in CPUs (e.g. 1.5), the tightest along its path to the
    root of the hierarchy; None where no quota is set or no cgroup is mounted at ``root``.
    ``proc_cgroup`` is ``/proc/self/cgroup``; both are parameters so tests can hand in fake files."""
    lines = (_read(proc_cgroup) or "").splitlines()
    v2_path, v1_path = "/", "/"
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":
            v2_path = path or "/"
        elif "cpu" in controllers.split(","):
            v1_path = path or "/"
    limits = []
    # cgroup v2: one unified hierarchy, cpu.max = "QUOTA PERIOD"
    for path in _ancestors(v2_path):
        text = _read(os.path.join(root, path.lstrip("/"), "cpu.max"))
        if text is not None and (q := _quota(text)) is not None:
            limits.append(q)
    # cgroup v1: the cpu controller's own mount (cpu, or cpu,cpuacct)
    for mount in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):
        for path in _ancestors(v1_path):
            folder = os.path.join(root, mount, path.lstrip("/"))
            quota, period = _read(os.path.join(folder, "cpu.cfs_quota_us")), _read(os.path.join(folder, "cpu.cfs_period_us"))
            if quota is not None and period is not None and (q := _quota(quota, period)) is not None:
                limits.append(q)
    return min(limits) if limits else None


def usable_cpus(root: str = CGROUP_ROOT, proc_cgroup: str = PROC_CGROUP) -> int:
    """Whole CPUs this process may use: ``DIFFUSION_CPUS`` if it is a number, else the smaller of its
    affinity mask and its cgroup quota (rounded down: a thread beyond the quota is throttled while
    the others wait at the next barrier), at least 1."""
    given = _override()
    if given is not None:
        return min(given, machine_cpus())  # more than the machine has would only plan idle workers
    cpus = affinity_cpus()
    quota = cgroup_cpu_limit(root, proc_cgroup)
    if quota is not None:
        cpus = min(cpus, math.floor(quota))
    return max(1, cpus)


def _override() -> int | None:
    """``DIFFUSION_CPUS`` as a number of CPUs (ASCII digits, at least 1), or None."""
    given = os.environ.get(ENV, "").strip()
    if not (given.isascii() and given.isdigit()):
        return None
    value = int(given) if len(given) <= 18 else 10 ** 18  # no 5000-digit parse
    return value if value > 0 else None


def machine_cpus() -> int:
    """The CPUs the machine has (all of them, whatever this process's mask or quota): the ceiling of
    ``DIFFUSION_CPUS``."""
    return max(1, os.cpu_count() or affinity_cpus())


def override_note() -> str | None:
    """One line when ``DIFFUSION_CPUS`` asks for more CPUs than the machine has (it is capped), else None."""
    given = _override()
    if enabled() and given is not None and given > machine_cpus():
        given = os.environ[ENV].strip()
        given = given if len(given) <= 20 else f"{given[:8]}...({len(given)} digits)"  # one line, not 5000 digits
        return (f"note: {ENV}={given} is more CPUs than this machine has; planning for its {machine_cpus()} "
                f"(a Ray cluster you join counts its own)")
    return None


def local_ranks() -> int:
    """Training processes on this node (Composer's and torchrun's ``LOCAL_WORLD_SIZE``), at least 1."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def rank_cpus() -> int:
    """This rank's share of the usable CPUs, at least 1."""
    return max(1, usable_cpus() // local_ranks())


def cpu_pressure(path: str | None = None) -> float | None:
    """The share of the last 10 s (in %) in which some runnable task on the machine waited for a CPU
    (Linux pressure stall information, ``some avg10``), or None where the kernel does not report it."""
    text = _read(path or PRESSURE) or ""
    for line in text.splitlines():
        if line.startswith("some "):
            for field in line.split()[1:]:
                name, _, value = field.partition("=")
                if name == "avg10":
                    try:
                        return float(value)
                    except ValueError:
                        return None
    return None


def busy_at_start() -> tuple[bool, str]:
    """(whether other work competes for the CPUs now, why): CPU pressure of at least ``BUSY_PRESSURE`` %
    over the last 10 s, or where the kernel does not report it a 1-minute load average of at least
    ``BUSY_LOAD`` per CPU; a cgroup CPU quota counts as busy (a spinning thread spends the quota)."""
    quota = cgroup_cpu_limit()
    if quota is not None:
        return True, f"a cgroup CPU quota of {quota:g}"
    pressure = cpu_pressure()
    if pressure is not None:
        return pressure >= BUSY_PRESSURE, f"CPU pressure {pressure:g}% over the last 10 s"
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    return load >= BUSY_LOAD * machine_cpus(), f"load average {load:.1f} on {machine_cpus()} CPUs"


def configure_process() -> None:
    """Before torch loads (libgomp and Intel's runtime read the wait policy once, at load), for this
    process and every process it starts (loader workers, Ray's workers): where other work competes for
    the CPUs at start (:func:`busy_at_start`), waiting OpenMP threads sleep at once
    (``OMP_WAIT_POLICY=PASSIVE``); on a quiet machine they keep libgomp's default, a spin of about 3 ms
    before they sleep, which the tiny model's thousands of small parallel regions need for full speed.
    The choice is recorded in ``DIFFUSION_OMP_WAIT`` (for :func:`describe`). A user's own
    ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` wins; ``DIFFUSION_CPUS=off`` sets nothing."""
    given = os.environ.get(ENV, "").strip()
    if given and enabled() and _override() is None:
        from diffusion.errors import ConfigError
        raise ConfigError(f"{ENV}={given!r} is not a number of CPUs; set a whole number of at least 1, "
                          f"or off to leave thread pools at their libraries' defaults")
    for name in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY"):  # set but empty (``VAR= cmd``) means unset:
        if name in os.environ and not os.environ[name].strip():  # libgomp warns on stderr otherwise
            del os.environ[name]
    if enabled():
        if "OMP_WAIT_POLICY" not in os.environ and not os.environ.get("GOMP_SPINCOUNT", "").strip():
            busy, why = busy_at_start()
            if busy:
                os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
            os.environ[CHOICE] = f"{'busy' if busy else 'quiet'} at start: {why}"
        else:
            os.environ.pop(CHOICE, None)
        note = override_note()
        if note and os.environ.get("LOCAL_RANK", "0") == "0" and os.environ.get("RANK", "0") == "0":
            import sys
            print(note, file=sys.stderr, flush=True)


def size_torch() -> dict[str, int] | None:
    """Size torch's intra-op and inter-op pools to this rank's CPUs (:func:`rank_cpus`), unless the user
    chose (``OMP_NUM_THREADS``) or ``DIFFUSION_CPUS=off``; returns what was set, or None."""
    if not enabled() or os.environ.get("OMP_NUM_THREADS"):
        return None
    import torch
    threads = rank_cpus()
    torch.set_num_threads(threads)
    sized = {"threads": threads}
    try:  # only before the first inter-op work; a no-op (not an error) for a process that already ran some
        torch.set_num_interop_threads(threads)
        sized["interop_threads"] = threads
    except RuntimeError:
        pass
    return sized


def loader_workers(requested: int) -> int:
    """The loader's worker processes: ``requested``, at most this rank's CPUs (a worker that has no
    CPU only adds a process to wait for); 0 (load in the training process) stays 0."""
    if requested <= 0 or not enabled():
        return requested
    return min(requested, rank_cpus())


def ray_cpus() -> int | None:
    """``num_cpus`` for a new local Ray cluster: the usable CPUs (Ray itself counts the cgroup but
    not the affinity mask, and truncates a fractional quota), or None with ``DIFFUSION_CPUS=off``."""
    return usable_cpus() if enabled() else None


def describe(workers: tuple[int, int] | None = None) -> str:
    """One line for a run's log: the CPUs found and how the pools were sized; ``workers`` is the
    train loader's (workers, workers asked for)."""
    if not enabled():
        return f"# cpus: {ENV}=off: thread pools at their libraries' defaults"
    import sys
    quota, torch = cgroup_cpu_limit(), sys.modules.get("torch")
    pools = [f"torch threads {torch.get_num_threads()}"] if torch is not None else []
    if workers is not None:
        pools.append(f"loader workers {workers[0]}" + (f" ({workers[1]} asked)" if workers[0] != workers[1] else ""))
    ranks = "" if local_ranks() == 1 else f" per rank of {local_ranks()}"
    return (f"# cpus: {usable_cpus()} usable (affinity {affinity_cpus()}, cgroup quota "
            f"{'none' if quota is None else f'{quota:g}'}); {', '.join(pools)}{ranks}; "
            f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}{_choice()}")


def _choice() -> str:
    """How the wait policy was chosen, for :func:`describe`: the user's, or from the load at start."""
    if os.environ.get("GOMP_SPINCOUNT"):
        return f", GOMP_SPINCOUNT={os.environ['GOMP_SPINCOUNT']}"
    choice = os.environ.get(CHOICE)
    if not choice:
        return ""
    if "OMP_WAIT_POLICY" in os.environ:
        return f" ({choice})"
    return f" (threads spin ~3 ms before they sleep; {choice})"


WATCH_ENV = "DIFFUSION_CPU_WATCH"  # off: keep the threads chosen at start, whatever other work arrives later
PROC_STAT = "/proc/stat"
WATCH_SECONDS = 2.0  # how often the watch reads the CPUs' time (a /proc/stat read: microseconds)


def _busy_seconds(cpus: set[int], path: str = PROC_STAT) -> float | None:
    """CPU-seconds the ``cpus`` have spent running anything (user, nice, system, irq, softirq) since boot,
    from ``/proc/stat``'s per-CPU lines; None where the file is missing or unreadable."""
    text = _read(path)
    if not text:
        return None
    hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    total, seen = 0, False
    for line in text.splitlines():
        name, *fields = line.split()
        if not (name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus) or len(fields) < 7:
            continue
        try:
            user, nice, system, _idle, _iowait, irq, softirq = (int(v) for v in fields[:7])
        except ValueError:
            return None
        total, seen = total + user + nice + system + irq + softirq, True
    return total / hz if seen else None


class SpinWatch:
    """Torch's threads sized down while other work uses the CPUs, and back up once it leaves.

    :func:`configure_process` lets libgomp's threads spin on a machine quiet at start (the tiny model's
    full speed), and the policy is read once, when torch loads. Work that arrives later then meets
    spinning threads: the thread that finished its share spins on a core the other thread needs
    (a quarter of the rate alone, BENCHMARKS.md "OpenMP wait policy"). Every ``interval`` seconds
    :meth:`poll` (between batches, in the training thread: the thread count is that thread's OpenMP
    setting) reads the CPU time the CPUs of this process's mask spent (``/proc/stat``) less its own
    (``os.times``): the CPUs *other* work used. When fewer CPUs are left than threads it sets torch's
    threads to what is left (at least 1: one thread neither spins nor waits at a barrier); when they
    come back, it sets them back (at most the count chosen at start). Hysteresis of half a CPU down and
    three quarters up keeps it from switching on a passing process. ``clock``, ``own`` and ``busy``
    are parameters so tests can hand in a scripted machine."""

    def __init__(self, threads: int, cpus: set[int], interval: float | None = None, *, set_threads=None,
                 clock=None, own=None, busy=None):
        import time
        self.full = self.threads = threads
        self.cpus = cpus
        self.interval = WATCH_SECONDS if interval is None else interval
        self.set_threads = set_threads or _set_torch_threads
        self.clock = clock or time.monotonic
        self.own = own or (lambda: sum(os.times()[:2]))
        self.busy = busy or (lambda: _busy_seconds(self.cpus))  # looked up at each read
        self._mark = None

    def _sample(self):
        busy = self.busy()
        return None if busy is None else (self.clock(), self.own(), busy)

    def poll(self) -> str | None:
        """Re-read the CPUs at most every ``interval`` s; returns one line when the thread count changed."""
        now = self.clock()
        if self._mark is not None and now - self._mark[0] < self.interval:
            return None
        sample = self._sample()
        if sample is None:
            return None
        previous, self._mark = self._mark, sample
        if previous is None:
            return None
        wall = sample[0] - previous[0]
        others = max(0.0, (sample[2] - previous[2]) - (sample[1] - previous[1])) / wall
        free = len(self.cpus) - others
        if self.threads > 1 and free < self.threads - 0.5:
            new = max(1, int(free + 0.5))
        elif self.threads < self.full and free >= self.threads + 0.75:
            new = min(self.full, int(free + 0.25))
        else:
            return None
        old, self.threads = self.threads, new
        self.set_threads(new)
        why = "other work is using" if new < old else "other work now uses only"
        return (f"# cpus: {why} {others:.1f} of {len(self.cpus)} CPUs: torch threads {old} -> {new}"
                + (f" (back to {self.full} when they are free; {WATCH_ENV}=off keeps {self.full})" if new < old else ""))

    def restore(self) -> None:
        """The count chosen at start again (the run is over)."""
        if self.threads != self.full:
            self.threads = self.full
            self.set_threads(self.full)


def _set_torch_threads(n: int) -> None:
    import torch
    torch.set_num_threads(n)


def spin_watch() -> SpinWatch | None:
    """A :class:`SpinWatch` for this training process where its threads spin (the wait policy was left
    to libgomp on a machine quiet at start, by :func:`configure_process`) and the pool is ours to size:
    pools sized by us (no user ``OMP_NUM_THREADS``), more than one thread, one rank on this node (ranks'
    shares are fixed), ``/proc/stat`` readable, and ``DIFFUSION_CPU_WATCH`` not ``off``. Else None."""
    if (not enabled() or _switched_off(WATCH_ENV)
            or "OMP_WAIT_POLICY" in os.environ or os.environ.get("OMP_NUM_THREADS")
            or not os.environ.get(CHOICE, "").startswith("quiet") or local_ranks() != 1):
        return None
    import sys
    torch = sys.modules.get("torch")
    threads = torch.get_num_threads() if torch is not None else 0
    try:
        mask = set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None
    if threads < 2 or _busy_seconds(mask) is None:
        return None
    return SpinWatch(threads, mask)
