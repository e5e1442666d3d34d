"""Conversations -> token ids and a per-token loss mask, the way transformers' ``apply_chat_template`` renders them.

A conversation is a list of messages ``{"role": str, "content": str}`` (the OpenAI / HF convention). The chat
template (jinja2, from ``tokenizer_config.json``'s ``chat_template`` or given as text) is compiled as transformers
compiles it: an ``ImmutableSandboxedEnvironment`` with ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols``
extension and the ``{% generation %}`` tag, the ``raise_exception`` and ``strftime_now`` globals, the ``tojson``
filter without HTML escaping, and the tokenizer's special tokens (``bos_token``, ``eos_token``, ...) as variables.
The rendered text is tokenized with ``add_special_tokens=False`` (the template writes its own special tokens).

Which tokens are trained on (mask 1) is decided by character spans of the rendered text, mapped to tokens by the
tokenizer's offsets (a token is in when its characters overlap a span, as transformers maps them):

- a template with ``{% generation %}`` blocks: the blocks' text is the assistant's (``return_assistant_tokens_mask``);
- any other role in ``train_on``, or every role of a template without those blocks: rendered message by message.
  Message ``i``'s text runs from the end of ``render(messages[:i])`` to the end of ``render(messages[:i + 1])``;
  its trained span starts where its content starts (found by rendering it once more with a marker in place of the
  content) and ends at the end of its text, trailing whitespace left out: the content and the template's
  end-of-turn text (``<|im_end|>``, ``<|eot_id|>``, ``</s>``) are trained on, the role header is not. A template
  for which ``render(messages[:i + 1])`` is not a prefix of the whole conversation (one that rewrites earlier turns)
  is refused for this rule, naming the message: add ``{% generation %}`` blocks to it.
"""

from __future__ import annotations

import contextvars
import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from datetime import datetime

import numpy as np

# The roles a message may have (OpenAI's and HF's conventions); anything else is refused naming the message.
KNOWN_ROLES = ("system", "developer", "user", "assistant", "tool")
GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
MARKER = "\ue000pageset-content\ue001"  # private-use characters: never in a template's own text

_TRACKING: contextvars.ContextVar = contextvars.ContextVar("pageset_generation_spans", default=None)


def _environment():
    """The jinja2 environment transformers renders chat templates in (utils/chat_template_utils.py)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTracker(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}``: renders its body; while a render records, notes the body's
        character span in the text rendered so far (as transformers' AssistantTracker does)."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_generation"), [], [], body).set_lineno(lineno)

        def _generation(self, caller):
            text = caller()
            tracking = _TRACKING.get()
            if tracking is not None:
                blocks, spans = tracking
                start = sum(map(len, blocks))
                spans.append((start, start + len(text)))
            return text

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationTracker, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


def _token_text(value):
    """A special token from tokenizer_config.json: a string or an AddedToken object ``{"content": ...}``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def read_tokenizer_config(path: str) -> dict:
    """``tokenizer_config.json`` as a dict; ValueError naming the file for one that is not a JSON object."""
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: not a JSON tokenizer config ({exc})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: a tokenizer config is a JSON object, got {type(config).__name__}")
    return config


@dataclass
class ChatEncoder:
    """Renders and tokenizes conversations: :meth:`encode` -> ``(int64 ids, uint8 mask)``. Picklable (the jinja2
    template is compiled on first use in each process). ``spec``: an HF :class:`~pageset.write.tokenizers.
    TokenizerSpec`; ``template``: the chat template's text; ``special_tokens``: ``{"bos_token": str, ...}``;
    ``train_on``: the roles whose tokens have mask 1; ``origin``: where the template came from (for errors)."""

    spec: object
    template: str
    special_tokens: dict
    train_on: tuple
    origin: str
    _compiled: object = field(default=None, repr=False, compare=False)

    def __getstate__(self):
        return dict(self.__dict__, _compiled=None)

    @property
    def has_generation(self) -> bool:
        return GENERATION_TAG.search(self.template) is not None

    def describe(self) -> dict:
        """The schema's ``tokens.loss_mask`` object (formats/v1.md section 10.1)."""
        return {"train_on": list(self.train_on), "rule": "generation" if self.has_generation else "messages",
                "template_sha256": hashlib.sha256(self.template.encode("utf-8")).hexdigest()}

    def _template(self):
        if self._compiled is None:
            import jinja2

            try:
                self._compiled = _environment().from_string(self.template)
            except jinja2.TemplateSyntaxError as exc:
                raise ValueError(f"the chat template ({self.origin}) does not compile: line {exc.lineno}: "
                                 f"{exc.message}; fix the template or pass chat_template=") from None
        return self._compiled

    def render(self, messages: list, where: str) -> tuple[str, list]:
        """``(text, generation spans)`` of ``messages``; ValueError naming ``where`` when the template fails."""
        blocks, spans = [], []
        token = _TRACKING.set((blocks, spans))
        try:
            for block in self._template().generate(messages=messages, tools=None, documents=None,
                                                   add_generation_prompt=False, **self.special_tokens):
                blocks.append(block)
        except ValueError:
            raise
        except Exception as exc:  # jinja2's TemplateError, raise_exception(...), a TypeError inside the template
            raise ValueError(f"{where}: the chat template ({self.origin}) failed to render the conversation: "
                             f"{type(exc).__name__}: {exc}; fix the conversation or the template") from None
        finally:
            _TRACKING.reset(token)
        return "".join(blocks), spans

    def encode(self, messages, where: str) -> tuple[np.ndarray, np.ndarray]:
        """``(int64[n] ids, uint8[n] mask)`` of one conversation; ValueError / TypeError naming ``where`` (file and
        line or row), the message index and field for a bad message, a failed render or a template the
        message-by-message rule cannot follow."""
        messages = check_messages(messages, where)
        text, gen_spans = self.render(messages, where)
        spans = list(gen_spans) if self.has_generation and "assistant" in self.train_on else []
        by_message = [r for r in self.train_on if not (self.has_generation and r == "assistant")]
        if any(m["role"] in by_message for m in messages):
            spans += self._message_spans(messages, text, set(by_message), where)
        spans.sort()
        enc = self.spec.obj.encode(text, add_special_tokens=False)
        ids = np.asarray(enc.ids, dtype=np.int64)
        return ids, _overlap_mask(enc.offsets, spans)

    def _message_spans(self, messages: list, text: str, roles: set, where: str) -> list:
        try:
            before = self.render([], where)[0]
        except ValueError:  # a template that needs a message; the first message's text then starts at 0
            before = ""
        spans = []
        for i, m in enumerate(messages):
            upto = self.render(messages[: i + 1], where)[0] if i + 1 < len(messages) else text
            if m["role"] in roles:
                problem = None
                if not (text.startswith(upto) and upto.startswith(before)):
                    problem = (f"rendering messages[:{i + 1}] does not give the start of the whole conversation "
                               "(the template rewrites earlier turns)")
                else:
                    marked = self.render(messages[:i] + [dict(m, content=MARKER)], where)[0]
                    at = marked.find(MARKER)
                    content = m["content"]
                    if at < len(before) or marked[:at] != upto[:at] or upto[at : at + len(content)] != content:
                        problem = "its content is not rendered verbatim where the template puts it"
                if problem:
                    raise ValueError(f"{where}: messages[{i}] ({m['role']}): {problem}, so its tokens cannot be "
                                     f"found message by message; mark the trained text with {{% generation %}} ... "
                                     "{% endgeneration %} in the chat template, or leave this role out of train_on")
                end = max(at + len(content), len(upto.rstrip()))
                spans.append((at, end))
            before = upto
        return spans


def _overlap_mask(offsets, spans) -> np.ndarray:
    """uint8 per token: 1 where the token's characters overlap a span (spans sorted; one pass, as transformers)."""
    mask = np.zeros(len(offsets), dtype=np.uint8)
    k = 0
    for t, (start, end) in enumerate(offsets):
        while k < len(spans) and start >= spans[k][1]:
            k += 1
        if k == len(spans):
            break
        if end > spans[k][0]:
            mask[t] = 1
    return mask


def check_messages(messages, where: str) -> list:
    """The conversation as a list of plain dicts; TypeError / ValueError naming ``where``, the message and field."""
    if isinstance(messages, dict) or not isinstance(messages, (list, tuple)):
        raise TypeError(f"{where}: a conversation is a list of messages {{'role': ..., 'content': ...}}, got "
                        f"{type(messages).__name__} {messages!r:.60}")
    if not messages:
        raise ValueError(f"{where}: the conversation has no messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise TypeError(f"{where}: messages[{i}] is {type(m).__name__} {m!r:.40}, not a dict with 'role' and "
                            "'content'")
        role, content = m.get("role"), m.get("content")
        if role not in KNOWN_ROLES:
            raise ValueError(f"{where}: messages[{i}].role is {role!r}, not one of {list(KNOWN_ROLES)}; fix the "
                             "role")
        if not isinstance(content, str):
            raise ValueError(f"{where}: messages[{i}].content holds {type(content).__name__} {content!r:.40}, not "
                             "a string")
        out.append({k: v for k, v in m.items() if v is not None})  # transformers drops None-valued keys
    return out


def check_train_on(train_on) -> tuple:
    """``train_on`` as a tuple of known roles; TypeError / ValueError naming the argument."""
    if isinstance(train_on, str):
        train_on = (train_on,)
    if not isinstance(train_on, (list, tuple)) or not train_on:
        raise TypeError(f"train_on must be a non-empty tuple of roles, e.g. ('assistant',), got {train_on!r}")
    bad = [r for r in train_on if r not in KNOWN_ROLES]
    if bad:
        raise ValueError(f"train_on: {bad} are not roles; the roles are {list(KNOWN_ROLES)}")
    return tuple(dict.fromkeys(train_on))


def chat_encoder(spec, tokenizer, chat_template, train_on) -> ChatEncoder:
    """The :class:`ChatEncoder` of an HF tokenizer ``spec`` (loaded from ``tokenizer``, a path or an object).

    ``chat_template``: template text, a path to a ``.jinja`` file or to a ``tokenizer_config.json``, or ``None``:
    the ``chat_template`` of the ``tokenizer_config.json`` beside a ``tokenizer.json`` path. The special-token
    variables come from that config when there is one. Raises TypeError (not an HF tokenizer), ValueError (no
    template found, naming where it was looked for), FileNotFoundError.
    """
    if getattr(spec, "kind", None) != "hf":
        raise TypeError(f"chat sources need an HF tokenizer (a tokenizer.json path or a tokenizers.Tokenizer): its "
                        f"offsets map the template's text to tokens; got a {getattr(spec, 'kind', type(spec))} one")
    beside = None
    if isinstance(tokenizer, (str, os.PathLike)):
        beside = os.path.join(os.path.dirname(os.fspath(tokenizer)) or ".", "tokenizer_config.json")
    config, origin = {}, "chat_template="
    if isinstance(chat_template, (str, os.PathLike)) and os.path.isfile(chat_template):
        path = os.fspath(chat_template)
        if path.endswith(".json"):
            config, origin = read_tokenizer_config(path), path
            chat_template = config.get("chat_template")
        else:
            with open(path, encoding="utf-8") as f:
                chat_template, origin = f.read(), path
    elif chat_template is None:
        if beside is None or not os.path.isfile(beside):
            raise ValueError("no chat template: pass chat_template= (the template text, a .jinja file or a "
                             f"tokenizer_config.json){'' if beside is None else f'; {beside} does not exist'}")
        config, origin = read_tokenizer_config(beside), beside
        chat_template = config.get("chat_template")
    if not config and beside is not None and os.path.isfile(beside):
        config = read_tokenizer_config(beside)
    if isinstance(chat_template, list):  # [{"name": "default", "template": ...}, ...] (named templates)
        named = {t.get("name"): t.get("template") for t in chat_template if isinstance(t, dict)}
        chat_template = named.get("default")
    if not isinstance(chat_template, str) or not chat_template:
        raise ValueError(f"{origin}: no chat_template in it (a string); pass chat_template= (the template text "
                         "or a .jinja file)")
    special = {k: _token_text(config.get(k)) for k in SPECIAL_TOKEN_KEYS}
    return ChatEncoder(spec, chat_template, {k: v for k, v in special.items() if v is not None},
                       check_train_on(train_on), origin)
