"""Online mode with ``model.repa`` (issue 41): the stream holds latents only, and the step decodes them with the
stream's own autoencoder for the frozen vision encoder, so an online run aligns to the features of the images
it streamed. In this process (a worker's trainer on the stream's operators), as
test_online.py::test_flux_and_sana_train_on_online_modes_batches does."""

import os

import numpy as np
import torch

from diffusion import schema
from diffusion.kit.encoder_fit import TINY_ENCODER_ASSET
from diffusion.train.config import load_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "yamls", "tiny-cpu.yaml")


def test_online_training_aligns_to_the_streamed_images_decoded_in_the_step(tiny_mmdit_kit, sample_data, tmp_path):
    """The tiny MMDiT (the shipped fitted VAE) with REPA, online: the images the step decodes from the stream's
    latents for the encoder are the crops the stream encoded (each nearer its own crop than another row's), the
    step's loss carries the alignment, and two batches train the projector."""
    from composer.core import Callback
    from diffusion.stream.ray_workers import OnlineTrainer, ShardBatches, stream_to_batch, with_absolute_paths
    from diffusion.stream.stream_source import stream_info
    from train_fixtures import RowsShard, encoded_sample_rows
    cfg = with_absolute_paths(load_config(TINY, [
        f"model.ref={tiny_mmdit_kit}", f"data.online.input={sample_data}", f"data.online.work_dir={tmp_path / 'work'}",
        "data.online.num_encoders=1", "data.online.num_train_workers=1", "data.train.batch_size=8",
        "trainer.max_duration=2ba", "trainer.save_folder=null", "trainer.autoresume=false", "loggers={}",
        "callbacks={}", "scheduler.t_warmup=0ba", "model.prediction_type=null", "model.objective=flow",
        "model.offset_noise=0.0", f"model.repa.encoder={TINY_ENCODER_ASSET}", "model.repa.block=2",
        "model.repa.projector_dim=16"]))
    info, empty = stream_info(cfg)
    transformed, columns = encoded_sample_rows(tiny_mmdit_kit, sample_data, cfg)
    crops = torch.from_numpy(np.asarray(transformed[schema.image_column(64)][:8])).permute(0, 3, 1, 2).float()
    crops = crops / 127.5 - 1  # the first batch's images, in [-1, 1]

    class Record(Callback):
        def __init__(self):
            self.aligned, self.decoded = [], None

        def fit_start(self, state, logger):
            self.projector = state.model.repa.projector[0].weight.detach().clone()

        def after_forward(self, state, logger):
            self.aligned.append("repa" in state.outputs)
            if self.decoded is None:
                self.decoded = state.model.repa.decoder(state.outputs["latents"].detach())

    record = Record()
    trainer = OnlineTrainer(cfg, info, empty)(ShardBatches(RowsShard(columns), 8, stream_to_batch(cfg, info, empty)), [record])
    assert type(trainer.state.model.denoiser).__name__ == "SD3Transformer2DModel"
    trainer.fit()
    assert int(trainer.state.timestamp.batch) == 2 and np.isfinite(float(trainer.state.loss))
    assert record.aligned == [True, True]
    assert not torch.equal(trainer.state.model.repa.projector[0].weight, record.projector)
    trainer.close()
    own = (record.decoded - crops).abs().mean(dim=(1, 2, 3))
    other = (record.decoded - crops.roll(1, dims=0)).abs().mean(dim=(1, 2, 3))
    assert bool((own < other).all()), (own, other)
