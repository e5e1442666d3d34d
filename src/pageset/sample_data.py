"""Real photos on this machine and an ImageNet-like folder made from them (demo, tests, benchmarks).

The photos come from wheels the test extra installs (scikit-image's ``skimage/data`` and scikit-learn's
``sklearn/datasets/images``) plus, when installed, Debian's wallpaper packages (``mate-backgrounds``,
``lomiri-wallpapers-*``, ``plasma-workspace-wallpapers``: about 40 photos of 1280x1024 to 6028x3391).
The ImageNet-like set takes random crops (30-100% of the largest window of a random aspect among 4:3, 3:2,
1:1, 3:4, 5:4, 16:9, 2:3) of each photo, resizes them with LANCZOS to a long side in ``long_side`` and saves
them as JPEG with varied quality and chroma subsampling; the source photo is the class label.
"""

from __future__ import annotations

import glob
import importlib.util
import os
from pathlib import Path

import numpy as np
from PIL import Image

# Colour photographs inside the wheels (grayscale test cards, text and synthetic images are left out).
WHEEL_PHOTOS = {
    "skimage": [
        "astronaut.png",
        "chelsea.png",
        "coffee.png",
        "rocket.jpg",
        "motorcycle_left.png",
        "hubble_deep_field.jpg",
        "retina.jpg",
        "ihc.png",
        "immunohistochemistry.png",
    ],
    "sklearn": ["datasets/images/china.jpg", "datasets/images/flower.jpg"],
}
DEBIAN_GLOBS = [
    "/usr/share/backgrounds/**/*.jpg",
    "/usr/share/backgrounds/**/*.png",
    "/usr/share/wallpapers/*/contents/images/*.jpg",
    "/usr/share/wallpapers/*/contents/images/*.png",
]
ASPECTS = [(4, 3), (3, 2), (1, 1), (3, 4), (5, 4), (16, 9), (2, 3)]


def wheel_photos() -> list[str]:
    """Paths of the real colour photos shipped in the scikit-image and scikit-learn wheels (if installed)."""
    out = []
    for pkg, names in WHEEL_PHOTOS.items():
        spec = importlib.util.find_spec(pkg)
        if spec is None or not spec.submodule_search_locations:
            continue
        root = Path(list(spec.submodule_search_locations)[0])
        for name in names:
            p = root / name if "/" in name else root / "data" / name
            if p.is_file():
                out.append(str(p))
    return out


def debian_photos(min_side: int = 800) -> list[str]:
    """JPEG photos from Debian's wallpaper packages, when installed (empty list otherwise), sorted by path.

    KDE wallpapers ship one picture in many sizes (``<Name>/contents/images/<W>x<H>.jpg``): only the largest
    is kept. PNGs (mostly artwork), files whose shorter side is below ``min_side`` and files Pillow cannot
    open are left out.
    """
    found = sorted({p for g in DEBIAN_GLOBS if g.endswith(".jpg") for p in glob.glob(g, recursive=True)})
    best: dict[str, tuple[int, str]] = {}
    for p in found:
        try:
            with Image.open(p) as img:
                w, h = img.size
        except OSError:
            continue
        if min(w, h) < min_side:
            continue
        parts = Path(p).parts
        key = str(Path(*parts[:-3])) if "contents" in parts else p  # one entry per KDE wallpaper
        if key not in best or w * h > best[key][0]:
            best[key] = (w * h, p)
    return sorted(p for _, p in best.values())


def real_photos() -> list[str]:
    """All real photos available here: wheel photos first, then Debian wallpapers. Raises if none."""
    photos = wheel_photos() + debian_photos()
    if not photos:
        raise RuntimeError("no real photos found: pip install scikit-image scikit-learn (the test extra)")
    return photos


def make_imagenet_like(
    out_dir, n_images: int, long_side=(400, 500), photos=None, seed: int = 0, quality=(75, 95)
) -> Path:
    """Write an ImageFolder of ``n_images`` JPEG crops of real photos to ``out_dir`` and return it.

    Classes are the source photos (``out_dir/<photo stem>/<k>.jpg``), images are spread round-robin over
    them. ``long_side``: (lo, hi) pixels of the longer side; ``quality``: (lo, hi) JPEG quality. Existing
    files are overwritten. Deterministic for a given ``seed`` and numpy version.
    """
    photos = list(photos) if photos is not None else real_photos()
    rng = np.random.default_rng(seed)
    out = Path(out_dir)
    # Draw every crop's parameters first (so the set depends on the seed only), then open each photo once.
    plan = [(k, k % len(photos), rng.integers(0, 2**63)) for k in range(n_images)]
    for j, p in enumerate(photos):
        mine = [(k, s) for k, pj, s in plan if pj == j]
        if not mine:
            continue
        with Image.open(p) as img:
            # Decode at a reduced DCT scale when the photo is huge: a 30% crop still keeps >= 510 px.
            img.draft(
                "RGB",
                (max(1, img.size[0] * 1700 // max(img.size)), max(1, img.size[1] * 1700 // max(img.size))),
            )
            img = img.convert("RGB")
        folder = out / _photo_name(p)
        folder.mkdir(parents=True, exist_ok=True)
        for k, s in mine:
            r = np.random.default_rng(int(s))
            crop = _random_crop(img, r)
            side = int(r.integers(long_side[0], long_side[1] + 1))
            scale = side / max(crop.size)
            size = (max(1, round(crop.size[0] * scale)), max(1, round(crop.size[1] * scale)))
            crop = crop.resize(size, Image.LANCZOS)
            crop.save(
                folder / f"{k:06d}.jpg",
                quality=int(r.integers(quality[0], quality[1] + 1)),
                subsampling=int(r.choice([0, 1, 2])),
            )
    return out


def _photo_name(path: str) -> str:
    """Class name of a photo: the file stem, or the wallpaper name for KDE's ``<Name>/contents/images/*``."""
    parts = Path(path).parts
    return parts[-4] if len(parts) >= 4 and parts[-3:-1] == ("contents", "images") else Path(path).stem


def _random_crop(img: Image.Image, rng) -> Image.Image:
    w, h = img.size
    aw, ah = ASPECTS[int(rng.integers(len(ASPECTS)))]
    # largest window of that aspect inside the photo, then 30-100% of it (in side length)
    win_w, win_h = (w, round(w * ah / aw)) if w * ah / aw <= h else (round(h * aw / ah), h)
    frac = float(rng.uniform(0.3, 1.0))
    cw, ch = max(1, round(win_w * frac)), max(1, round(win_h * frac))
    x0 = int(rng.integers(0, w - cw + 1))
    y0 = int(rng.integers(0, h - ch + 1))
    return img.crop((x0, y0, x0 + cw, y0 + ch))


def file_count(root) -> int:
    """Number of files under ``root`` (recursive)."""
    return sum(len(files) for _, _, files in os.walk(root))
