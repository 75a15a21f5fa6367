#!/usr/bin/env python3
"""Image loader benchmark: `trainer data` on an image classifier's config against the Python loader users write
(an ImageFolder over the class folders, per-image transforms, a torch DataLoader with 2 worker processes), on the
same demo images (scripts/make_demo_images.py) to the same 224 x 224 float tensors, batches of 16.

    scripts/bench/image_loader.py                   # 2000 images, 3 rounds (a few minutes)
    scripts/bench/image_loader.py --images 400 --rounds 1

Two preprocessing modes, the same on both sides:
- resize: resize to 224 x 224 (bilinear), rescale, normalise (ViTImageProcessor; trainer data.augment=false).
  Python side: Pillow decode + transformers' ViTImageProcessorPil per image.
- augment: random resized crop to 224 (8-100 % of the area, aspect 3/4-4/3) + horizontal flip, then rescale and
  normalise (trainer data.augment=true). Python side: torchvision's RandomResizedCrop / RandomHorizontalFlip /
  ToTensor / Normalize on Pillow images, when torchvision is installed; otherwise the same operations written
  with Pillow and torch (torchvision's PIL path does exactly these calls: crop + resize(BILINEAR), transpose,
  a uint8 -> float tensor, (x - mean) / std). The table says which one ran.

trainer: the real binary, data.num_workers=2 decoding threads, one process. Python: a DataLoader with
num_workers=2 (forked worker processes), shuffled. Each side runs in its own process, from a cold start
(imports, listing the folders); the files are in the page cache for both (one warm-up pass first). The sides
alternate, the order flipping each round; medians are reported. Memory: the peak over the run of the summed
proportional set size (PSS) of the side's process tree, sampled every 50 ms (PSS counts pages the forked workers
share with their parent once, where summed RSS would count them three times). Prints a Markdown table.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import BENCH_DIR, PY, ROOT, TRAINER, log, machine_notes, median, table, write_json  # noqa: E402

MIB = 2**20
SIZE = 224
MEAN = STD = [0.5, 0.5, 0.5]  # ViTImageProcessor's defaults

PYTHON_SIDE = r"""
import json, math, os, random, sys, time
start = time.perf_counter()
import numpy as np
import torch
from PIL import Image, ImageOps
folder, mode, workers, batch = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
SIZE, MEAN, STD = 224, [0.5, 0.5, 0.5], [0.5, 0.5, 0.5]
try:
    from torchvision import datasets, transforms
    HAVE_TORCHVISION = True
except Exception:
    HAVE_TORCHVISION = False

def load_rgb(path):
    with Image.open(path) as image:
        return ImageOps.exif_transpose(image).convert("RGB")

class ImageFolder(torch.utils.data.Dataset):
    # torchvision.datasets.ImageFolder's listing: one subfolder per class, sorted; files sorted within a class.
    def __init__(self, root, transform):
        classes = sorted(d.name for d in os.scandir(root) if d.is_dir())
        self.samples = [(os.path.join(root, c, f), i) for i, c in enumerate(classes)
                        for f in sorted(os.listdir(os.path.join(root, c)))]
        self.transform = transform
    def __len__(self):
        return len(self.samples)
    def __getitem__(self, i):
        path, label = self.samples[i]
        return self.transform(load_rgb(path)), label

mean = torch.tensor(MEAN).view(3, 1, 1)
std = torch.tensor(STD).view(3, 1, 1)

def to_normalised_tensor(image):  # ToTensor + Normalize
    array = torch.from_numpy(np.asarray(image, dtype=np.uint8).copy()).permute(2, 0, 1)
    return (array.float().div_(255) - mean) / std

def random_resized_crop(image):  # RandomResizedCrop.get_params + resized_crop, scale (0.08, 1), ratio (3/4, 4/3)
    width, height = image.size
    area = width * height
    log_ratio = (math.log(3 / 4), math.log(4 / 3))
    for _ in range(10):
        target = area * random.uniform(0.08, 1.0)
        aspect = math.exp(random.uniform(*log_ratio))
        w, h = int(round(math.sqrt(target * aspect))), int(round(math.sqrt(target / aspect)))
        if 0 < w <= width and 0 < h <= height:
            top, left = random.randint(0, height - h), random.randint(0, width - w)
            break
    else:
        in_ratio = width / height
        if in_ratio < 3 / 4:
            w, h = width, int(round(width / (3 / 4)))
        elif in_ratio > 4 / 3:
            h, w = height, int(round(height * (4 / 3)))
        else:
            w, h = width, height
        top, left = (height - h) // 2, (width - w) // 2
    return image.crop((left, top, left + w, top + h)).resize((SIZE, SIZE), Image.BILINEAR)

if mode == "resize":
    from transformers.models.vit.image_processing_pil_vit import ViTImageProcessorPil
    processor = ViTImageProcessorPil(size={"height": SIZE, "width": SIZE}, resample=2)
    transform = lambda image: torch.from_numpy(processor(image, return_tensors="np")["pixel_values"][0])
    side = "Pillow + transformers ViTImageProcessorPil"
elif HAVE_TORCHVISION:
    transform = transforms.Compose([transforms.RandomResizedCrop(SIZE), transforms.RandomHorizontalFlip(),
                                    transforms.ToTensor(), transforms.Normalize(MEAN, STD)])
    side = "torchvision transforms"
else:
    def transform(image):
        image = random_resized_crop(image)
        if random.random() < 0.5:
            image = image.transpose(Image.FLIP_LEFT_RIGHT)
        return to_normalised_tensor(image)
    side = "Pillow + torch (torchvision's PIL operations)"

if HAVE_TORCHVISION:
    dataset = datasets.ImageFolder(folder, transform=transform, loader=load_rgb)
    side = "torchvision ImageFolder + " + side
else:
    dataset = ImageFolder(folder, transform)
loader = torch.utils.data.DataLoader(dataset, batch_size=batch, shuffle=True, num_workers=workers,
                                     generator=torch.Generator().manual_seed(1))
images = 0
for pixels, labels in loader:
    assert pixels.shape[1:] == (3, SIZE, SIZE) and pixels.dtype == torch.float32
    images += pixels.shape[0]
print(json.dumps({"images": images, "seconds": time.perf_counter() - start, "side": side}))
"""


def tree_pss(pid):
    """The summed PSS of a process and its descendants, in bytes (0 for processes that are gone)."""
    children = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
                children.setdefault(parent, []).append(int(entry))
            except (OSError, ValueError, IndexError):
                pass
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        todo += children.get(p, [])
        try:
            with open(f"/proc/{p}/smaps_rollup") as f:
                total += next(int(line.split()[1]) * 1024 for line in f if line.startswith("Pss:"))
        except (OSError, StopIteration):
            pass
    return total


def run_sampled(command, env=None):
    """Runs `command` from the repository root; returns (stdout, seconds, peak summed PSS of its process tree)."""
    start = time.perf_counter()
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak = [0]

    def sample():
        while process.poll() is None:
            peak[0] = max(peak[0], tree_pss(process.pid))
            time.sleep(0.05)

    sampler = threading.Thread(target=sample)
    sampler.start()
    out, err = process.communicate()
    sampler.join()
    if process.returncode != 0:
        sys.exit(f"{command[0]} failed (exit {process.returncode}):\n{err[-3000:]}")
    return out, time.perf_counter() - start, peak[0]


def make_images(count, min_size, max_size):
    folder = os.path.join(BENCH_DIR, "images", f"demo-{count}-{min_size}-{max_size}")
    if not os.path.exists(os.path.join(folder, "train")):
        classes = 5
        subprocess.run([PY, os.path.join(ROOT, "scripts", "make_demo_images.py"), "--out", folder + ".part",
                        "--classes", str(classes), "--per-class", str(count // classes), "--validation-per-class",
                        "0", "--min-size", str(min_size), "--max-size", str(max_size)], check=True,
                       capture_output=True)
        os.replace(folder + ".part", folder)
    return os.path.join(folder, "train")


def model_dir():
    """A tiny ViT at 224 px: `trainer data` reads only its preprocessing (no weights are built)."""
    path = os.path.join(BENCH_DIR, "models", "vit-224-loader")
    os.makedirs(path, exist_ok=True)
    write_json(os.path.join(path, "config.json"),
               {"model_type": "vit", "architectures": ["ViTForImageClassification"], "hidden_size": 32,
                "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 64, "image_size": SIZE,
                "patch_size": 16})
    write_json(os.path.join(path, "preprocessor_config.json"),
               {"image_processor_type": "ViTImageProcessor", "do_resize": True, "size": {"height": SIZE, "width": SIZE},
                "resample": 2, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
                "image_mean": MEAN, "image_std": STD})
    return path


def ours(train, model, mode, workers, batch):
    out, seconds, pss = run_sampled(
        [TRAINER, "data", "--config", os.path.join(ROOT, "configs", "tiny-vit.json"), "--set",
         f"model.path={model}", "--set", f'data.train_files=["{train}"]', "--set", "data.validation_files=[]",
         "--set", f"data.num_workers={workers}", "--set", f"training.batch_size={batch}", "--set",
         f"data.augment={'true' if mode == 'augment' else 'false'}", "--set", "logging.level=warn"],
        env=dict(os.environ, OMP_NUM_THREADS="1"))
    images = int(re.search(r"images +(\d+) \(224 x 224", out).group(1))
    return images / seconds, pss, images


def theirs(train, mode, workers, batch):
    out, seconds, pss = run_sampled([PY, "-c", PYTHON_SIDE, train, mode, str(workers), str(batch)],
                                    env=dict(os.environ, OMP_NUM_THREADS="1"))
    result = json.loads(out.strip().splitlines()[-1])
    return result["images"] / seconds, pss, result["images"], result["side"]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--min-size", type=int, default=200)
    parser.add_argument("--max-size", type=int, default=500)
    parser.add_argument("--modes", nargs="+", default=["resize", "augment"])
    parser.add_argument("--json", help="also write the measurements here")
    args = parser.parse_args()
    train = make_images(args.images, args.min_size, args.max_size)
    model = model_dir()
    ours(train, model, "resize", args.workers, args.batch)  # warm-up: the files into the page cache
    rows, results = [], {}
    for mode in args.modes:
        a_rate, a_pss, b_rate, b_pss, side = [], [], [], [], ""
        for round_ in range(args.rounds):
            for which in (("ours", "theirs") if round_ % 2 == 0 else ("theirs", "ours")):
                if which == "ours":
                    rate, pss, images = ours(train, model, mode, args.workers, args.batch)
                    a_rate.append(rate)
                    a_pss.append(pss)
                else:
                    rate, pss, images, side = theirs(train, mode, args.workers, args.batch)
                    b_rate.append(rate)
                    b_pss.append(pss)
                log(f"{mode} round {round_ + 1} {which}: {images} images, {rate:.0f} images/s, "
                    f"peak PSS {pss / MIB:.0f} MiB")
        results[mode] = dict(ours=a_rate, theirs=b_rate, ours_pss=a_pss, theirs_pss=b_pss, side=side)
        rows.append([mode, side, f"{median(a_rate):.0f}", f"{median(b_rate):.0f}",
                     f"{median(a_rate) / median(b_rate):.2f}x", f"{median(a_pss) / MIB:.0f}",
                     f"{median(b_pss) / MIB:.0f}"])
    print(f"{args.images} demo images ({args.min_size}-{args.max_size} px, JPEG/PNG mix) -> {SIZE} x {SIZE} float, "
          f"batches of {args.batch}, {args.workers} workers, median of {args.rounds} rounds, sides alternating\n"
          f"{machine_notes()}\n")
    print(table(["mode", "Python side", "trainer data images/s", "Python images/s", "ratio",
                 "trainer peak PSS MiB", "Python peak PSS MiB (3 processes)"], rows))
    if args.json:
        write_json(args.json, results)


if __name__ == "__main__":
    main()
