"""JudgeMetrics: the scene judge's GenEval categories during training, beside the losses.

At every eval (or every ``interval``) it samples a fixed prompt set with the EMA weights, the way
:class:`~diffusion.train.callbacks.image_logger.ImageLogger` does (same sampler, seed and resolution),
reads the images back with :mod:`diffusion.sample.judge` and logs, to every logger the trainer has,
``metrics/judge/<category>`` (share judged right), ``metrics/judge/overall`` (their mean, GenEval's
score) and its cost: ``metrics/judge/seconds`` (this round's sampling and judging) and
``metrics/judge/seconds_total``. With ``clip_model`` and ``reference`` (images or raw data that
:func:`diffusion.sample.evaluate.iter_images` reads, the first ``reference_images`` of them) it also logs
``metrics/judge/cmmd``: CMMD (:mod:`diffusion.sample.cmmd`) between the round's images and the reference,
whose CLIP embeddings are computed once, by the reference code's (biased) estimator unless
``cmmd_estimator: unbiased``. The sampler draws from its own seeded generator, so training's
random draws are the same with and without it.

    callbacks:
      judge_metrics: {interval: 500ba, per_category: 4, images_per_prompt: 2, guidance_scale: 3}

The prompts default to the held-out set (:func:`diffusion.kit.scenes.prompt_set`, ``per_category`` a
category); ``prompts_file`` takes a JSONL of GenEval metadata lines instead.
"""

from __future__ import annotations

import time

from composer.core import State
from composer.loggers import Logger
from composer.utils import dist

from diffusion.train.callbacks.image_logger import ImageLogger


class JudgeMetrics(ImageLogger):
    key = "judge_metrics"

    def __init__(self, *, per_category: int = 4, prompts_file: str | None = None, seed: int = 0,
                 images_per_prompt: int = 2, guidance_scale: float = 3.0, steps: int = 25,
                 interval: str | None = None, scheduler: str | None = None, clip_model: str | None = None,
                 reference: str | None = None, reference_images: int = 256, cmmd_estimator: str = "biased"):
        if bool(clip_model) != bool(reference):
            raise ValueError("callbacks.judge_metrics: CMMD needs both clip_model and reference (or neither)")
        from diffusion.sample.cmmd import ESTIMATORS
        if cmmd_estimator not in ESTIMATORS:
            raise ValueError(f"callbacks.judge_metrics.cmmd_estimator={cmmd_estimator!r}: biased (the reference "
                             f"code's) or unbiased")
        self.cmmd_estimator = cmmd_estimator
        self.clip_model, self.reference, self.reference_images = clip_model, reference, int(reference_images)
        self._clip = self._reference_features = None
        if prompts_file:
            from diffusion.sample.geneval_layout import read_metadata
            self.lines = read_metadata(prompts_file)
        else:
            from diffusion.kit.scenes import prompt_set
            self.lines = prompt_set(per_category, seed=0)
        super().__init__([line["prompt"] for line in self.lines], interval=interval, seed=seed,
                         images_per_prompt=images_per_prompt, guidance_scale=guidance_scale, steps=steps,
                         scheduler=scheduler, name="judge")
        self.seconds_total = 0.0
        self.history: list[dict] = []

    def log_grid(self, state: State, logger: Logger):
        from diffusion.sample import judge
        start = time.perf_counter()
        images = self._sample(state)
        if images is None:
            return None
        per_prompt = self.sample_kwargs["images_per_prompt"]
        results, _ = judge.judge_many((image, self.lines[i // per_prompt]) for i, image in enumerate(images))
        summary = judge.summarize(results)
        metrics = {f"metrics/judge/{tag}": value for tag, value in summary["accuracy"].items()}
        if self.clip_model:
            metrics["metrics/judge/cmmd"] = self._cmmd(images)
        seconds = time.perf_counter() - start
        self.seconds_total += seconds
        metrics.update({"metrics/judge/overall": summary["overall"], "metrics/judge/seconds": seconds,
                        "metrics/judge/seconds_total": self.seconds_total})
        logger.log_metrics(metrics)
        self.history.append({"batch": int(state.timestamp.batch), **metrics})
        return summary

    def _cmmd(self, images) -> float:
        from diffusion.sample import cmmd, evaluate
        if self._clip is None:
            self._clip = evaluate.ClipScorer(self.clip_model)
            pairs = evaluate.iter_images(self.reference)
            reference = [image for _, (image, _) in zip(range(self.reference_images), pairs)]
            self._reference_features = self._clip.image_features(reference)
        return cmmd.cmmd(self._clip.image_features(images), self._reference_features, self.cmmd_estimator)

    def _sample(self, state: State):
        """The prompt set's images from the (EMA) weights on rank 0; None on other ranks."""
        from diffusion.train.callbacks.image_logger import _sharded, _unwrap
        rank0 = dist.get_global_rank() == 0
        if not rank0 and not _sharded(state.model):
            return None
        model = _unwrap(state.model)
        kwargs = dict(self.sample_kwargs)
        if kwargs["size"] is None:
            kwargs["size"] = getattr(model, "resolution", None)
        ema_context, _ = self._ema_weights(state)
        with ema_context:
            images = self._get_sampler(model)(getattr(model, "denoiser", model), self.prompts, **kwargs)
        return images if rank0 else None
