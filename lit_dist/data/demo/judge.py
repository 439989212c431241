"""``ShapesJudge`` judges the demo shapes ("a blue circle on a red background"): an image is correct when a
classifier trained on the real shapes (the quickstart's exported ``model.pt``) names the prompt's shape, the
dominant colour of its border is the prompt's background colour and the dominant colour of its centre,
background excluded, is the prompt's foreground colour (colours: the demo's palette, nearest in RGB).
"""

import re

import torch

from lit_dist.data.demo.shapes import CLASSES, COLOURS
from lit_dist.errors import ConfigError, DataError
from lit_dist.model.judge import Judge

PROMPT = re.compile(r"a (\w+) (\w+) on a (\w+) background")


class ShapesJudge(Judge):
    """The demo shapes: the shape by a trained classifier, the two colours by the palette."""

    def __init__(self, classifier: str, channels: list[int] = (16, 32, 64), mean: tuple[float, float, float] = (0.5,) * 3,
                 std: tuple[float, float, float] = (0.5,) * 3, border: int = 2):
        """Load the classifier.

        Args:
            classifier: The quickstart's exported state_dict (model.pt of a run of configs/quickstart.yaml).
            channels: Its SimpleCNN's channels (configs/quickstart.yaml's).
            mean: data.mean it trained with.
            std: data.std it trained with.
            border: Width in pixels of the border whose dominant colour is the background.
        """
        from lit_dist.model.nets import SimpleCNN

        self.net = SimpleCNN(num_classes=len(CLASSES), channels=tuple(channels)).eval()
        try:
            state = torch.load(classifier, map_location="cpu", weights_only=True)
        except FileNotFoundError as exc:
            raise ConfigError(f"samples.judge.init_args.classifier = {classifier!r} does not exist: export the "
                              "quickstart's classifier first (lit-dist fit --config configs/quickstart.yaml writes "
                              "model.pt in its run directory)") from exc
        except Exception as exc:  # noqa: BLE001 - torch.load raises many types for a file that is not a state_dict
            raise DataError(f"samples.judge.init_args.classifier = {classifier!r} is not a readable state_dict "
                            f"({type(exc).__name__}: {exc})") from exc
        missing, unexpected = self.net.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise DataError(f"samples.judge.init_args.classifier = {classifier!r} does not fit SimpleCNN(channels="
                            f"{list(channels)}): {len(missing)} missing, {len(unexpected)} unexpected keys")
        self.mean = torch.tensor(mean).view(1, 3, 1, 1) * 255
        self.std = torch.tensor(std).view(1, 3, 1, 1) * 255
        self.palette = torch.tensor(list(COLOURS.values()), dtype=torch.float32)  # (K, 3)
        self.names = list(COLOURS)
        self.border = border

    def check(self, prompts):
        for prompt in prompts:
            if PROMPT.fullmatch(prompt.strip()) is None:
                raise ConfigError(f"samples.judge: ShapesJudge reads prompts like 'a red circle on a white background', "
                                  f"not {prompt!r}")

    @torch.no_grad()
    def __call__(self, pixels, prompts):
        self.check(prompts)
        shapes = self.net((pixels.float() - self.mean) / self.std).argmax(-1)  # (N,)
        fg, bg = self.colours(pixels)
        correct = []
        for i, prompt in enumerate(prompts):
            colour, shape, background = PROMPT.fullmatch(prompt.strip()).groups()
            correct.append(CLASSES[int(shapes[i])] == shape and fg[i] >= 0 and self.names[fg[i]] == colour
                           and self.names[bg[i]] == background)
        return torch.tensor(correct)

    def colours(self, pixels: torch.Tensor) -> tuple[list[int], list[int]]:
        """Per image, (foreground, background) palette indices: the border's most common colour is the background;
        the most common other colour of the centre half is the foreground (-1 when the centre is all background)."""
        n, _, h, w = pixels.shape
        nearest = torch.cdist(pixels.float().permute(0, 2, 3, 1).reshape(n, -1, 3), self.palette.expand(n, -1, -1))
        index = nearest.argmin(-1).view(n, h, w)  # (N, H, W) palette index per pixel
        b = self.border
        ring = torch.ones(h, w, dtype=torch.bool)
        ring[b:h - b, b:w - b] = False
        centre = index[:, h // 4:h - h // 4, w // 4:w - w // 4].reshape(n, -1)
        k = len(self.names)
        fg, bg = [], []
        for i in range(n):
            background = int(torch.bincount(index[i][ring], minlength=k).argmax())
            counts = torch.bincount(centre[i], minlength=k)
            counts[background] = 0
            bg.append(background)
            fg.append(int(counts.argmax()) if counts.any() else -1)
        return fg, bg
