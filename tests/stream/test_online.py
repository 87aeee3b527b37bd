"""Online mode: raw sample data → transform → encode → Ray Train workers running the Composer trainer.

The slow tests run the whole thing on the local 2-CPU Ray with the tiny kits: the loss falls, bad rows
are counted like the converter counts them, the checkpoint continues offline in ``run.py``'s trainer
(one worker), and of two workers one killed mid-run is restarted with the other and training still
reaches ``max_duration``.
"""

import json
import os
import time

import numpy as np
import pytest
import torch

import fault_injector
from fault_injector import FaultInjector
from diffusion.train.config import ConfigError, load_config
from diffusion import schema
from diffusion.convert import transforms
from diffusion.loader.batches import CaptionDropout, ToModelBatch
from diffusion.stream.stream_source import data_resources, plan_online_pools
from diffusion.stream.ray_workers import ShardBatches, TrainPlacement, check_online, run_online

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "yamls", "tiny-cpu.yaml")
REASON = {"truncated": transforms.UNDECODABLE, "not_image": transforms.UNDECODABLE,
          "tiny": transforms.TOO_SMALL, "empty_caption": transforms.EMPTY_CAPTION}

# Ray's workers cannot import tests/ modules: ship the injector's code with the pickled callback.
import ray.cloudpickle  # noqa: E402
ray.cloudpickle.register_pickle_by_value(fault_injector)


def online_config(kit, raw, tmp_path, *extra, batches=6):
    return load_config(TINY, [
        f"model.ref={kit}", f"data.online.input={raw}", f"data.online.work_dir={tmp_path / 'work'}",
        "data.online.num_encoders=1", "data.online.num_train_workers=2", "data.train.batch_size=8",
        f"trainer.max_duration={batches}ba", f"trainer.save_folder={tmp_path / 'ckpt'}", "trainer.save_interval=2ba",
        "trainer.autoresume=true", "loggers={}", "callbacks={}", "scheduler.t_warmup=0ba",
        # The plumbing under test, not the demo's colour recipe: epsilon's loss falls within a few batches.
        "model.prediction_type=epsilon", "model.offset_noise=0.0", *extra])


def expected_rejects(sample_data) -> dict:
    with open(os.path.join(sample_data, "manifest.json")) as f:
        bad = json.load(f)["bad"]
    counts = {}
    for kind, n in bad.items():
        counts[REASON[kind]] = counts.get(REASON[kind], 0) + n
    return counts


# ---- the pieces, fast -------------------------------------------------------------------------------

def test_default_pools_fit_two_cpus_with_room_for_a_read():
    cfg = load_config(TINY, ["data.online.input=x"])
    plan = plan_online_pools({"CPU": 2.0}, cfg)
    o = cfg.data.online
    held = (o.num_train_workers * o.train_cpus + plan.num_transformers * plan.cpus_per_transformer
            + plan.num_encoders * plan.cpus_per_encoder)
    assert held <= 2.0 - 1.0  # a read task needs a whole CPU, or Ray Data waits for it forever
    assert plan.num_transformers >= 1 and plan.num_encoders >= 1 and plan.gpus_per_encoder == 0


def test_gpu_cluster_splits_gpus_between_trainers_and_encoders():
    cfg = load_config(TINY, ["data.online.input=x", "data.online.num_train_workers=4", "data.online.train_gpus=1",
                             "data.online.train_cpus=8", "data.online.encoder_accelerator_type=A10G",
                             "data.online.train_accelerator_type=H100"])
    assert data_resources({"CPU": 64, "GPU": 8}, cfg) == {"CPU": 32.0, "GPU": 4.0}
    plan = plan_online_pools({"CPU": 64, "GPU": 8}, cfg)
    assert (plan.num_encoders, plan.gpus_per_encoder) == (4, 1.0)
    scaling = TrainPlacement(num_workers=4, use_gpu=True, cpus_per_worker=8, accelerator_type="H100").scaling_config()
    assert scaling.use_gpu and scaling.accelerator_type == "H100" and scaling.resources_per_worker == {
        "CPU": 8, "GPU": 1.0}


def test_training_all_cpus_is_refused_with_the_reason():
    cfg = load_config(TINY, ["data.online.input=x", "data.online.train_cpus=1.0"])
    with pytest.raises(ConfigError, match="nothing is left to read"):  # the user's to fix: one line, no traceback
        plan_online_pools({"CPU": 2.0}, cfg)


@pytest.mark.parametrize("overrides, message", [
    ([], "data.online.input"),
    (["data.online.input=x", "data.online.num_train_workers=3"], "does not divide evenly"),
    (["data.online.input=x", "data.online.text_length=1"], "data.online.text_length must be at least 2"),
])
def test_config_errors_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        check_online(load_config(TINY, overrides))


def test_a_longer_text_length_than_clip_reads_is_refused_naming_the_key(tiny_kit):
    cfg = load_config(TINY, [f"model.ref={tiny_kit}", "data.online.input=x", "data.online.text_length=100"])
    with pytest.raises(ConfigError, match="data.online.text_length 100: the text encoder of .* is CLIP"):
        check_online(cfg)


def test_a_t5_text_length_past_what_its_tokenizer_reads_is_refused_naming_the_key(tiny_t5_kit):
    cfg = load_config(TINY, [f"model.ref={tiny_t5_kit}", "data.online.input=x", "data.online.text_length=100000"])
    with pytest.raises(ConfigError, match=r"data.online.text_length 100000: .* reads at most 64 tokens"):
        check_online(cfg)


def test_token_ids_with_fluxs_two_text_encoders_are_refused_naming_the_key(tiny_flux_kit):
    cfg = load_config(TINY, [f"model.ref={tiny_flux_kit}", "data.online.input=x", "model.text=ids"])
    with pytest.raises(ConfigError, match=r"^model.text=ids: .* two text encoders") as error:
        check_online(cfg)
    assert "\n" not in str(error.value)


def test_batches_follow_the_contract_and_drop_captions_to_the_empty_embedding():
    n, d = 400, 8
    empty = np.full((schema.MAX_TOKENS, d), -1.0, np.float16)
    columns = {schema.vae_moments_column(64): np.zeros((n, 8, 8, 8), np.float16),
               schema.TEXT_EMBEDS: np.ones((n, schema.MAX_TOKENS, d), np.float16),
               schema.INPUT_IDS: np.zeros((n, schema.MAX_TOKENS), np.int32),
               schema.CAPTION: np.array(["a"] * n, dtype=object),
               schema.KEY: np.array([f"{i:09d}" for i in range(n)], dtype=object)}
    batch = ToModelBatch(64, empty, CaptionDropout(0.25, seed=0))(columns, 0)
    assert set(batch) == {schema.BATCH_MOMENTS, schema.BATCH_TEXT_EMBEDS}
    assert batch[schema.BATCH_MOMENTS].shape == (n, 8, 8, 8)
    dropped = (batch[schema.BATCH_TEXT_EMBEDS] == -1).all(dim=(1, 2))
    kept = (batch[schema.BATCH_TEXT_EMBEDS] == 1).all(dim=(1, 2))
    assert bool((dropped | kept).all()) and 0.15 < dropped.float().mean() < 0.35
    # a stream of token ids (model.text=ids): the same captions dropped, to the empty caption's ids
    empty_ids = np.array([49406, 49407] + [0] * 75, np.int32)
    ids = ToModelBatch(64, empty_ids, CaptionDropout(0.25, seed=0), text_column=schema.INPUT_IDS)(columns, 0)
    assert set(ids) == {schema.BATCH_MOMENTS, schema.BATCH_INPUT_IDS} and ids[schema.BATCH_INPUT_IDS].dtype == torch.long
    assert torch.equal((ids[schema.BATCH_INPUT_IDS] == torch.from_numpy(empty_ids).long()).all(dim=1), dropped)


class FakeShard:
    """Stands in for a Ray Data shard: the same rows every pass."""

    def __init__(self, rows):
        self.rows, self.passes = rows, 0

    def iter_batches(self, batch_size, batch_format, drop_last, prefetch_batches):
        self.passes += 1
        for start in range(0, len(self.rows) - batch_size + 1, batch_size):
            yield {"x": np.arange(start, start + batch_size), "_encode_seconds": np.full(batch_size, 0.5)}


def test_shard_batches_loop_over_passes_and_sum_stage_times():
    shard = FakeShard(range(5))
    batches = ShardBatches(shard, batch_size=2, to_batch=lambda c, epoch: c["x"].tolist(), max_passes=3)
    assert list(batches) == [[0, 1], [2, 3]] * 3  # the partial batch of each pass is dropped
    assert batches.stage_seconds == {"_encode_seconds": 6 * 2 * 0.5} and batches.batch_size == 2
    assert len(batches.waits) == 6 and batches.passes == 3


def test_a_restarted_worker_groups_passes_draw_anew():
    """A worker group restarted from a checkpoint at batch B reads the stream from its start again: its passes are
    epochs B, B + 1, ... of the per-sample draws (noise, levels, caption dropout), not 0, 1, ... again, which replayed
    the first run's batches draw for draw (train_worker sets ``first_epoch``)."""
    import inspect
    from diffusion.stream import ray_workers
    batches = ShardBatches(FakeShard(range(4)), batch_size=2, to_batch=lambda c, epoch: epoch, max_passes=2)
    batches.first_epoch = 3
    assert list(batches) == [3, 3, 4, 4]
    assert "loader.first_epoch = resumed_from" in inspect.getsource(ray_workers.train_worker)


def test_a_config_a_worker_refuses_reaches_the_command_as_its_own_one_line_error():
    """A ConfigError raised in a Ray Train worker (build_trainer's refusal) arrives wrapped in Ray's task error and
    Train's WorkerGroupError: the command printed 37 lines with two tracebacks; fit_on_ray now raises the
    worker's own error, which the command prints as one line."""
    from ray.exceptions import RayTaskError
    from ray.train.v2.api.exceptions import WorkerGroupError
    from diffusion.errors import ConfigError
    from diffusion.stream.ray_workers import users_error
    refused = ConfigError("model.text_encoder=kit is read only when model.text=ids")
    wrapped = RayTaskError("train_worker", "Traceback (most recent call last): ...", refused).as_instanceof_cause()
    group = WorkerGroupError("rank 0 failed", {0: wrapped, 1: RuntimeError("rank 1 stopped with it")})
    assert users_error(group) is refused and str(users_error(group)) == str(refused)
    from ray.train.v2._internal.exceptions import UserExceptionWithTraceback  # how 2.60 hands a rank's error back
    group = WorkerGroupError("ranks 0, 1 failed", {0: UserExceptionWithTraceback(refused, "Traceback ...")})
    assert users_error(group) is refused
    assert users_error(WorkerGroupError("rank 0 failed", {0: RuntimeError("out of memory")})) is None


def test_shard_batches_fail_clearly_on_an_empty_stream():
    with pytest.raises(RuntimeError, match="no full batch of 8 rows"):
        next(iter(ShardBatches(FakeShard(range(3)), batch_size=8, to_batch=lambda c, epoch: c)))
    early = ShardBatches(FakeShard(range(3)), batch_size=8, to_batch=lambda c, epoch: c)
    early.start()
    with pytest.raises(RuntimeError, match="no full batch of 8 rows"):
        next(iter(early))


class SlowStartShard(FakeShard):
    """A shard whose pipeline takes ``delay`` seconds to give its first batch (the actors loading models)."""

    def __init__(self, rows, delay):
        super().__init__(rows)
        self.delay, self.asked = delay, []

    def iter_batches(self, **kwargs):
        self.asked.append(time.perf_counter())
        time.sleep(self.delay)
        yield from super().iter_batches(**kwargs)


def test_a_started_stream_loads_while_the_trainer_is_built_and_gives_the_same_batches():
    """Each training worker starts its shard before building its trainer: the pipeline's start (its actors
    loading their models) overlaps the build, and training waits only for what is left of it."""
    shard = SlowStartShard(range(5), delay=1.0)
    batches = ShardBatches(shard, batch_size=2, to_batch=lambda c, epoch: c["x"].tolist(), max_passes=2)
    started = time.perf_counter()
    batches.start()
    time.sleep(2.0)  # the trainer being built (1 s longer than the start: margin for a loaded machine)
    assert len(shard.asked) == 1 and shard.asked[0] - started < 1.0  # the stream was asked at start()
    assert list(batches) == [[0, 1], [2, 3]] * 2  # the same batches as a stream never started early
    assert batches.waits[0] < 0.5  # the 1 s start was over by the time training asked
    assert batches.waits[2] >= 0.9 and shard.passes == 2  # the second pass starts when asked, as before
    assert batches.stage_seconds == {"_encode_seconds": 4 * 2 * 0.5}


def test_fault_injector_stays_quiet_off_its_batch_and_after_it_fired(tmp_path):
    from types import SimpleNamespace
    marker = tmp_path / "fired"
    state = SimpleNamespace(timestamp=SimpleNamespace(batch=3))
    FaultInjector(at_batch=4, marker=str(marker), rank=0).batch_end(state, None)  # other batch: nothing
    marker.write_text("already")
    state.timestamp.batch = 4
    FaultInjector(at_batch=4, marker=str(marker), rank=0).batch_end(state, None)  # already fired: nothing
    assert marker.read_text() == "already"


@pytest.mark.parametrize("stop, progress, said", [
    (SystemExit(130), "[progress] batch 3/6 (50.0%)  loss 0.9000", "at batch 3; re-run the same command to resume "
                                                                   "from its last checkpoint"),
    (KeyboardInterrupt(), None, "before its first batch; re-run the same command to resume from its last checkpoint")])
def test_ctrl_c_in_online_mode_says_where_it_stopped(stop, progress, said, tmp_path, monkeypatch, capsys):
    """Ctrl-C reaches the driver as KeyboardInterrupt, or as the sys.exit(130) of Composer's engine where
    its handler ran: either ends with the README's interrupt line and status 130 (it ended with rc 1 and
    no word), at the batch of the workers' last progress line. The real signal: test_ray_cluster.py."""
    from diffusion import cli, online
    from diffusion.stream import ray_workers

    def interrupted(cfg):
        if progress:  # a worker's progress line, as Ray forwards it to the driver's printer
            ray_workers.print_progress_lines({"lines": ["(RayTrainWorker) other output", progress]})
        raise stop
    monkeypatch.setattr(ray_workers, "run_online", interrupted)
    monkeypatch.setattr(ray_workers, "last_progress", {})
    with pytest.raises(SystemExit) as ended:
        cli.run(online.main, "online", [os.path.join(ROOT, "yamls", "tiny-online-cpu.yaml"),
                                        f"trainer.save_folder={tmp_path}"])
    assert ended.value.code == 130
    printed = capsys.readouterr()
    assert printed.err.strip().splitlines()[-1] == f"online: interrupted {said}"
    assert (progress or "") in printed.out and "other output" not in printed.out


def finished_save_folder(tmp_path, *extra, batch=6):
    """A run's config and save folder as a finished online run leaves them: ``latest-rank0.pt`` -> the
    whole checkpoint of its last batch, and the run's record of it in the work dir."""
    from diffusion.stream import ray_workers
    cfg = online_config("kit", tmp_path / "raw", tmp_path, *extra)
    folder = tmp_path / "ckpt"
    folder.mkdir()
    torch.save({"state": {}}, folder / f"ep0-ba{batch}-rank0.pt")
    os.symlink(f"ep0-ba{batch}-rank0.pt", folder / "latest-rank0.pt")
    work_dir = str(tmp_path / "work" / (cfg.trainer.run_name or ray_workers.DEFAULT_RUN_NAME))
    ray_workers._record_finished(ray_workers.with_absolute_paths(cfg), work_dir, batch)
    return cfg, folder, work_dir


def test_rerunning_a_finished_run_says_so_without_starting_ray(tmp_path, monkeypatch):
    """The second run of a finished command reads the save folder's names, not its checkpoint, and says what
    the workers' trainer would have said (the end-to-end re-run: test_a_killed_worker_...)."""
    from types import SimpleNamespace
    from composer.core import Time, Timestamp
    from diffusion.stream import ray_workers
    from diffusion.train.trainer import finished_message
    cfg, _, _ = finished_save_folder(tmp_path)

    def no_ray():
        raise AssertionError("Ray was started for a finished run")
    monkeypatch.setattr(ray_workers, "_init_ray_with_progress", no_ray)
    again = run_online(cfg)
    trainer = SimpleNamespace(state=SimpleNamespace(max_duration=Time.from_timestring("6ba"), timestamp=Timestamp(batch=6)))
    assert again.finished == finished_message(trainer) and "at 6ba of trainer.max_duration=6ba" in again.finished
    assert again.batch == again.resumed_from == 6 and not again.losses and again.rejects == {}


@pytest.mark.parametrize("change", ["no record", "max_duration raised", "samples", "other config", "other name",
                                    "checkpoint rewritten", "later checkpoint beside it", "cut short", "sharded"])
def test_a_rerun_that_cannot_be_told_finished_from_names_starts_as_usual(change, tmp_path):
    """Anything but the very checkpoint a finished run of this config recorded, under Composer's default
    name, whole and the newest: the run starts (its workers load the checkpoint and say what it holds)."""
    from diffusion.stream.ray_workers import already_finished, with_absolute_paths
    cfg, folder, work_dir = finished_save_folder(tmp_path)
    assert already_finished(with_absolute_paths(cfg), work_dir).finished  # as left: told finished
    checkpoint = folder / "ep0-ba6-rank0.pt"
    overrides = {"max_duration raised": ["trainer.max_duration=8ba"], "samples": ["trainer.max_duration=48sp"],
                 "other config": ["optimizer.lr=0.5"]}.get(change, [])
    if overrides:
        cfg = online_config("kit", tmp_path / "raw", tmp_path, *overrides)
    if change == "no record":
        os.remove(os.path.join(work_dir, "finished-run.json"))
    elif change == "other name":  # another save_filename: the batch is not in the name
        os.replace(checkpoint, folder / "final.pt")
        os.remove(folder / "latest-rank0.pt")
        os.symlink("final.pt", folder / "latest-rank0.pt")
    elif change == "checkpoint rewritten":
        torch.save({"state": {"model": {}}}, checkpoint)
    elif change == "later checkpoint beside it":  # autoresume's recovery would move latest there
        torch.save({"state": {}}, folder / "ep0-ba8-rank0.pt")
    elif change == "cut short":
        checkpoint.write_bytes(checkpoint.read_bytes()[:100])
    elif change == "sharded":
        os.remove(folder / "latest-rank0.pt")
        (folder / "ep0-ba6").mkdir()
        os.symlink("ep0-ba6", folder / "latest-rank0.pt")
    assert already_finished(with_absolute_paths(cfg), work_dir) is None


# ---- end to end on the local Ray, slow -------------------------------------------------------------

@pytest.mark.slow
def test_online_training_learns_counts_rejects_and_continues_offline(tiny_kit, sample_data, ray_local, tmp_path):
    # One checkpoint, the run's last (Composer saves at max_duration whatever the interval): the two periodic
    # saves of the 2ba default held 2 of its 6 batches' ~1.3 s gaps each at ~4 s and nothing here reads them.
    # One training worker, with the whole batch of 8: two ranks splitting the stream are the killed-worker test's.
    result = run_online(online_config(tiny_kit, sample_data, tmp_path, "trainer.save_interval=6ba",
                                      "data.online.num_train_workers=1"))
    assert result.batch == 6 and result.resumed_from == 0
    losses = [loss for _, loss in result.losses]
    assert [b for b, _ in result.losses] == list(range(1, 7))
    assert np.mean(losses[-2:]) < 0.9 * np.mean(losses[:2]), losses
    assert result.rejects == expected_rejects(sample_data)
    assert result.stage_seconds.get(transforms.STAGE_SECONDS, 0) > 0

    # The checkpoint starts offline training in run.py's trainer, on MDS shards, from the same weights.
    from train_fixtures import tiny_overrides, write_latent_mds
    from diffusion.train.trainer import build_trainer
    checkpoint = tmp_path / "ckpt" / "latest-rank0.pt"
    assert checkpoint.exists()
    online_state = torch.load(checkpoint, map_location="cpu", weights_only=False)["state"]["model"]
    mds = write_latent_mds(str(tmp_path / "mds"), kit=tiny_kit, n=16)
    cfg = load_config(TINY, tiny_overrides(tiny_kit, mds, batches=2, extra=(
        f"trainer.load_path={checkpoint}", "trainer.load_weights_only=true")))
    trainer = build_trainer(cfg)
    loaded = trainer.state.model.state_dict()
    torch.testing.assert_close(loaded["denoiser.conv_in.weight"], online_state["denoiser.conv_in.weight"])
    trainer.fit()
    assert int(trainer.state.timestamp.batch) == 2
    trainer.close()


@pytest.mark.slow
def test_a_killed_worker_is_restarted_and_training_completes(tiny_t5_kit, sample_data, ray_local, tmp_path, capsys):
    # The MMDiT with rectified flow, from model.text=ids of a T5 at 24 tokens: the Ray pipeline runs no
    # text encoder, each worker encodes its batches' ids under their attention masks (and gets its text
    # encoder back when the group restarts), and the MMDiT attends to the captions' tokens only
    # (model.text_mask=true: SD3 trains T5 unmasked, the MMDiT's default). Either refuses a batch without the
    # stream's token counts.
    marker = tmp_path / "killed-once"
    injector = FaultInjector(at_batch=3, marker=str(marker), rank=1)
    mmdit = ("model.denoiser=SD3Transformer2DModel", "model.text=ids", "model.prediction_type=null",
             "model.objective=flow", "data.online.text_length=24", "model.text_mask=true")
    # 4 batches: checkpoint at 2, the kill at 3, and the restarted group trains 3 and 4 (a checkpoint resumed and
    # training continued past the kill to max_duration, as 6 batches showed with two more steps and a save).
    result = run_online(online_config(tiny_t5_kit, sample_data, tmp_path, *mmdit, batches=4), extra_callbacks=[injector])
    assert marker.exists()  # the fault happened...
    assert result.resumed_from == 2  # ...the new worker group resumed from the checkpoint before it...
    assert result.batch == 4 and [b for b, _ in result.losses] == [3, 4]  # ...and finished the run
    from diffusion.models.checkpoint import load_denoiser
    denoiser, description, _ = load_denoiser(str(tmp_path / "ckpt" / "latest-rank0.pt"))
    assert type(denoiser).__name__ == "SD3Transformer2DModel" and description.objective == "flow"
    assert description.text_mask and description.text_length == 24
    capsys.readouterr()
    again = run_online(online_config(tiny_t5_kit, sample_data, tmp_path, *mmdit, batches=4))  # the same command again
    assert again.finished and "already finished" in again.finished and again.batch == 4 and not again.losses
    assert "online pools" not in capsys.readouterr().out  # told from the save folder: no pools, no workers started




@pytest.mark.parametrize("kit_name, denoiser_class, stored", [
    ("tiny_flux_kit", "FluxTransformer2DModel", (32, 8, 8)), ("tiny_sana_kit", "SanaTransformer2DModel", (32, 2, 2))])
def test_flux_and_sana_train_on_online_modes_batches(kit_name, denoiser_class, stored, request, sample_data, tmp_path):
    """Flux and SANA in online mode, in this process (the slow tests above run whole jobs on Ray): the stream's
    description, its transform and encode operators on sample rows (Flux's 16-channel moments and both its text
    encoders, CLIP's pooled vector beside T5's sequence; SANA's DC-AE latents at /32), a worker's batches and
    its trainer, two batches of flow."""
    from diffusion.stream.ray_workers import OnlineTrainer, stream_to_batch, with_absolute_paths
    from diffusion.stream.stream_source import stream_info
    from train_fixtures import RowsShard, encoded_sample_rows
    kit = request.getfixturevalue(kit_name)
    cfg = with_absolute_paths(online_config(kit, sample_data, tmp_path, "model.prediction_type=null",
                                            "model.objective=flow", "trainer.save_folder=null", "trainer.autoresume=false",
                                            "data.train.caption_dropout=0.2", batches=2))
    info, empty = stream_info(cfg)
    _, columns = encoded_sample_rows(kit, sample_data, cfg)
    assert columns[info.latent_space.column(64)].shape[1:] == stored
    batches = ShardBatches(RowsShard(columns), 8, stream_to_batch(cfg, info, empty))
    first = next(iter(batches))
    assert (schema.BATCH_POOLED_TEXT_EMBEDS in first) == (kit_name == "tiny_flux_kit")
    trainer = OnlineTrainer(cfg, info, empty)(batches, [])
    assert type(trainer.state.model.denoiser).__name__ == denoiser_class
    assert trainer.state.model.pooled_text == (kit_name == "tiny_flux_kit")
    trainer.fit()
    assert int(trainer.state.timestamp.batch) == 2 and np.isfinite(float(trainer.state.loss))
    trainer.close()


def test_data_train_keys_online_mode_does_not_read_are_named_in_one_note(tmp_path, monkeypatch, capsys):
    """`python -m diffusion.online` on a YAML written for stored shards: data.train's path, cache, shuffling and loader
    workers were accepted without a word, though the rows come from data.online.input. Now one note names them
    (the workers' count as asked, before it is sized to the machine); the online YAML itself gets none."""
    from diffusion import cli, online
    from diffusion.stream import ray_workers
    monkeypatch.setattr(ray_workers, "run_online", lambda cfg: None)
    monkeypatch.setattr(ray_workers, "report", lambda result: None)
    yaml = os.path.join(ROOT, "yamls", "tiny-online-cpu.yaml")
    cli.run(online.main, "online", [yaml, f"trainer.save_folder={tmp_path}"])
    assert "note:" not in capsys.readouterr().err
    cli.run(online.main, "online", [yaml, f"trainer.save_folder={tmp_path}", "data.train.path=s3://bucket/mds",
                                    "data.train.num_workers=16", "data.train.shuffle=false", "data.train.batch_size=64"])
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note:")]
    assert notes == ["note: online mode reads raw rows from data.online.input and, of data.train, only batch_size, "
                     "caption_dropout: data.train.path=s3://bucket/mds, data.train.shuffle=False, "
                     "data.train.num_workers=16 do nothing here"]
