"""The SD2 recipe's fixed-seed losses on the training fixture: recorded once, before the model wing
(issue 26) split the model into denoiser x objective, and checked by test_sd2_unchanged.py ever since.

    PYTHONPATH=. python tests/models/sd2_recipe_losses.py --write   # re-record (only on purpose)

Each recipe's eval list is the raw weights' and the EMA's held-out loss after batch 3, then after batch 6. The
EMA's two (the 2nd and 4th) were re-recorded once, on purpose, when the EMA's warm-up was put in step with
diffusers' EMAModel (its first update takes the weights; it had run one update ahead): the training losses and
the raw weights' evals are still those recorded at 82321a8.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
RECORD = os.path.join(HERE, "sd2_recipe_losses.json")
sys.path.insert(0, os.path.dirname(HERE))

# Two recipes: the tests' epsilon default, and v-prediction with every option of the DDPM objective.
RECIPES = {
    "epsilon": [],
    "v_all_options": ["model.prediction_type=v_prediction", "model.zero_terminal_snr=true",
                      "model.min_snr_gamma=5.0", "model.offset_noise=0.1", "model.input_perturbation=0.1",
                      "data.train.caption_dropout=0.25", "trainer.device_train_microbatch_size=4"],
}


def run_recipe(kit: str, mds: str, extra: list[str]) -> dict:
    from composer.core import Callback

    from diffusion.train.config import load_config
    from train_fixtures import fit_in_process, tiny_overrides

    class Losses(Callback):
        def __init__(self):
            self.train, self.eval = [], []

        def after_train_batch(self, state, logger):
            self.train.append(float(state.loss))

        def eval_end(self, state, logger):
            self.eval.append(float(state.eval_metric_values["loss"]))

    losses = Losses()
    root = os.path.dirname(os.path.dirname(HERE))
    overrides = tiny_overrides(kit, mds, batches=6, extra=(
        f"data.eval.path={mds}", "data.eval.batch_size=8", "data.eval.num_workers=0", "trainer.eval_interval=3ba",
        "data.train.num_workers=0", "trainer.seed=5", *extra))
    cfg = load_config(os.path.join(root, "yamls", "tiny-cpu.yaml"), overrides)
    fit_in_process(cfg, callbacks=[losses])
    return {"train": losses.train, "eval": losses.eval}


def record_all(tmp: str) -> dict:
    from train_fixtures import write_latent_mds, write_training_kit
    kit = write_training_kit(os.path.join(tmp, "kit"))
    mds = write_latent_mds(os.path.join(tmp, "mds"), kit=kit, n=32)
    return {name: run_recipe(kit, mds, extra) for name, extra in RECIPES.items()}


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        result = record_all(tmp)
    print(json.dumps(result, indent=1))
    if "--write" in sys.argv:
        with open(RECORD, "w") as f:
            json.dump(result, f, indent=1)
