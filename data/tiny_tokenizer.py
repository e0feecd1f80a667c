"""A tiny, deterministic Qwen-style tokenizer built offline, for tests and toy runs.

Real Qwen checkpoints' tokenizers cannot be downloaded on the project's machines, yet the
CORD pipeline must be exercised against a *real* ``transformers`` tokenizer: byte-level BPE,
added special tokens that are split out before BPE, a Jinja chat template and the
``save_pretrained`` / ``from_pretrained`` round trip. This module trains such a tokenizer in
well under a second on a small built-in corpus of receipt-like text and JSON punctuation, so
every id stays below ~450 and a proxy model with ``model.vocab_size=512`` can read it.

The special tokens are Qwen's names, the pre-tokenizer is Qwen's split, and the chat template
renders Qwen3.5's layout (``<|im_start|>{role}\\n{content}<|im_end|>\\n``, with an empty think
block in the final assistant turn; see ``CHAT_TEMPLATE``), with an image part of user content
rendered as ``<|vision_start|><|image_pad|><|vision_end|>`` (one pad token;
``data.chat.encode_conversation`` expands it to the image's token count). ``<|video_pad|>`` is
there for video samples, which only the real template (tests/fixtures) renders.
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
    "<|video_pad|>",
)

# The layout of Qwen3.5's template (tests/fixtures/qwen35_chat_template.jinja, which the tests
# also render) for system/user/assistant turns: content trimmed, image parts as one image block,
# a think block (empty unless the message has reasoning_content) in assistant turns after the
# last user message. Tools, video and <think> parsing of content are left to the real template.
CHAT_TEMPLATE = (
    "{%- macro render(content) -%}"
    "{%- if content is string -%}{{- content -}}"
    "{%- else -%}{%- for part in content -%}"
    "{%- if part['type'] == 'image' -%}{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
    "{%- set ns = namespace(last_query=0) -%}"
    "{%- for message in messages -%}{%- if message['role'] == 'user' -%}{%- set ns.last_query = loop.index0 -%}"
    "{%- endif -%}{%- endfor -%}"
    "{%- for message in messages -%}"
    "{%- set content = render(message['content'])|trim -%}"
    "{%- if message['role'] == 'assistant' and loop.index0 > ns.last_query -%}"
    "{%- set reasoning = (message['reasoning_content'] if message['reasoning_content'] is string else '')|trim -%}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning + '\\n</think>\\n\\n' + content + '<|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

# Qwen2/3/3.5's pre-tokenizer split (tokenizer.json's Split pattern): letters with one leading
# non-letter, single digits, punctuation runs with their trailing newlines, newline runs.
QWEN_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Added (not special) tokens of Qwen3.5's tokenizer that the chat layout uses
QWEN_ADDED_TOKENS = ("<think>", "</think>")

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
    "assistant\n<think>\n\n</think>\n\nThe total is 9,000.\n\nTwo items.\n",  # newline runs merge
]


def build_tiny_tokenizer(out_dir: str | Path, special_tokens=QWEN_SPECIAL_TOKENS, vocab_size: int = 440,
                         chat_template: str = CHAT_TEMPLATE):
    """Train, save (``save_pretrained(out_dir)``) and return a ``PreTrainedTokenizerFast``.

    ``special_tokens`` may be narrowed (e.g. without ``<|image_pad|>``) to test how callers
    handle an incomplete tokenizer. Special tokens, then ``<think>``/``</think>``, get the ids
    after the trained vocabulary, as in Qwen (added tokens at the top), so ids are
    < vocab_size + len(special_tokens) + 2. ``chat_template``: e.g. Qwen3.5's real one.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([  # as Qwen's tokenizer.json: split, then bytes
        pre_tokenizers.Split(Regex(QWEN_SPLIT_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
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
    fast.add_tokens(list(QWEN_ADDED_TOKENS))
    if "<|im_end|>" in special_tokens:
        fast.eos_token = "<|im_end|>"
    fast.chat_template = chat_template
    fast.save_pretrained(str(out_dir))
    return fast
