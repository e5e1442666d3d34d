"""LLaVA-format conversations as a ``write_dataset`` source: a JSON list (``llava_v1_5_mix665k.json``,
``LLaVA-Instruct-150K``) or JSON lines of ``{"id", "image", "conversations": [{"from", "value"}, ...]}`` plus the
folder the image paths are relative to, as LLaVA's own training script reads them (``--data_path`` and
``--image_folder``).

Each entry becomes ``{conversation: ChatTokenizer(messages, images=k), images: [k image paths]}``: roles ``human``
-> ``user``, ``gpt`` -> ``assistant`` (``system`` kept), each ``<image>`` placeholder of the text replaced by the
ChatTokenizer's own ``image_token`` (so a Qwen2-VL tokenizer reads ``<|image_pad|>``); ``image`` is one path, a
list of paths (LLaVA-OneVision's multi-image entries) or absent (a text-only entry: no image).
"""

from __future__ import annotations

import json
import os

ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


class LlavaSource:
    """``LlavaSource(path, image_folder, chat)``: the entries of a LLaVA-format file as samples for
    ``write_dataset(out, LlavaSource(...), {"conversation": TokenIds(loss_mask=True), "images": RGBImages()})``.

    ``path``: a ``.json`` file (a list of entries) or ``.jsonl`` (one entry a line); ``image_folder``: the folder
    the entries' image paths are relative to (absolute paths are kept); ``chat``: a :class:`pageset.ChatTokenizer`
    made with ``image_token``; ``conversation`` / ``images``: the field names of the samples; ``placeholder``: the
    image placeholder the file's text uses (LLaVA's ``"<image>"``). The file is read once, here (FileNotFoundError,
    or ValueError naming the file and line for JSON that does not parse); an entry is checked when it is read,
    ValueError naming the file, the entry (index and id) and what is wrong: no ``conversations`` list, a turn
    without ``from``/``value`` or with an unknown role, an ``image`` that is not a path or a list of paths, a
    placeholder count that differs from its images (from ChatTokenizer)."""

    def __init__(self, path, image_folder, chat, conversation: str = "conversation", images: str = "images",
                 placeholder: str = "<image>"):
        from .chat import ChatTokenizer

        if isinstance(path, bytes) or not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"LlavaSource.path must be the LLaVA JSON file's path (str or os.PathLike), got {path!r}")
        if isinstance(image_folder, bytes) or not isinstance(image_folder, (str, os.PathLike)):
            raise TypeError(f"LlavaSource.image_folder must be a folder path (str or os.PathLike), got "
                            f"{image_folder!r}")
        if not isinstance(chat, ChatTokenizer):
            raise TypeError(f"LlavaSource.chat must be a pageset.ChatTokenizer, got {type(chat).__name__}")
        if chat.image_token is None:
            raise ValueError("LlavaSource.chat has no image_token: make it with ChatTokenizer(..., image_token=...) "
                             "(the model's placeholder, e.g. '<image>')")
        for arg, value in (("conversation", conversation), ("images", images), ("placeholder", placeholder)):
            if not isinstance(value, str) or not value:
                raise TypeError(f"LlavaSource.{arg} must be a non-empty str, got {value!r}")
        if conversation == images:
            raise ValueError(f"LlavaSource: conversation and images name the same field {images!r}")
        self.path, self.image_folder = os.fspath(path), os.fspath(image_folder)
        self.chat, self.names, self.placeholder = chat, (conversation, images), placeholder
        if not os.path.isdir(self.image_folder):
            raise FileNotFoundError(f"LlavaSource.image_folder {self.image_folder}: no such folder")
        self.entries = _read_entries(self.path)

    def __len__(self) -> int:
        return len(self.entries)

    def __repr__(self) -> str:
        return f"LlavaSource({self.path!r}, {self.image_folder!r})"

    def __getitem__(self, i: int) -> dict:
        entry = self.entries[i]
        where = f"{self.path}: entry {i}"
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
        paths = [] if image is None else [image] if isinstance(image, str) else image
        if not isinstance(paths, list) or not all(isinstance(p, str) and p for p in paths):
            raise ValueError(f"{where}: 'image' must be a path or a list of paths, got {image!r:.80}")
        paths = [os.path.join(self.image_folder, p) for p in paths]
        return {self.names[0]: self.chat(messages, images=len(paths), where=where), self.names[1]: paths}


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
