"""LLaVA-format conversations as a ``write_dataset`` source: ``{"id", "image", "conversations": [{"from",
"value"}, ...]}`` entries from a JSON list (``llava_v1_5_mix665k.json``, ``LLaVA-Instruct-150K``) or JSON lines,
plus the folder the image paths are relative to, as LLaVA's own training script reads them (``--data_path`` and
``--image_folder``); or from any sequence of such entries: a Hugging Face ``datasets.Dataset`` (an ``Image``
column gives PIL images), a :class:`pageset.ParquetSource`, a :class:`pageset.WebDatasetSource` whose json member
is the entry (``entry=``).

Each entry becomes ``{conversation: ChatTokenizer(messages, images=k), images: [k images]}``: roles ``human``
-> ``user``, ``gpt`` -> ``assistant`` (``system`` kept), each ``<image>`` placeholder of the text replaced by the
ChatTokenizer's own ``image_token`` (so a Qwen2-VL tokenizer reads ``<|image_pad|>``); ``image`` is one image, a
list of them (LLaVA-OneVision's multi-image entries) or absent (a text-only entry); an image is a path (under
``image_folder`` when relative), encoded bytes, Hugging Face's image struct ``{"bytes", "path"}``, a PIL image
or a uint8 array.
"""

from __future__ import annotations

import json
import os

ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


class LlavaSource:
    """``LlavaSource(data, chat, image_folder=None)``: LLaVA-format entries as samples for
    ``write_dataset(out, LlavaSource(...), {"conversation": TokenIds(loss_mask=True), "images": RGBImages()})``.

    ``data``: a ``.json`` file (a list of entries) or ``.jsonl`` (one entry a line), or a sequence of entries
    (``__len__`` and ``__getitem__``: a list, a Hugging Face Dataset, a ParquetSource); ``chat``: a
    :class:`pageset.ChatTokenizer` made with ``image_token``; ``image_folder``: the folder relative image paths
    are under (None: paths are used as they are); ``entry``: the key a sample holds its entry under (a
    WebDataset json member: ``WebDatasetSource(urls, {"entry": "json", "image": "jpg"})`` with
    ``entry="entry"``; the sample's other keys, its image, are added to the entry); ``conversation`` /
    ``images``: the field names of the samples; ``placeholder``: the image placeholder the text uses (LLaVA's
    ``"<image>"``). A file is read once, here (FileNotFoundError, or ValueError naming the file and line for JSON
    that does not parse); an entry is checked when it is read, ValueError naming where it came from (file or
    source, index, id) and what is wrong: no ``conversations`` list, a turn without ``from``/``value`` or with an
    unknown role, an ``image`` that is no image, a placeholder count that differs from its images (from
    ChatTokenizer)."""

    def __init__(self, data, chat, image_folder=None, *, entry: str | None = None,
                 conversation: str = "conversation", images: str = "images", placeholder: str = "<image>"):
        from .chat import ChatTokenizer

        if isinstance(data, (str, os.PathLike)):
            self.where, self.entries = os.fspath(data), _read_entries(os.fspath(data))
        elif hasattr(data, "__len__") and hasattr(data, "__getitem__") and not isinstance(data, (bytes, dict)):
            self.where, self.entries = f"{type(data).__name__} of {len(data)} entries", data
        else:
            raise TypeError(f"LlavaSource.data must be a LLaVA JSON/JSONL file's path or a sequence of entries "
                            f"(a list, a datasets.Dataset, a ParquetSource), got {type(data).__name__}")
        if not isinstance(chat, ChatTokenizer):
            raise TypeError(f"LlavaSource.chat must be a pageset.ChatTokenizer, got {type(chat).__name__}")
        if chat.image_token is None:
            raise ValueError("LlavaSource.chat has no image_token: make it with ChatTokenizer(..., image_token=...) "
                             "(the model's placeholder, e.g. '<image>')")
        if image_folder is not None:
            if isinstance(image_folder, bytes) or not isinstance(image_folder, (str, os.PathLike)):
                raise TypeError(f"LlavaSource.image_folder must be a folder path (str or os.PathLike) or None, got "
                                f"{image_folder!r}")
            image_folder = os.fspath(image_folder)
            if not os.path.isdir(image_folder):
                raise FileNotFoundError(f"LlavaSource.image_folder {image_folder}: no such folder")
        for arg, value in (("conversation", conversation), ("images", images), ("placeholder", placeholder)):
            if not isinstance(value, str) or not value:
                raise TypeError(f"LlavaSource.{arg} must be a non-empty str, got {value!r}")
        if entry is not None and (not isinstance(entry, str) or not entry):
            raise TypeError(f"LlavaSource.entry must be a key (a non-empty str) or None, got {entry!r}")
        if conversation == images:
            raise ValueError(f"LlavaSource: conversation and images name the same field {images!r}")
        self.image_folder, self.chat, self.entry = image_folder, chat, entry
        self.names, self.placeholder = (conversation, images), placeholder

    def __len__(self) -> int:
        return len(self.entries)

    def __repr__(self) -> str:
        return f"LlavaSource({self.where!r}, image_folder={self.image_folder!r})"

    def __getitem__(self, i: int) -> dict:
        entry = self.entries[i]
        where = f"{self.where}: entry {i}"
        if self.entry is not None:  # the entry under one key, the image(s) under the others
            if not isinstance(entry, dict) or not isinstance(entry.get(self.entry), dict):
                raise ValueError(f"{where}: expected a sample holding the entry (a JSON object) under "
                                 f"{self.entry!r}, got {entry!r:.80}")
            entry = {**entry[self.entry], **{k: v for k, v in entry.items() if k != self.entry}}
        if not isinstance(entry, dict):
            raise ValueError(f"{where}: an entry is a JSON object with 'conversations', got {type(entry).__name__}")
        where += f" (id {entry.get('id')!r})" if "id" in entry else ""
        turns = entry.get("conversations")
        if not isinstance(turns, list) or not turns:
            raise ValueError(f"{where}: 'conversations' must be a non-empty list of {{'from', 'value'}} turns, got "
                             f"{turns!r:.80}")
        messages = []
        for k, turn in enumerate(turns):
            if not isinstance(turn, dict) or not isinstance(turn.get("value"), str) or "from" not in turn:
                raise ValueError(f"{where}: turn {k} must be {{'from': role, 'value': text}}, got {turn!r:.80}")
            role = ROLES.get(turn["from"])
            if role is None:
                raise ValueError(f"{where}: turn {k} is from {turn['from']!r}; LLaVA roles are {sorted(ROLES)}")
            messages.append({"role": role, "content": turn["value"].replace(self.placeholder, self.chat.image_token)})
        image = entry.get("image")
        items = [] if image is None else list(image) if isinstance(image, (list, tuple)) else [image]
        images = [self._image(item, where) for item in items]
        return {self.names[0]: self.chat(messages, images=len(images), where=where), self.names[1]: images}

    def _image(self, item, where: str):
        """One image of an entry as write_dataset reads it: a path (under image_folder when relative), bytes,
        a PIL image or an array; Hugging Face's image struct gives its bytes (or its path)."""
        if isinstance(item, dict) and set(item) >= {"bytes", "path"}:
            item = item["bytes"] if item["bytes"] is not None else item["path"]
        if isinstance(item, str) and item:
            return item if self.image_folder is None else os.path.join(self.image_folder, item)
        if isinstance(item, (bytes, bytearray, memoryview)) or hasattr(item, "__array_interface__"):
            return item  # encoded bytes, a PIL image or an array: decoded by the writer
        raise ValueError(f"{where}: 'image' must be an image (a path, bytes, a PIL image) or a list of them, got "
                         f"{item!r:.80}")


def _read_entries(path: str) -> list:
    """The file's entries: a JSON list (``.json``) or one JSON value a line (``.jsonl``, blank lines skipped)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"LLaVA data file {path}: no such file")
    with open(path, encoding="utf-8") as f:
        if path.endswith((".jsonl", ".ndjson")):
            out = []
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    try:
                        out.append(json.loads(line))
                    except json.JSONDecodeError as exc:
                        raise ValueError(f"{path}:{lineno}: not JSON ({exc.msg} at column {exc.colno})") from None
            return out
        try:
            data = json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{exc.lineno}: not JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(data, list):
        raise ValueError(f"{path}: a LLaVA data file is a JSON list of entries (or .jsonl, one a line), got "
                         f"{type(data).__name__}")
    return data
