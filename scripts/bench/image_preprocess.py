#!/usr/bin/env python3
"""Image decode + preprocess benchmark: our decoder and Pillow-exact resampling (build/trainer_image_tool
decode-batch) against Pillow + transformers' ViTImageProcessorPil, on the same demo images, to the same
224 x 224 float tensors. A stand-in for the loader benchmark against torchvision until the image data path is in
`trainer data` (torchvision is not in .venv).

    scripts/bench/image_preprocess.py --images 400 --rounds 3

Each side runs in its own process from a cold start (the files are in the page cache for both: one warm-up pass
first), on 1 and on 2 threads (Python: 1 process, or a 2-process multiprocessing Pool). The sides alternate
within each round; the table has the median images/s of the rounds and the ratio. Prints a Markdown table.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import ROOT, median, table  # noqa: E402

TOOL = os.environ.get("TRAINER_IMAGE_TOOL", os.path.join(ROOT, "build", "trainer_image_tool"))

PYTHON_SIDE = r"""
import glob, sys, time
from multiprocessing import Pool
from PIL import Image, ImageOps
from transformers.models.vit.image_processing_pil_vit import ViTImageProcessorPil
processor = ViTImageProcessorPil(size={"height": 224, "width": 224}, resample=2)
def one(path):
    with Image.open(path) as image:
        rgb = ImageOps.exif_transpose(image).convert("RGB")
    return processor(rgb, return_tensors="np")["pixel_values"][0]
files = sorted(glob.glob(sys.argv[1] + "/train/*/*"))
workers = int(sys.argv[2])
start = time.perf_counter()
if workers == 1:
    out = [one(f) for f in files]
else:
    with Pool(workers) as pool:
        out = pool.map(one, files, chunksize=8)
print(len(out) / (time.perf_counter() - start))
"""


def ours(folder, model_dir, threads, scratch):
    start = time.perf_counter()
    subprocess.run([TOOL, "decode-batch", os.path.join(folder, "train"), "-", model_dir, str(threads), "error", "-",
                    os.path.join(scratch, "meta.json")], check=True)
    seconds = time.perf_counter() - start
    count = len(json.load(open(os.path.join(scratch, "meta.json")))["labels"])
    return count / seconds


def theirs(folder, workers):
    out = subprocess.run([sys.executable, "-c", PYTHON_SIDE, folder, str(workers)], check=True, capture_output=True,
                         text=True).stdout
    return float(out.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--min-size", type=int, default=200)
    parser.add_argument("--max-size", type=int, default=500)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        folder = os.path.join(scratch, "images")
        classes = 5
        subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "make_demo_images.py"), "--out", folder,
                        "--classes", str(classes), "--per-class", str(args.images // classes),
                        "--validation-per-class", "0", "--min-size", str(args.min_size), "--max-size",
                        str(args.max_size)], check=True, capture_output=True)
        model_dir = os.path.join(scratch, "model")
        os.makedirs(model_dir)
        with open(os.path.join(model_dir, "preprocessor_config.json"), "w") as f:
            json.dump({"image_processor_type": "ViTImageProcessor", "size": {"height": 224, "width": 224},
                       "resample": 2}, f)
        ours(folder, model_dir, 1, scratch)  # warm-up: files into the page cache
        rows = []
        for workers in (1, 2):
            a, b = [], []
            for round_ in range(args.rounds):
                if round_ % 2 == 0:
                    a.append(ours(folder, model_dir, workers, scratch))
                    b.append(theirs(folder, workers))
                else:
                    b.append(theirs(folder, workers))
                    a.append(ours(folder, model_dir, workers, scratch))
            rows.append([f"{workers}", f"{median(a):.0f}", f"{median(b):.0f}", f"{median(a) / median(b):.2f}x"])
        print(f"{args.images} demo images ({args.min_size}-{args.max_size} px, JPEG/PNG mix) -> 224 x 224 float, "
              f"median of {args.rounds} rounds\n")
        print(table(["threads / processes", "trainer images/s", "Pillow + transformers images/s", "ratio"], rows))


if __name__ == "__main__":
    main()
