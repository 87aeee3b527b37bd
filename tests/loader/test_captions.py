"""Caption choice among several caption columns: probabilities, determinism, independence from dropout."""

import math

import pytest

from diffusion.loader.batches import CaptionDropout
from diffusion.loader.captions import CaptionChoice

KEYS = [f"{i:06d}" for i in range(20_000)]


def test_each_column_is_chosen_with_its_probability_within_sampling_error():
    choice = CaptionChoice.from_mapping({"caption": 0.3, "recap_llava": 0.7}, seed=4)
    for epoch in (0, 1):
        picks = choice.choices(KEYS, epoch)
        share = picks.count("caption") / len(KEYS)
        sigma = math.sqrt(0.3 * 0.7 / len(KEYS))  # binomial standard error: 0.0032
        assert abs(share - 0.3) < 4 * sigma, share


def test_the_choice_is_a_function_of_seed_epoch_and_key_so_resume_repeats_it():
    choice = CaptionChoice.from_mapping({"a": 1, "b": 1}, seed=1)
    first = choice.choices(KEYS[:2000], epoch=3)
    again = CaptionChoice.from_mapping({"a": 1, "b": 1}, seed=1)  # a restarted process
    assert again.choices(KEYS[:2000], epoch=3) == first
    assert list(reversed(again.choices(list(reversed(KEYS[:2000])), epoch=3))) == first  # order, batching
    changed = sum(x != y for x, y in zip(first, choice.choices(KEYS[:2000], epoch=4))) / 2000
    assert 0.4 < changed < 0.6  # a new draw each epoch
    other_seed = CaptionChoice.from_mapping({"a": 1, "b": 1}, seed=2).choices(KEYS[:2000], epoch=3)
    assert other_seed != first


def test_dropout_composes_independently_of_the_choice():
    choice = CaptionChoice.from_mapping({"caption": 0.3, "recap_llava": 0.7}, seed=0)
    dropout = CaptionDropout(0.2, seed=0)
    picks, dropped = choice.choices(KEYS, 0), dropout.mask(KEYS, 0)
    for column in ("caption", "recap_llava"):
        mine = [d for p, d in zip(picks, dropped) if p == column]
        rate = sum(mine) / len(mine)
        assert abs(rate - 0.2) < 4 * math.sqrt(0.2 * 0.8 / len(mine)), (column, rate)


def test_a_zero_weight_column_is_never_chosen_and_bad_weights_name_the_column():
    choice = CaptionChoice.from_mapping({"caption": 0.0, "recap": 1.0})
    assert set(choice.choices(KEYS[:3000], 0)) == {"recap"}
    with pytest.raises(ValueError, match=r"data.train.captions.recap: a probability must be a number >= 0"):
        CaptionChoice.from_mapping({"caption": 1.0, "recap": -0.5})
    with pytest.raises(ValueError, match="add up to 0"):
        CaptionChoice.from_mapping({"caption": 0.0})


def test_copies_and_later_phases_draw_their_own_captions_and_a_first_reading_keeps_its_draw():
    from diffusion.loader.batches import key_number, unit_hash
    from diffusion.loader.captions import _CAPTION_STREAM
    keys = KEYS[:2000]
    choice = CaptionChoice.from_mapping({"a": 1, "b": 1}, seed=1)
    first = choice.choices(keys, epoch=2)
    # copy 0 of phase 0: the draw a run without repeats or phases always had
    assert first == ["a" if unit_hash(1, _CAPTION_STREAM, 2, key_number(k)) < 0.5 else "b" for k in keys]
    for copies, phase in (([1] * len(keys), 0), (None, 1), ([1] * len(keys), 1)):
        other = choice.choices(keys, 2, copies, phase)
        changed = sum(x != y for x, y in zip(first, other)) / len(keys)
        assert 0.4 < changed < 0.6, (copies is not None, phase)  # a draw of its own, not a replay


def test_the_collate_step_gives_each_copy_and_phase_the_caption_it_draws():
    import numpy as np
    from diffusion import schema
    from diffusion.loader.batches import SAMPLE_COPY, SAMPLE_EPOCH, StackSamples, ToModelBatch
    from diffusion.loader.captions import CaptionColumns
    text, embeds, _ = schema.caption_columns("recap")
    choice = CaptionChoice.from_mapping({"caption": 1, "recap": 1}, seed=7)
    stack = StackSamples(ToModelBatch(8, np.zeros((2, 4))),
                         CaptionColumns(choice, {"recap": (text, embeds)}, schema.TEXT_EMBEDS))

    def texts(copy, phase, n=200):
        stack.to_batch.phase = phase
        samples = [{schema.vae_moments_column(8): np.zeros((8, 1, 1), np.float16), schema.KEY: KEYS[i],
                    schema.TEXT_EMBEDS: np.zeros((2, 4), np.float16), text: "a recap",
                    embeds: np.ones((2, 4), np.float16), schema.BATCH_SAMPLE_INDEX: i, SAMPLE_EPOCH: 0,
                    SAMPLE_COPY: copy} for i in range(n)]
        return stack(samples)[schema.BATCH_TEXT_EMBEDS][:, 0, 0].tolist()

    first = texts(0, 0)
    assert first == [float(c == "recap") for c in choice.choices(KEYS[:200], 0)]
    for copy, phase in ((1, 0), (0, 1)):
        other = texts(copy, phase)
        assert 0.3 < sum(a != b for a, b in zip(first, other)) / 200 < 0.7, (copy, phase)
