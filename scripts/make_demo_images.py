#!/usr/bin/env python3
"""Writes a deterministic synthetic image-classification set for demos, tests and benchmarks; nothing is downloaded.

    scripts/make_demo_images.py --out data/demo/images --classes 5 --per-class 40 --validation-per-class 8

Each class is a shape in a colour on a textured background (circle-red, square-green, triangle-blue, stripes-
yellow, ...; any number of classes, shapes x colours), drawn at a random position, scale and rotation on an odd-
sized canvas. The files are a mix of what real photo folders hold: mostly RGB JPEG, then PNG, and a few of each
awkward kind a decoder must convert to RGB as Pillow does: grayscale (JPEG and PNG), palette PNG, RGBA PNG,
grayscale+alpha PNG, CMYK JPEG and JPEGs with an EXIF orientation tag (rotated pixels that the tag turns back).

Layout (both at once, so either form of `data.train_files` can be tried):
    OUT/train/<class>/<class>-0007.jpg ...       ImageFolder: one subfolder per class, classes sorted by name
    OUT/validation/<class>/...
    OUT/train.jsonl, OUT/validation.jsonl        {"image": "train/<class>/<file>", "label": "<class>"}
                                                 (paths relative to the JSONL file)
    OUT/train-captions.jsonl, OUT/validation-captions.jsonl
        image-caption pairs for CLIP (training.objective=contrastive), in the same order:
        {"image": "...", "caption": "a photo of a large red circle on the left", "label": "red circle"}
        (the caption names the size and side the shape was drawn at; the label is the class in words, for
        zero-shot evaluation with evaluation.class_prompts)
The same --seed gives byte-identical files for a given Pillow/libjpeg; each image depends only on (seed, split,
class, index), so a larger set extends a smaller one.
"""
import argparse
import json
import math
import os
import random
import sys

try:
    from PIL import Image, ImageDraw
except ImportError:  # pragma: no cover - the hint is the point
    sys.exit("make_demo_images.py needs Pillow: .venv/bin/python -m pip install pillow")

SHAPES = ["circle", "square", "triangle", "stripes", "checker", "ring", "cross", "dots", "diamond", "star"]
COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220), "yellow": (235, 210, 40),
           "purple": (140, 50, 190), "orange": (245, 140, 30), "cyan": (40, 200, 210), "pink": (240, 120, 180),
           "brown": (130, 80, 40), "white": (245, 245, 245)}
COLOUR_NAMES = list(COLOURS)

# File kinds and their share of the set (the rest is RGB JPEG). Each tuple: (kind, one in how many images).
SPECIAL_KINDS = [("png", 5), ("gray-jpeg", 17), ("gray-png", 19), ("palette-png", 13), ("rgba-png", 11),
                 ("la-png", 29), ("cmyk-jpeg", 23), ("exif-jpeg", 7)]


def class_names(count):
    """Shape i with colour i, then shape i with colour i+1, ...: distinct shapes first, sorted at the end."""
    names = []
    shift = 0
    while len(names) < count:
        for i, shape in enumerate(SHAPES):
            if len(names) == count:
                break
            names.append(f"{shape}-{COLOUR_NAMES[(i + shift) % len(COLOUR_NAMES)]}")
        shift += 1
        if shift > len(COLOUR_NAMES):
            sys.exit(f"at most {len(SHAPES) * len(COLOUR_NAMES)} classes")
    return sorted(names)


def jitter(rng, colour, amount=30):
    return tuple(max(0, min(255, c + rng.randint(-amount, amount))) for c in colour)


def background(rng, width, height):
    """A soft gradient with noise speckles: texture for the resampler and the JPEG encoder to work on."""
    top = tuple(rng.randint(60, 200) for _ in range(3))
    bottom = tuple(rng.randint(60, 200) for _ in range(3))
    image = Image.new("RGB", (width, height))
    draw = ImageDraw.Draw(image)
    for y in range(height):
        t = y / max(1, height - 1)
        draw.line([(0, y), (width, y)], fill=tuple(int(a + (b - a) * t) for a, b in zip(top, bottom)))
    for _ in range(width * height // 40):
        x, y = rng.randrange(width), rng.randrange(height)
        draw.point((x, y), fill=tuple(rng.randint(0, 255) for _ in range(3)))
    return image


def polygon(cx, cy, radius, corners, angle, inner=None):
    points = []
    steps = corners * (2 if inner else 1)
    for k in range(steps):
        r = radius if inner is None or k % 2 == 0 else inner
        a = angle + 2 * math.pi * k / steps
        points.append((cx + r * math.cos(a), cy + r * math.sin(a)))
    return points


def draw_shape(rng, image, shape, colour):
    width, height = image.size
    draw = ImageDraw.Draw(image)
    side = min(width, height)
    radius = side * rng.uniform(0.22, 0.42)
    cx = rng.uniform(radius, width - radius)
    cy = rng.uniform(radius, height - radius)
    angle = rng.uniform(0, 2 * math.pi)
    fill = jitter(rng, colour)
    box = [cx - radius, cy - radius, cx + radius, cy + radius]
    if shape == "circle":
        draw.ellipse(box, fill=fill)
    elif shape == "square":
        draw.polygon(polygon(cx, cy, radius, 4, angle), fill=fill)
    elif shape == "triangle":
        draw.polygon(polygon(cx, cy, radius, 3, angle), fill=fill)
    elif shape == "diamond":
        draw.polygon([(cx, cy - radius), (cx + radius * 0.6, cy), (cx, cy + radius), (cx - radius * 0.6, cy)],
                     fill=fill)
    elif shape == "star":
        draw.polygon(polygon(cx, cy, radius, 5, angle, inner=radius * 0.45), fill=fill)
    elif shape == "ring":
        draw.ellipse(box, outline=fill, width=max(2, int(radius * 0.3)))
    elif shape == "cross":
        arm = radius * 0.3
        draw.rectangle([cx - radius, cy - arm, cx + radius, cy + arm], fill=fill)
        draw.rectangle([cx - arm, cy - radius, cx + arm, cy + radius], fill=fill)
    elif shape == "stripes":
        period = max(4, int(side * rng.uniform(0.08, 0.16)))
        for x in range(-height, width + height, period):
            draw.line([(x, 0), (x + height, height)], fill=fill, width=max(1, period // 2))
    elif shape == "checker":
        cell = max(3, int(side * rng.uniform(0.08, 0.15)))
        for y in range(0, height, cell):
            for x in range(0, width, cell):
                if (x // cell + y // cell) % 2 == 0:
                    draw.rectangle([x, y, x + cell - 1, y + cell - 1], fill=fill)
    elif shape == "dots":
        dot = max(2, int(side * 0.05))
        for _ in range(rng.randint(8, 20)):
            x, y = rng.uniform(0, width), rng.uniform(0, height)
            draw.ellipse([x - dot, y - dot, x + dot, y + dot], fill=fill)
    else:
        raise ValueError(shape)
    return cx / width, radius / side


def pick_kind(rng):
    for kind, one_in in SPECIAL_KINDS:
        if rng.randrange(one_in) == 0:
            return kind
    return "jpeg"


def save(image, rng, kind, stem):
    """Saves image as kind; returns the file name written."""
    if kind == "jpeg":
        image.save(stem + ".jpg", quality=rng.randint(75, 95))
        return stem + ".jpg"
    if kind == "png":
        image.save(stem + ".png")
        return stem + ".png"
    if kind == "gray-jpeg":
        image.convert("L").save(stem + ".jpg", quality=90)
        return stem + ".jpg"
    if kind == "gray-png":
        image.convert("L").save(stem + ".png")
        return stem + ".png"
    if kind == "palette-png":
        image.convert("P", palette=Image.Palette.ADAPTIVE, colors=64).save(stem + ".png")
        return stem + ".png"
    if kind in ("rgba-png", "la-png"):
        alpha = Image.new("L", image.size, 255)
        draw = ImageDraw.Draw(alpha)
        w, h = image.size
        draw.rectangle([0, 0, w // 6, h - 1], fill=0)          # a transparent margin
        draw.rectangle([w - w // 8, 0, w - 1, h - 1], fill=128)  # and a half-transparent one
        out = image.convert("RGBA" if kind == "rgba-png" else "LA")
        out.putalpha(alpha)
        out.save(stem + ".png")
        return stem + ".png"
    if kind == "cmyk-jpeg":
        image.convert("CMYK").save(stem + ".jpg", quality=90)
        return stem + ".jpg"
    if kind == "exif-jpeg":
        # Store the pixels transformed and let the orientation tag undo it, as cameras do.
        orientation = rng.choice([2, 3, 4, 5, 6, 7, 8])
        inverse = {2: Image.Transpose.FLIP_LEFT_RIGHT, 3: Image.Transpose.ROTATE_180,
                   4: Image.Transpose.FLIP_TOP_BOTTOM, 5: Image.Transpose.TRANSPOSE,
                   6: Image.Transpose.ROTATE_90, 7: Image.Transpose.TRANSVERSE,
                   8: Image.Transpose.ROTATE_270}[orientation]
        exif = Image.Exif()
        exif[0x0112] = orientation
        image.transpose(inverse).save(stem + ".jpg", quality=90, exif=exif)
        return stem + ".jpg"
    raise ValueError(kind)


def make_image(seed, split, class_index, index, name, min_size, max_size):
    rng = random.Random(f"{seed}/{split}/{name}/{index}")
    width = rng.randint(min_size, max_size) | 1   # odd sizes: resampling edge cases
    height = rng.randint(min_size, max_size) | 1
    image = background(rng, width, height)
    shape, colour = name.split("-", 1)
    where, scale = draw_shape(rng, image, shape, COLOURS[colour])
    side = "on the left" if where < 1 / 3 else "in the middle" if where < 2 / 3 else "on the right"
    caption = f"a photo of a {'small' if scale < 0.32 else 'large'} {colour} {shape} {side}"
    return image, rng, caption


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="output directory (created)")
    parser.add_argument("--classes", type=int, default=5)
    parser.add_argument("--per-class", type=int, default=40, help="training images per class")
    parser.add_argument("--validation-per-class", type=int, default=8)
    parser.add_argument("--min-size", type=int, default=40)
    parser.add_argument("--max-size", type=int, default=160)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--jpeg-only", action="store_true", help="RGB JPEG only (for loader benchmarks)")
    args = parser.parse_args()
    if args.classes < 1 or args.min_size < 1 or args.max_size < args.min_size:
        parser.error("need --classes >= 1 and 1 <= --min-size <= --max-size")

    names = class_names(args.classes)
    kinds_written = {}
    for split, per_class in (("train", args.per_class), ("validation", args.validation_per_class)):
        records = []
        for class_index, name in enumerate(names):
            folder = os.path.join(args.out, split, name)
            os.makedirs(folder, exist_ok=True)
            for index in range(per_class):
                image, rng, caption = make_image(args.seed, split, class_index, index, name, args.min_size, args.max_size)
                kind = "jpeg" if args.jpeg_only else pick_kind(rng)
                kinds_written[kind] = kinds_written.get(kind, 0) + 1
                file = save(image, rng, kind, os.path.join(folder, f"{name}-{index:04d}"))
                records.append({"image": os.path.relpath(file, args.out), "label": name, "caption": caption})
        # Interleave classes in the JSONL (an ImageFolder is read class by class; a JSONL need not be).
        random.Random(f"{args.seed}/{split}/order").shuffle(records)
        with open(os.path.join(args.out, f"{split}.jsonl"), "w", encoding="utf-8") as out:
            for record in records:
                out.write(json.dumps({"image": record["image"], "label": record["label"]}) + "\n")
        with open(os.path.join(args.out, f"{split}-captions.jsonl"), "w", encoding="utf-8") as out:
            for record in records:
                shape, colour = record["label"].split("-", 1)
                out.write(json.dumps({"image": record["image"], "caption": record["caption"],
                                      "label": f"{colour} {shape}"}) + "\n")
    total = sum(kinds_written.values())
    print(f"wrote {total} images of {len(names)} classes to {args.out} "
          f"({', '.join(f'{k} {v}' for k, v in sorted(kinds_written.items()))})")


if __name__ == "__main__":
    main()
