"""Build tiny tokenizers for tests and write them into GGUF metadata.

Tiny models in the test suite need real tokenizers of both kinds mashbox supports: a
SentencePiece BPE vocabulary (GGUF model 'llama') and a byte-level BPE one (GGUF model
'gpt2'). Both are trained here, in well under a second, on ``TRAIN_TEXT``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import sentencepiece as spm
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

if TYPE_CHECKING:
    import gguf

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

SPECIAL_TOKENS = ["<|im_start|>", "<|im_end|>"]

# The byte-level vocabulary puts these first, so their ids are 0, 1 and 2.
BPE_SPECIAL_TOKENS = ["<|endoftext|>", *SPECIAL_TOKENS]

# The Qwen2 pre-tokenizer regex, as in Qwen2's tokenizer.json.
QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

TRAIN_TEXT = """\
The capital of France is Paris. Paris is also the largest city in France.
What is the capital of France? The capital of France is Paris.
Berlin is the capital of Germany, and Madrid is the capital of Spain.
Rome, the capital of Italy, was founded in 753 BC (according to legend).
The quick brown fox jumps over the lazy dog; the dog doesn't mind.
She sells sea shells by the sea shore: 3 shells for $1.50, or 10 for $4.
In 2024, about 2,100,000 people lived in Paris itself, and 12 million nearby.
A café on the Rue de Rivoli serves crème brûlée, croissants and café au lait.
The naïve résumé of the señor was written in Español and Français.
Zoë and Chloé visited Besançon, Orléans and Nîmes last summer.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 13 42 99 100 256 1024 65536.
Math: 2 + 2 = 4, 7 * 6 = 42, 10 / 4 = 2.5, and 3^2 = 9.
Punctuation matters! Does it? Yes... it does; really: "quotes" and 'apostrophes'.
Brackets [like these], braces {like these}, and <angle brackets> appear in code.
def add(a, b):
    return a + b

for i in range(10):
    print(i, i * i)
The user asked: "Where is the Eiffel Tower?" The assistant said: "In Paris, France."
Hello, world! Hello again, world. Goodbye, world.
I can't, I won't, I shouldn't, they're, we've, you'll, he'd, it's.
The weather today is sunny with a high of 21 degrees and a low of 12 degrees.
Tokenizers split text into pieces; models predict the next piece, one at a time.
Water boils at 100 degrees Celsius and freezes at 0 degrees Celsius.
The river Seine flows through Paris before it reaches the English Channel.
Lyon, Marseille, Toulouse, Nice, Nantes and Strasbourg are cities in France.
Email me at someone@example.com or visit https://example.com/path?q=1&x=2.
Item #1 costs 9.99; item #2 costs 19.95; the total is 29.94 (before tax).
Once upon a time, a small model learned to answer questions about geography.
It answered: the capital of France is Paris, the capital of Japan is Tokyo.
Questions and answers, questions and answers: that is what a chat model does.
Über, straße, größer, Mädchen, schön: German has umlauts and the eszett.
The year 1789 saw the French Revolution begin in Paris with the storming of the Bastille.
Lists: apples, bananas, cherries; red, green, blue; one, two, three.
"""


def train_spm(workdir: Path, vocab_size: int = 400) -> Path:
    """Train a SentencePiece BPE model with byte fallback on TRAIN_TEXT (mashbox.tiny's
    trainer, which mashbox-tiny uses too); return its path."""
    from mashbox.tiny import train_spm as train

    return train(Path(workdir), text=TRAIN_TEXT, vocab_size=vocab_size, name="tinyspm")


def train_bpe(
    workdir: Path, vocab_size: int = 400, more_special: tuple[str, ...] = ()
) -> tokenizers.Tokenizer:
    """Train a byte-level BPE tokenizer (Qwen2 pre-tokenizer) on TRAIN_TEXT.

    Its special tokens <|endoftext|>, <|im_start|> and <|im_end|> are ids 0, 1 and 2, then
    `more_special`'s.
    """
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(tokenizers.Regex(QWEN2_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[*BPE_SPECIAL_TOKENS, *more_special],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TRAIN_TEXT.splitlines(keepends=True), trainer=trainer)
    return tok


def add_spm_tokenizer(
    writer: gguf.GGUFWriter,
    model_path: Path,
    *,
    chat_template: str = CHATML_TEMPLATE,
    user_defined: frozenset[str] = frozenset(),
    add_space_prefix: bool = True,
) -> int:
    """Write a SentencePiece model's tokenizer.ggml.* keys (mashbox.tiny's writer, which
    mashbox-tiny uses too); return the vocabulary size."""
    from mashbox.tiny import add_spm_vocabulary

    sp = spm.SentencePieceProcessor(model_file=str(model_path))
    return add_spm_vocabulary(
        writer,
        sp,
        chat_template=chat_template,
        user_defined=user_defined,
        add_space_prefix=add_space_prefix,
    )


def bpe_merges(tok: tokenizers.Tokenizer) -> list[str]:
    """Return a byte-level BPE tokenizer's merges as GGUF stores them ("a b")."""
    merges = json.loads(tok.to_str())["model"]["merges"]
    # Newer tokenizers save each merge as a pair, older ones as "a b".
    return [m if isinstance(m, str) else " ".join(m) for m in merges]


def add_bpe_tokenizer(
    writer: gguf.GGUFWriter,
    tok: tokenizers.Tokenizer,
    *,
    pre: str = "qwen2",
    chat_template: str = CHATML_TEMPLATE,
    add_bos: bool = False,
) -> int:
    """Write a byte-level BPE tokenizer's tokenizer.ggml.* keys (model 'gpt2').

    Special added tokens become CONTROL tokens; bos is <|endoftext|> but not added (unless
    add_bos), eos is <|im_end|>, as Qwen2's GGUF files have them. Return the vocabulary size.
    """
    import gguf

    vocab = tok.get_vocab(with_added_tokens=True)
    by_id = sorted(vocab.items(), key=lambda kv: kv[1])
    if [i for _, i in by_id] != list(range(len(by_id))):
        raise ValueError("token ids are not contiguous")
    special = {t.content for t in tok.get_added_tokens_decoder().values() if t.special}
    tokens = [text for text, _ in by_id]
    types = [gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(bpe_merges(tok))
    writer.add_bos_token_id(vocab["<|endoftext|>"])
    writer.add_eos_token_id(vocab["<|im_end|>"])
    writer.add_pad_token_id(vocab["<|endoftext|>"])
    writer.add_add_bos_token(add_bos)
    writer.add_chat_template(chat_template)
    return len(tokens)


TOKENIZER_KINDS = ("sentencepiece", "bpe")


def train_tokenizer(workdir: Path, kind: str) -> tuple[int, Callable[[gguf.GGUFWriter], int]]:
    """Train a tiny tokenizer of one of TOKENIZER_KINDS; return its vocabulary size and the
    function that writes it into a GGUF file (write_gguf's add_tokenizer).

    The byte-level BPE one keeps Qwen2's pre-tokenizer whatever the model family: it is the
    vocabulary's own, as a converter would name it."""
    if kind == "sentencepiece":
        model_path = train_spm(workdir)
        size = spm.SentencePieceProcessor(model_file=str(model_path)).get_piece_size()
        return size, lambda writer: add_spm_tokenizer(writer, model_path)
    if kind == "bpe":
        tok = train_bpe(workdir)
        return tok.get_vocab_size(), lambda writer: add_bpe_tokenizer(writer, tok, pre="qwen2")
    raise ValueError(f"unknown tokenizer kind {kind!r} ({', '.join(TOKENIZER_KINDS)})")
