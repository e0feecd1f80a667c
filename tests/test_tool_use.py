"""Tool-use conversations (data/chat.py) against Qwen3.5's published chat template
(tests/fixtures/qwen35_chat_template.jinja) rendered by transformers' ``apply_chat_template`` with
``tools``: the ids are equal token for token, the calls and the final answers are supervised, the
tool schemas and tool results are not; and the conversations data set reads such records."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from helpers.chat_checks import image_count, supervised_runs

from data.chat import encode_conversation, special_token_ids
from data.tiny_tokenizer import build_tiny_tokenizer

TEMPLATE = (Path(__file__).parent / "fixtures" / "qwen35_chat_template.jinja").read_text()
IM_END = "<|im_end|>"

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city (°C).",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string",
                   "enum": ["c", "f"]}}, "required": ["city"]}}}
SEARCH = {"type": "function", "function": {
    "name": "search", "description": "Search receipts <by> shop & date.",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}, "filters": {"type": "object"},
                                                    "limit": {"type": "integer"}}}}}
TOOLS = [WEATHER, SEARCH]


def _call(name, arguments):
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


CASES = {
    "one_call": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [_call("get_weather", {"city": "Paris"})]},
        {"role": "tool", "content": '{"temp": 18, "sky": "clear"}'},
        {"role": "assistant", "content": "It is 18 C and clear in Paris."},
    ],
    "parallel_calls": [
        {"role": "system", "content": "You are a travel helper."},
        {"role": "user", "content": "Weather in Paris and Rome, in F?"},
        {"role": "assistant", "content": "Checking both.", "tool_calls": [
            _call("get_weather", {"city": "Paris", "unit": "f"}), _call("get_weather", {"city": "Rome", "unit": "f"})]},
        {"role": "tool", "content": "64 F"},
        {"role": "tool", "content": "  77 F\n"},
        {"role": "assistant", "content": "Paris 64 F, Rome 77 F."},
    ],
    "several_rounds": [  # two rounds before a new query (rendered without think blocks), one after
        {"role": "user", "content": "Find my coffee receipts."},
        {"role": "assistant", "content": "", "tool_calls": [
            {"name": "search", "arguments": {"query": "coffee", "filters": {"shop": "Kopi", "after": [2024, 1]},
                                             "limit": 3}}]},
        {"role": "tool", "content": "2 receipts: 9,000 and 4,500"},
        {"role": "assistant", "content": "", "tool_calls": [{"name": "search", "arguments": {
            "query": "coffee total", "limit": 1, "exact": True, "cursor": None, "score": 0.5}}]},
        {"role": "tool", "content": "total 13,500"},
        {"role": "assistant", "content": "Two receipts, 13,500 in all."},
        {"role": "user", "content": "And the weather where I bought them?"},
        {"role": "assistant", "content": "", "tool_calls": [_call("get_weather", {"city": "Jakarta"})]},
        {"role": "tool", "content": "31 C"},
        {"role": "assistant", "content": "31 C in Jakarta."},
    ],
    "reasoning_before_a_call": [
        {"role": "user", "content": "Is it warmer in Paris or Rome?"},
        {"role": "assistant", "content": "I will check Paris first.", "reasoning_content": "Need both temperatures.",
         "tool_calls": [_call("get_weather", {"city": "Paris"})]},
        {"role": "tool", "content": "18 C"},
        {"role": "assistant", "content": "<think>\nNow Rome.\n</think>\n\n",
         "tool_calls": [_call("get_weather", {"city": "Rome"})]},
        {"role": "tool", "content": "25 C"},
        {"role": "assistant", "content": "Rome is warmer.", "reasoning_content": "25 > 18."},
    ],
    "image_in_a_tool_result": [
        {"role": "system", "content": "Use the camera."},
        {"role": "user", "content": "What is on the shelf?"},
        {"role": "assistant", "content": "", "tool_calls": [_call("search", {"query": "shelf photo"})]},
        {"role": "tool", "content": [{"type": "image"}, {"type": "text", "text": "shelf.jpg"}]},
        {"role": "assistant", "content": "Three boxes of tea."},
    ],
}
_P = "<parameter="
# what the model must learn to write, decoded run by run
SUPERVISED = {
    "one_call": [
        f"<tool_call>\n<function=get_weather>\n{_P}city>\nParis\n</parameter>\n</function>\n</tool_call>{IM_END}",
        f"It is 18 C and clear in Paris.{IM_END}"],
    "parallel_calls": [
        f"Checking both.\n\n<tool_call>\n<function=get_weather>\n{_P}city>\nParis\n</parameter>\n{_P}unit>\nf\n"
        f"</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n{_P}city>\nRome\n</parameter>\n"
        f"{_P}unit>\nf\n</parameter>\n</function>\n</tool_call>{IM_END}",
        f"Paris 64 F, Rome 77 F.{IM_END}"],
    "several_rounds": [
        f'<tool_call>\n<function=search>\n{_P}query>\ncoffee\n</parameter>\n{_P}filters>\n{{"shop": "Kopi", '
        f'"after": [2024, 1]}}\n</parameter>\n{_P}limit>\n3\n</parameter>\n</function>\n</tool_call>{IM_END}',
        f"<tool_call>\n<function=search>\n{_P}query>\ncoffee total\n</parameter>\n{_P}limit>\n1\n</parameter>\n"
        f"{_P}exact>\nTrue\n</parameter>\n{_P}cursor>\nNone\n</parameter>\n{_P}score>\n0.5\n</parameter>\n"
        f"</function>\n</tool_call>{IM_END}",
        f"Two receipts, 13,500 in all.{IM_END}",
        f"<tool_call>\n<function=get_weather>\n{_P}city>\nJakarta\n</parameter>\n</function>\n</tool_call>{IM_END}",
        f"31 C in Jakarta.{IM_END}"],
    "reasoning_before_a_call": [
        f"Need both temperatures.\n</think>\n\nI will check Paris first.\n\n<tool_call>\n<function=get_weather>\n"
        f"{_P}city>\nParis\n</parameter>\n</function>\n</tool_call>{IM_END}",
        f"Now Rome.\n</think>\n\n<tool_call>\n<function=get_weather>\n{_P}city>\nRome\n</parameter>\n</function>\n"
        f"</tool_call>{IM_END}",
        f"25 > 18.\n</think>\n\nRome is warmer.{IM_END}"],
    "image_in_a_tool_result": [
        f"<tool_call>\n<function=search>\n{_P}query>\nshelf photo\n</parameter>\n</function>\n</tool_call>{IM_END}",
        f"Three boxes of tea.{IM_END}"],
}
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]


@pytest.fixture(scope="module", params=["bpe", "tool_tokens"])
def tok(request, tmp_path_factory):
    """The tiny Qwen-style tokenizer with the real template; "tool_tokens" adds Qwen3.5's added
    (not special) tool tokens, as the released tokenizer has them."""
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("tok_tools")
    build_tiny_tokenizer(out, chat_template=TEMPLATE)
    tok = AutoTokenizer.from_pretrained(str(out))
    if request.param == "tool_tokens":
        tok.add_tokens(TOOL_TOKENS)
    return tok


def _template_ids(tok, msgs, tools) -> list[int]:
    out = tok.apply_chat_template(msgs, tools=tools, tokenize=True, return_dict=False)
    return out["input_ids"] if isinstance(out, dict) else list(out)


@pytest.mark.parametrize("case", sorted(CASES))
def test_tool_use_equals_qwen35_template(tok, case):
    msgs = CASES[case]
    got, mask = encode_conversation(tok, msgs, [1] * image_count(msgs), special_token_ids(tok), tools=TOOLS)
    assert got == _template_ids(tok, msgs, TOOLS)
    assert supervised_runs(tok, got, mask) == SUPERVISED[case]
    text = tok.decode(got, skip_special_tokens=False)
    assert text.startswith("<|im_start|>system\n# Tools\n") and text.count("<tool_response>") == sum(
        m["role"] == "tool" for m in msgs)
    if case == "parallel_calls":  # two results in a row share one user turn
        assert "<|im_start|>user\n<tool_response>\n64 F\n</tool_response>\n<tool_response>\n77 F\n" \
               "</tool_response><|im_end|>" in text


def test_arguments_as_json_strings_and_bare_calls_render_as_objects(tok):
    """OpenAI's form (arguments a JSON string) is parsed; a bare {"name", "arguments"} call is the
    template's own form: both give the ids of the template fed the objects."""
    msgs = copy.deepcopy(CASES["several_rounds"])
    for m in msgs:
        for call in m.get("tool_calls", []):
            fn = call.get("function", call)
            fn["arguments"] = json.dumps(fn["arguments"])
    ids = special_token_ids(tok)
    assert encode_conversation(tok, msgs, [], ids, tools=TOOLS) == encode_conversation(tok, CASES["several_rounds"],
                                                                                    [], ids, tools=TOOLS)


def test_no_tools_and_a_system_prompt_without_tools(tok):
    """Tool calls and results without a tools list, and a plain system turn: as the template."""
    msgs = CASES["parallel_calls"]
    for tools in (None, []):
        got, _ = encode_conversation(tok, msgs, [], special_token_ids(tok), tools=tools)
        assert got == _template_ids(tok, msgs, tools)


@pytest.mark.parametrize("msgs, tools, match", [
    ([{"role": "tool", "content": "x"}, {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
     None, "tool result cannot come first"),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "", "tool_calls": [{"arguments": {}}]}],
     None, "needs a function name"),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "", "tool_calls": [
        {"name": "f", "arguments": "{not json"}]}], None, "arguments are not JSON"),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "", "tool_calls": [
        {"name": "f", "arguments": "[1, 2]"}]}], None, "not an object of named parameters"),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], ["f"], "tool 0 is str"),
    ([{"role": "user", "content": "<tool_response>\nx\n</tool_response>"}, {"role": "assistant", "content": "b"}],
     None, "no user message"),
])
def test_malformed_tool_use_names_the_problem(tok, msgs, tools, match):
    with pytest.raises(ValueError, match=match):
        encode_conversation(tok, msgs, [], special_token_ids(tok), tools=tools)


def test_conversations_dataset_reads_tool_use_records(tmp_path, tok, caplog):
    """JSONL records with tools (a list, or a JSON string of one) train as encode_conversation gives
    them; bad tool records are skipped and counted by reason."""
    from data.conversations import ConversationsDataset
    from models.qwen35_vl.config import ModelConfig
    from multimodal.config import DataConfig

    good = {"tools": TOOLS, "messages": CASES["parallel_calls"]}
    as_string = {"tools": json.dumps(TOOLS), "messages": CASES["one_call"]}
    bad = [{"tools": "{oops", "messages": CASES["one_call"]},
           {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "tool_calls": [{"arguments": {}}]}]},
           {"messages": [{"role": "user", "content": "a"}, {"role": "function", "content": "b"}]}]
    path = tmp_path / "tools.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [good, as_string, *bad]))
    ids = special_token_ids(tok)
    ds = ConversationsDataset(ModelConfig(vocab_size=512, **ids), DataConfig(name="conversations", path=str(path)),
                              2048, tok)
    for i, record in enumerate([good, as_string]):
        want, mask = encode_conversation(tok, record["messages"], [], ids, tools=TOOLS)
        s = ds[i]
        assert s["input_ids"].tolist() == want and s["loss_mask"].tolist() == mask
        assert want == _template_ids(tok, record["messages"], TOOLS)
    assert [ds[i] for i in (2, 3, 4)] == [None] * 3
    assert ds.skipped == {"bad_record": 2, "unknown_role": 1}
    assert "tools is not JSON" in caplog.text and "needs a function name" in caplog.text


def test_datasets_folder_of_tool_use_records_reads_as_the_jsonl(tmp_path, tok):
    """A datasets folder (arrow and parquet) of tool-use records in OpenAI's form (tools and
    arguments as JSON strings, one column type for all records) gives the JSONL's samples: the
    None that a table puts in absent keys (tool_calls of other messages, a call's missing fields)
    changes nothing."""
    import datasets
    import torch

    from data.conversations import ConversationsDataset
    from models.qwen35_vl.config import ModelConfig
    from multimodal.config import DataConfig

    def openai(msgs):
        out = []
        for m in copy.deepcopy(msgs):
            for call in m.get("tool_calls", []):
                if "function" not in call:
                    call["function"] = {"name": call.pop("name"), "arguments": call.pop("arguments")}
                call["type"] = "function"
                call["function"]["arguments"] = json.dumps(call["function"]["arguments"])
            out.append(m)
        return out

    records = [{"tools": json.dumps(TOOLS), "messages": openai(CASES[c])}
               for c in ("one_call", "parallel_calls", "several_rounds", "reasoning_before_a_call")]
    ids = special_token_ids(tok)

    def ds(path):
        return ConversationsDataset(ModelConfig(vocab_size=512, **ids), DataConfig(name="conversations", path=str(path)),
                                    4096, tok)

    jsonl = tmp_path / "tools.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in records))
    table = datasets.Dataset.from_list(records)
    table.save_to_disk(str(tmp_path / "arrow"))
    (tmp_path / "parquet").mkdir()
    table.to_parquet(str(tmp_path / "parquet" / "train-00000.parquet"))
    want = ds(jsonl)
    for folder in ("arrow", "parquet"):
        got = ds(tmp_path / folder)
        for i, record in enumerate(records):
            assert torch.equal(got[i]["input_ids"], want[i]["input_ids"]), (folder, i)
            assert torch.equal(got[i]["loss_mask"], want[i]["loss_mask"]), (folder, i)
        assert not got.skipped
    plain = encode_conversation(tok, CASES["several_rounds"], [], ids, tools=TOOLS)[0]
    assert want[2]["input_ids"].tolist() == plain
