"""Render chat conversations with a tokenizer's chat template and find the assistant tokens.

A conversation is a list of ``{"role", "content"}`` messages (OpenAI / Hugging Face chat format). It is
rendered with the template from the tokenizer's own folder (``transformers`` ``apply_chat_template``, local
files only) and tokenized once; a token is a training target when the assistant wrote it: the content of an
assistant message and its end-of-turn token (the tokenizer's ``eos_token``, e.g. ``<|eot_id|>`` or
``<|im_end|>``). Everything else (system and user turns, tool results, the role headers the template writes,
what it writes after the end-of-turn token) is context only.

Most released templates (Llama 3.x, Qwen 2.5 / 3) have no ``{% generation %}`` markers, so the assistant
spans are found by rendering the conversation prefix by prefix, as open-instruct's and OLMo's SFT pipelines
do: the text of ``messages[:i]`` plus the generation prompt ends where message ``i`` starts, the text of
``messages[:i + 1]`` ends where it stops, and the tokens of the whole conversation are mapped onto those
character spans by the fast tokenizer's offsets (a merge across a turn boundary cannot shift them). That is
only correct when every prefix renders to a prefix of the whole conversation; this is checked for every
conversation, and a template that breaks it (Qwen 3's template drops earlier turns' reasoning blocks) is
refused, naming the template file. A template with ``{% generation %}`` markers is used through
``transformers``' ``return_assistant_tokens_mask`` instead, which needs no prefix property.
"""

from __future__ import annotations

import bisect
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kempnerforge.errors import UserError

#: Message roles a conversation may hold; the loss is computed on ``assistant`` turns only.
ROLES = ("system", "user", "assistant", "tool")
_GENERATION_MARKER = re.compile(r"{%-?\s*generation\s*-?%}")


class ChatDataError(UserError):
    """Chat data or a chat tokenizer that cannot be used; ``field`` is the argument at fault
    (``source``, ``tokenizer``, ``messages_field``), without a ``data.`` / ``--`` prefix."""


@dataclass
class ChatTokenizer:
    """A ``transformers`` tokenizer loaded from a local folder, with its chat template.

    Attributes:
        path: the resolved tokenizer (or model) folder.
        template_file: the file the chat template comes from (``chat_template.jinja`` or
            ``tokenizer_config.json``), named in refusals.
        vocab_size: number of token ids including added / special tokens.
        eos_id: id of ``eos_token``, the end-of-turn token an assistant span ends with.
        pad_id: ``pad_token``'s id, else ``eos_id`` (padding is never attended to nor trained on).
        generation_markers: the template marks assistant text with ``{% generation %}``.
        tokenizer: the ``transformers`` tokenizer.
    """

    path: str
    template_file: str
    vocab_size: int
    eos_id: int
    pad_id: int
    generation_markers: bool
    tokenizer: Any


def chat_template_file(tok_dir: Path) -> Path | None:
    """The file holding ``tok_dir``'s chat template, as ``transformers`` 5 reads it: ``chat_template.jinja``
    (or ``chat_template.json``), else the ``chat_template`` entry of ``tokenizer_config.json``; None if none."""
    for name in ("chat_template.jinja", "chat_template.json"):
        if (tok_dir / name).is_file():
            return tok_dir / name
    config = tok_dir / "tokenizer_config.json"
    if config.is_file():
        try:
            if json.loads(config.read_text()).get("chat_template"):
                return config
        except (json.JSONDecodeError, AttributeError):
            return None
    return None


def check_chat_tokenizer_files(tokenizer: str) -> Path:
    """Cheap file-level check (no tokenizer is built): ``tokenizer`` is a local folder with a chat template.

    Returns:
        The template file (:func:`chat_template_file`).

    Raises:
        ChatDataError: ``field="tokenizer"``, when the folder is missing or has no chat template.
    """
    path = Path(tokenizer).expanduser()
    if not path.is_dir():
        raise ChatDataError(
            "tokenizer", f"{tokenizer} is not a local folder (a model or tokenizer folder; nothing is downloaded)"
        )
    template = chat_template_file(path)
    if template is None:
        raise ChatDataError(
            "tokenizer",
            f"{tokenizer} has no chat template (no chat_template.jinja, no chat_template in tokenizer_config.json); "
            "chat data is rendered with the template the model was instruction-tuned with: use the instruct "
            "model's folder or add a chat_template",
        )
    return template


def load_chat_tokenizer(tokenizer: str) -> ChatTokenizer:
    """Loads ``transformers.AutoTokenizer`` from the local folder ``tokenizer`` (never the Hub) with its template.

    Raises:
        ChatDataError: ``field="tokenizer"``: missing folder, no chat template, no ``eos_token``.
    """
    template = check_chat_tokenizer_files(tokenizer)
    from transformers import AutoTokenizer

    path = Path(tokenizer).expanduser().resolve()
    tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    if tok.eos_token_id is None:
        raise ChatDataError("tokenizer", f"{tokenizer} has no eos_token (set it in tokenizer_config.json)")
    source = tok.chat_template if isinstance(tok.chat_template, str) else json.dumps(tok.chat_template)
    vocab_size = max(len(tok), max(tok.get_vocab().values()) + 1)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    return ChatTokenizer(
        str(path),
        str(template),
        vocab_size,
        int(tok.eos_token_id),
        int(pad),
        bool(_GENERATION_MARKER.search(source)),
        tok,
    )


def check_messages(messages: Any, where: str) -> None:
    """A conversation the renderer accepts: a list of messages with a known role and string content,
    starting with a non-assistant turn and holding at least one assistant turn.

    Args:
        messages: the decoded value of one record's messages field.
        where: the record's place for the message (``"chat.jsonl line 3"``).

    Raises:
        ChatDataError: ``field="source"``, naming ``where`` and the message index.
    """
    if not isinstance(messages, list) or not messages:
        raise ChatDataError("source", f"{where}: messages must be a non-empty list of messages, got {messages!r:.80}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ChatDataError("source", f"{where}: messages[{i}] is {type(m).__name__}, not a {{role, content}} dict")
        role = m.get("role")
        if role not in ROLES:
            raise ChatDataError("source", f"{where}: messages[{i}].role={role!r} is not one of {', '.join(ROLES)}")
        content = m.get("content")
        if not isinstance(content, str) and not (content is None and role == "assistant" and m.get("tool_calls")):
            raise ChatDataError(
                "source",
                f"{where}: messages[{i}].content must be a string (null only for an assistant turn with tool_calls), "
                f"got {type(content).__name__}",
            )
    if messages[0]["role"] == "assistant":
        raise ChatDataError("source", f"{where}: messages[0] is an assistant turn; start with a system or user turn")
    if not any(m["role"] == "assistant" for m in messages):
        raise ChatDataError("source", f"{where}: no assistant message, so nothing to train on")


def _render(tok: ChatTokenizer, messages: list[dict], generation_prompt: bool, where: str) -> str:
    from jinja2.exceptions import TemplateError

    try:
        return tok.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    except TemplateError as err:  # e.g. raise_exception('roles must alternate user/assistant')
        raise ChatDataError("source", f"{where}: the chat template in {tok.template_file} refuses it: {err}") from err


def tokenize_conversations(
    tok: ChatTokenizer, conversations: list[list[dict]], wheres: list[str]
) -> list[tuple[list[int], list[bool]]]:
    """Token ids and target mask of each conversation (already :func:`check_messages`-checked).

    Each conversation is rendered whole and tokenized once (``add_special_tokens=False``: the template writes
    BOS itself, as ``apply_chat_template(tokenize=True)`` does). Assistant turn ``i`` is the text between the
    rendering of ``messages[:i]`` with the generation prompt and the rendering of ``messages[:i + 1]``, both
    required to be prefixes of the whole text; a token is a target when its first character lies in such a
    span (character offsets of the fast tokenizer, as ``transformers`` maps ``{% generation %}`` spans). The
    span stops after the tokenizer's EOS when it holds one: what a template writes after the end-of-turn
    token (ChatML's newline) is not generated by the model, so it is not trained on, as with the markers.

    ``mask[t]`` is the training label of position ``t - 1`` (labels are shifted: ``labels[t - 1] = ids[t]``
    where ``mask[t]``, else -100).

    Args:
        tok: from :func:`load_chat_tokenizer`.
        conversations: message lists.
        wheres: each conversation's place, for refusals.

    Returns:
        ``[(ids, mask)]``: ``len(ids) == len(mask)``, one per conversation.

    Raises:
        ChatDataError: ``field="tokenizer"``, naming the template file and the conversation, when a rendered
            prefix is not a prefix of the whole conversation's text (the prefix method would be wrong).
    """
    if tok.generation_markers:
        return [_with_generation_markers(tok, conv) for conv in conversations]
    fulls = [_render(tok, conv, False, where) for conv, where in zip(conversations, wheres, strict=True)]
    spans = [
        _assistant_spans(tok, conv, full, where) for conv, full, where in zip(conversations, fulls, wheres, strict=True)
    ]
    enc = tok.tokenizer(fulls, add_special_tokens=False, return_offsets_mapping=True)
    out = []
    for ids, offsets, conv_spans in zip(enc["input_ids"], enc["offset_mapping"], spans, strict=True):
        starts = [s for s, _ in offsets]
        mask = [False] * len(ids)
        for a, b in conv_spans:
            first, stop = bisect.bisect_left(starts, a), bisect.bisect_left(starts, b)
            span = ids[first:stop]
            if tok.eos_id in span:
                stop = first + len(span) - span[::-1].index(tok.eos_id)
            mask[first:stop] = [True] * (stop - first)
        out.append((list(ids), mask))
    return out


def _assistant_spans(tok: ChatTokenizer, conv: list[dict], full: str, where: str) -> list[tuple[int, int]]:
    """Character spans ``[start, stop)`` of the assistant turns in ``full``, checked to be prefix-stable."""
    spans = []
    for i, m in enumerate(conv):
        if m["role"] != "assistant":
            continue
        prompt, turn = _render(tok, conv[:i], True, where), _render(tok, conv[: i + 1], False, where)
        for text, what in ((prompt, f"messages[:{i}] with the generation prompt"), (turn, f"messages[:{i + 1}]")):
            if not full.startswith(text):
                raise ChatDataError(
                    "tokenizer",
                    f"the chat template in {tok.template_file} renders {what} of {where} to text that is not a "
                    "prefix of the whole conversation's, so the assistant turns cannot be found by rendering "
                    "prefixes (templates that rewrite earlier turns, e.g. Qwen 3 dropping reasoning blocks, do "
                    "this); mark the assistant text with {% generation %}...{% endgeneration %} in the template, "
                    "or use a template without that rewrite",
                )
        spans.append((len(prompt), len(turn)))
    return spans


def _with_generation_markers(tok: ChatTokenizer, conv: list[dict]) -> tuple[list[int], list[bool]]:
    enc = tok.tokenizer.apply_chat_template(
        conv, tokenize=True, return_dict=True, return_assistant_tokens_mask=True, add_generation_prompt=False
    )
    return list(enc["input_ids"]), [bool(m) for m in enc["assistant_masks"]]
