"""The CLIP BPE tokenizer, rebuilt offline from the vocabulary file that ``open_clip_torch`` ships.

SD2 uses OpenAI's CLIP BPE (49,408 tokens) with ``model_max_length`` 77 and ``!`` (id 0) as the pad
token. The merges in ``open_clip/bpe_simple_vocab_16e6.txt.gz`` define that vocabulary completely:
256 byte symbols, the same symbols with the end-of-word marker ``</w>``, one token per merge, then
the two special tokens. :func:`write_clip_tokenizer` writes it as the files
``transformers.CLIPTokenizer.from_pretrained`` reads, so no hub access is needed.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import pathlib

BOS, EOS, PAD = "<|startoftext|>", "<|endoftext|>", "!"
VOCAB_SIZE = 49408
MAX_LENGTH = 77
BPE_FILE = "bpe_simple_vocab_16e6.txt.gz"
_END_OF_WORD = "</w>"
_NUM_MERGES = VOCAB_SIZE - 2 * 256 - 2  # the file holds more merges than CLIP uses


def _byte_symbols() -> list[str]:
    """One printable unicode character per byte value, in CLIP's id order.

    Printable latin-1 bytes stand for themselves; the rest (whitespace, control characters) are
    shifted to code points from 256 up, so every byte has a visible symbol the BPE can merge.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in set(printable)]
    return [chr(b) for b in printable] + [chr(256 + i) for i in range(len(others))]


def bpe_path() -> pathlib.Path:
    """The BPE merges file inside the installed ``open_clip`` package (found without importing it)."""
    spec = importlib.util.find_spec("open_clip")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the CLIP vocabulary comes from the open_clip_torch package ({BPE_FILE}); "
                                f"install it with `pip install open_clip_torch`")
    for location in spec.submodule_search_locations:
        path = pathlib.Path(location) / BPE_FILE
        if path.exists():
            return path
    raise FileNotFoundError(f"{BPE_FILE} not found in the open_clip package at {list(spec.submodule_search_locations)}")


def read_merges(path=None) -> list[tuple[str, str]]:
    """The merges CLIP uses (the first line of the file is a header)."""
    path = path or bpe_path()
    lines = gzip.open(path).read().decode("utf-8").split("\n")
    merges = [tuple(line.split()) for line in lines[1:_NUM_MERGES + 1]]
    if len(merges) != _NUM_MERGES or any(len(m) != 2 for m in merges):
        raise ValueError(f"{path}: expected {_NUM_MERGES} merges of two symbols each, "
                         f"got {len(merges)}; is it CLIP's {BPE_FILE}?")
    return merges


def build_vocab(merges: list[tuple[str, str]]) -> dict[str, int]:
    """Token -> id, in CLIP's order: bytes, bytes + ``</w>``, merges, then the special tokens."""
    symbols = _byte_symbols()
    tokens = symbols + [s + _END_OF_WORD for s in symbols] + ["".join(m) for m in merges] + [BOS, EOS]
    vocab = {token: i for i, token in enumerate(tokens)}
    if len(vocab) != VOCAB_SIZE:
        raise ValueError(f"built {len(vocab)} distinct tokens, expected {VOCAB_SIZE}")
    return vocab


def _special(content: str) -> dict:
    return {"content": content, "lstrip": False, "normalized": True, "rstrip": False, "single_word": False}


def write_clip_tokenizer(out) -> pathlib.Path:
    """Write ``vocab.json``, ``merges.txt``, ``tokenizer_config.json`` and ``special_tokens_map.json``
    into ``out`` (created if needed) with SD2's settings; returns ``out``."""
    out = pathlib.Path(out)
    os.makedirs(out, exist_ok=True)
    merges = read_merges()
    with open(out / "vocab.json", "w", encoding="utf-8") as f:
        json.dump(build_vocab(merges), f, ensure_ascii=False)
    with open(out / "merges.txt", "w", encoding="utf-8") as f:
        # transformers skips the first line of merges.txt as a version header.
        f.write("#version: 0.2\n" + "\n".join(" ".join(m) for m in merges) + "\n")
    special = {"bos_token": _special(BOS), "eos_token": _special(EOS), "unk_token": _special(EOS), "pad_token": PAD}
    config = {
        **special,
        "tokenizer_class": "CLIPTokenizer",
        "model_max_length": MAX_LENGTH,
        "do_lower_case": True,
        "add_prefix_space": False,
        "errors": "replace",
        "clean_up_tokenization_spaces": True,
    }
    with open(out / "tokenizer_config.json", "w") as f:
        json.dump(config, f, indent=2)
    with open(out / "special_tokens_map.json", "w") as f:
        json.dump(special, f, indent=2)
    return out
