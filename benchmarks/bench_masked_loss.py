"""What a loss mask leaves out is not learned: a frame around every training image, masked out, is never drawn.

1. data: the demo shapes, each image given a frame (``--frame`` pixels wide) of a random palette colour that is
   neither of its caption's; a mask column names each image's mask, white inside the frame, black on it (a
   watermark or border that a fine-tune must not learn).
2. judge: the classification quickstart, trained here on the shapes without frames.
3. two runs of configs/t2i_quickstart.yaml on the framed images (the text-to-image quickstart: flow matching on
   pixels, captions from a cached tiny T5), the same in all but ``data.mask_column`` and their length: masked
   (``--epochs``, the quickstart's 60) and unmasked (``--baseline-epochs``, 20: frames are colours, learned early).
4. each run's last weights drawn by `lit-dist sample` (``--prompts`` validation captions x 4 images), judged
   three ways: ShapesJudge (the prompt's shape, foreground and background colours: the background is read at the
   image's border, where the frames are); shape and foreground alone; and whether a frame was drawn (the border
   is not the prompt's background colour).

Targets: the masked run draws frames in <= 0.2 x the unmasked run's share (the ratio), and its images meet their
prompts (ShapesJudge) >= 0.8. The unmasked run is the baseline: it learns the frames.

With ``--masks foreground`` the images keep no frame and each mask covers its shape alone (the pixels nearer the
caption's foreground colour than its background's): the background is what the mask leaves out. Targets then: the
masked run's images have the prompt's background colour in <= 0.3 x the unmasked run's share (0.125 would be
chance among the 8 colours), and its shapes and foreground colours (ShapeJudge) >= 0.8. A flat shape's outline
is its edge against the background, which such a mask leaves out: whether the shapes still form is what it
measures. ``--margin N`` grows each mask by N pixels around its shape: the outline shown, and a ring of the
background colour with it.

With ``--masks subject`` a fine-tuner's case: a subject always photographed against the same backdrop, beside other
data that shows what backgrounds are (a base model's prior, or regularisation images). The images of one shape
(``--held``) get a background of one colour (``--backdrop``) that their captions do not name (they keep their own
background words), and masks of the shape alone (with ``--margin``, and that many pixels of the backdrop around
it); the other shapes stay as they are, unmasked; the two tables are mixed as two datasets, each weighted by its
size. Judged on validation captions of the held shape that name neither the backdrop nor it as
their foreground: its shape and foreground colour (target >= 0.8), and the share of images drawn on the backdrop
colour in the masked run against the unmasked one (target <= 0.3), where the unmasked run drew it in at least half
of its images (else the runs were too short to learn a backdrop at all). With ``--prior-epochs N`` the fine-tune a user
runs on a pretrained model: a base is first trained for N epochs on the other shapes alone, unmasked (it draws
backgrounds as captions name them and has never seen the held shape), its weight average exported, and both runs
start from it (``model.init_weights``); the base is judged on the same captions first. ``--keep-prior FILE`` keeps
its weights, and ``--prior-weights FILE`` fine-tunes them again (another ``--margin``) without training a base.
With ``--prior-of all`` the base is trained on every shape on its own background, the held one too: a pretrained
model that knows the subject's kind, fine-tuned on photographs of it against one backdrop (``--lr`` sets both
fine-tunes' learning rate; a fine-tune's is usually below the pretraining's).

    .venv/bin/python -m benchmarks.bench_masked_loss [--masks frame] [--margin 0] [--held triangle] [--backdrop white]
        [--prior-epochs 0 | --prior-weights FILE] [--prior-of others] [--keep-prior FILE] [--lr LR] [--images 3000]
        [--epochs 60] [--seed 0] [--short]
"""

import argparse
import os
import shutil
import sys
import tempfile

import torch

from benchmarks.bench_lora_quality import split_table, val_captions
from benchmarks.bench_pipeline_quality import train_judge
from benchmarks.common import SHORT_HELP, lit_dist, machine, result_line, run_bench
from lit_dist.data.demo.judge import PROMPT, ShapesJudge
from lit_dist.data.demo.shapes import CLASSES, COLOURS

RATIO_TARGET = 0.2  # masked run's share of framed images / the unmasked run's
BACKGROUND_TARGET = 0.3  # --masks foreground: masked run's share of images with the prompt's background / unmasked;
# --masks subject: the same for the images drawn on the backdrop colour
ADHERENCE_TARGET = 0.8
# --masks subject: the unmasked run's share of images on the backdrop, at least: a fine-tune too short or too slow to
# learn the backdrop without masks shows nothing by not learning it with them.
LEARNED_TARGET = 0.5


class ShapeJudge(ShapesJudge):
    """The prompt's shape and foreground colour; the background not judged."""

    @torch.no_grad()
    def __call__(self, pixels, prompts):
        self.check(prompts)
        shapes = self.net((pixels.float() - self.mean) / self.std).argmax(-1)
        fg, _ = self.colours(pixels)
        return torch.tensor([CLASSES[int(shapes[i])] == PROMPT.fullmatch(p.strip()).group(2) and fg[i] >= 0
                             and self.names[fg[i]] == PROMPT.fullmatch(p.strip()).group(1)
                             for i, p in enumerate(prompts)])


class FrameJudge(ShapesJudge):
    """True where a frame was drawn: the border's dominant colour is not the prompt's background colour."""

    @torch.no_grad()
    def __call__(self, pixels, prompts):
        self.check(prompts)
        _, bg = self.colours(pixels)
        return torch.tensor([self.names[bg[i]] != PROMPT.fullmatch(p.strip()).group(3) for i, p in enumerate(prompts)])


class BackdropJudge(ShapesJudge):
    """True where the image's background (its border's colour) is ``backdrop``."""

    backdrop = "white"

    @torch.no_grad()
    def __call__(self, pixels, prompts):
        self.check(prompts)
        _, bg = self.colours(pixels)
        return torch.tensor([self.names[bg[i]] == self.backdrop for i in range(len(prompts))])


def framed_copy(table: str, dest: str, frame: int, seed: int = 0) -> str:
    """The demo table's images, each with a frame of a colour neither of its caption's, and their masks; returns the
    new table's path."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image, ImageDraw

    rows = pq.read_table(table)
    source = os.path.dirname(table)
    rng = np.random.default_rng(seed)
    names = []
    for name, caption in zip(rows.column("filename").to_pylist(), rows.column("caption").to_pylist(), strict=True):
        fg, _, bg = PROMPT.fullmatch(caption).groups()
        colour = rng.choice([c for c in COLOURS if c not in (fg, bg)])
        image = Image.open(os.path.join(source, name)).convert("RGB")
        mask = Image.new("L", image.size, 0)
        ImageDraw.Draw(mask).rectangle((frame, frame, image.width - 1 - frame, image.height - 1 - frame), fill=255)
        framed = Image.composite(image, Image.new("RGB", image.size, COLOURS[colour]), mask)
        for folder, picture in ((dest, framed), (os.path.join(dest, "masks"), mask)):
            os.makedirs(os.path.join(folder, os.path.dirname(name)), exist_ok=True)
            picture.save(os.path.join(folder, name))
        names.append(f"masks/{name}")
    path = os.path.join(dest, "metadata.parquet")
    pq.write_table(rows.append_column("mask", pa.array(names, pa.string())), path)
    return path


def shape_of(pixels, caption: str, margin: int = 0):
    """The shape in an image's (H, W, 3) float32 ``pixels``: the pixels nearer ``caption``'s foreground colour than
    its background's, as an (H, W) bool array and as a mask image (white on them) grown by ``margin`` pixels."""
    import numpy as np
    from PIL import Image, ImageFilter

    fg, _, bg = PROMPT.fullmatch(caption).groups()
    near = [np.linalg.norm(pixels - np.array(COLOURS[c], np.float32), axis=-1) for c in (fg, bg)]
    shape = near[0] < near[1]
    mask = Image.fromarray(np.where(shape, 255, 0).astype(np.uint8))
    if margin:
        mask = mask.filter(ImageFilter.MaxFilter(2 * margin + 1))  # a square of 2 x margin + 1 around each pixel
    return shape, mask


def foreground_copy(table: str, dest: str, margin: int = 0) -> str:
    """The demo table's images as they are, each with a mask of its shape alone: the pixels nearer its caption's
    foreground colour than its background's, and those within ``margin`` pixels of them. Returns the new table's
    path."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image

    shutil.copytree(os.path.dirname(table), dest)
    rows = pq.read_table(table)
    names = []
    for name, caption in zip(rows.column("filename").to_pylist(), rows.column("caption").to_pylist(), strict=True):
        pixels = np.asarray(Image.open(os.path.join(dest, name)).convert("RGB"), dtype=np.float32)
        os.makedirs(os.path.join(dest, "masks", os.path.dirname(name)), exist_ok=True)
        shape_of(pixels, caption, margin)[1].save(os.path.join(dest, "masks", name))
        names.append(f"masks/{name}")
    path = os.path.join(dest, "metadata.parquet")
    pq.write_table(rows.append_column("mask", pa.array(names, pa.string())), path)
    return path


def subject_copy(table: str, dest: str, held: str, backdrop: str, margin: int = 0) -> tuple[str, str]:
    """The demo table split in two: every shape but ``held`` as it is (a table beside the demo's), and ``held``'s
    images in ``dest`` with their background painted ``backdrop`` and masks of the shape alone (a mask column; grown
    by ``margin`` pixels of the backdrop around it), their captions as they were. Rows whose caption's foreground is
    ``backdrop`` are left out (a shape of the backdrop's colour would vanish). Returns the two tables' paths."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq
    from PIL import Image

    others, subject = split_table(table, held)
    rows = pq.read_table(subject)
    rows = rows.filter(pc.invert(pc.starts_with(rows["caption"], f"a {backdrop} ")))
    source = os.path.dirname(table)
    names = []
    for name, caption in zip(rows.column("filename").to_pylist(), rows.column("caption").to_pylist(), strict=True):
        pixels = np.asarray(Image.open(os.path.join(source, name)).convert("RGB"), dtype=np.float32)
        shape, mask = shape_of(pixels, caption, margin)
        painted = np.where(shape[..., None], pixels, np.array(COLOURS[backdrop], np.float32)).astype(np.uint8)
        for folder, picture in ((dest, Image.fromarray(painted)), (os.path.join(dest, "masks"), mask)):
            os.makedirs(os.path.join(folder, os.path.dirname(name)), exist_ok=True)
            picture.save(os.path.join(folder, name))
        names.append(f"masks/{name}")
    path = os.path.join(dest, "metadata.parquet")
    pq.write_table(rows.append_column("mask", pa.array(names, pa.string())), path)
    return others, path


def fit(args, table: str | list[dict], tmp: str, run_id: str, epochs: int, *extra: str) -> tuple[str, float]:
    """A run of the t2i quickstart on ``table``; returns its run directory and its steps/s. Its images are decoded in
    the training process: on 2 cores a loader worker beside torch's two threads ran the steps at 1.35/s, against
    1.8-1.9 with the few small PNGs of a step decoded in between."""
    short = ["--model.net.init_args.channels", "[16, 32]"] if args.short else []
    # A list of datasets (--masks subject) instead of one table.
    data = ["--data.metadata", table] if isinstance(table, str) else ["--data.metadata", "null", "--data.datasets",
                                                                      str(table)]
    timed = run_bench([
        sys.executable, "-m", "lit_dist", "fit", "--config", "configs/t2i_quickstart.yaml", *data,
        "--data.create_demo_if_missing", "false", "--data.cache.dir", os.path.join(tmp, "cache"),
        "--data.cache.pixels", "false", "--data.allow_oversubscription", "true", "--data.num_workers", "0",
        "--trainer.max_epochs", str(epochs), "--trainer.enable_progress_bar", "false",
        "--trainer.accelerator", "cpu" if not torch.cuda.is_available() else "auto", "--trainer.devices", "1",
        "--samples.every_n_steps", "null", "--samples.at_end", "false", "--export.filename", "null",
        "--run.root_dir", os.path.join(tmp, "runs"), "--run.run_id", run_id,
        "--trainer.callbacks+=benchmarks.common.StepTimer", "--trainer.callbacks.warmup_steps", "1",
        "--seed_everything", str(args.seed), "--data.seed", str(args.seed), "--samples.seed", str(args.seed),
        *short, *extra])
    return os.path.join(tmp, "runs", "t2i_quickstart", run_id), timed["steps_per_s"]


def judged(args, run: str, prompts: list[str], classifier: str) -> dict[str, float]:
    """The run's last weights drawn by `lit-dist sample` (4 images per prompt) and judged three ways (the module
    docstring): the share of images each judge passes."""
    import numpy as np
    from PIL import Image

    grid = os.path.join(run, "grid.png")
    lit_dist("sample", "--config", os.path.join(run, "config.yaml"), "--checkpoint", os.path.join(run, "checkpoints"),
             "--prompt", "; ".join(prompts), "--num", "4", "--steps", str(args.sample_steps), "--output", grid)
    pixels = torch.from_numpy(np.array(Image.open(grid).convert("RGB")))  # (rows x H, 4 x W, 3), no padding
    h, w = pixels.shape[0] // len(prompts), pixels.shape[1] // 4
    tiles = pixels.view(len(prompts), h, 4, w, 3).permute(0, 2, 4, 1, 3).reshape(-1, 3, h, w)
    asked = [p for p in prompts for _ in range(4)]
    BackdropJudge.backdrop = args.backdrop
    return {name: judge(classifier)(tiles, asked).float().mean().item()
            for name, judge in (("adherence", ShapesJudge), ("shape", ShapeJudge), ("framed", FrameJudge),
                                ("backdrop", BackdropJudge))}


def prior(args, table: str, tmp: str, prompts: list[str], classifier: str, figures: dict) -> list[str]:
    """The base a fine-tune starts from: the t2i quickstart on ``table`` (the shapes but the held one), unmasked, for
    ``--prior-epochs``; judged on ``prompts`` into ``figures``. Returns the flags that start a run from its weight
    average (what its samples are drawn with), exported as a file."""
    run_dir, figures["prior_steps_per_s"] = fit(args, table, tmp, "prior", args.prior_epochs)
    scores = judged(args, run_dir, prompts, classifier)
    figures.update({f"prior_{what}": score for what, score in scores.items()})
    print("prior: " + ", ".join(f"{what} {score:.3f}" for what, score in scores.items()), flush=True)
    start = os.path.join(tmp, "prior.safetensors")
    lit_dist("export", os.path.join(run_dir, "checkpoints"), "--ema", "true", "--output", start)
    if args.keep_prior:
        shutil.copyfile(start, args.keep_prior)
    return ["--model.init_weights", start]


def run(args, tmp: str) -> dict:
    import pyarrow.parquet as pq

    from lit_dist.data.demo.shapes import create_shapes_dataset

    table = os.path.join(tmp, "shapes", "metadata.parquet")
    create_shapes_dataset(table, num_images=args.images, seed=0)
    classifier = args.judge or train_judge(tmp, table, args.judge_epochs)
    figures = {}
    if args.masks == "subject":
        others, subject = subject_copy(table, os.path.join(tmp, "subject"), args.held, args.backdrop,
                                       args.margin)
        # Captions that name the backdrop as their background would count a right image as drawn on it.
        prompts = [p for p in val_captions(subject, 10 ** 6) if not p.endswith(f" {args.backdrop} background")]
        prompts = prompts[:args.prompts]
        # Each dataset's share of the batches is its share of the images, as in one table.
        weights = [pq.read_metadata(t).num_rows for t in (subject, others)]
        base = others if args.prior_of == "others" else table
        start = (["--model.init_weights", args.prior_weights] if args.prior_weights else
                 prior(args, base, tmp, prompts, classifier, figures) if args.prior_epochs else [])
        if args.lr is not None:
            start = [*start, "--model.optimizer.init_args.lr", str(args.lr)]
        runs = {name: ([{"metadata": subject, "weight": weights[0], **mask},
                        {"metadata": others, "weight": weights[1]}], start)
                for name, mask in (("masked", {"mask_column": "mask"}), ("unmasked", {}))}
    else:
        if args.masks == "frame":
            framed = framed_copy(table, os.path.join(tmp, "framed"), args.frame)
        else:
            framed = foreground_copy(table, os.path.join(tmp, "foreground"), args.margin)
        prompts = val_captions(framed, args.prompts)
        runs = {"masked": (framed, ["--data.mask_column", "mask"]), "unmasked": (framed, [])}
    for name, epochs in (("masked", args.epochs), ("unmasked", args.baseline_epochs)):
        data, extra = runs[name]
        run_dir, figures[f"{name}_steps_per_s"] = fit(args, data, tmp, name, epochs, *extra)
        scores = judged(args, run_dir, prompts, classifier)
        figures.update({f"{name}_{what}": score for what, score in scores.items()})
        said = ", ".join(f"{what} {score:.3f}" for what, score in scores.items())
        print(f"{name}: {said}", flush=True)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--masks", choices=["frame", "foreground", "subject"], default="frame",
                        help="what the masks leave out: a frame painted around each image, each shape's background, "
                             "or the backdrop of one shape's images beside unmasked others")
    parser.add_argument("--images", type=int, default=3000, help="demo shapes (the quickstarts' 3,000)")
    parser.add_argument("--epochs", type=int, default=60, help="epochs of each run (the t2i quickstart's 60)")
    # The frames' colours are learned long before the shapes (the t2i quickstart's colours were right at step 830 of
    # 4,980): a third of the masked run's epochs shows whether frames are learned, and a longer baseline would only
    # draw more of them (a smaller ratio).
    parser.add_argument("--baseline-epochs", type=int, default=20, help="epochs of the unmasked run")
    parser.add_argument("--frame", type=int, default=4, help="the frame's width in the images' pixels (36-72 a side)")
    parser.add_argument("--margin", type=int, default=0,
                        help="--masks foreground or subject: pixels of background each mask keeps around its shape "
                             "(its outline)")
    parser.add_argument("--held", default="triangle", choices=CLASSES,
                        help="--masks subject: the shape whose images get the backdrop and the masks")
    parser.add_argument("--backdrop", default="white", choices=list(COLOURS),
                        help="--masks subject: the colour of those images' background")
    parser.add_argument("--prior-epochs", type=int, default=0,
                        help="--masks subject: first train a base for this many epochs on the other shapes alone, "
                             "unmasked, and fine-tune it in both runs; 0: both runs start from scratch")
    parser.add_argument("--prior-weights",
                        help="--masks subject: fine-tune this base instead of training one (the prior.safetensors a "
                             "--prior-epochs run with the same --images exported, kept with --keep-prior)")
    parser.add_argument("--prior-of", choices=["others", "all"], default="others",
                        help="--prior-epochs: the base's data: the other shapes alone (it never saw the held one), or "
                             "every shape on its own background (it knows the held one)")
    parser.add_argument("--keep-prior", help="--prior-epochs: copy the base's weights to this file")
    parser.add_argument("--lr", type=float,
                        help="--masks subject: both runs' learning rate (default: the t2i quickstart's 0.001)")
    parser.add_argument("--seed", type=int, default=0,
                        help="every run's seed_everything, data.seed and samples.seed (its sampler's noise)")
    parser.add_argument("--prompts", type=int, default=32, help="validation captions, 4 images each")
    parser.add_argument("--sample-steps", type=int, default=20, help="sampler steps")
    parser.add_argument("--judge", help="the quickstart classifier's model.pt; default: train it here (about a minute)")
    parser.add_argument("--judge-epochs", type=int, help="epochs of the judge's training (default: the quickstart's)")
    parser.add_argument("--short", action="store_true", help=SHORT_HELP)
    args = parser.parse_args()
    if args.prior_weights and args.prior_epochs:
        parser.error("--prior-weights is a base trained before: leave out --prior-epochs")
    if args.lr is not None and args.masks != "subject":
        parser.error(f"--lr sets the fine-tunes' lr of --masks subject; --masks {args.masks} runs at the quickstart's")
    if args.prior_of != "others" and not args.prior_epochs:
        parser.error("--prior-of is the data of a base trained here: give --prior-epochs too")
    if args.short:
        args.images, args.epochs, args.baseline_epochs, args.prompts, args.sample_steps = 64, 1, 1, 2, 2
        args.judge_epochs = 1
        args.prior_epochs = min(args.prior_epochs, 1)
    seen = "the others" if args.prior_of == "others" else "every shape"
    base = (f", fine-tuning a base of {args.prior_epochs} epochs on {seen}" if args.prior_epochs else
            f", fine-tuning {args.prior_weights}" if args.prior_weights else "")
    base += f" at lr {args.lr}" if args.lr is not None else ""
    masks = {"frame": f"framed by {args.frame} pixels",
             "foreground": f"masked to their shapes and {args.margin} pixels around them",
             "subject": f"the {args.held}s on {args.backdrop} masked to their shapes and {args.margin} pixels "
                        f"around them, the others unmasked{base}"}[args.masks]
    print(f"machine: {machine()}; {args.images} demo shapes {masks}; {args.epochs} epochs masked, "
          f"{args.baseline_epochs} unmasked; seed {args.seed}", flush=True)
    tmp = tempfile.mkdtemp(prefix="lit-dist-bench-masked-")
    try:
        figures = run(args, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if args.masks == "frame":
        # Frames drawn by the masked run against the unmasked one (a run that learned no frame at all: 0 over 0 is 0).
        ratio = figures["masked_framed"] / figures["unmasked_framed"] if figures["unmasked_framed"] else 0.0
        met = ratio <= RATIO_TARGET and figures["masked_adherence"] >= ADHERENCE_TARGET
        target = f"<= {RATIO_TARGET}; masked adherence >= {ADHERENCE_TARGET}"
    elif args.masks == "subject":
        # Images drawn on the backdrop (which no prompt names) by the masked run against the unmasked one.
        ratio = figures["masked_backdrop"] / figures["unmasked_backdrop"] if figures["unmasked_backdrop"] else 1.0
        met = (ratio <= BACKGROUND_TARGET and figures["masked_shape"] >= ADHERENCE_TARGET
               and figures["unmasked_backdrop"] >= LEARNED_TARGET)
        target = f"<= {BACKGROUND_TARGET}; masked shape >= {ADHERENCE_TARGET}; unmasked backdrop >= {LEARNED_TARGET}"
    else:
        # The prompt's background colour (no "frame" at the border) in the masked run's images against the unmasked.
        background = {name: 1 - figures[f"{name}_framed"] for name in ("masked", "unmasked")}
        ratio = background["masked"] / background["unmasked"] if background["unmasked"] else 1.0
        met = ratio <= BACKGROUND_TARGET and figures["masked_shape"] >= ADHERENCE_TARGET
        target = f"<= {BACKGROUND_TARGET}; masked shape >= {ADHERENCE_TARGET}"
    subject = ({"held": args.held, "backdrop": args.backdrop, "prior_epochs": args.prior_epochs,
                "prior_weights": args.prior_weights, "prior_of": args.prior_of if args.prior_epochs else None,
                "lr": args.lr}
               if args.masks == "subject" else {})
    result_line("masked_loss", round(ratio, 3), target, met, masks=args.masks, margin=args.margin, seed=args.seed,
                **subject, machine=machine(), **figures, short=args.short)


if __name__ == "__main__":
    main()
