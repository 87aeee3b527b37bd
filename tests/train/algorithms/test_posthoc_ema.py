"""Post-hoc EMA: EDM2's widths, the power-function average against a direct sum over the weights,
snapshots, the synthesis of a tracked width, a killed run resumed through the product's trainer, bad keys."""

import os
import shutil

import pytest
import torch
from composer import Trainer
from composer.core import Callback
from composer.models import ComposerModel
from torch.utils.data import DataLoader, TensorDataset

from diffusion.errors import ConfigError
from diffusion.train.algorithms import posthoc_ema as phe
from diffusion.train.algorithms.posthoc_ema import PostHocEMA
from diffusion.train.config import load_config
from train_fixtures import fit_in_process, posthoc_overrides, write_latent_mds


class Regressor(ComposerModel):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))

    def forward(self, batch):
        return self.body(batch[0])

    def loss(self, outputs, batch):
        return torch.nn.functional.mse_loss(outputs, batch[1])


class Weights(Callback):
    def __init__(self):
        self.after_batch = []

    def batch_end(self, state, logger):
        self.after_batch.append({n: p.detach().clone() for n, p in state.model.named_parameters()})


def fit(algorithm, batches):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4 * batches, 4, generator=g)
    model, weights = Regressor(), Weights()
    trainer = Trainer(model=model, train_dataloader=DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4),
                      max_duration=f"{batches}ba", algorithms=[algorithm], callbacks=[weights],
                      optimizers=torch.optim.SGD(model.parameters(), lr=0.2), device="cpu", progress_bar=False,
                      log_to_console=False, seed=0)
    trainer.fit()
    trainer.close()
    return weights.after_batch


def power_average(weights, gamma):
    """EDM2's profile as a sum: update i's weights count the integral of (gamma+1) tau^gamma / t^(gamma+1)
    over [i-1, i], with no recursion."""
    t = len(weights)
    coefficients = [(i ** (gamma + 1) - (i - 1) ** (gamma + 1)) / t ** (gamma + 1) for i in range(1, t + 1)]
    return {k: sum(c * w[k] for c, w in zip(coefficients, weights)) for k in weights[0]}


def test_sigma_rel_and_gamma_are_edm2s():
    # EDM2 (Karras et al. 2024) gives gamma 16.97 for sigma_rel 0.05 and 6.94 for 0.10
    assert phe.gamma_of(0.05) == pytest.approx(16.97, abs=0.01)
    assert phe.gamma_of(0.10) == pytest.approx(6.94, abs=0.01)
    for sigma_rel in (0.01, 0.05, 0.13, 0.25):
        assert phe.sigma_rel_of(phe.gamma_of(sigma_rel)) == pytest.approx(sigma_rel)
    for bad in (0, -0.1, 0.3, "wide"):
        with pytest.raises(ValueError, match="sigma_rel"):
            phe.gamma_of(bad)


def test_power_average_and_its_snapshots_match_a_direct_sum(tmp_path):
    # 0.2 and 0.2004 round alike to three decimals: each still gets its own snapshot file
    algorithm = PostHocEMA(sigma_rels=[0.05, 0.2, 0.2004], snapshot_every="4ba", folder=str(tmp_path))
    weights = fit(algorithm, 10)
    state = algorithm.state_dict()
    for profile in state["profiles"]:
        expected = power_average(weights, profile["gamma"])
        assert profile["num_updates"] == 10
        for name, tensor in expected.items():
            torch.testing.assert_close(profile["ema_params"][name], tensor, rtol=1e-5, atol=1e-6, msg=name)
    # the narrow profile follows the last weights more closely than the wide one
    last = weights[-1]["body.0.weight"]
    narrow, wide = (p["ema_params"]["body.0.weight"] for p in state["profiles"][:2])
    assert (narrow - last).norm() < (wide - last).norm()
    # snapshots every 4 batches and at the end (batch 10), each the average at its time
    snapshots = phe.read_snapshots(str(tmp_path))
    assert [(s.batch, s.sigma_rel) for s in snapshots] == [(b, w) for b in (4, 8, 10) for w in (0.05, 0.2, 0.2004)]
    assert {os.path.basename(s.path) for s in snapshots if s.batch == 4} == {
        "ema-0.050-ba4.safetensors", "ema-0.200-ba4.safetensors", "ema-0.2004-ba4.safetensors"}
    from safetensors.torch import load_file
    for s in snapshots:
        assert s.t == s.batch and s.gamma == pytest.approx(phe.gamma_of(s.sigma_rel))
        assert os.stat(s.path).st_mode & 0o777 == 0o666 & ~phe._UMASK  # as readable as the checkpoints
        saved = load_file(s.path)
        for name, tensor in power_average(weights[:s.batch], s.gamma).items():
            torch.testing.assert_close(saved[name], tensor, rtol=1e-5, atol=1e-6, msg=name)


def test_synthesising_a_tracked_width_reproduces_it_and_a_width_between_comes_close(tmp_path):
    from diffusion.posthoc_ema import synthesise
    algorithm = PostHocEMA(sigma_rels=[0.05, 0.08, 0.10, 0.2], snapshot_every="3ba", folder=str(tmp_path))
    weights = fit(algorithm, 24)
    tracked = {p["sigma_rel"]: p["ema_params"] for p in algorithm.state_dict()["profiles"]}
    snapshots = [s for s in phe.read_snapshots(str(tmp_path)) if s.sigma_rel in (0.05, 0.10)]
    for sigma_rel in (0.05, 0.10):
        params, info = synthesise(snapshots, sigma_rel)
        assert info["batch"] == 24 and info["residual"] < 1e-6
        for name, tensor in tracked[sigma_rel].items():
            torch.testing.assert_close(params[name], tensor, rtol=1e-4, atol=1e-5, msg=name)
    # 0.08 (between) and 0.2 (beyond) from the 0.05 and 0.10 snapshots alone, against profiles of those
    # widths tracked directly: far closer to them than either neighbour is. The coefficients sum to 1, as
    # EDM2's solve_posthoc_coefficients makes them: the raw least squares sums to 1.001 at 0.08 and 0.980
    # at 0.2, which scales every weight (4x and 7x farther from the tracked average here).
    distance = lambda a, b: sum((a[k] - b[k]).norm() ** 2 for k in a) ** 0.5  # noqa: E731
    for sigma_rel, bound in ((0.08, 0.05), (0.2, 0.15)):
        params, info = synthesise(snapshots, sigma_rel)
        assert 0 < info["residual"] < 0.1 and sum(info["coefficients"]) == pytest.approx(1, abs=1e-12)
        assert distance(params, tracked[sigma_rel]) < bound * min(distance(tracked[0.05], tracked[sigma_rel]),
                                                                   distance(tracked[0.10], tracked[sigma_rel]))
    assert not torch.equal(weights[-1]["body.0.weight"], params["body.0.weight"])


def test_bad_keys_are_one_line_naming_them(tmp_path):
    with pytest.raises(ConfigError, match=r"algorithms.posthoc_ema.sigma_rels: sigma_rel 0.5 must be"):
        PostHocEMA(sigma_rels=[0.05, 0.5])
    with pytest.raises(ConfigError, match="names a width twice"):
        PostHocEMA(sigma_rels=[0.1, 0.1])
    with pytest.raises(ConfigError, match=r"algorithms.posthoc_ema.snapshot_every='1ep'"):
        PostHocEMA(snapshot_every="1ep")
    with pytest.raises(ConfigError, match=r"writes its snapshots into trainer.save_folder/posthoc: set"):
        fit(PostHocEMA(), 1)  # no save folder, no folder
    with pytest.raises(ConfigError, match=r"unknown config key 'algorithms.posthoc_ema.sigma_rel'"):
        load_config("yamls/tiny-mmdit-flow-cpu.yaml", ["algorithms.posthoc_ema={sigma_rel: 0.1}"])
    with pytest.raises(ConfigError, match=r"state_dict_type=sharded with algorithms.posthoc_ema needs "
                                          r"trainer.fsdp.version=2"):  # FSDP1: full tensors only
        load_config("yamls/tiny-mmdit-flow-cpu.yaml", ["algorithms.ema=null", "algorithms.posthoc_ema={}",
                                                       "trainer.fsdp={version: 1, state_dict_type: sharded}"])


@pytest.fixture(scope="module")
def mds(mmdit_train_kit, tmp_path_factory):
    return write_latent_mds(str(tmp_path_factory.mktemp("mds")), kit=mmdit_train_kit, n=32)


mmdit_overrides = posthoc_overrides


def test_a_killed_run_resumes_its_profiles_and_snapshots_exactly(mmdit_train_kit, mds, tmp_path):
    """The product's trainer: a run killed after its batch-2 checkpoint (having written no snapshot yet)
    and resumed by autoresume ends with the averages and snapshots of a run never stopped."""
    yaml = "yamls/tiny-mmdit-flow-cpu.yaml"
    straight = tmp_path / "straight"
    fit_in_process(load_config(yaml, mmdit_overrides(mmdit_train_kit, mds, save_folder=str(straight))))
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copy(straight / "ep0-ba2-rank0.pt", resumed / "ep0-ba2-rank0.pt")
    os.symlink("ep0-ba2-rank0.pt", resumed / "latest-rank0.pt")
    fit_in_process(load_config(yaml, mmdit_overrides(mmdit_train_kit, mds, "trainer.autoresume=true",
                                                     save_folder=str(resumed))))
    from safetensors.torch import load_file

    def profiles(folder):
        state = torch.load(folder / "latest-rank0.pt", weights_only=False)["state"]
        (algorithm,) = [s for name, s in state["algorithms"] if name == "PostHocEMA"]
        return {p["sigma_rel"]: p for p in algorithm["profiles"]}

    a, b = profiles(straight), profiles(resumed)
    assert sorted(a) == [0.05, 0.10]
    for sigma_rel, profile in a.items():
        assert b[sigma_rel]["num_updates"] == profile["num_updates"] == 6
        for name, tensor in profile["ema_params"].items():
            torch.testing.assert_close(b[sigma_rel]["ema_params"][name], tensor, rtol=0, atol=0, msg=name)
    names = sorted(os.listdir(straight / "posthoc"))
    assert names == sorted(phe.snapshot_name(w, b) for w in (0.05, 0.1) for b in (3, 6))
    assert sorted(os.listdir(resumed / "posthoc")) == names
    for name in names:
        x, y = load_file(straight / "posthoc" / name), load_file(resumed / "posthoc" / name)
        for key in x:
            torch.testing.assert_close(y[key], x[key], rtol=0, atol=0, msg=key)
    # a resumed run keeps its widths
    with pytest.raises(ConfigError, match=r"sigma_rels=\[0.07\], but the checkpoint tracks \[0.05, 0.1\]"):
        fit_in_process(load_config(yaml, mmdit_overrides(mmdit_train_kit, mds, "trainer.autoresume=true",
                                                         "algorithms.posthoc_ema.sigma_rels=[0.07]",
                                                         "trainer.max_duration=8ba", save_folder=str(resumed))))


# Two FSDP ranks (FSDP1, FSDP2) snapshot what one process averages and resume exactly:
# test_two_fsdp_ranks_snapshot_what_one_process_averages_and_resume_exactly in tests/train/test_fsdp_mmdit.py,
# variants of that file's one `composer -n 2` launch.
