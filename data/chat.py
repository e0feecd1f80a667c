"""Tokenise a Qwen chat conversation with an exact, shifted loss mask.

The conversation is rendered turn by turn and piece by piece, in the layout of Qwen's chat
template (``<|im_start|>{role}\\n{content}<|im_end|>\\n``), instead of rendering the whole
string and searching it for the assistant spans afterwards: every token is produced by a
known piece, so the supervised span is exact by construction and cannot be fooled by an
answer that happens to contain ``assistant`` or ``<|im_end|>``-like text.

Pieces are separated by special tokens (which the tokenizer splits out before BPE) or by the
role header's newline, so the ids equal those of tokenising the template's rendered string
(``tests/test_cord.py`` checks this against the tokenizer's own chat template).

Loss mask convention (as in ``data.mock``): ``loss_mask[t]`` weights the prediction of
``input_ids[t + 1]`` (the labels are the inputs shifted left by one). It is 1 exactly where
that next token is an assistant answer token or the ``<|im_end|>`` closing an assistant turn,
so the model learns the answer and when to stop, but never the system/user turns, the
``<|im_start|>assistant\\n`` header, image/vision tokens, or the newline after ``<|im_end|>``.
"""

from __future__ import annotations

_SPECIAL_NAMES = {
    "image_token_id": "<|image_pad|>",
    "vision_start_token_id": "<|vision_start|>",
    "vision_end_token_id": "<|vision_end|>",
    "im_start_token_id": "<|im_start|>",
    "im_end_token_id": "<|im_end|>",
}


def special_token_ids(tokenizer) -> dict[str, int]:
    """Resolve the Qwen special ids from ``tokenizer`` (never hard-coded).

    Returns the keys of ``ModelConfig`` (``image_token_id``, ..., ``eos_token_id``,
    ``pad_token_id``). eos defaults to ``<|im_end|>`` when the tokenizer names none; pad falls
    back to eos (Qwen's tokenizers often have no pad). Raises ``ValueError`` naming any missing
    token, and when neither pad nor eos exists.
    """
    vocab = tokenizer.get_vocab()  # convert_tokens_to_ids maps unknowns to unk (or None): check first
    missing = [tok for tok in _SPECIAL_NAMES.values() if tok not in vocab]
    if missing:
        raise ValueError(
            f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} lacks the Qwen special token(s) "
            f"{missing} (e.g. {_SPECIAL_NAMES['image_token_id']} marks image patches); use a Qwen-VL "
            "tokenizer or add them with tokenizer.add_special_tokens"
        )
    ids = {key: int(tokenizer.convert_tokens_to_ids(tok)) for key, tok in _SPECIAL_NAMES.items()}
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id
    if pad is None:
        pad = eos
    if pad is None:
        raise ValueError("tokenizer has neither a pad token nor an eos token to pad with; set tokenizer.pad_token")
    ids["eos_token_id"] = int(eos if eos is not None else ids["im_end_token_id"])
    ids["pad_token_id"] = int(pad)
    return ids


def _text(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False) if text else []


def encode_conversation(tokenizer, messages: list[dict], image_token_counts: list[int],
                        special_ids: dict[str, int]) -> tuple[list[int], list[float]]:
    """Token ids and shifted loss mask of a conversation (see the module docstring).

    ``messages``: ``[{"role": ..., "content": str | [{"type": "image"} | {"type": "text", "text": ...}]}]``.
    Image parts are consumed in order; image i becomes ``<|vision_start|>`` + ``image_token_counts[i]``
    x ``<|image_pad|>`` + ``<|vision_end|>``. Every assistant turn is supervised.
    """
    im_start, im_end = special_ids["im_start_token_id"], special_ids["im_end_token_id"]
    vs, ve, pad = special_ids["vision_start_token_id"], special_ids["vision_end_token_id"], special_ids["image_token_id"]
    newline = _text(tokenizer, "\n")
    ids: list[int] = []
    target: list[bool] = []  # target[i]: token i is supervised (as a label)
    n_img = 0

    def add(tokens: list[int], supervised: bool) -> None:
        ids.extend(tokens)
        target.extend([supervised] * len(tokens))

    for turn, msg in enumerate(messages):
        role, content = msg.get("role"), msg.get("content")
        if not isinstance(role, str) or not role:
            raise ValueError(f"message {turn} has no role: {msg!r}")
        answer = role == "assistant"
        add([im_start] + _text(tokenizer, role + "\n"), False)
        parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(parts, list):
            raise ValueError(f"message {turn} content must be a string or a list of parts, got {type(content).__name__}")
        for part in parts:
            kind = part.get("type")
            if kind == "text":
                add(_text(tokenizer, part.get("text", "")), answer)
            elif kind == "image":
                if answer:
                    raise ValueError(f"message {turn}: images in assistant turns are not supported")
                if n_img >= len(image_token_counts):
                    raise ValueError(f"conversation has more images than image_token_counts ({len(image_token_counts)})")
                add([vs] + [pad] * int(image_token_counts[n_img]) + [ve], False)
                n_img += 1
            else:
                raise ValueError(f"message {turn}: unknown content part type {kind!r}")
        add([im_end], answer)  # the model must learn to stop
        add(newline, False)
    if n_img != len(image_token_counts):
        raise ValueError(f"{len(image_token_counts)} image token counts given but the conversation has {n_img} image(s)")
    loss_mask = [1.0 if t else 0.0 for t in target[1:]] + [0.0]
    return ids, loss_mask
