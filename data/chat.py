"""Tokenise a Qwen chat conversation with an exact, shifted loss mask.

The ids are those of Qwen3.5's published chat template (``apply_chat_template``; the template
is kept in ``tests/fixtures/qwen35_chat_template.jinja`` and the tests compare token for token):

- every message's content is rendered (text parts joined, an image part as
  ``<|vision_start|><|image_pad|><|vision_end|>``, a video part as
  ``<|vision_start|><|video_pad|><|vision_end|>``) and then trimmed of surrounding whitespace;
- an optional system message comes first: ``<|im_start|>system\\n{content}<|im_end|>\\n``;
- user turns: ``<|im_start|>user\\n{content}<|im_end|>\\n``;
- assistant turns *after the last user message* carry a think block,
  ``<|im_start|>assistant\\n<think>\\n{reasoning}\\n</think>\\n\\n{answer}<|im_end|>\\n``, empty
  (``<think>\\n\\n</think>\\n\\n``) when the sample has no reasoning; earlier assistant turns render
  as ``<|im_start|>assistant\\n{answer}<|im_end|>\\n``. Reasoning comes from a message's
  ``reasoning_content`` or from ``<think>...</think>`` at the start of its content, as in the
  template.

The conversation is built piece by piece instead of rendering the whole string and searching
it for the answers afterwards, so the supervised span is exact by construction and cannot be
fooled by an answer that contains ``assistant`` or ``<|im_end|>``-like text. Prompt pieces are
rendered as text and tokenised whole (the tokenizer splits special tokens out first); each
supervised piece starts right after a newline with non-space text (content is trimmed) and ends
at ``<|im_end|>``, both boundaries that Qwen's pre-tokenizer never merges across.

Loss mask convention (as in ``data.mock``): ``loss_mask[t]`` weights the prediction of
``input_ids[t + 1]`` (the labels are the inputs shifted left by one). It is 1 exactly where that
next token is an assistant answer token or the ``<|im_end|>`` closing an assistant turn, so the
model learns the answer and when to stop. Real reasoning text, with its ``\\n</think>\\n\\n``, is
supervised too (the model writes it after the ``<think>\\n`` of the generation prompt); the empty
think block is prompt: it is what the stock template feeds with thinking off. Never trained:
system/user turns, role headers, image tokens, the newline after ``<|im_end|>``.
"""

from __future__ import annotations

_SPECIAL_NAMES = {
    "image_token_id": "<|image_pad|>",
    "vision_start_token_id": "<|vision_start|>",
    "vision_end_token_id": "<|vision_end|>",
    "im_start_token_id": "<|im_start|>",
    "im_end_token_id": "<|im_end|>",
}
VIDEO_PAD = "<|video_pad|>"  # optional: read when the tokenizer has it (every Qwen-VL tokenizer does)
IMAGE_BLOCK = "<|vision_start|><|image_pad|><|vision_end|>"
VIDEO_BLOCK = "<|vision_start|><|video_pad|><|vision_end|>"
ROLES = ("system", "user", "assistant")


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
    if VIDEO_PAD in vocab:
        ids["video_token_id"] = int(tokenizer.convert_tokens_to_ids(VIDEO_PAD))
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id
    if pad is None:
        pad = eos
    if pad is None:
        raise ValueError("tokenizer has neither a pad token nor an eos token to pad with; set tokenizer.pad_token")
    ids["eos_token_id"] = int(eos if eos is not None else ids["im_end_token_id"])
    ids["pad_token_id"] = int(pad)
    return ids


def _is_image(part: dict) -> bool:
    return part.get("type") == "image" or "image" in part or "image_url" in part  # the template's test


def is_video(part: dict) -> bool:
    return part.get("type") == "video" or "video" in part  # the template's test, after the image one


def render_content(content, turn: int, allow_images: bool = True) -> tuple[str, int, int]:
    """The template's ``render_content(...)|trim``: the message text with one image block per
    image part and one video block per video part, stripped of surrounding whitespace; and the
    numbers of images and videos."""
    if content is None:
        return "", 0, 0
    if isinstance(content, str):
        return content.strip(), 0, 0
    if not isinstance(content, list):
        raise ValueError(f"message {turn} content must be a string or a list of parts, got {type(content).__name__}")
    out, n_images, n_videos = [], 0, 0
    for part in content:
        if not isinstance(part, dict):
            raise ValueError(f"message {turn}: content part {part!r} is not an object")
        if _is_image(part):
            if not allow_images:
                raise ValueError(f"message {turn}: images are only supported in user turns")
            out.append(IMAGE_BLOCK)
            n_images += 1
        elif is_video(part):
            if not allow_images:
                raise ValueError(f"message {turn}: videos are only supported in user turns")
            out.append(VIDEO_BLOCK)
            n_videos += 1
        elif "text" in part:
            out.append(str(part["text"]))
        else:
            raise ValueError(f"message {turn}: unknown content part {part!r} (expected text, image or video)")
    return "".join(out).strip(), n_images, n_videos


def split_reasoning(msg: dict, content: str) -> tuple[str, str]:
    """(reasoning, answer) of an assistant message, the way the template separates them."""
    reasoning = msg.get("reasoning_content")
    if not isinstance(reasoning, str):
        reasoning = ""
        if "</think>" in content:
            reasoning = content.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
            content = content.split("</think>")[-1].lstrip("\n")
    return reasoning.strip(), content


def last_user_index(messages: list[dict]) -> int:
    for i in range(len(messages) - 1, -1, -1):
        if messages[i].get("role") == "user":
            return i
    raise ValueError("the conversation has no user message (Qwen's chat template refuses it)")


def video_expansion(tokenizer, timestamps: list[float], tokens_per_group: int, special_ids: dict[str, int]) -> list[int]:
    """The ids that replace a video's ``<|video_pad|>``, as Qwen3-VL's processor (Qwen3.5's) writes
    them: per temporal group ``<{t:.1f} seconds><|vision_start|>`` + its pad tokens + ``<|vision_end|>``
    (inside the template's own ``<|vision_start|>...<|vision_end|>``). The timestamp text sits
    between special tokens, so tokenising it alone gives the ids of the whole string."""
    out: list[int] = []
    for t in timestamps:
        out += tokenizer.encode(f"<{t:.1f} seconds>", add_special_tokens=False)
        out += [special_ids["vision_start_token_id"]] + [special_ids["video_token_id"]] * int(tokens_per_group)
        out.append(special_ids["vision_end_token_id"])
    return out


def encode_conversation(tokenizer, messages: list[dict], image_token_counts: list[int],
                        special_ids: dict[str, int],
                        videos: list[tuple[list[float], int]] = ()) -> tuple[list[int], list[float]]:
    """Token ids and shifted loss mask of a conversation (see the module docstring).

    ``messages``: ``[{"role": ..., "content": str | [{"type": "image"} | {"type": "video"} |
    {"type": "text", "text": ...}], "reasoning_content": str (optional)}]``. Image i becomes
    ``<|vision_start|>`` + ``image_token_counts[i]`` x ``<|image_pad|>`` + ``<|vision_end|>``; video j,
    ``videos[j] = (timestamps of its temporal groups, tokens per group)``, is expanded by
    ``video_expansion``. Every assistant turn is supervised.
    """
    pad = special_ids["image_token_id"]
    video_pad = special_ids.get("video_token_id")
    for turn, msg in enumerate(messages):
        if msg.get("role") not in ROLES:
            raise ValueError(f"message {turn} has role {msg.get('role')!r}; expected one of {', '.join(ROLES)}")
    last_query = last_user_index(messages)
    pieces: list[tuple[str, bool]] = []  # (text, supervised); prompt text is merged until an answer
    n_img = n_vid = 0
    for turn, msg in enumerate(messages):
        role = msg["role"]
        if role == "system" and turn:
            raise ValueError(f"message {turn}: a system message must come first")
        content, k, kv = render_content(msg.get("content"), turn, allow_images=role == "user")
        n_img, n_vid = n_img + k, n_vid + kv
        if role != "assistant":
            pieces.append((f"<|im_start|>{role}\n{content}<|im_end|>\n", False))
            continue
        reasoning, answer = split_reasoning(msg, content)
        if turn > last_query and reasoning:
            pieces += [("<|im_start|>assistant\n<think>\n", False), (f"{reasoning}\n</think>\n\n{answer}", True)]
        elif turn > last_query:
            pieces += [("<|im_start|>assistant\n<think>\n\n</think>\n\n", False), (answer, True)]
        else:
            pieces += [("<|im_start|>assistant\n", False), (answer, True)]
        pieces += [("<|im_end|>", True), ("\n", False)]
    if n_img != len(image_token_counts):
        raise ValueError(f"{len(image_token_counts)} image token counts given but the conversation has {n_img} image(s)")
    if n_vid != len(videos):
        raise ValueError(f"{len(videos)} video(s) given but the conversation has {n_vid} video part(s)")
    if n_vid and video_pad is None:
        raise ValueError("the tokenizer has no <|video_pad|> token; use a Qwen-VL tokenizer for video samples")

    ids: list[int] = []
    target: list[bool] = []  # target[i]: token i is supervised (as a label)
    counts, video_iter = iter(image_token_counts), iter(videos)
    text, supervised = "", False
    for piece, sup in pieces + [("", not pieces[-1][1])]:  # a sentinel flushes the last run
        if sup == supervised:
            text += piece
            continue
        for tok in tokenizer.encode(text, add_special_tokens=False) if text else []:
            if tok == pad:  # the template's one pad per image -> the image's token count
                n = next(counts, None)
                if n is None:
                    raise ValueError("the conversation's text holds more <|image_pad|> tokens than it has images")
                n = int(n)
                ids.extend([pad] * n)
                target.extend([supervised] * n)
            elif tok == video_pad:
                expanded = video_expansion(tokenizer, *next(video_iter), special_ids)
                ids.extend(expanded)
                target.extend([supervised] * len(expanded))
            else:
                ids.append(tok)
                target.append(supervised)
        text, supervised = piece, sup
    loss_mask = [1.0 if t else 0.0 for t in target[1:]] + [0.0]
    return ids, loss_mask
