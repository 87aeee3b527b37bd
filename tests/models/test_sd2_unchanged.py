"""The SD2 recipe trains exactly as before the model was split into denoiser x objective (issue 26):
the fixed-seed losses recorded at 82321a8 (sd2_recipe_losses.json) are reproduced, train and eval."""

import json

import pytest

import sd2_recipe_losses as recorded


@pytest.mark.parametrize("recipe", sorted(recorded.RECIPES))
def test_fixed_seed_losses_unchanged(recipe, train_kit, tmp_path):
    from train_fixtures import write_latent_mds
    with open(recorded.RECORD) as f:
        before = json.load(f)[recipe]
    mds = write_latent_mds(str(tmp_path / "mds"), kit=train_kit, n=32)
    after = recorded.run_recipe(train_kit, mds, recorded.RECIPES[recipe])
    assert after["train"] == pytest.approx(before["train"], rel=1e-5)
    assert after["eval"] == pytest.approx(before["eval"], rel=1e-5)
