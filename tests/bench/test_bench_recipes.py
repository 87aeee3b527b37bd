"""bench/bench_recipes.py runs the tiny Flux and SANA recipes beside the others in one run, each on the demo rows
converted with its own autoencoder (16-channel latents, DC-AE's), and scores them as it scores the others."""

import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _bench():
    spec = importlib.util.spec_from_file_location("bench_recipes", ROOT / "bench" / "bench_recipes.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_flux_and_sana_train_on_their_own_latents_beside_the_unet_in_one_run(tmp_path, monkeypatch, tiny_kit,
                                                                            tiny_flux_kit, tiny_sana_kit):
    bench = _bench()
    converted, trained = [], []

    def ensure_data(mds, kit, scenes="default"):
        converted.append((mds, pathlib.Path(kit).name))
        return mds

    def run(cmd):  # a training run: its checkpoints, 1 CPU-second
        trained.append(cmd)
        folder = pathlib.Path(next(a.split("=", 1)[1] for a in cmd if a.startswith("trainer.save_folder=")))
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "ep0-ba2-rank0.pt").touch()
        return 1.0

    score = {"adherence": 0.5, "judge": {"single_object": 1.0, "colors": 0.5}, "overall": 0.75}
    monkeypatch.setattr(bench, "ensure_data", ensure_data)
    monkeypatch.setattr(bench, "_run", run)
    monkeypatch.setattr(bench, "adherence", lambda checkpoint, grid, scenes="default": score)
    monkeypatch.setattr(bench, "plot", lambda curves, path: path)
    data = str(tmp_path / "mds")
    curves = bench.main(["--recipes", "unet-v", "flux-flow", "sana-flow", "--batches", "2", "--every", "2",
                         "--out", str(tmp_path / "out"), "--data", data])
    assert list(curves) == ["unet-v", "flux-flow", "sana-flow"]
    assert (f"{data}-tiny-flux", "tiny-flux") in converted and (f"{data}-tiny-sana", "tiny-sana") in converted
    paths = {cmd[cmd.index("run.py") + 2]: next(a for a in cmd if a.startswith("data.train.path=")) for cmd in trained}
    assert paths == {f"model.ref={tiny_kit}": f"data.train.path={data}",
                     f"model.ref={tiny_flux_kit}": f"data.train.path={data}-tiny-flux",
                     f"model.ref={tiny_sana_kit}": f"data.train.path={data}-tiny-sana"}
    assert all(curve["points"][0]["adherence"] == 0.5 for curve in curves.values())
