"""The CPUs a process may really use (affinity and cgroup quota, not nproc), and the thread pools every
command sizes from them: on a busy machine torch's spinning pool made training 60-170x slower."""

import os
import subprocess
import sys

import pytest

from diffusion import cpus

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def v2(tmp_path, limits: dict[str, str], own: str = "/"):
    """A fake cgroup v2 mount with ``cpu.max`` per cgroup path, and a /proc/self/cgroup naming ``own``."""
    for path, text in limits.items():
        write(tmp_path / "cg" / path.lstrip("/") / "cpu.max", text)
    write(tmp_path / "proc-cgroup", f"0::{own}\n")
    return str(tmp_path / "cg"), str(tmp_path / "proc-cgroup")


def test_cgroup_v2_quota_in_cpus(tmp_path):
    assert cpus.cgroup_cpu_limit(*v2(tmp_path, {"/": "150000 100000\n"})) == 1.5


def test_cgroup_v2_without_a_quota(tmp_path):
    assert cpus.cgroup_cpu_limit(*v2(tmp_path, {"/": "max 100000\n"})) is None


def test_cgroup_v2_a_parents_tighter_quota_limits_the_child(tmp_path):
    limits = {"/kubepods/pod1/c1": "max 100000", "/kubepods/pod1": "200000 100000", "/kubepods": "800000 100000"}
    assert cpus.cgroup_cpu_limit(*v2(tmp_path, limits, own="/kubepods/pod1/c1")) == 2.0


def test_cgroup_v1_cfs_quota(tmp_path):
    folder = tmp_path / "cg" / "cpu,cpuacct" / "docker" / "abc"
    write(folder / "cpu.cfs_quota_us", "50000\n")
    write(folder / "cpu.cfs_period_us", "100000\n")
    write(tmp_path / "cg" / "cpu,cpuacct" / "cpu.cfs_quota_us", "-1\n")  # the root: no limit
    write(tmp_path / "cg" / "cpu,cpuacct" / "cpu.cfs_period_us", "100000\n")
    write(tmp_path / "proc-cgroup", "12:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n")
    assert cpus.cgroup_cpu_limit(str(tmp_path / "cg"), str(tmp_path / "proc-cgroup")) == 0.5


def test_no_cgroup_mounted(tmp_path):
    assert cpus.cgroup_cpu_limit(str(tmp_path / "none"), str(tmp_path / "no-proc")) is None


@pytest.mark.parametrize("affinity, quota, expected", [
    (64, "max 100000", 64),       # a big machine, no limit: all of it
    (64, "250000 100000", 2),     # a pod's 2.5-CPU limit on it: 2 threads, not 64
    (2, "800000 100000", 2),      # taskset to 2 of a node with a larger quota: the mask
    (8, "50000 100000", 1),       # half a CPU: still one
])
def test_usable_cpus_is_the_smaller_of_affinity_and_quota(tmp_path, monkeypatch, affinity, quota, expected):
    monkeypatch.delenv(cpus.ENV, raising=False)
    monkeypatch.setattr(cpus, "affinity_cpus", lambda: affinity)
    assert cpus.usable_cpus(*v2(tmp_path, {"/": quota})) == expected


def test_affinity_is_the_mask_not_the_machine():
    assert cpus.affinity_cpus() == len(os.sched_getaffinity(0))


def test_ranks_on_a_node_share_the_cpus(monkeypatch):
    monkeypatch.setattr(cpus, "machine_cpus", lambda: 64)  # a machine with 8 CPUs or more
    monkeypatch.setenv(cpus.ENV, "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert cpus.rank_cpus() == 2
    assert cpus.loader_workers(8) == 2
    assert cpus.loader_workers(0) == 0  # loading in the training process stays so
    monkeypatch.setenv(cpus.ENV, "off")
    assert cpus.loader_workers(8) == 8 and cpus.ray_cpus() is None


def _command(code: str, env: dict, pressure: float = 95.0) -> subprocess.CompletedProcess:
    """``code`` run as a command through :func:`diffusion.cli.run`, in a fresh process (torch not loaded),
    on a machine whose CPU pressure at start is ``pressure`` % (a fake /proc/pressure/cpu, no cgroup quota)."""
    full = {k: v for k, v in os.environ.items()
            if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", cpus.CHOICE, cpus.ENV)}
    fake = ("import tempfile\nwith tempfile.NamedTemporaryFile('w', delete=False) as f:\n"
            f"    f.write('some avg10={pressure:.2f} avg60=0.00 avg300=0.00 total=1\\n')\n"
            "cpus.PRESSURE, cpus.cgroup_cpu_limit = f.name, lambda *a: None\n")
    script = ("import os, sys\nfrom diffusion import cli, cpus\n" + fake +
              f"def main(argv):\n    {code}\n"
              "cli.run(main, 'probe')\n")
    return subprocess.run([sys.executable, "-c", script], cwd=ROOT, env={**full, **env, "PYTHONPATH": ROOT},
                          capture_output=True, text=True, timeout=120)


PROBE = ("sized = cpus.size_torch(); import torch; "
         "print(os.environ.get('OMP_WAIT_POLICY'), torch.get_num_threads(), torch.get_num_interop_threads())")


PROBE_2 = ("cpus.size_torch(); import torch; torch.ones(64, 64) @ torch.ones(64, 64); "
           "print(os.environ.get('OMP_WAIT_POLICY'), os.environ.get('GOMP_SPINCOUNT'), torch.get_num_threads(), "
           "torch.get_num_interop_threads(), cpus.spin_watch() is not None); "
           "print(cpus.describe())")


@pytest.mark.parametrize("pressure, policy, why", [
    (95.0, "PASSIVE", "(busy at start: CPU pressure 95% over the last 10 s)"),  # sleep: cores others need
    (0.5, "None", "(threads spin ~3 ms before they sleep; quiet at start: CPU pressure 0.5% over the last 10 s)"),
])
def test_a_command_sizes_torch_and_its_threads_sleep_where_the_machine_is_busy_at_start_and_spin_where_quiet(
        pressure, policy, why):
    """Torch's pools get the planned CPUs. Sleeping cost the tiny model about 46% of its samples/s on a quiet machine; spinning beside other
    work cost 96%. The policy is chosen from the CPU pressure when the command starts."""
    result = _command(PROBE_2, {cpus.ENV: "2"}, pressure=pressure)
    assert result.returncode == 0, result.stderr
    first, line = result.stdout.splitlines()
    # the spinning pool is watched for work that arrives later (SpinWatch); a sleeping one needs no watch
    assert first.split() == [policy, "None", "2", "2", str(policy == "None")]
    assert line.endswith(f"OMP_WAIT_POLICY={'unset' if policy == 'None' else policy} {why}"), line


def test_the_users_own_settings_win():
    result = _command(PROBE, {cpus.ENV: "1", "OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "ACTIVE"})
    assert result.stdout.split()[:2] == ["ACTIVE", "2"], result.stderr


def test_an_empty_setting_counts_as_unset_and_adds_nothing_to_stderr():
    result = _command(PROBE, {cpus.ENV: "1", "OMP_NUM_THREADS": "", "OMP_WAIT_POLICY": " "})
    assert result.stdout.split() == ["PASSIVE", "1", "1"] and result.stderr == "", result.stderr


def test_off_keeps_the_libraries_defaults():
    result = _command(PROBE, {cpus.ENV: "off"})
    assert result.stdout.split()[:2] == ["None", str(len(os.sched_getaffinity(0)))], result.stderr


def test_a_bad_setting_is_one_line():
    result = _command("pass", {cpus.ENV: "lots"})
    assert result.returncode == 2
    assert result.stderr.strip() == ("probe: error: DIFFUSION_CPUS='lots' is not a number of CPUs; set a whole "
                                     "number of at least 1, or off to leave thread pools at their libraries' defaults")


def test_run_py_trains_with_pools_sized_to_the_usable_cpus(train_kit, tmp_path):
    from train_fixtures import tiny_overrides, write_latent_mds
    mds = write_latent_mds(str(tmp_path / "mds"), kit=train_kit, n=16)
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")}
    result = subprocess.run([sys.executable, "run.py", "yamls/tiny-cpu.yaml",
                             *tiny_overrides(train_kit, mds, batches=1, batch_size=4), "data.train.num_workers=4"],
                            cwd=ROOT, env={**env, cpus.ENV: "1"}, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    line = next(line for line in result.stdout.splitlines() if line.startswith("# cpus:"))
    assert line.startswith("# cpus: 1 usable (affinity ")
    # 4 workers asked for, 1 CPU to run them; threads sleep while they wait
    assert "; torch threads 1, loader workers 1 (4 asked); OMP_WAIT_POLICY=" in line  # chosen at start


def test_a_new_local_ray_cluster_gets_the_usable_cpus(monkeypatch):
    from diffusion import cluster
    monkeypatch.setenv(cpus.ENV, "1")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr("ray._private.services.find_bootstrap_address", lambda temp_dir=None: None)
    assert cluster._local_cpus(None) == 1
    assert cluster._local_cpus("10.0.0.1:6379") is None  # a running cluster counts its own


def test_an_override_beyond_the_machine_is_capped_and_says_so(monkeypatch):
    """DIFFUSION_CPUS=1000000000 planned 450,000,000 transform actors on a new local Ray cluster."""
    from diffusion import cluster
    from diffusion.convert.pipeline import ConvertConfig, plan_pools
    machine = os.cpu_count()
    monkeypatch.setenv(cpus.ENV, "1000000000")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr("ray._private.services.find_bootstrap_address", lambda temp_dir=None: None)
    assert cpus.usable_cpus() == cluster._local_cpus(None) == machine
    plan = plan_pools({"CPU": cluster._local_cpus(None)}, ConvertConfig(input="in", output="out", model="kit"))
    assert plan.num_transformers + plan.num_encoders <= machine
    monkeypatch.setenv(cpus.ENV, "9" * 5000)  # no 5000-digit parse either
    assert cpus.usable_cpus() == machine
    assert cpus.override_note().startswith("note: DIFFUSION_CPUS=99999999...(5000 digits) is more CPUs than")
    result = _command("pass", {cpus.ENV: "1000000000"})
    assert result.returncode == 0 and result.stderr == (
        f"note: DIFFUSION_CPUS=1000000000 is more CPUs than this machine has; planning for its {machine} "
        f"(a Ray cluster you join counts its own)\n"), result.stderr


class Machine:
    """A scripted machine for :class:`cpus.SpinWatch`: at each read, the wall clock, this process's CPU
    time and the CPUs' busy time advance by one step of ``interval`` s in which other work used ``others``
    CPUs and this process ``own``."""

    def __init__(self):
        self.t = self.own = self.busy = 0.0
        self.reads = 0

    def step(self, seconds: float, others: float, own: float = 2.0):
        self.t += seconds
        self.own += own * seconds
        self.busy += (own + others) * seconds

    def read_busy(self):
        self.reads += 1
        return self.busy


def test_the_spinning_pool_steps_down_while_other_work_takes_the_cpus_and_back_up_when_it_leaves():
    """A run that started on a quiet machine keeps libgomp's spin (the policy is read once, at load); work
    that arrives later met the spinning threads at a quarter of the rate alone (BENCHMARKS.md). The watch
    gives the CPUs others take back: threads down to what is left, and up again once it leaves."""
    machine, threads = Machine(), []
    watch = cpus.SpinWatch(2, {0, 1}, interval=2.0, set_threads=threads.append, clock=lambda: machine.t,
                           own=lambda: machine.own, busy=machine.read_busy)
    assert watch.poll() is None  # the first read only marks
    machine.step(2.0, others=0.3)  # a shell, a daemon: not worth a thread
    assert watch.poll() is None and threads == []
    machine.step(1.0, others=2.0)
    assert watch.poll() is None and machine.reads == 2  # not due: /proc/stat is not read between intervals
    machine.step(1.0, others=2.0, own=1.2)  # two busy loops arrive: the window saw 1.0 CPU of others a second
    machine.step(2.0, others=1.4, own=0.6)
    line = watch.poll()
    assert threads == [1] and watch.threads == 1
    assert line.startswith("# cpus: other work is using ") and line.split(" CPUs: ")[1].startswith(
        "torch threads 2 -> 1 (back to 2 when they are free; DIFFUSION_CPU_WATCH=off keeps 2)"), line
    machine.step(2.0, others=1.1, own=0.9)  # still there: no change back and forth
    assert watch.poll() is None and threads == [1]
    machine.step(2.0, others=0.1, own=1.0)  # gone
    assert watch.poll().endswith("torch threads 1 -> 2") and threads == [1, 2]
    machine.step(2.0, others=1.8, own=0.2)
    watch.poll()
    assert threads == [1, 2, 1]
    watch.restore()  # the run is over: the count chosen at start again
    assert threads == [1, 2, 1, 2] and watch.threads == 2


def test_the_watch_reads_what_the_cpus_ran_from_proc_stat(tmp_path):
    """The CPUs' busy time is the per-CPU lines of /proc/stat for the CPUs of the mask (user, nice, system,
    irq, softirq; not idle, iowait or steal), and on this machine it counts a busy child's CPU time."""
    fake = tmp_path / "stat"
    hz = os.sysconf("SC_CLK_TCK")
    fake.write_text("cpu  9 9 9 9 9 9 9 9 0 0\n"
                    f"cpu0 {hz} 0 {hz} 500 7 0 {hz} 3 0 0\n"
                    f"cpu1 {2 * hz} {hz} 0 500 0 {hz} 0 0 0 0\n"
                    f"cpu2 {5 * hz} 0 0 0 0 0 0 0 0 0\nintr 1 2 3\n")
    assert cpus._busy_seconds({0, 1}, str(fake)) == 7.0
    assert cpus._busy_seconds({2}, str(fake)) == 5.0
    assert cpus._busy_seconds({0}, str(tmp_path / "none")) is None
    mask = set(os.sched_getaffinity(0))
    before = cpus._busy_seconds(mask)
    child = subprocess.run([sys.executable, "-c", "import time\nwhile time.process_time() < 0.5: pass\n"
                            "print(time.process_time())"], capture_output=True, text=True, timeout=60)
    assert cpus._busy_seconds(mask) - before >= float(child.stdout) - 0.05
