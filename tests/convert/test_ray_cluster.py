"""A two-node Ray cluster on one machine, started as README's runbook says (``ray start --head``, then
``ray start --address`` on the second node, each with its own CPUs, temp dir and ports), with token
authentication on (the head finds ``~/.ray/auth_token``, as after any earlier local ``ray.init``): the
converter joins it through ``RAY_ADDRESS`` alone and writes the samples (keys) a local run writes."""

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RAY = os.path.join(os.path.dirname(sys.executable), "ray")


def _free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _node_ip() -> str:
    """The address ``ray start --head`` binds (this host's, as Ray finds it)."""
    from ray._private.services import get_node_ip_address
    return get_node_ip_address()


def _node_ports() -> list[str]:
    """A node's own dashboard agent port (every node would take 52365); Ray picks the others free."""
    [agent] = _free_ports(1)
    return [f"--dashboard-agent-listen-port={agent}"]


@pytest.fixture
def two_node_cluster(tmp_path):
    """(RAY_ADDRESS, environment) of a head and a worker node, 1 CPU each, stopped (both) even when the
    test is interrupted. HOME is the test's own, holding a Ray token, so the head turns token auth on."""
    from ray._private.authentication.authentication_token_generator import generate_new_authentication_token
    home = tmp_path / "home"
    (home / ".ray").mkdir(parents=True)
    (home / ".ray" / "auth_token").write_text(generate_new_authentication_token())
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(HOME=str(home), RAY_USAGE_STATS_ENABLED="0", PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    temp_dirs = [tempfile.mkdtemp(prefix="rayh"), tempfile.mkdtemp(prefix="rayw")]  # short: socket paths
    [port] = _free_ports(1)
    address = f"{_node_ip()}:{port}"
    # 1 CPU a node: the half-CPU actors land one a node, and a read task wanting a whole CPU hung (planned
    # for the nodes now, the read tasks ask for the half CPU each node keeps)
    common = ["--num-cpus=1", "--disable-usage-stats"]
    try:
        for i, role in enumerate((["--head", f"--port={port}"], [f"--address={address}"])):
            started = subprocess.run([RAY, "start", *role, *common, *_node_ports(), f"--temp-dir={temp_dirs[i]}"],
                                     env=env if i == 0 else dict(env, RAY_AUTH_MODE="token"),
                                     capture_output=True, text=True, timeout=180)
            assert started.returncode == 0, started.stdout[-2000:] + started.stderr[-2000:]
        yield address, env
    finally:
        # `ray stop` stops every Ray process of this user on the machine: stop this cluster's own nodes
        # only, by the pids their temp dirs record
        _stop_nodes(temp_dirs)  # both at once: one wait for the slowest process, not one a node
        for temp in temp_dirs:
            shutil.rmtree(temp, ignore_errors=True)


def _stop_nodes(temp_dirs: list[str]) -> None:
    import psutil
    mine = {os.getpid()}

    def of_nodes(process) -> bool:
        return process.pid not in mine and any(temp in part for temp in temp_dirs
                                               for part in process.info["cmdline"] or ())
    for process in psutil.process_iter(["pid", "cmdline"]):
        try:
            if of_nodes(process):
                process.send_signal(signal.SIGTERM)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    _, alive = psutil.wait_procs([p for p in psutil.process_iter(["cmdline"]) if of_nodes(p)], timeout=10)
    for process in alive:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass


def _keys(out) -> list[str]:
    from streaming import StreamingDataset
    dataset = StreamingDataset(local=str(out), shuffle=False, batch_size=1)
    return sorted(sample["key"] for sample in dataset)


@pytest.mark.slow
def test_conversion_on_a_two_node_cluster_writes_the_keys_a_local_run_writes(
        two_node_cluster, sample_data, manifest, tiny_kit, tmp_path):
    address, env = two_node_cluster
    out = tmp_path / "cluster-out"
    conversion = subprocess.Popen([sys.executable, os.path.join(ROOT, "convert", "laion_to_mds.py"), "--input",
                                   sample_data, "--output", str(out), "--model", tiny_kit, "--resolutions", "32", "64",
                                   "--deterministic"],
                                  cwd=ROOT, env=dict(env, RAY_ADDRESS=address), stdout=subprocess.DEVNULL,
                                  stderr=(tmp_path / "convert.err").open("w"))
    # Meanwhile (it imports while the conversion runs): online mode on the same cluster plans its pools for the
    # two small nodes (it hung silently for 20 minutes), and Ctrl-C while it starts ends with the README's
    # interrupt line and status 130 (it ended with rc 1 and no word): the real signal, sent once the plan is
    # printed, as Ray Train starts.
    online = subprocess.Popen(
        [sys.executable, "-m", "diffusion.online", os.path.join(ROOT, "yamls", "tiny-online-cpu.yaml"),
         f"model.ref={tiny_kit}", f"data.online.input={sample_data}", f"data.online.work_dir={tmp_path / 'work'}",
         f"trainer.save_folder={tmp_path / 'ckpt'}", "data.train.batch_size=8"],
        cwd=ROOT, env=dict(env, RAY_ADDRESS=address, PYTHONUNBUFFERED="1"), stdout=subprocess.PIPE,
        stderr=(tmp_path / "online.err").open("w"), text=True)
    try:
        lines = []
        for line in online.stdout:
            lines.append(line)
            if line.startswith("online pools:"):
                break
        assert lines and lines[-1].startswith("online pools:"), "".join(lines) + (tmp_path / "online.err").read_text()
        assert lines[-1].rstrip().endswith("read tasks 0.5 CPU; 2 node(s)"), lines[-1]
        time.sleep(3)
        online.send_signal(signal.SIGINT)  # what Ctrl-C sends
        # within a bound: Ray Train's own handler waited for a controller blocked on starting the workers the
        # busy cluster had no room for, 62 s here (one of Ray Train's 60 s start waits) and over 180 s in CI
        from diffusion.stream.ray_workers import ABORT_WAIT_S
        bound = ABORT_WAIT_S + 40
        try:
            online.communicate(timeout=bound)
        except subprocess.TimeoutExpired:
            err = (tmp_path / "online.err").read_text()
            pytest.fail(f"online mode still ran {bound:g} s after Ctrl-C: {err[-3000:]}")
        conversion.wait(timeout=600)
    finally:
        online.kill()
        conversion.kill()
    err = (tmp_path / "online.err").read_text()
    assert online.returncode == 130, err[-3000:]
    assert re.fullmatch(r"online: interrupted (before its first batch|at batch \d+); re-run the same command to "
                        r"resume from its last checkpoint", err.strip().splitlines()[-1]), err[-3000:]

    err = (tmp_path / "convert.err").read_text()
    assert conversion.returncode == 0, err[-3000:]
    assert "InvalidAuthToken" not in err
    # the sample's good rows' keys: what a local run writes (test_pipeline.py's
    # test_shards_read_back_with_streaming), without a local conversion here for the comparison
    from diffusion import schema
    from diffusion.convert.readers import iter_rows
    good = sorted(r[schema.RAW_KEY] for r in iter_rows(sample_data) if r[schema.RAW_KEY] not in manifest["bad_keys"])
    assert _keys(out) == good


def test_ray_start_and_join_failures_are_one_line():
    """What ``ray.init`` raises where the user can act, as one line: a local start that timed out on a busy
    machine (Ray 2.60's "The current node timed out during startup", a raw traceback before), a token the
    cluster refuses; anything else is left as it was."""
    from diffusion.cluster import _start_failure
    from diffusion.errors import UserError
    timeout = _start_failure(Exception("The current node timed out during startup. This could happen because "
                                       "some of the raylet failed to startup or the GCS has become overloaded."), None)
    assert isinstance(timeout, UserError) and "\n" not in str(timeout)
    assert str(timeout).startswith("Ray's local start timed out (The current node timed out during startup.")
    assert str(timeout).endswith("the machine is busy; re-run the same command (it resumes where it stopped)")
    auth = _start_failure(type("AuthenticationError", (Exception,), {})("InvalidAuthToken"), "head:6379")
    assert str(auth) == ("the Ray cluster at head:6379 refused this process's token: copy the head's "
                         "~/.ray/auth_token to this host (or set RAY_AUTH_TOKEN) and set RAY_AUTH_MODE=token")
    other = RuntimeError("something else")
    assert _start_failure(other, None) is other


@pytest.mark.timeout(180)
def test_joining_an_address_where_no_cluster_answers_ends_in_one_line(sample_data, tiny_kit, tmp_path):
    """``RAY_ADDRESS`` naming a port where no cluster runs: the real command ends within seconds with one
    line naming the address (``ray.init`` kept retrying it, over 10 minutes, a Ray warning every ~40 s). No Ray
    starts: the address is checked before ``ray.init``."""
    [port] = _free_ports(1)  # nobody listens there
    address = f"127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(RAY_ADDRESS=address, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", RAY_USAGE_STATS_ENABLED="0")
    command = [sys.executable, os.path.join(ROOT, "convert", "laion_to_mds.py"), "--input", sample_data,
               "--output", str(tmp_path / "out"), "--model", tiny_kit, "--resolutions", "64"]
    started = time.monotonic()
    try:  # the bound is mostly the interpreter's start and imports on a busy machine; the check takes ~0 s
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=90)
    except subprocess.TimeoutExpired as e:
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        pytest.fail(f"still running after 90 s with RAY_ADDRESS={address}: {err[-2000:]}")
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and len(lines) == 1, done.stderr[-3000:]
    assert lines[0].startswith(f"laion_to_mds: error: no Ray cluster answers at {address} (RAY_ADDRESS"), lines[0]
    assert f"ray start --head --port={port}" in lines[0], lines[0]
    assert time.monotonic() - started < 90


@pytest.fixture
def no_ray_start(monkeypatch):
    """``ray.init`` (and the token switch before it) replaced: reaching it raises :class:`_Reached`."""
    import ray

    from diffusion import cluster

    def reached(**kwargs):
        raise _Reached(kwargs.get("address"))
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", reached)
    monkeypatch.setattr(cluster, "_token_for_cluster", lambda: None)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    return cluster


class _Reached(Exception):
    pass


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["unknown host", "closed port", "ray client"])
def test_an_address_where_nothing_answers_is_refused_before_ray_init(no_ray_start, kind):
    """A host name that does not resolve, a closed port, a ``ray://`` address: one ``UserError`` naming the
    address and where it came from (``--address``), within seconds, and ``ray.init`` is never called."""
    from diffusion.errors import UserError
    [port] = _free_ports(1)
    address = {"unknown host": "nonsense.invalid:1", "closed port": f"127.0.0.1:{port}",
               "ray client": f"ray://127.0.0.1:{port}"}[kind]
    started = time.monotonic()
    with pytest.raises(UserError) as raised:
        no_ray_start.init_ray(address)
    assert time.monotonic() - started < no_ray_start.ANSWER_WAIT_S + 5
    message = str(raised.value)
    assert "\n" not in message and message.startswith(f"no Ray cluster answers at {address} (--address"), message
    assert ("host nonsense.invalid not found" if kind == "unknown host" else "connection refused") in message


def test_an_address_that_answers_goes_on_to_ray_init(no_ray_start):
    """A port that takes the connection (here a plain listener on every interface) is left to ``ray.init``
    as before, with the address as given; ``127.0.0.1`` is probed where Ray connects (this host's address)."""
    listener = socket.socket()
    listener.bind(("0.0.0.0", 0))
    listener.listen(1)
    try:
        address = f"127.0.0.1:{listener.getsockname()[1]}"
        with pytest.raises(_Reached) as reached:
            no_ray_start.init_ray(address)
        assert reached.value.args == (address,)
    finally:
        listener.close()
