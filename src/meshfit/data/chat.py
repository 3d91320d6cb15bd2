"""Conversations ([data] format "chat"): each row's messages checked and put in the form its
chat template renders, then rendered and tokenized with the assistant's tokens marked.

A message is a mapping in the chat format of OpenAI's API and transformers'
``apply_chat_template``: a ``role`` (system, user, assistant, tool) and its ``content``:

* a string;
* a list of parts ``[{"type": "text", "text": ...}, ...]`` (OpenAI's form, common in
  exported data). A template that renders parts itself (it loops over the content, as
  multimodal models' templates do) gets them as they are; one that expects a string (it
  concatenates ``message['content']``, as most text models' do, and would render the list as
  Python prints it, or fail) gets their texts joined by newlines, as vLLM does for such
  templates. Parts of another type (an image, audio) are refused: meshfit trains on text;
* null, or left out, only for an assistant turn that calls tools (``tool_calls``); a null
  value is a key left out, as transformers reads it.

Anything else (a number, a mapping) is refused with the row, the message and the fix, not
rendered as Python prints it. ``tool_calls`` are kept where the template renders them (its
output names the called function) and refused where it leaves them out: the turn would be
trained without its call. What the template does with parts and tool calls is found once per
template, by rendering two small conversations (`template_traits`). Any other failure of the
template on a row is one line naming the file and row, not the template engine's traceback.

Tokens: a conversation's rendered text is tokenized only as far as the row keeps
(`meshfit.data.tokenizer.encode_head`), and the assistant's turns are found as character
spans of the text (the template's ``{% generation %}`` markers through transformers' own
renderer, or turn by turn: `meshfit.data.examples`' docstring), so the time and memory of a
long conversation follow the tokens kept.
"""

from __future__ import annotations

from typing import Any

from meshfit.data.tokenizer import encode_head

__all__ = ["ROLES", "chat_example", "conversation", "has_generation_markers", "template_traits"]

ROLES = ("system", "user", "assistant", "tool")
_PROBE_TEXT = ("meshfit-probe-question", "meshfit-probe-answer")
_PROBE_CALL = "meshfit_probe_function"


def has_generation_markers(template: str | None) -> bool:
    return bool(template) and any(f"{{%{dash} generation" in template
                                  for dash in ("", "-", "+"))


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [""])[0] or type(err).__name__


def _render(hf: Any, messages: list[dict], template: str | None, where: str, **kwargs) -> str:
    """The template's text of `messages`; a template error is one line naming `where`."""
    extra = {"chat_template": template} if template else {}
    try:
        return hf.apply_chat_template(messages, tokenize=False, **extra, **kwargs)
    except Exception as err:  # noqa: BLE001 - jinja's and the template's own errors alike
        raise ValueError(f"{where}: the chat template cannot render this conversation "
                         f"({type(err).__name__}: {_first_line(err)}); fix the row, or give "
                         "data.chat_template a template that renders it") from None


def template_traits(hf: Any, template: str | None) -> tuple[bool, bool]:
    """(renders a content list of text parts itself, renders an assistant's tool_calls) for
    the template `template` (None: the tokenizer's), found by rendering two conversations."""
    user, answer = _PROBE_TEXT
    parts = [{"role": "user", "content": [{"type": "text", "text": user}]},
             {"role": "assistant", "content": [{"type": "text", "text": answer}]}]
    call = [{"role": "user", "content": user},
            {"role": "assistant", "tool_calls": [{"type": "function", "function": {
                "name": _PROBE_CALL, "arguments": {"x": 1}}}]}]
    try:
        text = _render(hf, parts, template, "probe")
        takes_parts = user in text and answer in text and "'type'" not in text \
            and '"type"' not in text
    except ValueError:
        takes_parts = False
    try:
        renders_calls = _PROBE_CALL in _render(hf, call, template, "probe")
    except ValueError:
        renders_calls = False
    return takes_parts, renders_calls


def conversation(messages: Any, where: str, *, parts: bool, tools: bool,
                 every_token: bool = False) -> list[dict]:
    """`messages` checked and put in the form the template renders (module docstring):
    `parts` and `tools` are `template_traits`'; `every_token` (data.train_on_prompt) lets a
    conversation without an assistant turn through. One-line ValueErrors naming `where`."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: a conversation must be a non-empty list of "
                         "{'role': ..., 'content': ...}")
    out = [_message(m, f"{where}, message {k}", parts=parts, tools=tools)
           for k, m in enumerate(messages)]
    if not every_token and not any(m["role"] == "assistant" for m in out):
        raise ValueError(f"{where}: the conversation has no assistant turn, so nothing in it "
                         "would be trained; remove it or set data.train_on_prompt=true")
    return out


def _message(m: Any, where: str, *, parts: bool, tools: bool) -> dict:
    if not isinstance(m, dict) or "role" not in m:
        raise ValueError(f"{where}: {str(m)[:80]!r} is not a {{'role', 'content'}} mapping")
    if m["role"] not in ROLES:
        raise ValueError(f"{where}: role {m['role']!r} is not one of {', '.join(ROLES)}")
    m = {key: value for key, value in m.items() if value is not None}
    role, calls = m["role"], m.get("tool_calls")
    if calls is not None and calls != []:
        if role != "assistant" or not isinstance(calls, list):
            raise ValueError(f"{where}: tool_calls={str(calls)[:60]} on a {role!r} message; "
                             "tool calls are a list on an assistant message")
        if not tools:
            raise ValueError(f"{where}: the assistant's tool_calls, which the chat template "
                             "does not render (the turn would be trained without its call); "
                             "give data.chat_template a template that renders tool calls, or "
                             "leave such rows out")
    elif "tool_calls" in m:
        del m["tool_calls"]  # an empty list: no call
        calls = None
    if "content" not in m:
        if calls is None:
            raise ValueError(f"{where}: a {role!r} message without content (null or missing); "
                             "give it its text")
        return m
    m["content"] = _content(m["content"], where, parts)
    return m


def _content(value: Any, where: str, parts: bool) -> str | list[dict]:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for part in value:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"{where}: content part {str(part)[:60]} is not "
                                 "{'type': 'text', 'text': ...}; meshfit trains on text, so "
                                 "give text parts only (or the content as a string)")
            texts.append(part["text"])
        return [{"type": "text", "text": t} for t in texts] if parts else "\n".join(texts)
    raise ValueError(f"{where}: content {str(value)[:40]} is {type(value).__name__}, not "
                     "text; write it as a string (or a list of {'type': 'text', 'text': ...} "
                     "parts)")


def chat_example(hf: Any, messages: list[dict], *, template: str | None = None,
                 limit: int | None = None,
                 where: str = "the conversation") -> tuple[list[int], list[int]]:
    """(ids, mask) of one conversation through the chat template (the tokenizer's, or
    `template`): its first `limit` tokens (None: all), mask 1 on every token overlapping an
    assistant turn (`meshfit.data.examples`' docstring: the same masks as TRL's
    ``SFTTrainer``). `messages` as `conversation` gives them; errors name `where`."""
    if not getattr(hf, "is_fast", False):
        raise ValueError("data.format='chat' needs a fast (Rust) tokenizer to find the "
                         "assistant's tokens; save the tokenizer with tokenizer.json")
    active = hf.get_chat_template(template)
    if has_generation_markers(active):
        text, spans = _render_marked(hf, messages, active, where)
        ids, offsets = encode_head(hf, text, limit, add_special_tokens=False)
    else:
        text = _render(hf, messages, template, where)
        ids, offsets = encode_head(hf, text, limit, add_special_tokens=False)
        spans = _turn_spans(hf, messages, text, template, where,
                            upto=max((end for _, end in offsets), default=0))
    return ids, _overlapping(offsets, spans)


def _render_marked(hf: Any, messages: list[dict], template: str,
                   where: str) -> tuple[str, list[tuple[int, int]]]:
    """The text of `messages` and the character spans its ``{% generation %}`` markers hold:
    transformers' own renderer, called as ``apply_chat_template`` calls it (the tokenizer's
    special tokens as the template's variables), which gives the spans with the text."""
    from transformers.utils.chat_template_utils import render_jinja_template

    try:
        rendered, spans = render_jinja_template(
            conversations=[messages], chat_template=template,
            return_assistant_tokens_mask=True, **hf.special_tokens_map)
    except Exception as err:  # noqa: BLE001 - jinja's and the template's own errors alike
        raise ValueError(f"{where}: the chat template cannot render this conversation "
                         f"({type(err).__name__}: {_first_line(err)}); fix the row, or give "
                         "data.chat_template a template that renders it") from None
    return rendered[0], [tuple(s) for s in spans[0]]


def _turn_spans(hf: Any, messages: list[dict], text: str, template: str | None, where: str,
                *, upto: int) -> list[tuple[int, int]]:
    """The assistant turns' character spans of `text`, each what the template adds when the
    turn is appended to the conversation before it rendered with the generation prompt;
    turns that begin at or after character `upto` (past the tokens kept) are not rendered."""
    spans = []
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _render(hf, messages[:k], template, where, add_generation_prompt=True) \
            if k else ""
        if len(before) >= upto:
            break
        through = _render(hf, messages[:k + 1], template, where)
        if not (through.startswith(before) and text.startswith(through)):
            raise ValueError("data.format='chat': the chat template renders the beginning of a "
                             "conversation differently when more messages follow, so the "
                             "assistant's turns cannot be found; give data.chat_template a "
                             "template with {% generation %} markers, or data.train_on_prompt"
                             "=true")
        spans.append((len(before), len(through)))
    return spans


def _overlapping(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    """1 for each token whose characters overlap a span (both in order: one pass), as
    transformers' ``return_assistant_tokens_mask`` marks them."""
    mask, s = [0] * len(offsets), 0
    for i, (start, end) in enumerate(offsets):
        while s < len(spans) and start >= spans[s][1]:
            s += 1
        if s == len(spans):
            break
        if end > spans[s][0]:
            mask[i] = 1
    return mask
