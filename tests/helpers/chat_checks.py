"""What the chat-template tests compare: the supervised text and the image count of a conversation."""

from __future__ import annotations


def supervised_runs(tok, seq, mask) -> list[str]:
    """Decode each contiguous run of supervised labels (seq[t + 1] where mask[t] == 1)."""
    runs, cur = [], []
    for t, m in enumerate(mask):
        if m:
            cur.append(seq[t + 1])
        elif cur:
            runs.append(cur)
            cur = []
    return [tok.decode(r, skip_special_tokens=False) for r in runs + ([cur] if cur else [])]


def image_count(msgs) -> int:
    """Images in a conversation's messages (a tool call's message may have no content)."""
    return sum(isinstance(m.get("content"), list) and sum(p.get("type") == "image" for p in m["content"])
               for m in msgs)
