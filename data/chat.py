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
  template;
- tool use: ``tools`` (function schemas) open the system turn (``tools_system_text``), an
  assistant's ``tool_calls`` follow its answer in the template's ``<tool_call>`` layout
  (``tool_calls_text``), and ``tool`` messages (results) are ``<tool_response>`` blocks, a run of
  them in one user turn. A user message that is only a wrapped ``<tool_response>`` is not a query.

The conversation is built piece by piece instead of rendering the whole string and searching
it for the answers afterwards, so the supervised span is exact by construction and cannot be
fooled by an answer that contains ``assistant`` or ``<|im_end|>``-like text. Prompt pieces are
rendered as text and tokenised whole (the tokenizer splits special tokens out first); each
supervised piece starts right after a newline with non-space text (content is trimmed) and ends
at ``<|im_end|>``, both boundaries that Qwen's pre-tokenizer never merges across.

Loss mask convention (as in ``data.mock``): ``loss_mask[t]`` weights the prediction of
``input_ids[t + 1]`` (the labels are the inputs shifted left by one). It is 1 exactly where that
next token is an assistant answer token (tool calls included) or the ``<|im_end|>`` closing an
assistant turn, so the model learns the answer and when to stop. Real reasoning text, with its ``\\n</think>\\n\\n``, is
supervised too (the model writes it after the ``<think>\\n`` of the generation prompt); the empty
think block is prompt: it is what the stock template feeds with thinking off. Never trained:
system/user turns, tool schemas and tool results, role headers, image tokens, the newline after
``<|im_end|>``.
"""

from __future__ import annotations

import json

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
ROLES = ("system", "user", "assistant", "tool")

# Qwen3.5's template (tests/fixtures/qwen35_chat_template.jinja, the released checkpoints'
# chat_template.jinja) writes this into the system turn when a conversation has ``tools``: the
# schemas, one JSON object a line, between the two halves; then the system message, if any.
TOOLS_HEAD = "# Tools\n\nYou have access to the following functions:\n\n<tools>"
TOOLS_TAIL = (
    "\n</tools>\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n"
    "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n"
    "<parameter=example_parameter_2>\nThis is the value for the second parameter\nthat can span\nmultiple lines\n"
    "</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\nReminder:\n- Function calls MUST follow the "
    "specified format: an inner <function=...></function> block must be nested within <tool_call></tool_call> "
    "XML tags\n- Required parameters MUST be specified\n- You may provide optional reasoning for your function "
    "call in natural language BEFORE the function call, but NOT after\n- If there is no function call "
    "available, answer the question like normal with your current knowledge and do not tell the user about "
    "function calls\n</IMPORTANT>"
)


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
    """The last user query; as in the template, a user message that is only a wrapped tool result
    (``<tool_response>...</tool_response>``) is not one."""
    for i in range(len(messages) - 1, -1, -1):
        if messages[i].get("role") == "user":
            content = render_content(messages[i].get("content"), i)[0]
            if not (content.startswith("<tool_response>") and content.endswith("</tool_response>")):
                return i
    raise ValueError("the conversation has no user message (Qwen's chat template refuses it)")


def _json(value) -> str:
    # transformers' tojson filter (the one apply_chat_template gives templates): no HTML escaping,
    # non-ASCII kept, keys in their given order
    return json.dumps(value, ensure_ascii=False)


def tools_system_text(tools: list, system: str) -> str:
    """The system turn of a conversation with tools, as the template writes it."""
    for k, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise ValueError(f"tool {k} is {type(tool).__name__}, not a JSON object (a function schema)")
    body = TOOLS_HEAD + "".join("\n" + _json(tool) for tool in tools) + TOOLS_TAIL
    return f"<|im_start|>system\n{body}{chr(10) * 2 + system if system else ''}<|im_end|>\n"


def tool_calls_text(calls, answer: str, turn: int) -> str:
    """An assistant message's ``tool_calls`` as the template writes them after its answer:
    ``<tool_call>\n<function=NAME>\n`` + one ``<parameter=KEY>\nVALUE\n</parameter>\n`` per
    argument + ``</function>\n</tool_call>``, calls a newline apart, two newlines after a non-empty
    answer. A call is ``{"name", "arguments"}`` or OpenAI's ``{"function": {"name", "arguments"}}``;
    arguments are an object or a JSON string of one (parsed here: the template iterates them as an
    object). A value that is an object or a list is written as JSON, anything else as Python's
    ``str`` (the template's ``|string``: ``True``, ``None``, ``2.5``)."""
    if calls is None:
        return ""
    if not isinstance(calls, list):
        raise ValueError(f"message {turn}: tool_calls must be a list of calls, got {type(calls).__name__}")
    out = []
    for k, call in enumerate(calls):
        fn = (call["function"] if call.get("function") is not None else call) if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError(f"message {turn}: tool call {k} needs a function name "
                             '({"name": ..., "arguments": {...}} or {"function": {"name": ..., "arguments": ...}})')
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError as e:
                raise ValueError(f"message {turn}: tool call {k} ({fn['name']}) arguments are not JSON ({e}); "
                                 "give an object or a JSON string of one") from None
        if args is not None and not isinstance(args, dict):
            raise ValueError(f"message {turn}: tool call {k} ({fn['name']}) arguments are "
                             f"{type(args).__name__}, not an object of named parameters")
        sep = ("\n\n" if answer.strip() else "") if k == 0 else "\n"
        values = {key: _json(v) if isinstance(v, (dict, list, tuple)) else str(v) for key, v in (args or {}).items()}
        params = "".join(f"<parameter={key}>\n{v}\n</parameter>\n" for key, v in values.items())
        out.append(f"{sep}<tool_call>\n<function={fn['name']}>\n{params}</function>\n</tool_call>")
    return "".join(out)


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
                        videos: list[tuple[list[float], int]] = (),
                        tools: list | None = None) -> tuple[list[int], list[float]]:
    """Token ids and shifted loss mask of a conversation (see the module docstring).

    ``messages``: ``[{"role": ..., "content": str | [{"type": "image"} | {"type": "video"} |
    {"type": "text", "text": ...}], "reasoning_content": str (optional)}]``. Image i becomes
    ``<|vision_start|>`` + ``image_token_counts[i]`` x ``<|image_pad|>`` + ``<|vision_end|>``; video j,
    ``videos[j] = (timestamps of its temporal groups, tokens per group)``, is expanded by
    ``video_expansion``. Every assistant turn is supervised, its ``tool_calls`` with it.

    Tool use: ``tools`` (function schemas) go into the system turn; an assistant message may carry
    ``tool_calls`` (``tool_calls_text``); ``tool`` messages hold the results, a run of them in one
    user turn as ``\n<tool_response>\n{content}\n</tool_response>`` each. Tool results are prompt.
    """
    pad = special_ids["image_token_id"]
    video_pad = special_ids.get("video_token_id")
    for turn, msg in enumerate(messages):
        if msg.get("role") not in ROLES:
            raise ValueError(f"message {turn} has role {msg.get('role')!r}; expected one of {', '.join(ROLES)}")
    last_query = last_user_index(messages)
    pieces: list[tuple[str, bool]] = []  # (text, supervised); prompt text is merged until an answer
    if tools is not None and not isinstance(tools, list):
        raise ValueError(f"tools must be a list of function schemas, got {type(tools).__name__}")
    if tools:  # the system turn carries the schemas, then the system message if there is one
        system = messages[0].get("role") == "system"
        text = render_content(messages[0].get("content"), 0, allow_images=False)[0] if system else ""
        pieces.append((tools_system_text(tools, text), False))
    n_img = n_vid = 0
    for turn, msg in enumerate(messages):
        role = msg["role"]
        if role == "system" and turn:
            raise ValueError(f"message {turn}: a system message must come first")
        content, k, kv = render_content(msg.get("content"), turn, allow_images=role in ("user", "tool"))
        n_img, n_vid = n_img + k, n_vid + kv
        if role == "system" and tools:
            continue  # written above
        if role == "tool":  # a run of results shares one user turn
            if turn == 0:
                raise ValueError("message 0: a tool result cannot come first; it answers an assistant's tool call")
            opens = messages[turn - 1]["role"] != "tool"
            closes = turn + 1 == len(messages) or messages[turn + 1]["role"] != "tool"
            pieces.append((("<|im_start|>user" if opens else "") + f"\n<tool_response>\n{content}\n</tool_response>"
                           + ("<|im_end|>\n" if closes else ""), False))
            continue
        if role != "assistant":
            pieces.append((f"<|im_start|>{role}\n{content}<|im_end|>\n", False))
            continue
        reasoning, answer = split_reasoning(msg, content)
        answer += tool_calls_text(msg.get("tool_calls"), answer, turn)
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
