"""data/chat.py against Qwen3.5's published chat template (tests/fixtures/qwen35_chat_template.jinja):
the ids equal ``apply_chat_template``'s token for token, and the loss covers exactly the answers."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers.chat_checks import image_count, supervised_runs

from data.chat import encode_conversation, special_token_ids
from data.tiny_tokenizer import build_tiny_tokenizer

QWEN35_TEMPLATE = (Path(__file__).parent / "fixtures" / "qwen35_chat_template.jinja").read_text()
IMG = {"type": "image"}


def _text(t):
    return {"type": "text", "text": t}


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("tok35")
    build_tiny_tokenizer(out, chat_template=QWEN35_TEMPLATE)
    return AutoTokenizer.from_pretrained(str(out))


@pytest.fixture(scope="module")
def ids(tok):
    return special_token_ids(tok)


CASES = {
    "single_image": [
        {"role": "user", "content": [IMG, _text("Extract the receipt fields as JSON.")]},
        {"role": "assistant", "content": '{"menu": {"nm": "Latte", "cnt": "1"}}'},
    ],
    "multi_image": [
        {"role": "user", "content": [_text("Compare "), IMG, _text(" and\n"), IMG, _text(" please.")]},
        {"role": "assistant", "content": "The total is 9,000 in both."},
    ],
    "system_prompt_and_trimming": [
        {"role": "system", "content": "  You read receipts.\n\n"},
        {"role": "user", "content": [_text("\n  "), IMG, _text("Total?  \n")]},
        {"role": "assistant", "content": "\n 48,000 \n\n"},
    ],
    "multi_turn": [
        {"role": "system", "content": [_text("Be brief.")]},
        {"role": "user", "content": [IMG, _text("Total?")]},
        {"role": "assistant", "content": "48,000"},
        {"role": "user", "content": "And the assistant said what about items?"},
        {"role": "assistant", "content": "2 Latte\n\n1 Croissant."},
    ],
    "text_only": [
        {"role": "user", "content": "What is a receipt?"},
        {"role": "assistant", "content": "A record of a sale."},
    ],
    "reasoning_content": [
        {"role": "user", "content": "Sum 2 and 3."},
        {"role": "assistant", "content": "5", "reasoning_content": "\n2 plus 3.\n"},
    ],
    "think_in_content": [
        {"role": "user", "content": [IMG, _text("Price?")]},
        {"role": "assistant", "content": "<think>\nRead the last line.\n</think>\n\n9,000"},
    ],
    "answer_with_chat_like_text": [
        {"role": "user", "content": "Quote the log."},
        {"role": "assistant", "content": "assistant\nuser: <im_end> done"},
    ],
}
# What the model must learn to write in each case (decoded supervised labels, run by run)
SUPERVISED = {
    "single_image": ['{"menu": {"nm": "Latte", "cnt": "1"}}<|im_end|>'],
    "multi_image": ["The total is 9,000 in both.<|im_end|>"],
    "system_prompt_and_trimming": ["48,000<|im_end|>"],
    "multi_turn": ["48,000<|im_end|>", "2 Latte\n\n1 Croissant.<|im_end|>"],
    "text_only": ["A record of a sale.<|im_end|>"],
    "reasoning_content": ["2 plus 3.\n</think>\n\n5<|im_end|>"],
    "think_in_content": ["Read the last line.\n</think>\n\n9,000<|im_end|>"],
    "answer_with_chat_like_text": ["assistant\nuser: <im_end> done<|im_end|>"],
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_ids_equal_qwen35_apply_chat_template(tok, ids, case):
    msgs = CASES[case]
    want = tok.apply_chat_template(msgs, tokenize=True, return_dict=False)
    want = want["input_ids"] if isinstance(want, dict) else list(want)
    got, mask = encode_conversation(tok, msgs, [1] * image_count(msgs), ids)
    assert got == want
    assert len(mask) == len(got) and mask[-1] == 0.0
    assert supervised_runs(tok, got, mask) == SUPERVISED[case]


def test_final_turn_has_the_empty_think_block_as_prompt(tok, ids):
    msgs = CASES["multi_turn"]
    rendered = tok.apply_chat_template(msgs, tokenize=False)
    # only the assistant turn after the last user message carries the (empty) think block
    assert rendered.count("<think>\n\n</think>\n\n") == 1
    assert rendered.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n2 Latte\n\n1 Croissant.<|im_end|>\n")
    assert "<|im_start|>assistant\n48,000<|im_end|>" in rendered
    got, mask = encode_conversation(tok, msgs, [1], ids)
    think = [i for i, t in enumerate(got) if t in tok.convert_tokens_to_ids(["<think>", "</think>"])]
    assert len(think) == 2 and tok.decode(got[think[1] + 1]) == "\n\n"
    answer_start = think[1] + 2
    # no label from <|im_start|>assistant through the think block's closing newlines is trained
    assert all(mask[i - 1] == 0.0 for i in range(think[0] - 2, answer_start))
    assert mask[answer_start - 1] == 1.0


def test_image_tokens_expand_in_place(tok, ids):
    msgs = CASES["multi_image"]
    one, _ = encode_conversation(tok, msgs, [1, 1], ids)
    many, mask = encode_conversation(tok, msgs, [3, 5], ids)
    pad = ids["image_token_id"]
    first = one.index(pad)
    second = one.index(pad, first + 1)
    assert many == one[:first] + [pad] * 3 + one[first + 1:second] + [pad] * 5 + one[second + 1:]
    assert not any(mask[i - 1] for i, t in enumerate(many) if t == pad)


def test_tiny_tokenizer_template_renders_like_qwen35(tmp_path):
    """The tiny tokenizer's own short template (used by scripts and the proxy) agrees with the real one."""
    from transformers import AutoTokenizer

    build_tiny_tokenizer(tmp_path)
    small = AutoTokenizer.from_pretrained(str(tmp_path))
    real = AutoTokenizer.from_pretrained(str(tmp_path))
    real.chat_template = QWEN35_TEMPLATE
    for case in ("single_image", "multi_image", "system_prompt_and_trimming", "multi_turn", "reasoning_content"):
        assert small.apply_chat_template(CASES[case], tokenize=False) == real.apply_chat_template(CASES[case], tokenize=False)


@pytest.mark.parametrize("msgs, match", [
    ([{"role": "assistant", "content": "hi"}], "no user message"),
    ([{"role": "user", "content": "a"}, {"role": "system", "content": "b"}], "system message must come first"),
    ([{"role": "bot", "content": "a"}], "role 'bot'"),
    ([{"role": "user", "content": [{"type": "video"}]}], "video"),
    ([{"role": "user", "content": [{"type": "audio"}]}], "unknown content part"),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": [IMG]}], "only supported in user turns"),
])
def test_malformed_conversations_raise(tok, ids, msgs, match):
    with pytest.raises(ValueError, match=match):
        encode_conversation(tok, msgs, [1] * image_count(msgs), ids)
