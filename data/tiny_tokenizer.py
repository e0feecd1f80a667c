"""A tiny, deterministic Qwen-style tokenizer built offline, for tests and toy runs.

Real Qwen checkpoints' tokenizers cannot be downloaded on the project's machines, yet the
CORD pipeline must be exercised against a *real* ``transformers`` tokenizer: byte-level BPE,
added special tokens that are split out before BPE, a Jinja chat template and the
``save_pretrained`` / ``from_pretrained`` round trip. This module trains such a tokenizer in
well under a second on a small built-in corpus of receipt-like text and JSON punctuation, so
every id stays below ~450 and a proxy model with ``model.vocab_size=512`` can read it.

The special tokens are Qwen's names; the chat template renders Qwen's layout::

    <|im_start|>{role}\\n{content}<|im_end|>\\n

with an image part of user content rendered as ``<|vision_start|><|image_pad|><|vision_end|>``
(one pad token; ``data.chat.encode_conversation`` expands it to the image's token count).
eos is ``<|im_end|>``; no pad token is set, so callers exercise the pad -> eos fallback.
"""

from __future__ import annotations

from pathlib import Path

QWEN_SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
)

# Whitespace control keeps the output byte-exact: nothing but the literal pieces is emitted.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}"
    "{{- message['content'] -}}"
    "{%- else -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' -%}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] == 'text' -%}"
    "{{- part['text'] -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

# Enough variety that the frequent receipt/JSON strings become single tokens; small enough
# to train instantly. Order matters only for determinism, which the trainer guarantees.
_CORPUS = [
    "Extract the receipt fields as JSON.",
    "Read this receipt and answer with its menu items, counts, prices and total.",
    '{"menu": [{"nm": "Iced Americano", "cnt": "2", "price": "9,000"}], "total": {"total_price": "9,000"}}',
    '{"menu": {"nm": "Croissant", "cnt": "1", "price": "3,500"}, "sub_total": {"subtotal_price": "3,500"}}',
    '{"total": {"total_price": "48,000", "cashprice": "50,000", "changeprice": "2,000"}}',
    "<s_menu><s_nm>Latte</s_nm><s_cnt>1</s_cnt><s_price>4,500</s_price></s_menu>",
    "<sep/><s_total><s_total_price>12,000</s_total_price></s_total>",
    "TOTAL SUBTOTAL TAX CASH CHANGE QTY ITEM PRICE RECEIPT THANK YOU",
    "Nasi Goreng Mie Ayam Es Teh Manis Kopi Susu Roti Bakar Cheese Cake Green Tea",
    "Chicken Burger French Fries Cola Mineral Water Sandwich Bagel Muffin Donut",
    "0 1 2 3 4 5 6 7 8 9 10 12 15 20 25 30 50 100 000 500 ,000 .00 x @ Rp",
    "[ ] { } ( ) : , . ; ' \" - _ / \\ < > = + * # % & ! ?",
    "user assistant system\nsystem\nuser\nassistant\n",
]


def build_tiny_tokenizer(out_dir: str | Path, special_tokens=QWEN_SPECIAL_TOKENS, vocab_size: int = 440):
    """Train, save (``save_pretrained(out_dir)``) and return a ``PreTrainedTokenizerFast``.

    ``special_tokens`` may be narrowed (e.g. without ``<|image_pad|>``) to test how callers
    handle an incomplete tokenizer. Special tokens get the ids after the trained vocabulary,
    as in Qwen (specials at the top), so ids are < vocab_size + len(special_tokens).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodable
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=False)
    fast.add_special_tokens({"additional_special_tokens": list(special_tokens)})
    if "<|im_end|>" in special_tokens:
        fast.eos_token = "<|im_end|>"
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))
    return fast
