"""Conversations -> token ids and a per-token loss mask, the way transformers' ``apply_chat_template`` renders them.

A conversation is a list of messages ``{"role": str, "content": str or list of parts}`` (the OpenAI / HF
convention; parts ``{"type": "text", "text": ...}`` / ``{"type": "image"}`` for multimodal templates); an assistant
message with ``tool_calls`` may have ``content`` ``None`` or leave it out. As transformers does, keys whose value is
``None`` are dropped and a ``reasoning`` / ``thinking`` / ``reasoning_content`` field is passed under the names
templates read. The chat template (jinja2, from ``tokenizer_config.json``'s ``chat_template`` or given as text) is
compiled as transformers compiles it: an ``ImmutableSandboxedEnvironment`` with ``trim_blocks`` and
``lstrip_blocks``, the ``loopcontrols`` extension and the ``{% generation %}`` tag, the ``raise_exception`` and
``strftime_now`` globals, the ``tojson`` filter without HTML escaping, and the tokenizer's special tokens
(``bos_token``, ``eos_token``, ...) as variables. The rendered text is tokenized with ``add_special_tokens=False``
(the template writes its own special tokens).

Which tokens are trained on (mask 1) is decided by character spans of the rendered text ``R`` of the whole
conversation, mapped to tokens by the tokenizer's offsets (a token is in when its characters overlap a span, as
transformers maps them):

- a template with ``{% generation %}`` blocks: the blocks' text is the assistant's (``return_assistant_tokens_mask``);
- any other role in ``train_on``, or every role of a template without those blocks (the *message rule*): message
  ``i``'s span runs from where its content starts in ``R`` to the end of its turn, trailing whitespace left out:
  the content as the template renders it (trimmed, for the many templates that ``trim`` it), then what the
  template writes after it in that turn (tool calls, the end-of-turn text ``<|eot_id|>``, ``<|im_end|>``,
  ``</s>``); the role header (and anything else the template writes before the content) is not trained on.
  Found with a marker put in place of the content (never in a template's own text): ``L`` is ``messages[:i + 1]``
  rendered (the message last) and ``b`` where its content starts in ``L``: the marker's place in ``L'`` (the same
  messages, the marker as message ``i``'s content), where ``L'`` and ``L`` agree on everything before it; the
  content as rendered is ``L[b:]`` up to the text ``L`` and ``L'`` end with alike, and the turn is ``L[b:]``
  stripped of trailing whitespace. The span starts at ``b`` when ``R`` starts with ``L[:b]`` and holds the turn
  there; else (a template that renders earlier turns otherwise once later ones follow, as Qwen3's drop a turn's
  ``<think>`` block) at the marker's place in ``R'`` (the whole conversation with the marker), which must agree
  with ``R`` before it and hold the turn after it. An assistant message whose content the template does not
  render (Llama 3.1's tool calls) starts after ``messages[:i]`` rendered with ``add_generation_prompt=True``.
  Only the prefixes ``messages[:i + 1]`` of trained messages are rendered (never one no trained message needs:
  Qwen3.5's template refuses ``[system]`` alone). A message is refused for the rule, naming it and why, when its
  content is not rendered (or rendered twice), when the text before the content depends on the content (a
  template that moves a ``<think>`` block out of it), when the template refuses ``messages[:i + 1]``, or when
  ``R`` does not hold the turn (a template that rewrites earlier turns, or writes text after the last message
  only, as Phi-3's ``eos_token``): mark the trained text with ``{% generation %}`` blocks then. The last
  message's turn runs to the end of ``R``.
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
# The names a message's reasoning goes under (transformers passes it under all three; the first is the one most
# templates read).
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
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
        try:
            return self._render(messages)
        except Exception as exc:  # jinja2's TemplateError, raise_exception(...), a TypeError inside the template
            raise ValueError(f"{where}: the chat template ({self.origin}) failed to render the conversation: "
                             f"{type(exc).__name__}: {exc}; fix the conversation or the template") from None

    def _render(self, messages: list, add_generation_prompt: bool = False) -> tuple[str, list]:
        blocks, spans = [], []
        token = _TRACKING.set((blocks, spans))
        try:
            for block in self._template().generate(messages=messages, tools=None, documents=None,
                                                   add_generation_prompt=add_generation_prompt,
                                                   **self.special_tokens):
                blocks.append(block)
        finally:
            _TRACKING.reset(token)
        return "".join(blocks), spans

    def _rule_render(self, messages: list, what: str, add_generation_prompt: bool = False) -> str:
        """A rendering the message rule needs; :class:`_Refused` naming ``what`` when the template fails on it."""
        try:
            return self._render(messages, add_generation_prompt)[0]
        except Exception as exc:  # the template's raise_exception(...) or an error inside it
            raise _Refused(f"the template refuses {what} ({type(exc).__name__}: {exc})") from None

    def encode(self, messages, where: str) -> tuple[np.ndarray, np.ndarray]:
        """``(int64[n] ids, uint8[n] mask)`` of one conversation; ValueError / TypeError naming ``where`` (file and
        line or row), the message index and field for a bad message, a failed render or a message the message
        rule cannot follow (see the module docstring)."""
        messages = check_messages(messages, where)
        text, gen_spans = self.render(messages, where)
        spans = list(gen_spans) if self.has_generation and "assistant" in self.train_on else []
        for i, m in enumerate(messages):
            if m["role"] in self.train_on and not (self.has_generation and m["role"] == "assistant"):
                try:
                    span, problem = self._message_span(messages, i, text)
                except _Refused as exc:
                    span, problem = None, str(exc)
                if problem:
                    raise ValueError(f"{where}: messages[{i}] ({m['role']}): {problem}, so its tokens cannot be "
                                     "found message by message; mark the trained text with {% generation %} ... "
                                     "{% endgeneration %} in the chat template, or leave this role out of train_on")
                spans.append(span)
        spans.sort()
        enc = self.spec.obj.encode(text, add_special_tokens=False)
        ids = np.asarray(enc.ids, dtype=np.int64)
        return ids, _overlap_mask(enc.offsets, spans)

    def _message_span(self, messages: list, i: int, text: str) -> tuple[tuple | None, str | None]:
        """The message rule (module docstring) for ``messages[i]`` in ``text`` (the whole conversation rendered):
        ``((start, end), None)``, or ``(None, why not)``. Renders ``messages[:i + 1]`` and the same with the marker;
        the whole conversation with the marker only when it does not start with ``messages[:i + 1]``'s text."""
        # a multimodal message's parts give way to one text part (a trained message with image parts is then
        # refused: the text before its content changes; mark its text with {% generation %} instead)
        parts = isinstance(messages[i].get("content"), list)
        marked = dict(messages[i], content=[{"type": "text", "text": MARKER}] if parts else MARKER)
        last = i + 1 == len(messages)
        alone = text if last else self._rule_render(messages[: i + 1], f"messages[:{i + 1}] on its own")
        alone_marked = self._rule_render(messages[:i] + [marked], f"messages[:{i + 1}] with a placeholder content")
        b, why = _content_start(alone_marked, alone)
        prompted = False
        if why == NOT_RENDERED and messages[i]["role"] == "assistant" and i > 0:
            # a message whose content the template leaves out (a tool call): its turn starts after the header
            # the template writes as its generation prompt
            prompt = self._rule_render(messages[:i], f"messages[:{i}] with add_generation_prompt=True", True)
            if alone.startswith(prompt):
                b, why, prompted = len(prompt), None, True
        if why is not None:
            return None, why
        content = len(alone) - b - min(_common_suffix(alone, alone_marked), len(alone) - b)  # as rendered
        turn = alone[b:].rstrip()
        if text[:b] == alone[:b] and text[b : b + len(turn)] == turn:
            at = b  # the whole conversation renders the same up to the end of the turn
        elif prompted:
            at = None
        else:  # the content's place in the whole conversation, which renders earlier turns otherwise
            whole = self._rule_render(messages[:i] + [marked] + messages[i + 1 :],
                                      "the conversation with a placeholder content")
            at, why = _content_start(whole, text)
            if why is not None:
                return None, why
        if at is None or text[at : at + len(turn)] != turn:
            return None, (f"rendering messages[:{i + 1}] does not give its turn as the whole conversation renders "
                          "it (the template rewrites earlier turns, or writes text after the last message only)")
        return (at, at + max(content, len(turn))), None


NOT_RENDERED = "the template does not render its content"


class _Refused(Exception):
    """The template fails on a rendering the message rule needs (a prefix, or the placeholder content)."""


def _content_start(marked: str, text: str) -> tuple[int | None, str | None]:
    """Where a message's content starts in ``text``: the marker's place in ``marked`` (the same messages rendered
    with the marker as its content), when the two renderings agree on everything before it. ``(start, None)``, or
    ``(None, why not)``."""
    at = marked.find(MARKER)
    if at < 0:
        return None, NOT_RENDERED
    if marked.find(MARKER, at + 1) >= 0:
        return None, "the template renders its content more than once"
    if marked[:at] != text[:at]:
        return None, "the template's text before its content depends on the content"
    return at, None


def _common_suffix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    k = 0
    while k < n and a[-1 - k] == b[-1 - k]:
        k += 1
    return k


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
    """The conversation as a list of plain dicts, as transformers passes it to the template: keys whose value is
    ``None`` dropped, a ``reasoning_content`` / ``thinking`` / ``reasoning`` field under all three names. A
    message's ``content`` is a string, a list of parts (``{"type": "text", "text": ...}``, ``{"type":
    "image"}``, ...: what multimodal templates such as Qwen2-VL's iterate over), or ``None`` / absent in a message
    with ``tool_calls`` (the OpenAI convention). TypeError / ValueError naming ``where``, the message and field."""
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
        if content is None and not m.get("tool_calls"):
            raise ValueError(f"{where}: messages[{i}].content is missing or None, which only a message with "
                             "tool_calls may leave out; give it a string")
        if isinstance(content, (list, tuple)):  # a multimodal message: its parts, as HF templates take them
            for k, part in enumerate(content):
                if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                    raise ValueError(f"{where}: messages[{i}].content[{k}] is {part!r:.40}, not a part "
                                     "{'type': 'text', 'text': ...} or {'type': 'image'}")
                if part["type"] == "text" and not isinstance(part.get("text"), str):
                    raise ValueError(f"{where}: messages[{i}].content[{k}] is a text part without a 'text' string")
        elif content is not None and not isinstance(content, str):
            raise ValueError(f"{where}: messages[{i}].content holds {type(content).__name__} {content!r:.40}, not "
                             "a string or a list of parts")
        m = {k: v for k, v in m.items() if v is not None}  # transformers drops None-valued keys
        if isinstance(content, (list, tuple)):  # the parts copied: the caller's messages are never changed
            m["content"] = [dict(part) for part in content]
        reasoning = next((m[k] for k in REASONING_FIELDS if k in m), None)
        if reasoning is not None:  # as transformers' _alias_reasoning_fields
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
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
    encoder = ChatEncoder(spec, chat_template, {k: v for k, v in special.items() if v is not None},
                          check_train_on(train_on), origin)
    encoder._template()  # a template that does not compile fails here, before any conversation is read
    return encoder


class ChatTokenizer:
    """Conversations as a ``TokenIds(loss_mask=True)`` value: ``tok(messages)`` -> ``{"input_ids": int64[n],
    "loss_mask": uint8[n]}``, rendered with the chat template and masked by the rules of this module (the same
    ids and mask as :func:`pageset.write_tokens` writes for a chat source, and as transformers'
    ``apply_chat_template(..., return_assistant_tokens_mask=True)`` gives for a ``{% generation %}`` template).

    ``tokenizer``: an HF tokenizer (a ``tokenizer.json`` path or a ``tokenizers.Tokenizer``); ``chat_template``:
    the template text, a ``.jinja`` file or a ``tokenizer_config.json`` (None: the config beside the tokenizer
    file); ``train_on``: the roles whose tokens have mask 1. ``image_token``: the text of a vision-language
    model's image placeholder (LLaVA's ``"<image>"``, Qwen2-VL's ``"<|image_pad|>"``), which must be one token
    of the tokenizer (an added token); then ``tok(messages, images=k)`` checks that the conversation holds
    exactly ``k`` placeholders, and ``image_token_id`` is its id (give it to :class:`pageset.ExpandImageTokens`).
    Raises TypeError / ValueError naming ``where`` (default ``"conversation"``), the message and the fix."""

    def __init__(self, tokenizer, chat_template=None, train_on=("assistant",), image_token: str | None = None):
        from .tokenizers import load_tokenizer

        spec = load_tokenizer(tokenizer)
        self._encoder = chat_encoder(spec, tokenizer, chat_template, train_on)
        self.image_token, self.image_token_id = image_token, None
        if image_token is not None:
            if not isinstance(image_token, str) or not image_token:
                raise TypeError(f"image_token is the placeholder's text (a str), got {image_token!r}")
            ids = spec.obj.encode(image_token, add_special_tokens=False).ids
            if len(ids) != 1:
                raise ValueError(f"image_token {image_token!r} is {len(ids)} tokens of this tokenizer, not one; add "
                                 "it as a special token (tokenizer.add_special_tokens([...])) or use the model's own")
            self.image_token_id = int(ids[0])

    def __call__(self, messages, images: int | None = None, where: str = "conversation") -> dict:
        ids, mask = self._encoder.encode(messages, where)
        if images is not None:
            if self.image_token_id is None:
                raise ValueError(f"{where}: images={images} given, but this ChatTokenizer has no image_token; pass "
                                 "image_token='<image>' (the model's placeholder)")
            found = int((ids == self.image_token_id).sum())
            if found != images:
                raise ValueError(f"{where}: {found} image placeholders {self.image_token!r} in the conversation but "
                                 f"{images} images; put one placeholder per image in the messages")
        return {"input_ids": ids, "loss_mask": mask}
