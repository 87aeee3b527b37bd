"""Config: YAMLs validate; misspelt keys, bad values and epochs fail at start naming the key."""

import glob
import os
import re
import subprocess
import sys

import pytest

from diffusion.train.config import ConfigError, load_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "yamls", "tiny-cpu.yaml")


SHIPPED = (glob.glob(os.path.join(ROOT, "yamls", "*.yaml")) + glob.glob(os.path.join(ROOT, "yamls", "micro-budget", "*.yaml"))
           + glob.glob(os.path.join(ROOT, "yamls", "mlperf-flux", "*.yaml")))  # every training YAML (not cost/, mcli/)


@pytest.mark.parametrize("path", sorted(SHIPPED))
def test_shipped_yamls_validate(path):
    cfg = load_config(path)
    assert cfg.trainer.max_duration.endswith("ba")


@pytest.mark.parametrize("objective, override, key", [
    ("flow", "model.min_snr_gamma=5.0", "model.min_snr_gamma=5.0"),
    ("flow", "model.min_snr_floor=0.1", "model.min_snr_floor=0.1"),
    ("epsilon", "model.flow.shift=3.0", "model.flow.shift=3.0"),
    ("v_prediction", "model.flow.weighting=cosmap", "model.flow.weighting='cosmap'"),
    ("epsilon", "model.flow.precondition_outputs=true", "model.flow.precondition_outputs=True")])
def test_a_key_the_objective_does_not_read_is_refused_naming_it(objective, override, key):
    """Issue 47, item 7: min-SNR under flow (or flow's σ settings under ε/v) was accepted and ignored."""
    flow_yaml = os.path.join(ROOT, "yamls", "tiny-mmdit-flow-cpu.yaml")
    base = [f"model.objective={objective}", "model.prediction_type=null"]  # the YAML's flow: section holds
    # flow's defaults only, which is not a setting ε/v would ignore
    with pytest.raises(ConfigError, match=rf"^{re.escape(key)}: only the .* objectives? reads? it, and this run "
                                          rf"trains {objective}, which would ignore it"):
        load_config(flow_yaml, [*base, override])
    load_config(flow_yaml, base)  # the same run without the key is fine
    from diffusion.models import objectives
    from diffusion.train.config import ModelConfig
    with pytest.raises(ConfigError, match="min_snr_gamma"):  # also where the objective is only known at build
        objectives.check_keys("flow", ModelConfig(min_snr_gamma=5.0))


@pytest.mark.parametrize("override, message", [
    ("model.flow.logit_mean=1.0", "model.flow.logit_mean=1.0 is read only with model.flow.sigma_density=logit_normal"),
    ("model.flow.mode_scale=0.5", "model.flow.mode_scale=0.5 is read only with model.flow.sigma_density=mode"),
    ("model.min_snr_floor=0.1", "model.min_snr_floor=0.1 is read only with model.min_snr_gamma set"),
    ("model.min_snr_gamma=-5.0", "model.min_snr_gamma=-5.0 must be positive")])
def test_a_setting_the_objectives_other_settings_leave_unread_is_refused(override, message):
    """Issue 47, item 7 within one objective: the logit-normal draw's mean under a uniform draw, the mode draw's
    scale under logit-normal, min-SNR's floor without min-SNR were accepted and ignored (a negative gamma
    weighted the loss below 0)."""
    yaml = os.path.join(ROOT, "yamls", "tiny-flux-mlperf-cpu.yaml" if "flow" in override else "tiny-cpu.yaml")
    with pytest.raises(ConfigError, match=rf"^{re.escape(message)}"):
        load_config(yaml, [override])
    # read where the setting that reads it is on
    fix = {"logit_mean": "model.flow.sigma_density=logit_normal", "mode_scale": "model.flow.sigma_density=mode",
           "floor": "model.min_snr_gamma=5.0"}
    reader = next((v for k, v in fix.items() if k in override), None)
    if reader:
        load_config(yaml, [override, reader])


def test_recipe_numbers():
    p1, p2 = load_config(f"{ROOT}/yamls/sd2-base-256.yaml"), load_config(f"{ROOT}/yamls/sd2-base-512.yaml")
    assert (p1.data.train.batch_size, p1.trainer.max_duration, p1.model.resolution) == (2048, "550000ba", 256)
    assert (p2.data.train.batch_size, p2.trainer.max_duration, p2.model.resolution) == (2048, "850000ba", 512)
    for cfg in (p1, p2):
        assert (cfg.optimizer.lr, cfg.optimizer.weight_decay, cfg.scheduler.t_warmup) == (1e-4, 0.01, "10000ba")
        assert cfg.trainer.fsdp.sharding_strategy == "SHARD_GRAD_OP"
    assert p2.algorithms["ema"] == {"smoothing": 0.9999, "start": "800000ba", "warmup": True}

    assert p2.trainer.load_weights_only and p2.trainer.load_strict  # strict: a key mismatch fails


def test_overrides_are_typed():
    cfg = load_config(TINY, ["optimizer.lr=3e-4", "trainer.max_duration=7ba", "trainer.save_folder=null",
                             "data.train.shuffle=false", "trainer.device_train_microbatch_size=4",
                             "algorithms.ema=null"])
    assert cfg.optimizer.lr == 3e-4 and cfg.trainer.max_duration == "7ba" and cfg.trainer.save_folder is None
    assert cfg.data.train.shuffle is False and cfg.trainer.device_train_microbatch_size == 4
    assert "ema" not in cfg.algorithms


def test_misspelt_key_names_it_and_suggests():
    with pytest.raises(ConfigError) as e:
        load_config(TINY, ["trainer.max_duraton=10ba"])
    message = str(e.value)
    assert "'trainer.max_duraton'" in message and "did you mean 'max_duration'" in message
    assert "save_folder" in message  # the valid keys are listed


def test_misspelt_key_in_a_yaml_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model:\n  resolutoin: 256\n")
    with pytest.raises(ConfigError, match="'model.resolutoin'.*did you mean 'resolution'"):
        load_config(str(path))


def test_unknown_section_and_component():
    with pytest.raises(ConfigError, match="did you mean 'optimizer'"):
        load_config(TINY, ["optimiser.lr=1"])
    with pytest.raises(ConfigError, match="'callbacks.speed_monitr'.*did you mean 'speed_monitor'"):
        load_config(TINY, ["callbacks.speed_monitr={}"])
    with pytest.raises(ConfigError, match="'callbacks.speed_monitor.windw_size'.*did you mean 'window_size'"):
        load_config(TINY, ["callbacks.speed_monitor.windw_size=3"])
    with pytest.raises(ConfigError, match="^model: expected a mapping, got 5$"):  # was "model.: ..."
        load_config(TINY, ["model=5"])
    from diffusion.train.components import build_components  # a value the component refuses: its key, one line
    with pytest.raises(ConfigError, match=r"^algorithms\.ema: EMA smoothing must be in \[0, 1\], got 2\.0$"):
        build_components("algorithms", {"ema": {"smoothing": 2}})
    with pytest.raises(ConfigError, match=r"^algorithms\.ema: EMA update_interval must be a whole number of batches "
                                          r">= 1, got 'x'$"):  # was "'<' not supported between 'str' and 'int'"
        build_components("algorithms", {"ema": {"update_interval": "x"}})
    # a merge key still overrides what it merges (no "given twice")
    from diffusion.train.config import _parse_yaml
    assert _parse_yaml("a: &x {lr: 1}\nb: {<<: *x, lr: 2}\n", "t")["b"] == {"lr": 2}


def test_bad_values_fail_with_the_key():
    with pytest.raises(ConfigError, match="optimizer.lr"):
        load_config(TINY, ["optimizer.lr=fast"])
    with pytest.raises(ConfigError, match="trainer.precision.*did you mean 'amp_bf16'"):
        load_config(TINY, ["trainer.precision=amp_bf61"])
    with pytest.raises(ConfigError, match="trainer.max_duration.*batches"):
        load_config(TINY, ["trainer.max_duration=2ep"])
    with pytest.raises(ConfigError, match="zero_terminal_snr needs"):
        load_config(TINY, ["model.zero_terminal_snr=true", "model.prediction_type=epsilon"])
    with pytest.raises(ConfigError, match="not key=value"):
        load_config(TINY, ["trainer.max_duration"])


def test_run_py_reports_config_errors_without_a_traceback():
    result = subprocess.run([sys.executable, "run.py", "yamls/tiny-cpu.yaml", "trainer.max_duraton=1ba"],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert "max_duraton" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("override, names", [
    ("trainer.grad_clip_norm=-1", "trainer.grad_clip_norm"),  # a negative threshold trains backwards
    ("optimizer.lr=-1e-4", "optimizer.lr"),
    ("optimizer.lr=.nan", "optimizer.lr"),
    ("optimizer.lr=nan", "optimizer.lr"),  # the string form too
    ("optimizer.weight_decay=-0.01", "optimizer.weight_decay"),
    ("optimizer.betas=[0.9]", "optimizer.betas"),
    ("optimizer.betas=[0.9, 1.0]", "optimizer.betas"),
    ("optimizer.betas=[-0.1, 0.999]", "optimizer.betas"),
    ("optimizer.eps=0", "optimizer.eps"),
    ("trainer.max_duration=xyzba", "trainer.max_duration"),
    ("trainer.max_duration=0ba", "trainer.max_duration"),
    ("trainer.max_duration=1.5ba", "trainer.max_duration"),
    ("trainer.max_duration=0.5dur", "trainer.max_duration"),  # a fraction of itself: was Composer's traceback
    ("trainer.save_interval=ba", "trainer.save_interval"),
    ("scheduler.t_warmup=abc", "scheduler.t_warmup"),
    ("scheduler.t_warmup=10ep", "scheduler.t_warmup"),
    ("scheduler.alpha_f=2", "scheduler.alpha_f"),
    ("data.train.batch_size=0", "data.train.batch_size"),
    ("data.train.batch_size=-8", "data.train.batch_size"),
    ("data.train.num_workers=-1", "data.train.num_workers"),
    ("data.train.num_samples=3", "data.train.num_samples"),  # fewer samples than one batch: no progress
    ("data.train.prefetch_factor=0", "data.train.prefetch_factor"),
    ("trainer.seed=-1", "trainer.seed=-1 must be a whole number from 0 to 2**32 - 1"),  # were numpy's and
    ("trainer.seed=4294967296", "trainer.seed"),                                         # streaming's tracebacks
    ("data.train.shuffle_seed=-1", "data.train.shuffle_seed=-1 must be"),
])
def test_values_that_cannot_train_are_refused_at_start(override, names):
    with pytest.raises(ConfigError, match=re.escape(names)):
        load_config(TINY, [override])


def test_edge_values_that_can_train_are_accepted():
    cfg = load_config(TINY, ["trainer.grad_clip_norm=null", "optimizer.lr=0", "optimizer.weight_decay=0",
                             "optimizer.betas=[0.0, 0.999]", "scheduler.t_warmup=0ba", "data.train.num_workers=0",
                             "trainer.eval_interval=0.25dur", "data.train.num_samples=64",
                             "data.train.batch_size=64"])
    assert cfg.trainer.grad_clip_norm is None and cfg.scheduler.t_warmup == "0ba"
    assert load_config(TINY, ["trainer.grad_clip_norm=0"]).trainer.grad_clip_norm == 0.0  # off, as before


def test_fsdp_version_is_the_configs_choice_not_the_environments(monkeypatch):
    """FSDP1 unless the YAML says version 2; FSDP2 takes only the settings it can honour."""
    from composer.utils.parallelism import FSDP2Config, FSDPConfig

    from diffusion.train.trainer import build_parallelism
    monkeypatch.setenv("FSDP_VERSION", "2")  # Composer's switch: must not turn a version-1 YAML into FSDP2
    one = build_parallelism(load_config(TINY, ["trainer.fsdp.sharding_strategy=FULL_SHARD"]))["fsdp"]
    assert isinstance(one, FSDPConfig) and one.sharding_strategy == "FULL_SHARD"
    two = build_parallelism(load_config(TINY, ["trainer.fsdp.version=2", "trainer.fsdp.sharding_strategy=SHARD_GRAD_OP"]))
    assert isinstance(two["fsdp"], FSDP2Config) and two["fsdp"].reshard_after_forward is False
    full = build_parallelism(load_config(TINY, ["trainer.fsdp.version=2", "trainer.fsdp.sharding_strategy=FULL_SHARD"]))
    assert full["fsdp"].reshard_after_forward is True
    # sharded checkpoints load with the planner that lets a checkpoint without EMA shards load (ema.EMAShards)
    sharded = build_parallelism(load_config(TINY, ["trainer.fsdp={version: 2, state_dict_type: sharded}"]))["fsdp"]
    assert type(sharded.load_planner).__name__ == "OptionalShardsLoadPlanner" and full["fsdp"].load_planner is None
    with pytest.raises(ConfigError, match="NO_SHARD has no FSDP2 equivalent"):
        load_config(TINY, ["trainer.fsdp.version=2", "trainer.fsdp.sharding_strategy=NO_SHARD"])
    with pytest.raises(ConfigError, match="auto fails under FSDP2"):
        load_config(TINY, ["trainer.fsdp.version=2", "trainer.device_train_microbatch_size=auto"])
    with pytest.raises(ConfigError, match="trainer.fsdp.version"):
        load_config(TINY, ["trainer.fsdp.version=3"])


def test_streams_mix_datasets_with_streamings_weights():
    cfg = load_config(TINY, ["data.train.path=null",
                             "data.train.streams=[{path: s3://a, proportion: 0.7}, {path: s3://b, proportion: 0.3}]"])
    assert [(s.path, s.proportion) for s in cfg.data.train.streams] == [("s3://a", 0.7), ("s3://b", 0.3)]
    assert cfg.data.train.path is None
    from diffusion.train.config import from_dict
    assert from_dict({}).data.train.path == "out/demo/mds"  # neither path nor streams: the demo's dataset, as before


@pytest.mark.parametrize("overrides, message", [
    (["data.train.streams=[{path: s3://a}]"],  # tiny-cpu.yaml sets data.train.path
     "data.train.path=out/demo/mds and data.train.streams are both set"),
    (["data.train.path=null", "data.train.streams=[]"], "data.train.streams is empty"),
    (["data.train.path=null", "data.train.streams=[{local: /tmp/x}]"], "data.train.streams[0].path is not set"),
    (["data.train.path=null", "data.train.streams=[{path: s3://a, proportion: 0.5, repeat: 2}]"],
     "data.train.streams[0] (s3://a) sets proportion and repeat"),
    (["data.train.path=null", "data.train.streams=[{path: s3://a, proportion: 0.5}, {path: s3://b}]"],
     "data.train.streams[1] (s3://b) has no proportion"),
    (["data.train.path=null", "data.train.streams=[{path: s3://a, repeat: -1}]"], "repeat=-1.0 must not be negative"),
    (["data.train.path=null", "data.train.num_samples=64", "data.train.streams=[{path: s3://a, choose: 64}]"],
     "data.train.num_samples=null"),
    (["data.train.path=null", "data.train.streams=[{path: s3://a}, {path: s3://a/}]"], "lists s3://a twice"),
    (["data.train.path=null", "data.train.streams=[{path: s3://b/x/a}, {path: s3://b/x/./a}]"],
     "lists s3://b/x/a twice (as s3://b/x/a and s3://b/x/./a)"),
    (["data.train.path=null", "data.train.streams=[{path: /data/a}, {path: /data/./a/}]"],
     f"lists {os.path.realpath('/data/a')} twice (as /data/a and /data/./a/)"),
    (["data.train.path=null", "data.train.streams=[{path: s3://a, weight: 2}]"], "unknown config key 'data.train.streams[0].weight'"),
    (["data.eval.path=null", "data.eval.streams=[{path: s3://a}]"], "data.eval.streams: the held-out set"),
    (["data.train.path=null", "data.train.local=/tmp/c", "data.train.streams=[{path: s3://a}]"],
     "data.train.local=/tmp/c is for data.train.path: give each stream its own local"),
])
def test_streams_that_cannot_train_are_refused_at_start(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(TINY, overrides)


def test_run_py_refuses_path_and_streams_in_one_line(capfd):
    """Through run.py's entry in this process (train_fixtures.run_py_here): this refusal comes after Composer's
    imports (~15 CPU-s a process); this file's other run.py refusals run as processes."""
    from train_fixtures import run_py_here
    result = run_py_here(capfd, TINY, "data.train.streams=[{path: s3://a}]")
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().splitlines()[-1].startswith("run.py: error: data.train.path=out/demo/mds and "
                                                             "data.train.streams are both set")


def test_micro_budget_recipe_is_microdits_published_schedule():
    """Four phases, batch 2048: 250k masked + 30k unmasked at 256, 50k masked + 5k unmasked at 512; each
    later phase loads the last one's final checkpoint. MicroDiT's learning rates (2.4e-4 cosine to 8e-5,
    then 8e-5 constant, a 500-batch warm-up in phase 3) and averages (none in phases 1-2; 0.99975 over
    phase 3's second half; 0.9975 in phase 4, from phase 3's average with its update count restarted)."""
    names = ["1-masked-256", "2-unmasked-256", "3-masked-512", "4-unmasked-512"]
    phases = [load_config(f"{ROOT}/yamls/micro-budget/{n}.yaml") for n in names]
    assert [(p.model.resolution, p.model.masking.ratio, p.trainer.max_duration) for p in phases] == [
        (256, 0.75, "250000ba"), (256, 0.0, "30000ba"), (512, 0.75, "50000ba"), (512, 0.0, "5000ba")]
    assert {p.data.train.batch_size for p in phases} == {2048} and {p.model.objective for p in phases} == {"flow"}
    for before, after in zip(phases, phases[1:]):
        handed = f"{before.trainer.save_folder}/latest-rank0.pt"
        assert after.trainer.load_path == handed and after.trainer.load_weights_only
    assert [(p.optimizer.lr, p.scheduler.name, p.scheduler.t_warmup) for p in phases] == [
        (2.4e-4, "cosine_with_warmup", "2500ba"), (8e-5, "constant_with_warmup", "0ba"),
        (8e-5, "constant_with_warmup", "500ba"), (8e-5, "constant_with_warmup", "0ba")]
    assert phases[0].scheduler.alpha_f == pytest.approx(8e-5 / 2.4e-4, abs=0.01)  # phase 1 ends at 8e-5
    assert ["ema" in p.algorithms for p in phases] == [False, False, True, True]
    assert phases[2].algorithms["ema"] == {"smoothing": 0.99975, "warmup": False, "start": "25000ba"}
    assert phases[3].algorithms["ema"] == {"smoothing": 0.9975, "warmup": False, "restart": True,
                                           "init_from": f"{phases[2].trainer.save_folder}/latest-rank0.pt"}
    # the EMA that generate and export use at the end is phase 4's: phase 3's average weighs 0.9975^5000
    assert 0.9975 ** 5000 < 1e-5


@pytest.mark.parametrize("text, names", [
    ("model:\n  resolution: 256\n   ref: x\n", "line 3, column 7: not valid YAML: mapping values are not allowed"),
    ("model: {resolution: [1, 2\n", "line 2, column 1: not valid YAML: while parsing a flow sequence"),
    ("model:\n\tresolution: 3\n", "line 2, column 1: not valid YAML: .*'\\\\t'"),
    ("trainer: !!python/object/apply:os.system ['echo hi']\n", "line 1, column 10: .*!!python/object/apply:os.system "
                                                               "is not allowed"),
    ("trainer:\n  load_path: !!python/name:os.system\n", "line 2, column 14: .*!!python/name:os.system is not allowed"),
    (b"model:\n  ref: \xff\xfe\n", "not valid YAML: not UTF-8 text"),
    # PyYAML kept the second silently: the first optimizer section was dropped without a word
    ("optimizer:\n  lr: 1\nmodel: {}\noptimizer:\n  lr: 2\n", "line 4, column 1: not valid YAML: the key 'optimizer' "
                                                              "is given twice in one mapping"),
    ("# only a comment\n", "empty \\(no sections\\); start from a recipe"),  # trained SD2 from the hub
])
def test_yaml_syntax_errors_and_python_tags_are_one_line_naming_the_file(tmp_path, text, names):
    path = tmp_path / "bad.yaml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ConfigError, match=f"^{re.escape(str(path))}, .*{names}|^{re.escape(str(path))}: {names}"):
        load_config(str(path))


def test_an_override_that_is_not_yaml_is_named():
    with pytest.raises(ConfigError, match=r"^override 'optimizer.betas=\[0.9, 0.99': not valid YAML"):
        load_config(TINY, ["optimizer.betas=[0.9, 0.99"])
    with pytest.raises(ConfigError, match=r"override 'trainer.load_path=!!python/name:os.system'.*is not allowed"):
        load_config(TINY, ["trainer.load_path=!!python/name:os.system"])


def test_run_py_refuses_a_python_tag_in_one_line_and_runs_nothing(tmp_path):
    marker = tmp_path / "ran"
    path = tmp_path / "hostile.yaml"
    path.write_text(f"model: !!python/object/apply:os.system ['touch {marker}']\n")
    result = subprocess.run([sys.executable, "run.py", str(path)], cwd=ROOT, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert result.stderr.strip().splitlines() == [f"run.py: error: {path}, line 1, column 8: not valid YAML: the tag "
                                                 f"!!python/object/apply:os.system is not allowed: a config holds "
                                                 f"plain values (numbers, strings, lists, mappings), never Python "
                                                 f"objects"]
    assert not marker.exists()
