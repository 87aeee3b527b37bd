"""EMA: against a plain-Python reference, warm-up, start (batches or a fraction of the run), half-life,
trainable-only, raw and EMA eval under their own labels, checkpoints."""

import copy
import math
import os

import pytest
import torch
from composer import Trainer
from composer.core import Callback, Evaluator
from composer.loggers import InMemoryLogger
from composer.models import ComposerModel
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics import MeanSquaredError

from diffusion.train.algorithms.ema import EMA, drop_gathered_parameters, parameter_name, smoothing_from_half_life
from diffusion.train.config import load_config
from diffusion.errors import ConfigError

YAMLS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))), "yamls")


class TinyRegressor(ComposerModel):
    """Two trainable layers and a frozen one: enough to tell trainable from frozen parameters."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        self.frozen = torch.nn.Linear(4, 4)
        self.frozen.requires_grad_(False)
        self.metric = MeanSquaredError()

    def forward(self, batch):
        x, _ = batch
        return self.body(self.frozen(x))

    def loss(self, outputs, batch):
        return torch.nn.functional.mse_loss(outputs, batch[1])

    def get_metrics(self, is_train=False):
        return {} if is_train else {"mse": self.metric}

    def update_metric(self, batch, outputs, metric):
        metric.update(outputs, batch[1])


def loader(n=48, batch_size=4):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 4, generator=g)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=batch_size, shuffle=False)


def trainable(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


class WeightRecorder(Callback):
    """Training weights after each batch, weights each evaluator starts with (by label), and after eval."""

    def __init__(self):
        self.after_batch, self.at_eval, self.after_eval = [], [], []

    def batch_end(self, state, logger):
        self.after_batch.append(trainable(state.model))

    def eval_start(self, state, logger):
        self.at_eval.append((int(state.timestamp.batch), state.dataloader_label, trainable(state.model)))

    def eval_after_all(self, state, logger):
        self.after_eval.append(trainable(state.model))


def fit(ema, duration="6ba", **kwargs):
    model = TinyRegressor()
    recorder = WeightRecorder()
    trainer = Trainer(model=model, train_dataloader=loader(), max_duration=duration, algorithms=[ema],
                      optimizers=torch.optim.SGD(model.parameters(), lr=0.1), callbacks=[recorder],
                      device="cpu", progress_bar=False, log_to_console=False, seed=0, **kwargs)
    trainer.fit()
    return trainer, recorder


def diffusers_decay(smoothing: float, updates_before: int) -> float:
    """The decay diffusers' EMAModel gives the update after ``updates_before`` others (its own get_decay)."""
    from diffusers.training_utils import EMAModel
    return EMAModel([torch.nn.Parameter(torch.zeros(1))], decay=smoothing).get_decay(updates_before + 1)


def reference_ema(weights, smoothing, start_batch=0, initial=None, interval=1, warmup=True):
    """Plain Python over the per-batch weights: copy at start_batch, then one update per interval, each
    with diffusers' EMAModel's decay when warming up (0 for the first: it takes the weights)."""
    ema = {k: v.clone() for k, v in initial.items()} if start_batch == 0 else None
    n = 0
    for batch, w in enumerate(weights, start=1):
        if ema is None:
            if batch >= start_batch:
                ema = {k: v.clone() for k, v in w.items()}
            continue
        if (batch - start_batch) % interval == 0:
            decay = diffusers_decay(smoothing, n) if warmup else smoothing
            n += 1
            ema = {k: decay * ema[k] + (1 - decay) * w[k] for k in w}
    return ema


def assert_close(a, b):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-6, atol=1e-6, msg=k)


def test_ema_matches_reference_over_several_steps():
    ema = EMA(smoothing=0.8, warmup=False)
    trainer, rec = fit(ema)
    initial = trainable(TinyRegressor())
    expected = reference_ema(rec.after_batch, 0.8, initial=initial, warmup=False)
    assert_close(ema.state_dict()["ema_params"], expected)
    assert ema.num_updates == 6
    # the average really lags behind the trained weights
    assert not torch.allclose(expected["body.0.weight"], rec.after_batch[-1]["body.0.weight"])


def test_warmup_follows_diffusers_schedule_by_default():
    # diffusers' EMAModel, update for update: decay 0 (the first takes the weights), then 2/11, 3/12, ...
    # (min(smoothing, (1 + n) / (10 + n)) after n updates) until it reaches smoothing
    from diffusers.training_utils import EMAModel
    ema = EMA(smoothing=0.25)
    assert ema.warmup and ema.decay == 0.0
    _, rec = fit(ema)
    initial = trainable(TinyRegressor())
    theirs = EMAModel([torch.nn.Parameter(v.clone()) for v in initial.values()], decay=0.25)
    for weights in rec.after_batch:
        theirs.step([torch.nn.Parameter(w) for w in weights.values()])
    assert_close(ema.state_dict()["ema_params"], dict(zip(initial, theirs.shadow_params)))
    assert ema.decay == 0.25 == theirs.get_decay(7)  # update 7: 7/16 > 0.25
    slow = EMA(smoothing=0.9)
    fit(slow)
    assert slow.decay == pytest.approx(7 / 16)  # still warming up after 6 updates
    warmed = reference_ema(rec.after_batch, 0.9, initial=initial)
    plain = reference_ema(rec.after_batch, 0.9, initial=initial, warmup=False)
    assert_close(slow.state_dict()["ema_params"], warmed)
    # the warm-up follows the weights: early on far closer to them than a plain 0.9 average
    last = rec.after_batch[-1]["body.0.weight"]
    assert (warmed["body.0.weight"] - last).norm() < 0.5 * (plain["body.0.weight"] - last).norm()


def test_start_and_interval():
    ema = EMA(smoothing=0.5, start="3ba", update_interval=2)
    assert EMA(smoothing=0.5, start=3).state_dict()["ema_params"] == {}  # nothing before start
    _, rec = fit(ema, duration="8ba")
    expected = reference_ema(rec.after_batch, 0.5, start_batch=3, interval=2)
    assert_close(ema.state_dict()["ema_params"], expected)
    assert ema.num_updates == 2  # batches 5 and 7
    assert ema.state_dict()["started_at_batch"] == 3


@pytest.mark.parametrize("start, duration, started_at", [("0.5dur", "8ba", 4), ("0.25dur", "32sp", 2),
                                                         ("8sp", "6ba", 2), (0, "6ba", 0)])
def test_start_as_a_fraction_of_the_run_or_in_samples(start, duration, started_at):
    # 4 samples per batch: 32sp is 8 batches, 8sp is 2 batches
    ema = EMA(smoothing=0.5, start=start)
    _, rec = fit(ema, duration=duration)
    assert ema.state_dict()["started_at_batch"] == started_at
    initial = trainable(TinyRegressor())
    expected = reference_ema(rec.after_batch, 0.5, start_batch=started_at, initial=initial)
    assert_close(ema.state_dict()["ema_params"], expected)


def test_bad_starts_are_refused():
    for bad in ("1ep", "-3ba", "1.5dur", "soon", -1, 2.5):
        with pytest.raises(ValueError, match="EMA start"):
            EMA(start=bad)
    with pytest.raises(ValueError, match="max_duration must then be in batches or samples"):
        fit(EMA(start="0.5dur"), duration="1ep")


def test_half_life_conversion():
    assert smoothing_from_half_life("1000ba") == pytest.approx(0.5 ** (1 / 1000))
    assert EMA(half_life="10ba", update_interval=5).smoothing == pytest.approx(math.sqrt(0.5))
    # after half_life batches the old average keeps half its weight
    assert EMA(half_life="100ba").smoothing ** 100 == pytest.approx(0.5)
    with pytest.raises(ValueError, match="batches"):
        EMA(half_life="1ep")


def test_only_trainable_parameters_and_clean_names():
    ema = EMA(smoothing=0.9)
    fit(ema, duration="1ba")
    names = set(ema.state_dict()["ema_params"])
    assert names == {"body.0.weight", "body.0.bias", "body.2.weight", "body.2.bias"}
    assert parameter_name("_fsdp_wrapped_module.unet._orig_mod.conv_in.weight") == "unet.conv_in.weight"
    assert parameter_name("module.unet.conv_in.weight") == "unet.conv_in.weight"


def test_raw_and_ema_weights_are_evaluated_under_their_own_labels_once_the_ema_runs():
    ema = EMA(smoothing=0.7, start="3ba")
    held_out = loader(8)
    metrics = InMemoryLogger()
    _, rec = fit(ema, duration="6ba", eval_dataloader=[Evaluator(label="eval", dataloader=held_out),
                                                       ema.evaluator(held_out, "2ba")],
                 eval_interval="2ba", loggers=[metrics])
    # before the start (batch 2) only the raw weights; then both, raw first, on the same batches
    assert [(b, label) for b, label, _ in rec.at_eval] == [(2, "eval"), (4, "eval"), (4, "eval_ema"),
                                                           (6, "eval"), (6, "eval_ema")]
    for batch, label, weights in rec.at_eval:
        if label == "eval":
            assert_close(weights, rec.after_batch[batch - 1])
    expected = {b: reference_ema(rec.after_batch[:b], 0.7, start_batch=3) for b in (4, 6)}
    assert_close(rec.at_eval[2][2], expected[4])
    assert_close(rec.at_eval[4][2], expected[6])
    for restored, batch in zip(rec.after_eval, (2, 4, 6)):  # training weights back after every eval
        assert_close(restored, rec.after_batch[batch - 1])
    logged = metrics.data
    assert [int(t.batch) for t, _ in logged["metrics/eval/mse"]] == [2, 4, 6]
    assert [int(t.batch) for t, _ in logged["metrics/eval_ema/mse"]] == [4, 6]
    # distinct numbers: the EMA lags behind the weights it averages
    assert logged["metrics/eval_ema/mse"][-1][1] != logged["metrics/eval/mse"][-1][1]


def test_ema_weights_context_manager_swaps_and_restores():
    ema = EMA(smoothing=0.6)
    trainer, _ = fit(ema, duration="3ba")
    model = trainer.state.model
    before = trainable(model)
    with ema.ema_weights(model):
        assert_close(trainable(model), ema.state_dict()["ema_params"])
        with ema.ema_weights(model):  # nested use (image logging during eval) is a no-op
            assert_close(trainable(model), ema.state_dict()["ema_params"])
    assert_close(trainable(model), before)


def test_state_dict_round_trip_into_a_fresh_algorithm():
    ema = EMA(smoothing=0.9)
    trainer, _ = fit(ema, duration="3ba")
    saved = copy.deepcopy(ema.state_dict())
    other = EMA(smoothing=0.9)
    other.load_state_dict(saved)  # before the model is bound: applied when it is
    with other.ema_weights(trainer.state.model):
        pass
    assert other.num_updates == 3
    assert_close(other.state_dict()["ema_params"], saved["ema_params"])
    third = EMA()
    third.load_state_dict(dict(saved, ema_params={"nope": torch.zeros(1)}))
    with pytest.raises(KeyError, match="trainable parameter"):
        third._bind(trainer.state.model)


def test_checkpoint_holds_ema_and_resume_is_exact(tmp_path):
    # smoothing 0.9 warms up for 80 updates: the resumed run must continue the warm-up, not restart it
    straight = EMA(smoothing=0.9, start="0.3dur")  # batch 2 of 6
    fit(straight, duration="6ba")

    first = EMA(smoothing=0.9, start="0.3dur")
    fit(first, duration="6ba", save_folder=str(tmp_path), save_interval="3ba",
        save_filename="ep{epoch}-ba{batch}.pt")
    ckpt = torch.load(tmp_path / "ep0-ba3.pt", weights_only=False)
    algorithms = dict(ckpt["state"]["algorithms"])
    assert set(algorithms["EMA"]["ema_params"]) == {"body.0.weight", "body.0.bias", "body.2.weight", "body.2.bias"}
    assert algorithms["EMA"]["num_updates"] == 1 and algorithms["EMA"]["started_at_batch"] == 2

    resumed = EMA(smoothing=0.9, start="0.3dur")
    fit(resumed, duration="6ba", load_path=str(tmp_path / "ep0-ba3.pt"))
    assert resumed.num_updates == straight.num_updates == 4
    assert resumed.decay == straight.decay == pytest.approx(5 / 14)
    assert_close(resumed.state_dict()["ema_params"], straight.state_dict()["ema_params"])


def test_sharded_fsdp1_checkpoints_with_ema_are_refused_at_start_and_fsdp2_ones_accepted():
    # FSDP1's EMA is checkpointed as full tensors only: refused when the config is read, not at the first save.
    # FSDP2's is saved sharded beside the weights (tests/train/test_fsdp_mmdit.py resumes it exactly).
    tiny = os.path.join(YAMLS, "tiny-cpu.yaml")
    with pytest.raises(ConfigError, match=r"trainer\.fsdp\.state_dict_type=sharded with algorithms\.ema needs "
                                          r"trainer\.fsdp\.version=2"):
        load_config(tiny, ["trainer.fsdp={state_dict_type: sharded}"])
    load_config(tiny, ["trainer.fsdp={state_dict_type: sharded, version: 2}"])
    load_config(tiny, ["trainer.fsdp={state_dict_type: sharded}", "algorithms.ema=null"])
    load_config(tiny, ["trainer.fsdp={state_dict_type: full}"])
    cfg = load_config(os.path.join(YAMLS, "sd2-base-512.yaml"))  # phase 2: EMA, FSDP, full, strict load
    assert "ema" in cfg.algorithms and cfg.trainer.fsdp.state_dict_type == "full" and cfg.trainer.load_strict


def test_a_sharded_checkpoint_without_ema_shards_loads_into_a_run_with_ema(tmp_path):
    """A sharded checkpoint of before the EMA started (or of a run without EMA) holds no EMAShards entries: they
    are left unloaded (the EMA then starts as configured) where torch's planner refuses the load; a checkpoint
    holding only some of them is still refused."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from diffusion.train.algorithms.ema import optional_shards_load_planner
    dcp.save({"state": {"model": {"w": torch.ones(3)}, "callbacks": {"EMAShards": {"EMA": {"a": torch.ones(2)}}}}},
             checkpoint_id=tmp_path / "with")
    dcp.save({"state": {"model": {"w": torch.ones(3)}}}, checkpoint_id=tmp_path / "without")

    def template():
        return {"state": {"model": {"w": torch.zeros(3)},
                          "callbacks": {"EMAShards": {"EMA": {"a": torch.zeros(2), "b": torch.zeros(1)}}}}}
    with pytest.raises(CheckpointException, match="Missing key"):  # torch's own planner
        dcp.load(template(), checkpoint_id=tmp_path / "without")
    loaded = template()
    dcp.load(loaded, checkpoint_id=tmp_path / "without", planner=optional_shards_load_planner())
    assert torch.equal(loaded["state"]["model"]["w"], torch.ones(3))
    with pytest.raises(CheckpointException, match=r"Missing key.*EMAShards\.EMA\.b"):  # a group held in part
        dcp.load(template(), checkpoint_id=tmp_path / "with", planner=optional_shards_load_planner())
    loaded = template()
    del loaded["state"]["callbacks"]["EMAShards"]["EMA"]["b"]
    dcp.load(loaded, checkpoint_id=tmp_path / "with", planner=optional_shards_load_planner())
    assert torch.equal(loaded["state"]["callbacks"]["EMAShards"]["EMA"]["a"], torch.ones(2))


def test_swaps_without_fsdp_drop_nothing():
    # Under FSDP every swap drops the gathered full parameters (tests/train/test_fsdp.py); without, a no-op.
    model = TinyRegressor()
    before = trainable(model)
    drop_gathered_parameters(model)
    assert_close(trainable(model), before)


def _earlier_phase(tmp_path):
    """A 3-batch phase at smoothing 0.9 (warming up) and its final checkpoint's EMA."""
    fit(EMA(smoothing=0.9), duration="3ba", save_folder=str(tmp_path), save_interval="3ba",
        save_filename="ep{epoch}-ba{batch}.pt")
    path = str(tmp_path / "ep0-ba3.pt")
    return path, dict(torch.load(path, weights_only=False)["state"]["algorithms"])["EMA"]


def test_init_from_continues_the_earlier_phases_count_unless_restarted(tmp_path):
    path, earlier = _earlier_phase(tmp_path)
    assert earlier["num_updates"] == 3
    went_on = EMA(smoothing=0.9, init_from=path)
    _, rec = fit(went_on, duration="2ba")
    assert went_on.num_updates == 5  # the warm-up went on: update 4's decay 4/13, not a first update's 0
    expected = dict(earlier["ema_params"])
    for n, weights in zip((3, 4), rec.after_batch):
        decay = (1 + n) / (10 + n)
        expected = {k: decay * expected[k] + (1 - decay) * weights[k] for k in weights}
    assert_close(went_on.state_dict()["ema_params"], expected)
    # restart: this phase's own schedule from its first batch, starting from the earlier average
    restarted = EMA(smoothing=0.5, warmup=False, init_from=path, restart=True)
    _, rec = fit(restarted, duration="4ba")
    assert restarted.num_updates == 4
    assert_close(restarted.state_dict()["ema_params"],
                 reference_ema(rec.after_batch, 0.5, initial=earlier["ema_params"], warmup=False))
    warm = EMA(smoothing=0.9, init_from=path, restart=True)
    _, rec = fit(warm, duration="2ba")
    assert warm.num_updates == 2 and warm.decay == pytest.approx(3 / 12)  # the warm-up again: 0, 2/11, 3/12, ...
    assert_close(warm.state_dict()["ema_params"], reference_ema(rec.after_batch, 0.9, initial=earlier["ema_params"]))
    with pytest.raises(ValueError, match="give algorithms.ema.init_from"):
        EMA(restart=True)


@pytest.fixture(scope="module")
def s3_bucket():
    """A bucket on moto's S3 server (127.0.0.1), the endpoint where diffusion.storage looks."""
    import boto3
    from moto.server import ThreadedMotoServer
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{server.get_host_and_port()[1]}"
    with pytest.MonkeyPatch.context() as env:
        for name, value in {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
                            "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true",
                            "AWS_ENDPOINT_URL": endpoint}.items():
            env.setenv(name, value)
        client = boto3.client("s3", endpoint_url=endpoint)
        client.create_bucket(Bucket="phases")
        yield client, "phases"
    server.stop()


def test_init_from_reads_an_earlier_phase_on_s3_through_latest(tmp_path, s3_bucket):
    """The micro-budget YAMLs continue the EMA of s3://.../latest-rank0.pt: Composer's remote latest is the
    object latest-rank0.pt.symlink holding the checkpoint's key (as tests/train/callbacks/
    test_checkpoint_pruning.py sees it write)."""
    client, bucket = s3_bucket
    path, earlier = _earlier_phase(tmp_path)
    client.upload_file(path, bucket, "masked/ep0-ba3-rank0.pt")
    client.put_object(Bucket=bucket, Key="masked/latest-rank0.pt.symlink", Body=b"masked/ep0-ba3-rank0.pt")
    for uri in (f"s3://{bucket}/masked/ep0-ba3-rank0.pt", f"s3://{bucket}/masked/latest-rank0.pt"):
        went_on = EMA(smoothing=0.9, init_from=uri)
        _, rec = fit(went_on, duration="1ba")
        assert went_on.num_updates == 4  # the earlier phase's 3 updates went on
        decay = 4 / 13
        expected = {k: decay * earlier["ema_params"][k] + (1 - decay) * w for k, w in rec.after_batch[0].items()}
        assert_close(went_on.state_dict()["ema_params"], expected)
    missing = f"s3://{bucket}/unmasked/latest-rank0.pt"
    with pytest.raises(ConfigError) as refused:
        fit(EMA(init_from=missing), duration="1ba")
    assert str(refused.value).startswith(f"algorithms.ema.init_from={missing}: no such checkpoint")
    assert "\n" not in str(refused.value)
