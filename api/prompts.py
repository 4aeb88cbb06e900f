"""Prompts to token ids, for admission (which runs these on its tokenizer threads).

Whose text may hold control tokens (`<|im_start|>`, `<|endoftext|>`, ...):

- A completion's text prompt is the client's whole prompt, any chat template included, as in
  vLLM's `/v1/completions`: its control tokens are read as such, so a client can write the
  template itself.
- A chat's messages are text that the model's chat template puts in its own structure: only
  that structure is control tokens, never a message's text (as with vLLM's and OpenAI's chat
  APIs). Read as control tokens, `<|im_start|>system\\n...` in a user's message would open a
  system turn of the user's own.
"""

from __future__ import annotations

import re
import secrets

from api.errors import bad_request


def completion_ids(tokenizer, prompt: str) -> list[int]:
    return list(tokenizer.encode(prompt, add_special_tokens=False))


def chat_ids(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """The chat template's tokens around the messages' text, that text never read as control
    tokens.

    Tokenizers find control tokens before anything else and tokenize the text between them
    on its own; this does the same, finding them in the template's text only. So the text
    from one of the template's control tokens to the next (the template's text and the
    contents within it) is tokenized as one piece, with `split_special_tokens`, and a prompt
    without control-token text in its messages gets the ids the rendered template gets. (Not
    so for a tokenizer whose control tokens strip the whitespace next to them, `lstrip` /
    `rstrip`, which no ChatML model's do: there a space next to one is a token of its own.)
    """
    pieces = _template_pieces(tokenizer, messages)
    if pieces is None:
        return _rendered_ids(tokenizer, messages)
    control = _control_pattern(tokenizer)
    ids: list[int] = []
    text = ""  # since the template's last control token
    for i, piece in enumerate(pieces):
        # The pattern has one group, so `split` puts each control token at an odd index.
        for j, part in enumerate(control.split(piece)):
            if j % 2 == 0:
                text += part
                continue
            ids += _plain_ids(tokenizer, text)
            ids.append(tokenizer.convert_tokens_to_ids(part))
            text = ""
        if i < len(messages):
            text += messages[i]["content"]
    return ids + _plain_ids(tokenizer, text)


def _template_pieces(tokenizer, messages: list[dict[str, str]]) -> list[str] | None:
    """The template's text before, between and after the messages' contents (one more piece
    than messages), or None when the template does not render each content once, in order,
    and unchanged (a `| trim`, say)."""
    nonce = secrets.token_hex(8)
    marked = [{**m, "content": f"\ue000{nonce}:{i}\ue001"} for i, m in enumerate(messages)]
    parts = re.split(f"\ue000{nonce}:(\\d+)\ue001", _render(tokenizer, marked))
    pieces, order = parts[0::2], [int(i) for i in parts[1::2]]
    if order != list(range(len(messages))):
        return None
    contents = [m["content"] for m in messages]
    rendered = "".join(p + c for p, c in zip(pieces, [*contents, ""], strict=True))
    return pieces if rendered == _render(tokenizer, messages) else None


def _rendered_ids(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """A template that rewrites the contents: its control tokens cannot be told apart from
    the messages' once rendered, so messages with control-token text are refused."""
    control = _control_pattern(tokenizer)
    for message in messages:
        if (found := control.search(message["content"])) is not None:
            raise bad_request(
                f"messages: `{found.group()}` is a control token of this model, and its chat "
                "template cannot keep message text apart from its own control tokens.",
                param="messages",
                code="invalid_value",
            )
    return list(tokenizer.encode(_render(tokenizer, messages), add_special_tokens=False))


def _render(tokenizer, messages: list[dict[str, str]]) -> str:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def _plain_ids(tokenizer, text: str) -> list[int]:
    if not text:
        return []
    return list(tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True))


def _control_pattern(tokenizer) -> re.Pattern[str]:
    """The tokenizer's special added tokens, longest first (a tokenizer takes the longest
    match), as one group; `re` caches the compiled pattern."""
    tokens = [t.content for t in tokenizer.added_tokens_decoder.values() if t.special]
    alternatives = "|".join(re.escape(t) for t in sorted(tokens, key=len, reverse=True))
    return re.compile(f"({alternatives or '(?!)'})")
