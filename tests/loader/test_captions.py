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
