"""Session-wide fixtures: the tiny model kit (built once, cached under .cache/), sample data, Ray."""

import functools
import os
import pathlib

import pytest

from process_cleanup import pytest_configure, pytest_sessionfinish  # noqa: F401 (hooks: the suite's processes end with it)

ROOT = pathlib.Path(__file__).resolve().parents[1]
CACHE = pathlib.Path(os.environ.get("DIFFUSION_TEST_CACHE", ROOT / ".cache"))

# Tests never touch the network: the hub is offline, telemetry off.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
# Any torch.compile (the aot_eager and eager backends included) imports inductor's compile module, which forks a
# pool of compile workers for Triton's GPU kernels when triton is installed (torch 2.7's CPU wheel pulls it in):
# a process importing torch beside each compiling process, ~7 CPU-s each on this machine, unused on a CPU.
os.environ.setdefault("TORCH_WARM_POOL", "0")
# `make test` runs one pytest worker per CPU, so every process a test starts shares the CPUs with the other
# worker's tests: its OpenMP threads wait passively. (diffusion.cpus would choose from the load at the process's
# own start, and one started in a quiet moment spins beside the other worker's next test: the demo's training
# ran at 2.4 batches/s in CI against ~10 alone.) tests/test_cpus.py clears it where it tests that choice.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# For the same reason each worker's processes get its share of the CPUs as torch threads (one each on 2 CPUs
# and 2 workers), as a user's OMP_NUM_THREADS would: two threads per process beside the other worker's tests
# cost the demo's training ~20% more CPU-s per batch and ~20% more wall time (at load ~6: 150 batches in 64-70 s
# and 55-59 CPU-s on one thread, 81-87 s and 68-74 CPU-s on two; the same losses). A single pytest process
# (no xdist) leaves the threads to diffusion.cpus, as a run would.
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1) > 1 and "OMP_NUM_THREADS" not in os.environ:
    from diffusion.cpus import usable_cpus
    os.environ["OMP_NUM_THREADS"] = str(max(1, usable_cpus() // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


def pytest_xdist_auto_num_workers(config) -> int:
    """``make test`` runs ``-n auto``: one worker per CPU this process may use (affinity and cgroup quota,
    as training sizes its threads), not per CPU the machine has. (With one a CPU the suite kept its CPUs busy
    65% of its wall time, a fresh clone on the quiet 2-core machine, 2026-11-28: 64 CPU-min in 49 min. A third
    worker on 2 CPUs was tried the same day and not kept: online mode's file took 677 s against 425 s, and the
    compile test, CPU-bound, over 15 min against 9: BENCHMARKS.md, "The suite's wall time".)"""
    from diffusion.cpus import usable_cpus
    return usable_cpus()


# The longest test files, longest first (each file's total from --durations=0 in a fresh clone's make test on
# the quiet machine, 2026-11-28 at b4f5160, with session 20's merges: test_fsdp_mmdit.py holds four files'
# two-rank runs, test_fsdp.py test_multiprocess.py's), collected first: `make test`'s workers
# (--no-loadscope-reorder keeps this order) take them first and the short files fill in beside them, instead of
# a long one ending the suite alone.
LONGEST_FIRST = ("test_demo.py", "test_compile_fsdp.py", "test_online.py", "test_pipeline.py", "test_fsdp.py",
                 "test_fsdp_mmdit.py", "test_recaption.py", "test_fsdp_hybrid.py", "test_multinode.py",
                 "test_full_disk.py", "test_ray_cluster.py", "test_where_and_dedupe.py",
                 "test_save_folder.py", "test_buckets.py", "test_posthoc_ema.py", "test_streams.py", "test_hostile.py")


# The files that use a local Ray instance (the data stage's folders, and any file naming the ray_local fixture)
# run on one pytest worker, one after another: one Ray instance for all of them, started at the first and shut
# down after the last (a Ray instance left idle costs ~10% of a CPU: 228 CPU-s for two of them over 19 min of
# the suite, 2026-11-28), and the session fixtures they share (a conversion of the sample data) are made once.
RAY_FOLDERS = ("convert", "download")
RAY_GROUP = "ray"


@functools.lru_cache(maxsize=None)
def uses_ray(path: pathlib.Path) -> bool:
    """Whether the test file at ``path`` belongs to the Ray group (decided from the file alone: xdist's
    controller, which assigns the files to workers, sees no fixtures)."""
    return path.parent.name in RAY_FOLDERS or "ray_local" in path.read_text()


def _order(item) -> tuple:
    """Ray's group first (the longest unit of work), then LONGEST_FIRST, then every other file in its order."""
    name = item.path.name
    return (not uses_ray(item.path), LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST))


def pytest_collection_modifyitems(session, config, items):
    items.sort(key=_order)  # stable: ties keep their order
    using = [item for item in items if "ray_local" in item.fixturenames]
    if using:
        using[-1].stash[_LAST_RAY_TEST] = True


def pytest_xdist_make_scheduler(config, log):
    """``--dist loadfile`` with the Ray group's files as one unit of work (see RAY_FOLDERS)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class RayFilesTogether(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            scope = super()._split_scope(nodeid)
            return RAY_GROUP if uses_ray(config.rootpath / scope) else scope

    return RayFilesTogether(config, log)


@pytest.fixture(scope="session")
def tiny_kit() -> str:
    """A tiny diffusers-layout model directory (random UNet/text encoder, the shipped fitted VAE):
    built in seconds, cached."""
    from diffusion.kit.build import ensure_kit
    return str(ensure_kit("tiny", CACHE / "kit" / "tiny"))


@pytest.fixture(scope="session")
def train_kit(tmp_path_factory) -> str:
    """The tiny kit's UNet, text-encoder and scheduler configs without the fitted VAE: written in
    seconds, for tests that train on synthetic MDS and never decode an image."""
    from train_fixtures import write_training_kit
    return write_training_kit(str(tmp_path_factory.mktemp("train_kit")))


@pytest.fixture(scope="session")
def mmdit_train_kit(tmp_path_factory) -> str:
    """The tiny MMDiT kit's configs (transformer, text encoder, flow scheduler) without weights."""
    from train_fixtures import write_mmdit_training_kit
    return write_mmdit_training_kit(str(tmp_path_factory.mktemp("mmdit_train_kit")))


@pytest.fixture(scope="session")
def tiny_mmdit_kit() -> str:
    """The tiny-mmdit kit (random MMDiT and text encoder, the shipped fitted VAE): built in seconds, cached."""
    from diffusion.kit.build import ensure_kit
    return str(ensure_kit("tiny-mmdit", CACHE / "kit" / "tiny-mmdit"))


@pytest.fixture(scope="session")
def tiny_t5_kit() -> str:
    """The tiny-t5 kit (random T5 text encoder, its tokenizer trained on the sample captions, the tiny UNet
    and MMDiT, the shipped fitted VAE): built in seconds, cached."""
    from diffusion.kit.build import ensure_kit
    return str(ensure_kit("tiny-t5", CACHE / "kit" / "tiny-t5"))


@pytest.fixture(scope="session")
def tiny_vae16_kit() -> str:
    """The tiny-vae16 kit (a random 16-channel AutoencoderKL with a shift factor, an MMDiT reading 16 channels)."""
    from diffusion.kit.build import ensure_kit
    return str(ensure_kit("tiny-vae16", CACHE / "kit" / "tiny-vae16"))


@pytest.fixture(scope="session")
def tiny_dcae_kit() -> str:
    """The tiny-dcae kit (a random AutoencoderDC: 32 channels, /32; an MMDiT reading 32 channels)."""
    from diffusion.kit.build import ensure_kit
    return str(ensure_kit("tiny-dcae", CACHE / "kit" / "tiny-dcae"))


@pytest.fixture(scope="session")
def tiny_flux_kit() -> str:
    """The tiny-flux kit (Flux.1's transformer at toy widths over the tiny-vae16 autoencoder)."""
    from diffusion.kit.build import ensure_kit
    return str(ensure_kit("tiny-flux", CACHE / "kit" / "tiny-flux"))


@pytest.fixture(scope="session")
def tiny_sana_kit() -> str:
    """The tiny-sana kit (SANA's linear-attention DiT at toy widths over the tiny-dcae autoencoder)."""
    from diffusion.kit.build import ensure_kit
    return str(ensure_kit("tiny-sana", CACHE / "kit" / "tiny-sana"))


@pytest.fixture(scope="session")
def sd2_kit() -> str:
    """The SD2-base configs and tokenizer (no weights)."""
    from diffusion.kit.build import ensure_kit
    return str(ensure_kit("sd2-base", CACHE / "kit" / "sd2-base"))


@pytest.fixture(scope="session")
def tiny_clip() -> str:
    """A tiny random CLIP (text + vision) with the real tokenizer, for CLIP score and FID."""
    from diffusion.kit.build import ensure_kit
    return str(ensure_kit("tiny-clip", CACHE / "kit" / "tiny-clip"))


@pytest.fixture(scope="session")
def tiny_captioner() -> str:
    """A tiny random BLIP image-to-text model with its processor (the converter's --recaption)."""
    from diffusion.kit.build import ensure_kit
    return str(ensure_kit("tiny-captioner", CACHE / "kit" / "tiny-captioner"))


@pytest.fixture(scope="session")
def sample_data(tmp_path_factory) -> str:
    """A small LAION-style parquet dataset with its bad rows (see diffusion.kit.sample)."""
    from diffusion.kit.sample import write_sample_data
    out = tmp_path_factory.mktemp("sample")
    write_sample_data(out, n=96, seed=0, rows_per_shard=32)
    return str(out)


@pytest.fixture(scope="session")
def manifest(sample_data) -> dict:
    """What the sample data's generator wrote: rows, bad rows by kind."""
    import json
    with open(os.path.join(sample_data, "manifest.json")) as f:
        return json.load(f)


_LAST_RAY_TEST = pytest.StashKey[bool]()


def _start_ray():
    import ray
    for attempt in (1, 2):
        if ray.is_initialized():
            break
        try:
            ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
        except Exception as error:  # Ray waits a fixed 30 s for its raylet: a loaded machine can miss it once
            if attempt == 2 or "timed out" not in str(error):
                raise
            ray.shutdown()
    # Ray's log monitor re-reads the session's worker logs ten times a second to forward their lines to
    # drivers. This Ray forwards nothing (log_to_driver=False) and the subprocess commands that join it
    # (RAY_ADDRESS) assert on their own output, yet over the Ray group's ~20 minutes and hundreds of worker
    # logs the monitor used ~65 CPU-s, the most of any Ray process of its own (BENCHMARKS, session 23's census).
    # `ray start --include-log-monitor=false` is the same; ray.init has no such argument.
    node = getattr(getattr(getattr(ray, "_private", None), "worker", None), "_global_node", None)
    if node is not None and hasattr(node, "kill_log_monitor"):
        node.kill_log_monitor(check_alive=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    return ray


@pytest.fixture(scope="session")
def ray_local():
    """One local Ray instance, sized like this machine (2 CPUs): started by the first test that asks for it
    and shut down after the last (in the collected order, which runs Ray's group of files together)."""
    ray = _start_ray()
    yield ray
    ray.shutdown()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """A test that asks for Ray after the last one shut it down (run out of the collected order) starts it again."""
    if "ray_local" in item.fixturenames:
        import ray
        if not ray.is_initialized():
            _start_ray()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield
    if item.stash.get(_LAST_RAY_TEST, False):  # after its fixtures' teardown: no dataset of its is left
        import ray
        ray.shutdown()


@pytest.fixture
def fake_checkpoint(tiny_kit, tmp_path) -> str:
    """A Composer checkpoint in training's format: raw weights perturbed, EMA weights the kit's."""
    import torch
    from sampling_helpers import kit_unet
    unet = kit_unet(tiny_kit)
    ema = {f"unet.{k}": v.clone() for k, v in unet.state_dict().items()}
    raw = {k: v + 0.05 * torch.randn_like(v) if v.is_floating_point() else v for k, v in ema.items()}
    raw["_extra_state"] = {"model_ref": tiny_kit, "unet_config": dict(unet.config), "scaling_factor": 0.5,
                           "prediction_type": "v_prediction", "resolution": 32,
                           "text_dim": unet.config.cross_attention_dim}
    path = tmp_path / "ep0-ba4-rank0.pt"
    torch.save({"state": {"model": raw, "algorithms": [("EMA", {"ema_params": ema})]}}, path)
    return str(path)


def _close_blocks(shared) -> None:
    """Close (not unlink) the blocks of one of streaming's SharedMemory objects: the names stay taken, so
    streaming never picks a prefix again that a dataset of this session used; its atexit handler unlinks
    them when the session ends."""
    for block in (*shared.created_shms, *shared.opened_shms):
        try:
            block.close()
        except BufferError:  # still viewed by an array someone holds: left to exit
            pass


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    """The shared memory streaming opens during a test body is closed when it ends (fixtures' datasets live
    on). Streaming keeps every block it opens until the process exits (two file descriptors a block, held
    by its atexit handlers), and each new dataset opens one block of every prefix in use while it picks
    its own: a session of hundreds of datasets would run out of descriptors."""
    from streaming.base.shared.memory import SharedMemory
    opened, original = [], SharedMemory.__init__

    def recording_init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        opened.append(self)

    SharedMemory.__init__ = recording_init
    try:
        yield
    finally:
        SharedMemory.__init__ = original
        for shared in opened:
            _close_blocks(shared)
