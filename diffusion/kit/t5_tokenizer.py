"""A T5-style tokenizer trained offline on the sample data's captions (the ``tiny-t5`` kit's).

A real T5 ships a SentencePiece vocabulary of 32k pieces; the tiny kit needs one that covers the
sample captions and behaves as T5's does where it matters to training: ``<pad>`` is id 0 and pads on the
right, every caption ends in ``</s>``, and an unknown word becomes ``<unk>``. :func:`write_t5_tokenizer`
trains a word-level vocabulary with the ``tokenizers`` library on every caption the sample data can hold
(each scene's caption and its dense ``recap``, digits one by one) and saves it as the files
``transformers.AutoTokenizer.from_pretrained`` reads.
"""

from __future__ import annotations

import itertools
import pathlib

from diffusion.kit import sample

PAD, EOS, UNK = "<pad>", "</s>", "<unk>"  # ids 0, 1, 2, as in T5


def caption_corpus() -> list[str]:
    """Every first caption the sample scenes can have, and their dense captions in each wording."""
    colors, shapes, backgrounds = list(sample.COLORS), sample.SHAPES, list(sample.BACKGROUNDS)
    captions = []
    for color, shape in itertools.product(colors, shapes):
        one = f"{sample._a(color)} {shape}"
        captions += [one] + [f"{one} on {sample._a(bg)} background" for bg in backgrounds]
        for relation, other, other_shape in itertools.product(sample.RELATIONS, colors, shapes):
            captions.append(f"{one} {relation} {sample._a(other)} {other_shape}")
    dense = [sample.recap(c, w, h, seed=0, index=i) for i, (c, (w, h)) in
             enumerate(zip(captions[::7], itertools.cycle([(64, 64), (96, 64), (64, 96)])))]
    return captions + [d for d in dense if d] + [" ".join("0123456789")]


def write_t5_tokenizer(out, max_length: int = 64) -> int:
    """Train the tokenizer on :func:`caption_corpus` and save it to ``out``; returns its vocabulary size."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel(unk_token=UNK))
    tokenizer.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Whitespace(),
                                                       pre_tokenizers.Digits(individual_digits=True)])
    tokenizer.train_from_iterator(caption_corpus(), trainers.WordLevelTrainer(special_tokens=[PAD, EOS, UNK]))
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"$A {EOS}", pair=f"$A {EOS} $B {EOS}", special_tokens=[(EOS, tokenizer.token_to_id(EOS))])
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token=PAD, eos_token=EOS, unk_token=UNK,
                                   model_max_length=max_length, padding_side="right")
    pathlib.Path(out).mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out))
    return tokenizer.get_vocab_size()
