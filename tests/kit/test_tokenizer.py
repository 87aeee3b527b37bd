"""The CLIP tokenizer rebuilt offline from open_clip's BPE file gives SD2's token ids."""

import gzip

import pytest
from transformers import CLIPTokenizer, CLIPTokenizerFast

from diffusion.kit.tokenizer import VOCAB_SIZE, read_merges, write_clip_tokenizer

CAT_IDS = [49406, 320, 1125, 539, 320, 2368, 49407]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return write_clip_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.mark.parametrize("cls", [CLIPTokenizer, CLIPTokenizerFast])
def test_sd2_ids_padding_and_truncation(tokenizer_dir, cls):
    tok = cls.from_pretrained(tokenizer_dir)
    assert (tok.model_max_length, len(tok)) == (77, VOCAB_SIZE)
    assert (tok.bos_token, tok.bos_token_id) == ("<|startoftext|>", 49406)
    assert (tok.eos_token, tok.eos_token_id) == ("<|endoftext|>", 49407)
    assert (tok.pad_token, tok.pad_token_id) == ("!", 0)

    ids = tok("a photo of a cat", padding="max_length", truncation=True).input_ids
    assert ids == CAT_IDS + [0] * (77 - len(CAT_IDS))

    long = tok("a red circle above a blue square " * 20, padding="max_length", truncation=True).input_ids
    assert len(long) == 77 and long[0] == 49406 and long[-1] == 49407


def test_slow_and_fast_agree_on_unusual_text(tokenizer_dir):
    text = "Hello, World!  naïve café 😀 x2 <b>"
    slow = CLIPTokenizer.from_pretrained(tokenizer_dir)(text).input_ids
    fast = CLIPTokenizerFast.from_pretrained(tokenizer_dir)(text).input_ids
    assert slow == fast
    assert CLIPTokenizer.from_pretrained(tokenizer_dir).decode(CAT_IDS, skip_special_tokens=True) == "a photo of a cat"


def test_wrong_bpe_file_is_named(tmp_path):
    bogus = tmp_path / "bogus.txt.gz"
    with gzip.open(bogus, "wt") as f:
        f.write("#version\na b\nc d\n")
    with pytest.raises(ValueError, match="bogus.txt.gz"):
        read_merges(bogus)
