"""One description of a trained model: what sampling, export, evaluation and the image logger need.

Training writes it into every checkpoint (the model's extra state, key ``description``); everything that
reads a checkpoint rebuilds the denoiser and the objective from it, and nothing passes the pieces around
as loose arguments. Checkpoints written before it existed (SD2 UNets: ``unet_config``,
``prediction_type``, ``noise_schedule`` ... at the top of the extra state) are read into the same shape.
"""

from __future__ import annotations

import dataclasses

from diffusion import schema


@dataclasses.dataclass
class ModelDescription:
    model_ref: str  # the VAE, text encoder and tokenizer come from here
    denoiser: str  # a diffusers class name (diffusion.models.denoisers)
    denoiser_config: dict
    objective: str  # epsilon, v_prediction, flow (diffusion.models.objectives)
    objective_params: dict  # what the objective needs to rebuild itself (noise schedule, shift ...)
    scaling_factor: float | None  # the VAE latent scaling training multiplied by (None: the VAE config's)
    resolution: int | None  # training resolution in pixels, the default sample size
    text_dim: int
    text_length: int = schema.MAX_TOKENS  # tokens per caption the model was trained on (sampling pads to it)
    text_mask: bool = False  # the denoiser attends to each caption's tokens only (not its padding)
    # The latent space trained in (schema.LatentSpace as a dict: autoencoder, channels, downsampling,
    # scaling and shift); None in checkpoints written before it was recorded: the model reference's VAE.
    latent_space: dict | None = None
    # The denoiser's pooled vector came from the model reference's second text encoder (Flux's CLIP beside T5),
    # not the mean of the text states; False in checkpoints written before.
    pooled_text: bool = False
    # The value a guidance-distilled denoiser (Flux.1-dev's guidance_embeds) read in its guidance embedding in
    # training (model.embedded_guidance); sampling feeds it the same. None: no such embedding, or a checkpoint
    # written before it was recorded (then the training default, 1.0).
    embedded_guidance: float | None = None
    # The text encoder whose embeddings it was trained on (its config's model_type, dataset.json's
    # text_encoder_type: clip_text_model, t5 ...); None where the data or an older checkpoint did not say.
    text_encoder_type: str | None = None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "ModelDescription":
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in fields})

    @classmethod
    def from_extra_state(cls, state: dict) -> "ModelDescription":
        """A checkpoint's model extra state: today's ``{"description": ...}`` or a pre-description UNet's."""
        if isinstance(state.get("description"), dict):
            return cls.from_dict(state["description"])
        if "unet_config" not in state:
            raise KeyError("description")
        objective = state.get("prediction_type") or "epsilon"
        return cls(model_ref=state["model_ref"], denoiser="UNet2DConditionModel",
                   denoiser_config=dict(state["unet_config"]), objective=objective,
                   objective_params={"noise_schedule": state.get("noise_schedule")},
                   scaling_factor=state.get("scaling_factor"), resolution=state.get("resolution"),
                   text_dim=int(state.get("text_dim") or state["unet_config"]["cross_attention_dim"]))

    def space(self) -> schema.LatentSpace:
        """The latent space to decode from: the recorded one, else (older checkpoints) the model
        reference's autoencoder with the scaling factor training recorded."""
        if self.latent_space is not None:
            return schema.LatentSpace.from_dict(self.latent_space)
        from diffusion.models import loading
        space = loading.latent_space_of(loading.load_vae_config(self.model_ref))
        if self.scaling_factor is not None:
            space = dataclasses.replace(space, scaling_factor=float(self.scaling_factor))
        return space

    # ---- the parts -----------------------------------------------------------------------------------
    @property
    def adapter(self):
        from diffusion.models import denoisers
        return denoisers.adapter(self.denoiser)

    def build_objective(self):
        """The objective as trained, for sampling; a pre-description checkpoint without a recorded noise
        schedule gets the model reference's."""
        from diffusion.models import loading, objectives
        params = dict(self.objective_params)
        if self.objective in ("epsilon", "v_prediction") and not params.get("noise_schedule"):
            params["noise_schedule"] = loading.noise_schedule_of(loading.load_scheduler(self.model_ref).config)
        return objectives.from_description(self.objective, params)

    def build_denoiser(self):
        """The denoiser of the recorded config, weights not loaded (reading text masks if trained with them)."""
        denoiser = self.adapter.model_class.from_config(self.denoiser_config)
        if self.text_mask:
            self.adapter.enable_text_mask(denoiser)
        return self.with_embedded_guidance(denoiser)

    def with_embedded_guidance(self, denoiser):
        """``denoiser`` carrying the guidance value it was trained with, where it has a guidance embedding
        (Flux.1-dev's shape), for sampling to feed it the same."""
        if self.denoiser_config.get("guidance_embeds"):
            denoiser.embedded_guidance = 1.0 if self.embedded_guidance is None else float(self.embedded_guidance)
        return denoiser

    @property
    def prediction_type(self) -> str | None:
        return self.objective if self.objective in ("epsilon", "v_prediction") else None

    @property
    def noise_schedule(self) -> dict | None:
        return self.objective_params.get("noise_schedule")

    @property
    def zero_terminal_snr(self) -> bool:
        return bool(self.noise_schedule and self.noise_schedule.get("rescale_betas_zero_snr"))
